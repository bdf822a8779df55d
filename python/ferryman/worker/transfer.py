"""A step's host arrays to the device without waiting for it.

A copy from pageable host memory to CUDA first waits for everything queued on the stream. Made
after a step's forward is queued, it held the host until that forward ended (with async
scheduling the host then applied the step before it only afterwards: nothing overlapped); made
before, it held the host until the previous step ended, so the device idled while the host
planned and queued the next one. ``to_device`` stages the array in freshly page-locked memory
(PyTorch's caching host allocator, which keeps the buffer until the copy has run) and copies it
without a wait. On the CPU it is ``torch.from_numpy(a).to(device)``.

Every copy a step makes goes through it (the torch attention reference aside); the host then
waits for the device only where it reads a result (the sampled ids' event, logprobs). A
page-locked buffer the host rewrites every step must not be rewritten while a copy from it is
still queued: FlashInfer's plan buffer waits for its previous plan (``PlanArgs``); the others
here are fresh per copy.

``page_locked`` is the other kind of host memory a CUDA engine keeps: the host KV pool, locked
once at its own size.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device`` (its dtype), copied without a stream wait on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    # pin_memory() returns memory that is page-locked already as it is (a view of a pinned buffer
    # the host may rewrite before the copy runs): such an array gets a staging buffer of its own
    staged = torch.empty_like(t, pin_memory=True).copy_(t) if t.is_pinned() else t.pin_memory()
    return staged.to(device, non_blocking=True)


def page_locked(shape: tuple[int, ...], dtype: torch.dtype, cudart: Any = None) -> torch.Tensor:
    """An uninitialised host tensor, page-locked at its own size (``cudaHostRegister``) and
    unlocked when the last tensor over it is freed. ``pin_memory=True`` would take PyTorch's
    caching host allocator, which rounds every request up to a power of two: a host KV pool of
    4.002 GiB (``swap_space=4``) locked 8 GiB. ``cudart``: ``torch.cuda.cudart()`` by default."""
    cudart = cudart if cudart is not None else torch.cuda.cudart()  # type: ignore[no-untyped-call]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    owner = np.empty(max(nbytes, 1), dtype=np.uint8)  # the tensor's storage holds it to the end
    err = int(cudart.cudaHostRegister(owner.ctypes.data, owner.nbytes, 0))
    if err != 0:
        raise RuntimeError(f"page-locking {owner.nbytes} bytes of host memory failed: cudaError {err}")
    # runs when the array is freed, after every tensor over it (each holds a reference to it)
    weakref.finalize(owner, cudart.cudaHostUnregister, owner.ctypes.data)
    return torch.from_numpy(owner)[:nbytes].view(dtype).view(shape)
