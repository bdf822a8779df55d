"""CUDA graphs for decode-only steps: the GPU path with FlashInfer, on unless ``enforce_eager``.

Owns the batch sizes captured, one graph per size (all sharing one memory pool), the static
input buffers the graphs read, and one FlashInfer decode wrapper per size in its CUDA-graph mode
(a wrapper's batch size is fixed for its life). A decode-only step of B rows runs on the smallest
captured size >= B; larger or mixed steps run eager.

Padding: rows B..size-1 are dummies that own nothing. Each reads one page, the null block (page
0, one entry), and writes its K/V to slot 0 of the null block; no request ever owns block 0, and
no FlashInfer step reads it for a request (only the torch backend reads it, as masked padding, and
the torch backend never runs with graphs). Their outputs are dropped.

Invariants: graphs are captured after the KV pool is allocated (they hold its address); every
replay is preceded by that size's ``plan()`` with the step's page table (host-side; its inputs
are already on the device, so planning does not wait for the GPU); the host -> device copies of a
step go through freshly pinned tensors, so a copy still in flight never has its source rewritten.

``capture_sizes``, ``graph_size`` and ``pad_decode`` are pure and tested on CPU; capture and
replay run only on CUDA and are checked against eager in ``tests/gpu`` (passed on an H200).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferryman.attention.flashinfer_backend import write_and_attend
from ferryman.models.llama import LlamaForCausalLM
from ferryman.worker.kv_cache import KvCache

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to ``min(max_num_seqs, limit)`` (included)."""
    top = min(max_num_seqs, limit)
    if top < 1:
        return []
    sizes = {s for s in (1, 2, 4, 8) if s < top} | set(range(16, top, 16)) | {top}
    return sorted(sizes)


def graph_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds ``batch`` rows, or None (run eager)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if batch >= 1 and i < len(sizes) else None


@dataclass(slots=True)
class PaddedDecode:
    """One decode-only step padded to a captured size; every array has ``size`` rows (indptr
    ``size + 1``)."""

    input_ids: np.ndarray  # int64 [size]
    positions: np.ndarray  # int64 [size]
    slot_mapping: np.ndarray  # int64 [size]
    kv_indptr: np.ndarray  # int32 [size + 1]
    kv_indices: np.ndarray  # int32 [kv_indptr[-1]]
    kv_last_page_len: np.ndarray  # int32 [size]


def pad_decode(out: Any, size: int) -> PaddedDecode:
    """Pads a decode-only step (one token per row) with dummy rows on the null block."""
    rows = len(out.kv_indptr) - 1
    if len(out.input_ids) != rows:
        raise ValueError(f"not a decode-only step: {len(out.input_ids)} tokens in {rows} rows")
    if not 0 <= rows <= size:
        raise ValueError(f"{rows} rows do not fit a graph of size {size}")
    pad = size - rows
    zeros = np.zeros(pad, dtype=np.int64)
    last = int(out.kv_indptr[-1]) if rows else 0
    return PaddedDecode(
        input_ids=np.concatenate([np.asarray(out.input_ids, dtype=np.int64), zeros]),
        positions=np.concatenate([np.asarray(out.positions, dtype=np.int64), zeros]),
        slot_mapping=np.concatenate([np.asarray(out.slot_mapping, dtype=np.int64), zeros]),
        kv_indptr=np.concatenate(
            [np.asarray(out.kv_indptr, dtype=np.int32), last + np.arange(1, pad + 1, dtype=np.int32)]
        ),
        kv_indices=np.concatenate(
            [np.asarray(out.kv_indices, dtype=np.int32), np.zeros(pad, dtype=np.int32)]
        ),
        kv_last_page_len=np.concatenate(
            [np.asarray(out.kv_last_page_len, dtype=np.int32), np.ones(pad, dtype=np.int32)]
        ),
    )


class _GraphAttention:
    """The attention the captured forward calls: K/V written through the static slots, then the
    size's CUDA-graph decode wrapper."""

    def __init__(self, kv: KvCache, wrapper: Any, slots: torch.Tensor, block_size: int) -> None:
        self.kv, self.wrapper, self.slots, self.bs = kv, wrapper, slots, block_size
        self.blk = self.off = slots  # set from the slots at layer 0 of every forward

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer_idx == 0:
            # (block, offset) from the static slot buffer INSIDE the forward, so the capture
            # records these kernels and each replay reads that step's slots. (Computed once at
            # construction they were frozen at the capture's dummy slots: every replay wrote its
            # K/V into the null block. The H200 check caught it; test_cuda_graph_logits_match_eager.)
            self.blk, self.off = self.slots // self.bs, self.slots % self.bs
        return write_and_attend(self.kv.layer(layer_idx), self.blk, self.off, self.wrapper, q, k, v)


class DecodeGraphs:
    """Captures the model's decode forward at ``sizes``; ``run(out)`` replays the right one."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KvCache,
        block_size: int,
        scale: float,
        sizes: list[int],
        max_pages_per_row: int,
        workspace: torch.Tensor,
    ) -> None:
        import flashinfer

        cfg = model.cfg
        dev = kv.device_kv.device
        self.model, self.kv, self.bs, self.sizes = model, kv, block_size, sizes
        self.dtype = kv.device_kv.dtype
        self._plan_kw = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": scale}
        self._heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        top = sizes[-1]
        self._inputs = torch.zeros((3, top), dtype=torch.long, device=dev)  # ids, positions, slots
        self._indices = torch.zeros(top * max_pages_per_row + top, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):  # largest first, so the smaller ones reuse its pool memory
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=dev),
            )
            ids, pos, slots = self._inputs[0, :size], self._inputs[1, :size], self._inputs[2, :size]
            dummy = pad_decode(_EmptyStep(), size)
            self._stage(dummy, size, wrapper)
            attn = _GraphAttention(kv, wrapper, slots, block_size)
            side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, autotuning)
                model(ids, pos, attn)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model(ids, pos, attn)
            self._graphs[size] = (graph, wrapper, hidden)
        torch.cuda.synchronize(dev)

    def _stage(self, p: PaddedDecode, size: int, wrapper: Any) -> None:
        dev = self._inputs.device
        host = torch.from_numpy(np.stack([p.input_ids, p.positions, p.slot_mapping])).pin_memory()
        self._inputs[:, :size].copy_(host, non_blocking=True)
        indices = torch.from_numpy(p.kv_indices).pin_memory().to(dev, non_blocking=True)
        hq, hkv, d = self._heads
        wrapper.plan(
            torch.from_numpy(p.kv_indptr).pin_memory(),
            indices,
            torch.from_numpy(p.kv_last_page_len).pin_memory(),
            hq,
            hkv,
            d,
            self.bs,
            **self._plan_kw,
        )

    def run(self, out: Any) -> torch.Tensor | None:
        """Hidden states ``[B, hidden]`` of a decode-only step, or None when no graph fits."""
        rows = len(out.kv_indptr) - 1
        size = graph_size(self.sizes, rows)
        if size is None or out.num_scheduled_tokens != rows:
            return None
        graph, wrapper, hidden = self._graphs[size]
        self._stage(pad_decode(out, size), size, wrapper)
        graph.replay()
        return hidden[:rows]


class _EmptyStep:
    """A decode step of no rows: what capture pads into an all-dummy batch."""

    input_ids = positions = slot_mapping = np.zeros(0, dtype=np.int64)
    kv_indptr = np.zeros(1, dtype=np.int32)
    kv_indices = kv_last_page_len = np.zeros(0, dtype=np.int32)
