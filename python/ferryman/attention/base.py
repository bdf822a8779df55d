"""What every attention backend offers the model and the runner, and the one K/V write they share.

``StepInputs`` is what a step's forward reads (the runner builds it from the scheduler's output and
its block table, ``worker/block_table.py``). ``AttentionBackend`` is the protocol: ``plan(step)``
once per step, before the forward;
``forward(layer, q, k, v)`` per layer, which writes the step's K/V of that layer (``write_kv``)
and then attends over each request's blocks, the new K/V included.

The K/V cache a backend writes is handed to it as layer tensors: layer i is a
``[num_blocks, 2, block_size, Hkv, D]`` view (K at index 0, V at 1; FlashInfer's NHD layout with
a block stride) of the block-major pool ``worker/kv_cache.py`` allocates. ``KvWriter`` owns how a
slot of ``slot_mapping`` addresses that view: block ``slot // block_size``, offset
``slot % block_size``, computed once per step (``map``) and used by every layer (``write``). Both
are tensor ops without a host sync, so a CUDA graph can capture them. ``put_inflight`` writes a
step's input ids that were still being sampled when it was planned (async scheduling) over the
ids it staged, eager or before a graph's replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class StepInputs:
    """What one step's forward and attention read: the core's per-row arrays and the per-token
    arrays derived here (B rows, T tokens)."""

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * block_size + offset of each token's K/V
    qo_indptr: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    kv_indptr: np.ndarray  # int32 [B+1]
    kv_indices: np.ndarray  # int32 [kv_indptr[-1]]: each row's blocks, row after row
    kv_last_page_len: np.ndarray  # int32 [B]

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.input_ids)


class AttentionBackend(Protocol):
    def plan(self, out: StepInputs) -> None:
        """Prepares the step's metadata (page tables, slots) from the scheduler's arrays."""
        ...

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes the layer's K/V ``[T, Hkv, D]``, then returns attention ``[T, Hq, D]`` of q."""
        ...

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the step's K/V of one layer into its cache at the step's slots."""
        ...


class KvWriter:
    """The step's slots as (block, offset) in a layer view, and the K/V write through them."""

    __slots__ = ("blk", "block_size", "off")

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.blk = torch.empty(0, dtype=torch.long, device=device)
        self.off = torch.empty(0, dtype=torch.long, device=device)

    def map(self, slots: torch.Tensor) -> None:
        """Slot -> (block, offset) for the step's tokens; ``slots`` is an integer tensor ``[T]``
        on the cache's device."""
        self.blk, self.off = slots // self.block_size, slots % self.block_size

    def write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes K and V ``[T, Hkv, D]`` into one layer's view, cast to the cache's dtype: one
        index_put where V follows K in memory row by row (the model's views of its qkv buffer,
        with RoPE applied in place), else one each."""
        kv = _side_by_side(k, v)
        if kv is not None:
            cache[self.blk, :, self.off] = kv.to(cache.dtype)
            return
        cache[self.blk, 0, self.off] = k.to(cache.dtype)
        cache[self.blk, 1, self.off] = v.to(cache.dtype)


def _side_by_side(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[T, 2, Hkv, D]``, a view of K and V together, when each row of ``v`` starts right after
    the same row of ``k`` ends (same strides, each row's heads contiguous); else None."""
    t, h, d = k.shape
    if v.shape != k.shape or v.stride() != k.stride() or v.dtype != k.dtype or k.stride()[1:] != (d, 1):
        return None
    if v.data_ptr() - k.data_ptr() != h * d * k.element_size():
        return None
    return k.as_strided((t, 2, h, d), (k.stride(0), h * d, d, 1))


Inflight = tuple[torch.Tensor | slice, torch.Tensor]


def put_inflight(input_ids: torch.Tensor, fill: Inflight) -> None:
    """Writes the in-flight token ids over ``input_ids`` (int64) at their places."""
    at, ids = fill
    if isinstance(at, slice):
        input_ids[at].copy_(ids)  # int32 -> int64 in the copy
    else:
        input_ids.index_copy_(0, at, ids)
