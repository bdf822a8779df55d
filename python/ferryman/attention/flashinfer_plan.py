"""A CUDA-graph decode wrapper's re-plan, without FlashInfer's Python pass over the batch.

FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan()`` (0.6.13) finds the longest KV length
with Python's built-in ``max()`` over a CPU tensor: a loop that unbinds the tensor and compares
0-d tensors one by one. On the H200 machine's host that was about 0.6 ms per step at 256 rows
(cProfile in ``benchmarks/gpu_overlap.py``), against a whole device step of 1.2 ms for
SmolLM2-135M's shape: the plan alone kept the device idle. It also re-copies the page table into
the wrapper's buffers, which the graphs have already filled in their one staging copy.

A graph wrapper is planned by its own ``plan()`` once, at capture; every later plan differs only
in the page table, so ``FastDecodePlan.plan`` redoes only what depends on it: the compiled
module's ``plan`` (the scheduling of work over the GPU's blocks, written to the wrapper's
workspace), called with the arguments ``plan()`` passes it on the tensor-core FA2 path and with
the KV lengths computed in numpy. ``FastDecodePlan.usable`` says where that is the case (a
FlashInfer version in ``VERSIONS``, whose ``plan()`` this mirrors; tensor cores, FA2, graph
mode, planned once); anywhere else the caller runs the wrapper's own ``plan()``.

Checked on a GPU (``tests/gpu``): a wrapper re-planned this way runs the same attention as one
planned by ``plan()``, for batches whose lengths move the split of work.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

VERSIONS = ("0.6.13",)  # FlashInfer releases whose decode plan() this mirrors, read in their source


class FastDecodePlan:
    """The re-plan of one CUDA-graph decode wrapper of ``size`` rows (see the module header)."""

    def __init__(self, wrapper: Any, size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.wrapper, self.size = wrapper, size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.qo_indptr = torch.arange(size + 1, dtype=torch.int32)  # one query token per row
        self._usable = False

    def usable(self) -> bool:
        """Whether this wrapper's ``plan()`` is the one mirrored, and has run once (which, once
        true, stays true: a wrapper's settings are fixed at its first plan)."""
        if not self._usable:
            self._usable = self._check()
        return self._usable

    def _check(self) -> bool:
        import flashinfer

        w = self.wrapper
        return bool(
            flashinfer.__version__.split("+")[0] in VERSIONS
            and getattr(w, "use_tensor_cores", False)
            and getattr(w, "is_cuda_graph_enabled", False)
            and getattr(w, "_backend", None) == "fa2"
            and getattr(w, "_jit_module", True) is None
            and getattr(w, "_cached_module", None) is not None
            and getattr(w, "_window_left", None) == -1
        )

    def plan(self, kv_indptr: np.ndarray, kv_last_page_len: np.ndarray, page_size: int) -> None:
        """Re-plans for a step whose page table (``kv_indptr``, the page list and
        ``kv_last_page_len``, ``size`` rows) is already in the wrapper's device buffers, or queued
        there on the current stream. ``kv_indptr`` must stay unchanged until the plan returns
        (the module reads it on the host)."""
        w, (hq, hkv, d) = self.wrapper, self.heads
        if kv_indptr.dtype != np.int32 or len(kv_indptr) != self.size + 1:
            raise ValueError(f"kv_indptr must be int32 [{self.size + 1}]")  # the module reads it raw
        indptr = torch.from_numpy(kv_indptr)
        kv_lens = np.maximum(np.diff(kv_indptr) - 1, 0) * page_size + kv_last_page_len
        w._max_kv_len = int(kv_lens.max())
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer,
            w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer,
            self.qo_indptr,
            indptr,
            torch.from_numpy(kv_lens.astype(np.int32)),
            self.size,  # rows in all
            self.size,  # requests
            hq,
            hkv,
            page_size,
            True,  # CUDA-graph mode
            d,  # head size of q and k
            d,  # of v
            False,  # not causal: one query token per row
            -1,  # no sliding window
            -1,  # no fixed split size
            False,  # split KV allowed
            0,  # no co-located CTAs
        )
