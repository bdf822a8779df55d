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
replay is preceded by that size's plan with the step's page table (host-side, so planning does
not wait for the GPU; the first by the wrapper's own ``plan()``, later ones by
``FastDecodePlan`` where usable); (block, offset) of the K/V write is computed from the static
slot buffer inside the captured forward, so each replay writes at its own step's slots; a step's
inputs and page table reach the device in one copy from a page-locked buffer (``StepStaging``)
that is not rewritten while that copy may still be queued.

``capture_sizes``, ``graph_size`` and ``StepStaging`` (its padding and layout) are tested on CPU,
and so is the K/V write of a captured size's attention; capture, replay and the fast plan run
only on CUDA and are checked against eager in ``tests/gpu``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ferryman.attention.base import AttentionBackend, Inflight, KvWriter, StepInputs, put_inflight
from ferryman.attention.flashinfer_backend import FlashInferBackend, PlanArgs, run_planned
from ferryman.attention.flashinfer_plan import FastDecodePlan

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


class StepStaging:
    """Where every captured size reads its step from: one device buffer of int32 words, and
    page-locked host buffers of the same layout (a ring of ``RING``) that a step is packed into
    and copied from in one piece (one copy per step, where there were six). Layout, for the
    largest size T: token ids, positions and slots as int64 rows ``[3, T]`` (words 0..6T),
    ``kv_indptr`` (6T..7T+1), ``kv_last_page_len`` (7T+1..8T+1), then the page list; a size S
    uses the first S entries of each row (S+1 of the indptr). A host buffer is rewritten only
    after everything queued by the step that used it, up to its plan, has run (an event per
    buffer, recorded by ``staged()``; almost always long past)."""

    RING = 4

    def __init__(self, top: int, max_pages_per_row: int, device: torch.device) -> None:
        self.top = top
        words = 8 * top + 1 + top * max_pages_per_row + top
        self.device_buf = torch.zeros(words, dtype=torch.int32, device=device)
        self._cuda = device.type == "cuda"
        self._host = [torch.zeros(words, dtype=torch.int32, pin_memory=self._cuda) for _ in range(self.RING)]
        self._copied: list[Any] = [None] * self.RING  # the event after each host buffer's last read
        self._next = self._last = 0

    def inputs(self, size: int) -> torch.Tensor:
        """The device's int64 ``[3, size]`` view: token ids, positions, slots."""
        t = self.top
        return self.device_buf[: 6 * t].view(torch.int64).view(3, t)[:, :size]

    def kv_indptr(self, buf: torch.Tensor, size: int) -> torch.Tensor:
        return buf[6 * self.top : 6 * self.top + size + 1]

    def kv_last_page_len(self, buf: torch.Tensor, size: int) -> torch.Tensor:
        return buf[7 * self.top + 1 : 7 * self.top + 1 + size]

    def kv_indices(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[8 * self.top + 1 :]

    def stage(self, out: Any, size: int) -> torch.Tensor:
        """Pads the decode-only step ``out`` (a ``StepInputs``; one token per row) to ``size``
        rows, packed into the next host buffer, and queues that buffer's copy to the device
        buffer on the current stream; returns the host buffer (the plan reads ``kv_indptr``
        from it). A dummy row owns nothing: one token on page 0, the null block (one entry),
        writing its slot 0."""
        rows = len(out.kv_indptr) - 1
        if len(out.input_ids) != rows:
            raise ValueError(f"not a decode-only step: {len(out.input_ids)} tokens in {rows} rows")
        if not 0 <= rows <= size:
            raise ValueError(f"{rows} rows do not fit a graph of size {size}")
        i, self._next = self._next, (self._next + 1) % self.RING
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        host, t = self._host[i], self.top
        h = host.numpy()
        tokens = h[: 6 * t].view(np.int64).reshape(3, t)
        for r, a in enumerate((out.input_ids, out.positions, out.slot_mapping)):
            tokens[r, :rows] = a
            tokens[r, rows:size] = 0
        pages = int(out.kv_indptr[-1]) if rows else 0
        indptr = h[6 * t : 6 * t + size + 1]
        indptr[: rows + 1] = out.kv_indptr
        indptr[rows + 1 :] = pages + np.arange(1, size - rows + 1)
        last = h[7 * t + 1 : 7 * t + 1 + size]
        last[:rows] = out.kv_last_page_len
        last[rows:] = 1
        n = 8 * t + 1 + pages + size - rows
        h[8 * t + 1 : 8 * t + 1 + pages] = out.kv_indices
        h[8 * t + 1 + pages : n] = 0
        self.device_buf[:n].copy_(host[:n], non_blocking=self._cuda)
        self._last = i
        return host

    def staged(self) -> None:
        """Marks the last staged host buffer free once what is queued now has run: called after
        the step's plan, whose own copies (FlashInfer's ``plan()``, the fall-back) may read it."""
        if self._cuda:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(torch.cuda.current_stream(self.device_buf.device))  # the copy's device
            self._copied[self._last] = ev


class _GraphAttention:
    """One captured size's attention, an ``AttentionBackend``. ``plan(out)`` pads the step to the
    size and stages everything the captured forward reads (``StepStaging``): token ids,
    positions, slots and the page table, which the size's CUDA-graph decode wrapper reads from
    the same device buffer; then re-plans the wrapper (``FastDecodePlan`` where usable, else its
    own ``plan()``). ``forward`` maps the static slots to (block, offset) at layer 0, inside the
    captured forward, so each replay writes K/V at that step's slots."""

    def __init__(
        self,
        kv_layers: Sequence[torch.Tensor],
        wrapper: Any,
        staging: StepStaging,
        size: int,
        args: PlanArgs,
        fast: FastDecodePlan | None = None,
    ) -> None:
        self.layers, self.wrapper, self.staging, self.args = list(kv_layers), wrapper, staging, args
        self.size, self.fast = size, fast
        self.inputs = staging.inputs(size)
        self.writer = KvWriter(args.block_size, self.inputs.device)
        self.num_fast_plans = 0

    def plan(self, out: StepInputs) -> None:
        st, size = self.staging, self.size
        host = st.stage(out, size)
        indptr, last = st.kv_indptr(host, size), st.kv_last_page_len(host, size)
        try:
            if self.fast is not None and self.fast.usable():
                self.args.replan_decode(self.fast, indptr.numpy(), last.numpy())
                self.num_fast_plans += 1
            else:
                indices = st.kv_indices(st.device_buf)[: int(indptr[-1])]
                self.args.plan_decode(self.wrapper, indptr, indices, last)  # copies from `host` too
        finally:  # a plan that raised may still have queued copies from `host`
            st.staged()

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
        self,
        backend: FlashInferBackend,
        forward: StepForward,
        sizes: list[int],
        max_pages_per_row: int,
        head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    ) -> None:
        """``head``: captured after the forward (the LM head: the graphs then give float32
        logits, and the step launches two kernels fewer outside them; ``logits_in_graph``), into
        one buffer all sizes share: a step's logits are valid until the next replay."""
        import flashinfer

        self.logits_in_graph = head is not None

        dev = backend.device
        self.sizes = sizes
        top = sizes[-1]
        self.staging = st = StepStaging(top, max_pages_per_row, dev)
        buf, a = st.device_buf, backend.args
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, _GraphAttention, torch.Tensor]] = {}
        with torch.cuda.device(dev):  # the pool, streams and capture on the backend's device
            pool = torch.cuda.graph_pool_handle()
            logits: torch.Tensor | None = None  # with ``head``: the sizes' shared output
            for size in reversed(sizes):  # largest first, so the smaller ones reuse its pool memory
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    backend.workspace,
                    kv_layout="NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=st.kv_indptr(buf, size),  # views of the staged step
                    paged_kv_indices_buffer=st.kv_indices(buf),
                    paged_kv_last_page_len_buffer=st.kv_last_page_len(buf, size),
                )
                fast = FastDecodePlan(wrapper, size, a.num_qo_heads, a.num_kv_heads, a.head_dim)
                attn = _GraphAttention(backend.layers, wrapper, st, size, a, fast)
                attn.plan(_EmptyStep())  # type: ignore[arg-type]
                ids, pos = attn.inputs[0], attn.inputs[1]
                side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, autotuning)
                    warm = forward(ids, pos, attn)
                    if head is not None:
                        warm = head(warm, None)
                        if logits is None:  # one buffer every size writes (the largest is first)
                            logits = torch.empty_like(warm)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = forward(ids, pos, attn)
                    if logits is not None and head is not None:
                        hidden = head(hidden, logits[:size])  # cast into it: no float32 temporary
                self._graphs[size] = (graph, attn, hidden)
            torch.cuda.synchronize(dev)

    @property
    def num_fast_plans(self) -> int:
        """Plans done by ``FastDecodePlan`` rather than the wrapper's own ``plan()``."""
        return sum(attn.num_fast_plans for _, attn, _ in self._graphs.values())

    def run(self, out: StepInputs, fill: Inflight | None = None) -> torch.Tensor | None:
        """Hidden states ``[B, hidden]`` of a decode-only step (with ``head``: its float32
        logits ``[B, vocab]``), or None when no graph fits. ``fill``: (places, token ids) on the
        device for inputs still in flight (async scheduling), written over the staged ids
        before the replay."""
        rows = len(out.kv_indptr) - 1
        size = graph_size(self.sizes, rows)
        if size is None or out.num_scheduled_tokens != rows:
            return None
        graph, attn, hidden = self._graphs[size]
        attn.plan(out)
        if fill is not None:
            put_inflight(attn.inputs[0], fill)
        graph.replay()
        return hidden[:rows]


class _EmptyStep:
    """A decode step of no rows: what capture pads into an all-dummy batch."""

    input_ids = positions = slot_mapping = np.zeros(0, dtype=np.int64)
    kv_indptr = np.zeros(1, dtype=np.int32)
    kv_indices = kv_last_page_len = np.zeros(0, dtype=np.int32)
