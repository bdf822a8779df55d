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
"""

from __future__ import annotations

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
