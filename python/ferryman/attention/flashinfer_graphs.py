"""CUDA graphs for decode-only steps: the GPU path with FlashInfer, on unless ``enforce_eager``.

Owns the batch sizes captured, one graph per size (all sharing one memory pool), the static
input buffers the graphs read, and one FlashInfer decode wrapper per size in its CUDA-graph mode
(a wrapper's batch size is fixed for its life). A decode-only step of B rows runs on the smallest
captured size >= B; larger or mixed steps run eager. Built from a ``FlashInferBackend`` (its
layer views, workspace and ``PlanArgs``) and the model's forward as a callable.

Padding: rows B..size-1 are dummies that own nothing. Each reads one page, the null block (page
0, one entry), and writes its K/V to slot 0 of the null block; no request ever owns block 0, and
no FlashInfer step reads it for a request (only the torch backend reads it, as masked padding, and
the torch backend never runs with graphs). Their outputs are dropped.

Invariants: graphs are captured after the KV pool is allocated (they hold its address); every
replay is preceded by that size's ``plan()`` with the step's page table (host-side; its inputs
are already on the device, so planning does not wait for the GPU); (block, offset) of the K/V
write is computed from the static slot buffer inside the captured forward, so each replay writes
at its own step's slots; the host -> device copies of a step go through freshly pinned tensors,
so a copy still in flight never has its source rewritten.

``capture_sizes``, ``graph_size`` and ``pad_decode`` are pure and tested on CPU, and so is the
K/V write of a captured size's attention; capture and replay run only on CUDA and are checked
against eager in ``tests/gpu``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferryman.attention.base import AttentionBackend, KvWriter, StepInputs
from ferryman.attention.flashinfer_backend import FlashInferBackend, PlanArgs, run_planned

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
    """One captured size's attention, an ``AttentionBackend``. ``plan(out)`` pads the step to the
    size and stages everything the captured forward reads: token ids, positions and slots (one
    copy into ``inputs``, ``[3, size]``) and the page table (the size's CUDA-graph decode
    wrapper). ``forward`` maps the static slots to (block, offset) at layer 0, inside the captured
    forward, so each replay writes K/V at that step's slots."""

    def __init__(
        self, kv_layers: Sequence[torch.Tensor], wrapper: Any, inputs: torch.Tensor, args: PlanArgs
    ) -> None:
        self.layers, self.wrapper, self.inputs, self.args = list(kv_layers), wrapper, inputs, args
        self.size = int(inputs.shape[1])
        self.writer = KvWriter(args.block_size, inputs.device)

    def plan(self, out: StepInputs) -> None:
        self.stage(pad_decode(out, self.size))

    def stage(self, p: PaddedDecode) -> None:
        host = torch.from_numpy(np.stack([p.input_ids, p.positions, p.slot_mapping])).pin_memory()
        self.inputs.copy_(host, non_blocking=True)
        indices = torch.from_numpy(p.kv_indices).pin_memory().to(self.inputs.device, non_blocking=True)
        last_page_len = torch.from_numpy(p.kv_last_page_len).pin_memory()
        self.args.plan_decode(
            self.wrapper, torch.from_numpy(p.kv_indptr).pin_memory(), indices, last_page_len
        )

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.writer.write(self.layers[layer_idx], k, v)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer_idx == 0:
            self.writer.map(self.inputs[2])
        self.write_kv(layer_idx, k, v)
        return run_planned(self.wrapper, self.layers[layer_idx], q)


StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]


class DecodeGraphs:
    """Captures a decode forward at ``sizes``; ``run(out)`` replays the right one. ``forward``
    is the model's ``(input_ids, positions, attention) -> hidden states``."""

    def __init__(
        self, backend: FlashInferBackend, forward: StepForward, sizes: list[int], max_pages_per_row: int
    ) -> None:
        import flashinfer

        dev = backend.device
        self.sizes = sizes
        top = sizes[-1]
        self._inputs = torch.zeros((3, top), dtype=torch.long, device=dev)  # ids, positions, slots
        self._indices = torch.zeros(top * max_pages_per_row + top, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, _GraphAttention, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):  # largest first, so the smaller ones reuse its pool memory
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=dev),
            )
            attn = _GraphAttention(backend.layers, wrapper, self._inputs[:, :size], backend.args)
            attn.stage(pad_decode(_EmptyStep(), size))
            ids, pos = attn.inputs[0], attn.inputs[1]
            side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, autotuning)
                forward(ids, pos, attn)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(ids, pos, attn)
            self._graphs[size] = (graph, attn, hidden)
        torch.cuda.synchronize(dev)

    def run(
        self, out: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Hidden states ``[B, hidden]`` of a decode-only step, or None when no graph fits.
        ``fill``: (places, token ids) on the device for inputs still in flight (async
        scheduling), written over the staged ids before the replay."""
        rows = len(out.kv_indptr) - 1
        size = graph_size(self.sizes, rows)
        if size is None or out.num_scheduled_tokens != rows:
            return None
        graph, attn, hidden = self._graphs[size]
        attn.plan(out)
        if fill is not None:
            attn.inputs[0].index_copy_(0, fill[0], fill[1])
        graph.replay()
        return hidden[:rows]


class _EmptyStep:
    """A decode step of no rows: what capture pads into an all-dummy batch."""

    input_ids = positions = slot_mapping = np.zeros(0, dtype=np.int64)
    kv_indptr = np.zeros(1, dtype=np.int32)
    kv_indices = kv_last_page_len = np.zeros(0, dtype=np.int32)
