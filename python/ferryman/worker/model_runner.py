"""ModelRunner: one step's tensors in, logits of the rows to sample out.

Order within a step: the persistent batch's block-table changes (``worker/block_table.py``, which
also derives the step's positions, slots and page indices), the swap/copy plans, then the
attention plan, then the forward, then the
logits of ``logits_indices`` (a row repeats for n > 1). With async scheduling a decode input may
be a token still in flight (-1 in ``input_ids``): it is filled on the device from the previous
step's sampled ids (``prev``), which the engine keeps there. With FlashInfer and without
``enforce_eager``, a decode-only step that fits a captured batch size replays a CUDA graph
(``attention/flashinfer_graphs.py``) instead of the eager plan + forward. The model's
elementwise kernels (norms, RoPE, SiLU-and-mul) are FlashInfer's fused ones with FlashInfer's
attention, once they pass a check against the torch reference at start-up (``models/ops.py``;
``ops_note`` says which run and why)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ferryman._core import SchedulerOutput
from ferryman.attention.base import AttentionBackend, Inflight, put_inflight
from ferryman.attention.flashinfer_backend import FlashInferBackend
from ferryman.attention.flashinfer_graphs import DecodeGraphs, capture_sizes
from ferryman.attention.selector import select_backend
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.ops import Shapes, select_ops
from ferryman.worker.block_table import BlockTable
from ferryman.worker.kv_cache import KvCache
from ferryman.worker.transfer import to_device


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KvCache,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
    ) -> None:
        """``attention_backend``: "torch" (the reference; the CPU path), "flashinfer" (CUDA and
        ``ferryman[gpu]``), or "auto" (FlashInfer when both are there, else torch); see
        ``attention/selector.py``."""
        self.model = model
        self.kv = kv
        model.pack_cpu_weights()  # CPU float32 only; a no-op elsewhere
        self.device = device
        cfg = model.cfg
        self.attn: AttentionBackend = select_backend(
            attention_backend,
            device,
            kv.layers(),
            block_size=block_size,
            scale=cfg.head_dim**-0.5,
            num_qo_heads=model.shard.num_heads,  # this rank's (tensor parallelism)
            num_kv_heads=model.shard.num_kv_heads,
            head_dim=cfg.head_dim,
        )
        fi = self.attn if isinstance(self.attn, FlashInferBackend) else None
        self.attention_backend = "torch" if fi is None else "flashinfer"
        self.max_model_len = max_model_len
        pages = -(-max_model_len // block_size)
        s = model.shard
        shapes = Shapes(  # positions stay below what the block table can address
            cfg.hidden_size, s.num_heads, s.num_kv_heads, cfg.head_dim, s.intermediate_size,
            model.embed_tokens.weight.dtype, device, pages * block_size,
        )  # fmt: skip
        choice = select_ops(fi is not None, model.inv_freq, model.rope_scale, shapes)
        self.ops, self.ops_note = choice.ops, choice.note  # the elementwise kernels (models/ops.py)
        # positions a step may reach: checked with FlashInfer (its RoPE table, the graphs' buffers)
        self.position_limit = shapes.max_positions if fi is not None else 0
        self.graphs: DecodeGraphs | None = None  # where CUDA graphs are on
        self.num_graph_steps = 0
        self.block_table = BlockTable(max_num_seqs, pages, block_size)
        self._graph_args = (fi, capture_sizes(max_num_seqs), pages)
        if fi is not None and not enforce_eager:
            self.capture_graphs()

    def capture_graphs(self, logits_in_graph: bool = False) -> None:
        """(Re)captures the decode graphs (FlashInfer only); ``logits_in_graph`` captures the LM
        head with them (one rank only), which ``benchmarks/gpu_overlap.py`` compares. The logits
        a step returns are then valid until the runner's next step."""
        fi, sizes, pages = self._graph_args
        if fi is None:
            raise ValueError("CUDA graphs need the FlashInfer backend")
        if self.model.tp.world > 1:  # a capture on one rank would wait for the others' all-reduce
            raise ValueError("decode graphs are not captured under tensor parallelism")
        forward = functools.partial(self.model, ops=self.ops)
        head = self.model.compute_logits if logits_in_graph else None
        self.graphs = None  # the old graphs' memory pool goes before the new one is taken
        torch.cuda.empty_cache()
        self.graphs = DecodeGraphs(fi, forward, sizes, pages, head)

    def use_skinny_gemm(self, on: bool = True) -> dict[str, Any]:
        """Measures, per projection and decode graph size up to ``skinny_gemm.MAX_ROWS``, whether
        the skinny GEMM kernel beats cuBLAS on this device and uses it where it does
        (``worker/gemm_choice.py``; ``on=False``: cuBLAS everywhere again), then captures the
        graphs again. Returns the measurements. CUDA, one rank only."""
        from ferryman.worker import gemm_choice

        if self.device.type != "cuda" or self.model.tp.world > 1:
            raise ValueError("the skinny GEMM runs on one CUDA device")
        report: dict[str, Any] = {}
        if on:
            report = gemm_choice.calibrate(self.model, self._graph_args[1])
        else:
            gemm_choice.clear(self.model)
        if self.graphs is not None:
            self.capture_graphs(logits_in_graph=self.graphs.logits_in_graph)
        return report

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, prev: torch.Tensor | None = None, also: np.ndarray | None = None
    ) -> torch.Tensor:
        """float32 logits ``[S, vocab]``, S = len(out.logits_indices), then one row per token
        index of ``also`` (prompt logprobs). ``prev``: the previous step's sampled ids (int32,
        on the device) when this step's inputs name some."""
        step = self.block_table.step(out)
        if self.position_limit and len(step.positions) and int(step.positions.max()) >= self.position_limit:
            # FlashInfer's RoPE table and the CUDA graphs' page buffers end there, unchecked
            top = int(step.positions.max())
            raise ValueError(f"position {top} is past the {self.position_limit} this runner was sized for")
        self.kv.run_plans(
            out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, step.slot_mapping
        )
        if out.num_scheduled_tokens == 0:
            return torch.empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        fill = self._inflight_inputs(out, prev)
        hidden = self.graphs.run(step, fill) if self.graphs is not None else None
        logits_ready = hidden is not None and self.graphs is not None and self.graphs.logits_in_graph
        if hidden is not None:
            self.num_graph_steps += 1
        else:
            self.attn.plan(step)
            input_ids = to_device(step.input_ids.astype(np.int64), self.device)
            if fill is not None:
                put_inflight(input_ids, fill)
            positions = to_device(step.positions, self.device)
            hidden = self.model(input_ids, positions, self.attn, self.ops)
        at = out.logits_indices if also is None else np.concatenate([out.logits_indices, also])
        every_row = len(at) == len(hidden) and (not len(at) or _run_start(at) == 0)  # decode
        if not every_row:
            hidden = hidden[to_device(at, self.device)]
        return hidden if logits_ready else self.model.compute_logits(hidden)

    def _inflight_inputs(self, out: SchedulerOutput, prev: torch.Tensor | None) -> Inflight | None:
        """(places in ``input_ids``, token ids) of the inputs still in flight, on the device: a
        slice and a slice of ``prev`` when both sides are consecutive (a decode batch whose rows
        kept their order: no index copies), else index tensors."""
        places, src = out.inflight_token_indices, out.inflight_sample_indices
        if not len(places):
            return None
        if prev is None:
            raise RuntimeError("this step's inputs name samples of a step that did not run here")
        p0, s0, n = _run_start(places), _run_start(src), len(places)
        if p0 is not None and s0 is not None:
            return slice(p0, p0 + n), prev[s0 : s0 + n]
        dev = self.device
        at = to_device(places.astype(np.int64), dev)
        return at, prev[to_device(src.astype(np.int64), dev)].long()


def _run_start(a: np.ndarray) -> int | None:
    """``a[0]`` when ``a`` is a run of consecutive integers (``a[0], a[0] + 1, ...``), else None
    (an empty ``a`` too)."""
    if not len(a) or int(a[-1]) - int(a[0]) != len(a) - 1 or not (np.diff(a) == 1).all():
        return None
    return int(a[0])


def runner_with_pool(
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
    attention_backend: str = "auto",
    enforce_eager: bool = False,
    max_num_seqs: int = 256,
    max_model_len: int = 8192,
) -> ModelRunner:
    """A runner over a new KV pool sized for ``model``'s KV heads (one rank's with tensor
    parallelism)."""
    mc = model.cfg
    kv = KvCache(
        mc.num_layers,
        num_device_blocks,
        num_host_blocks,
        block_size,
        model.shard.num_kv_heads,
        mc.head_dim,
        dtype,
        device,
    )
    return ModelRunner(
        model,
        kv,
        block_size,
        device,
        attention_backend,
        enforce_eager=enforce_eager,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
