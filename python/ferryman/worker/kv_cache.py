"""KV tensors and the plans that move blocks: device and host pools with one block shape.

Layout: block-major, ``[num_blocks, layers, 2, block_size, num_kv_heads, head_dim]``; block 0
is the null block. One block is one contiguous chunk across all layers, so a swap moves each
maximal run of consecutive blocks (consecutive on both sides) with one copy, whatever the number
of layers; ``layers()[i]`` is layer i's ``[num_blocks, 2, block_size, Hkv, D]`` view (FlashInfer's
NHD with a block stride, which FlashInfer accepts). The plans run in the order swap-out, swap-in,
copy (the scheduler's contract).

On CUDA the host pool is page-locked at its own size and allocated once (``page_locked``); swaps
run on a dedicated copy stream that first waits for the compute stream (so a block's last writes
land before it is copied out). The compute stream then waits for exactly what the step needs:
for the swap-ins (and the swap-outs queued before them) when there are any; for the swap-outs
when this step writes one of the blocks they free (``swap_out_blocks_rewritten``: the step's
slots and copy targets). Otherwise the swap-out overlaps this step's forward, and the next step
waits for it before anything else, so no freed block is rewritten, and no swapped-in block read,
before its copy is done.

A swap whose blocks are scattered on the device but run on in the host pool goes through a
device staging buffer (CUDA, with a host pool; ``STAGING_BYTES``): each chunk of blocks is
gathered into one half of it with one kernel and copied out by host runs (swap-in: copied in by
host runs, then scattered with one kernel), so a plan of n scattered blocks costs a few large
host copies instead of n small ones, each of which pays a fixed cost (on an H200, 1,024
scattered blocks of 2 MiB moved 0.79 of a plain copy's bandwidth copied run by run, 0.89 staged
through one buffer). A plan is staged only where that makes fewer host copies. The gathers and
scatters run on a side stream, the host copies on the copy stream, so one half's kernel overlaps
the other half's host copy; events order each half's reuse.

The device pool starts zeroed (the null block pads reads). On the CPU it is anonymous memory,
which the kernel hands out as zero pages on first touch: a large pool costs nothing at start-up
until blocks are written, where ``torch.zeros`` would write all of it (~0.3 s for 512 MiB here).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import Any

import numpy as np
import torch

from ferryman.worker.transfer import page_locked, to_device


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU, over an anonymous memory map (zero until written; the tensor
    keeps the map alive)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


STAGING_BYTES = 128 << 20  # device memory a swap is staged through (whole blocks, at least one)


def staging_blocks(bytes_per_block: int) -> int:
    """Blocks of the staging buffer: ``STAGING_BYTES`` worth, at least one."""
    return max(1, STAGING_BYTES // bytes_per_block)


def _on(stream: torch.cuda.Stream | None) -> Any:
    """A context running on ``stream`` (none on the CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now (None on the CPU)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    return ev


def _wait(stream: torch.cuda.Stream | None, ev: torch.cuda.Event | None) -> None:
    """``stream`` waits for ``ev`` (nothing to wait for on the CPU)."""
    if stream is not None and ev is not None:
        stream.wait_event(ev)


def host_runs(host_ids: np.ndarray) -> int:
    """Maximal runs of consecutive ids in ``host_ids`` once sorted."""
    if len(host_ids) == 0:
        return 0
    return int(np.count_nonzero(np.diff(np.sort(host_ids)) != 1)) + 1


def contiguous_runs(pairs: np.ndarray) -> np.ndarray:
    """Groups (src, dst) block pairs into maximal runs where both sides advance by one:
    ``[r, 3]`` int64 rows of (src start, dst start, length). Pairs are taken in src order."""
    if len(pairs) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    p = pairs[np.argsort(pairs[:, 0], kind="stable")].astype(np.int64)
    breaks = np.flatnonzero((np.diff(p[:, 0]) != 1) | (np.diff(p[:, 1]) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(p)])))
    return np.stack([p[starts, 0], p[starts, 1], lengths], axis=1)


def swap_out_blocks_rewritten(
    swap_out: np.ndarray, slot_mapping: np.ndarray | None, copy: np.ndarray, block_size: int
) -> bool:
    """Whether a step writes a device block its swap-out frees (through its slots or as a copy
    target), so its forward must wait for the swap-out; unknown writes (None) count as yes."""
    if len(swap_out) == 0:
        return False
    if slot_mapping is None:
        return True
    written = np.concatenate([np.asarray(slot_mapping) // block_size, np.asarray(copy)[:, 1]])
    return bool(np.isin(swap_out[:, 0], written).any())


class KvCache:
    def __init__(
        self,
        num_layers: int,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        staging: int | None = None,
    ) -> None:
        """``staging``: blocks of the swap staging buffer (default: ``staging_blocks`` on CUDA
        with a host pool, else none; a CPU test passes a number to run the staged path)."""
        block = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.block_size = block_size
        self.device_kv = zeroed((num_device_blocks + 1, *block), dtype, device)
        self._cuda = device.type == "cuda"
        # host blocks are always written (swap-out) before they are read, so their memory is
        # left untouched until used; device blocks are zeroed because the null block pads reads
        shape = (num_host_blocks + 1, *block)
        self.host_kv = page_locked(shape, dtype) if self._cuda else torch.empty(shape, dtype=dtype)
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._side_stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._pending_swap_out: torch.cuda.Event | None = None  # a swap-out the forward did not wait for
        if staging is None and self._cuda and num_host_blocks > 0:
            per_block = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
            staging = staging_blocks(per_block)
        self._staging = torch.empty((staging, *block), dtype=dtype, device=device) if staging else None
        self.num_staged_swaps = 0  # plans that went through the staging buffer

    @property
    def num_device_blocks(self) -> int:
        return int(self.device_kv.shape[0]) - 1

    @property
    def num_host_blocks(self) -> int:
        return int(self.host_kv.shape[0]) - 1

    def layers(self) -> list[torch.Tensor]:
        """Each layer's ``[num_blocks, 2, block_size, Hkv, D]`` view of the device pool: the layer
        tensors an attention backend writes and reads."""
        return [self.device_kv[:, i] for i in range(self.num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def run_plans(
        self,
        swap_out: np.ndarray,
        swap_in: np.ndarray,
        copy: np.ndarray,
        slot_mapping: np.ndarray | None = None,
    ) -> None:
        """Runs one step's plans. ``slot_mapping`` (the step's writes) lets a swap-out that frees
        no block this step writes overlap the forward (CUDA only; see the module docstring)."""
        if self._copy_stream is not None:
            compute = torch.cuda.current_stream(self.device_kv.device)
            if self._pending_swap_out is not None:
                compute.wait_event(self._pending_swap_out)
                self._pending_swap_out = None
            if len(swap_out) or len(swap_in):
                self._copy_stream.wait_stream(compute)
                with torch.cuda.stream(self._copy_stream):
                    self._swap(swap_out, to_host=True)
                    out_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    out_done.record(self._copy_stream)
                    self._swap(swap_in, to_host=False)
                    in_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    in_done.record(self._copy_stream)
                if len(swap_in):
                    compute.wait_event(in_done)  # the copy stream runs in order: out, then in
                elif swap_out_blocks_rewritten(swap_out, slot_mapping, copy, self.block_size):
                    compute.wait_event(out_done)
                else:
                    self._pending_swap_out = out_done
        else:
            self._swap(swap_out, to_host=True)
            self._swap(swap_in, to_host=False)
        if len(copy):
            idx = to_device(copy.astype(np.int64), self.device_kv.device)
            self.device_kv[idx[:, 1]] = self.device_kv[idx[:, 0]]

    def _swap(self, plan: np.ndarray, to_host: bool) -> None:
        """A swap-out (``to_host``: rows (device, host)) or swap-in plan (rows (host, device)):
        staged where that makes fewer host copies than copying each run on both sides."""
        src, dst = (self.device_kv, self.host_kv) if to_host else (self.host_kv, self.device_kv)
        if self._staging is None or len(plan) == 0:
            self._copy_runs(plan, src, dst)
            return
        host = plan[:, 1] if to_host else plan[:, 0]
        chunks = -(-len(plan) // self._chunk_blocks())
        if host_runs(host) + chunks >= len(contiguous_runs(plan)):
            self._copy_runs(plan, src, dst)
            return
        self.num_staged_swaps += 1
        self._staged(plan[np.argsort(host, kind="stable")], to_host)

    def _staged(self, plan: np.ndarray, to_host: bool) -> None:
        """``plan`` sorted by host block: chunk by chunk, the device side gathered into (or
        scattered from) a half of the staging buffer with one kernel, the host side copied by
        runs. On CUDA the kernels run on a side stream, so chunk c+1's gather (or chunk c-1's
        scatter) overlaps chunk c's host copy on the copy stream; each half waits for its last
        use on the other stream before it is reused."""
        assert self._staging is not None
        h, d = (1, 0) if to_host else (0, 1)
        # the gather and scatter index rows of [blocks, block elements] views (the same memory):
        # a 2-D index kernel, not one that works out six coordinates per element
        flat_dev = self.device_kv.view(self.device_kv.shape[0], -1)
        size = self._chunk_blocks()
        halves = [self._staging[i * size : (i + 1) * size] for i in range(len(self._staging) // size)]
        side, copy = self._side_stream, self._copy_stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device_kv.device))  # the copy stream
        with _on(side):
            dev_all = to_device(plan[:, d].astype(np.int64), self.device_kv.device)
        free: list[torch.cuda.Event | None] = [None] * len(halves)  # each half's last use
        for c, start in enumerate(range(0, len(plan), size)):
            rows = plan[start : start + size]
            n, k = len(rows), c % len(halves)
            dev_idx = dev_all[start : start + n]
            stage = halves[k][:n]
            flat_stage = stage.view(n, -1)
            # (host start, staging start, length) of each run of consecutive host blocks
            runs = contiguous_runs(np.stack([rows[:, h], np.arange(n)], axis=1)).tolist()
            host = [self.host_kv[hs : hs + m] for hs, _, m in runs]
            staged = [stage[i : i + m] for _, i, m in runs]
            if to_host:
                with _on(side):
                    _wait(side, free[k])
                    torch.index_select(flat_dev, 0, dev_idx, out=flat_stage)
                    gathered = _record(side)
                with _on(copy):
                    _wait(copy, gathered)
                    torch._foreach_copy_(host, staged, non_blocking=self._cuda)
                    free[k] = _record(copy)
            else:
                with _on(copy):
                    _wait(copy, free[k])
                    torch._foreach_copy_(staged, host, non_blocking=self._cuda)
                    loaded = _record(copy)
                with _on(side):
                    _wait(side, loaded)
                    flat_dev.index_copy_(0, dev_idx, flat_stage)
                    free[k] = _record(side)
        if side is not None and copy is not None:
            copy.wait_stream(side)  # what follows on the copy stream sees every scatter

    def _chunk_blocks(self) -> int:
        """Blocks per staged chunk: half the buffer (two chunks in flight), or all of a buffer
        of one block."""
        assert self._staging is not None
        return max(1, len(self._staging) // 2)

    def _copy_runs(self, plan: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One plan's runs in one multi-tensor copy call (the per-run dispatch happens in C++, not
        in a Python loop); callers run swap-out before swap-in, since a block one frees the other
        may take."""
        runs = contiguous_runs(plan).tolist()
        if runs:
            torch._foreach_copy_(
                [dst[d : d + n] for _, d, n in runs],
                [src[s : s + n] for s, _, n in runs],
                non_blocking=self._cuda,  # the host side is pinned there
            )
