"""KV tensors and the plans that move blocks: device and host pools with one block shape.

Layout: block-major, ``[num_blocks, layers, 2, block_size, num_kv_heads, head_dim]``; block 0
is the null block. One block is one contiguous chunk across all layers, so a swap moves each
maximal run of consecutive blocks (consecutive on both sides) with one copy, whatever the number
of layers; ``layer(i)`` is layer i's ``[num_blocks, 2, block_size, Hkv, D]`` view (FlashInfer's
NHD with a block stride, which FlashInfer accepts). The plans run in the order swap-out, swap-in,
copy (the scheduler's contract).

On CUDA the host pool is pinned and allocated once; swaps run on a dedicated copy stream that
first waits for the compute stream (so a block's last writes land before it is copied out), and
the compute stream waits for the copies' event before the forward (so no freed block is
rewritten, and no swapped-in block read, before its copy is done).
"""

from __future__ import annotations

import numpy as np
import torch


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
    ) -> None:
        block = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.device_kv = torch.zeros((num_device_blocks + 1, *block), dtype=dtype, device=device)
        self._cuda = device.type == "cuda"
        # host blocks are always written (swap-out) before they are read, so their memory is
        # left untouched until used; device blocks are zeroed because the null block pads reads
        self.host_kv = torch.empty((num_host_blocks + 1, *block), dtype=dtype, pin_memory=self._cuda)
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]

    @property
    def num_device_blocks(self) -> int:
        return int(self.device_kv.shape[0]) - 1

    @property
    def num_host_blocks(self) -> int:
        return int(self.host_kv.shape[0]) - 1

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's ``[num_blocks, 2, block_size, Hkv, D]`` view of the device pool."""
        return self.device_kv[:, i]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def run_plans(self, swap_out: np.ndarray, swap_in: np.ndarray, copy: np.ndarray) -> None:
        if len(swap_out) or len(swap_in):
            if self._copy_stream is None:
                self._swap(swap_out, swap_in)
            else:
                compute = torch.cuda.current_stream(self.device_kv.device)
                self._copy_stream.wait_stream(compute)
                with torch.cuda.stream(self._copy_stream):
                    self._swap(swap_out, swap_in)
                compute.wait_stream(self._copy_stream)
        if len(copy):
            idx = torch.from_numpy(copy).to(self.device_kv.device, torch.long)
            self.device_kv[idx[:, 1]] = self.device_kv[idx[:, 0]]

    def _swap(self, swap_out: np.ndarray, swap_in: np.ndarray) -> None:
        """Each plan's runs in one multi-tensor copy call (the per-run dispatch happens in C++, not
        in a Python loop); swap-out before swap-in, since a block one frees the other may take."""
        for plan, src, dst in (
            (swap_out, self.device_kv, self.host_kv),
            (swap_in, self.host_kv, self.device_kv),
        ):
            runs = contiguous_runs(plan).tolist()
            if runs:
                torch._foreach_copy_(
                    [dst[d : d + n] for _, d, n in runs],
                    [src[s : s + n] for s, _, n in runs],
                    non_blocking=self._cuda,  # the host side is pinned there
                )
