"""ModelRunner: one step's tensors in, logits of the rows to sample out.

Order within a step: the swap/copy plans, then the attention plan, then the forward, then the
logits of ``logits_indices`` (a row repeats for n > 1). With FlashInfer and without
``enforce_eager``, a decode-only step that fits a captured batch size replays a CUDA graph
(``worker/cuda_graph.py``) instead of the eager plan + forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferryman._core import SchedulerOutput
from ferryman.attention.base import AttentionBackend
from ferryman.attention.flashinfer_backend import FlashInferBackend, flashinfer_available
from ferryman.attention.torch_backend import TorchAttentionBackend
from ferryman.models.llama import LlamaForCausalLM
from ferryman.worker.kv_cache import KvCache

if TYPE_CHECKING:
    from ferryman.worker.cuda_graph import DecodeGraphs

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


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
        ``ferryman[gpu]``), or "auto" (FlashInfer when both are there, else torch)."""
        self.model = model
        self.kv = kv
        model.pack_cpu_weights()  # CPU float32 only; a no-op elsewhere
        self.device = device
        cfg = model.cfg
        scale = cfg.head_dim**-0.5
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        use_fi = False
        if attention_backend == "flashinfer" or (attention_backend == "auto" and device.type == "cuda"):
            use_fi = device.type == "cuda" and flashinfer_available()
            if attention_backend == "flashinfer" and not use_fi:
                need = "a CUDA device and FlashInfer (pip install ferryman[gpu])"
                raise ValueError(f"attention_backend='flashinfer' needs {need}")
        self.attn: AttentionBackend
        layers = kv.layers()
        fi: FlashInferBackend | None = None
        if use_fi:
            fi = FlashInferBackend(layers, block_size, scale, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            self.attn = fi
        else:
            self.attn = TorchAttentionBackend(layers, block_size, scale=scale)
        self.attention_backend = "flashinfer" if use_fi else "torch"
        self.graphs: DecodeGraphs | None = None  # where CUDA graphs are on
        self.num_graph_steps = 0
        if fi is not None and not enforce_eager:
            from ferryman.worker.cuda_graph import DecodeGraphs, capture_sizes

            pages = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(fi, model, capture_sizes(max_num_seqs), pages)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits ``[S, vocab]``, S = len(out.logits_indices)."""
        self.kv.run_plans(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, out.slot_mapping)
        if out.num_scheduled_tokens == 0:
            return torch.empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        hidden = self.graphs.run(out) if self.graphs is not None else None
        if hidden is not None:
            self.num_graph_steps += 1
        else:
            self.attn.plan(out)
            input_ids = torch.from_numpy(out.input_ids).to(self.device, torch.long)
            positions = torch.from_numpy(out.positions).to(self.device)
            hidden = self.model(input_ids, positions, self.attn)
        rows = hidden[torch.from_numpy(out.logits_indices).to(self.device)]
        return self.model.compute_logits(rows)
