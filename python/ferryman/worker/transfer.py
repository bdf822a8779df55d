"""Small host arrays to the device without waiting for it.

A copy from pageable host memory to CUDA first waits for everything queued on the stream, so
one made after a forward is queued holds the host until that forward ends: with async
scheduling the host could then not apply the step before it meanwhile. ``to_device`` stages the
array in pinned memory (PyTorch's caching host allocator, which keeps the buffer until the copy
has run) and copies it without a wait. On the CPU it is ``torch.from_numpy(a).to(device)``.

Used for what a step copies after its forward is queued (the logits rows, the sampler's and the
logit adjustments' indices). What it copies before (block-table changes, in-flight inputs, new
rows' sampling parameters) is still pageable: those copies make the host wait for the step
before, so the device idles while the host plans and queues the next one. Making them wait-free
needs every page-locked buffer the host rewrites each step to be safe against a copy still
queued from it (FlashInfer's plan buffer is, ``PlanArgs``); that has not run on a GPU yet.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device`` (its dtype), copied without a stream wait on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
