"""StepWorker: runs planned steps' forward and sampling, in step order — inline, or (async
scheduling) in one worker thread, so the engine plans the next step and turns the previous one's
tokens into text meanwhile. torch releases the GIL in its kernels on CPU; on CUDA the thread only
prepares and launches, and the sampled ids come back through pinned memory and an event, so the
thread can launch the next step while the device still runs this one.

It keeps the last step's sampled ids on the device: a decode input still in flight names one of
them (``SchedulerOutput.inflight_*``), and the runner fills it there.

Invariant: steps run in the order they were submitted, each after every earlier one's block-table
changes, plans and writes (one thread, one stream).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferryman.worker.model_runner import ModelRunner
from ferryman.worker.sampler import SampleArgs, SamplingTable

Logprobs = list[dict[int, float] | None] | None


@dataclass(slots=True)
class Sampled:
    """One step's sampled ids, maybe still on their way to the host, and their logprobs."""

    ids: np.ndarray | torch.Tensor  # numpy, or a pinned tensor that ``ready`` fills
    logprobs: Logprobs
    ready: torch.cuda.Event | None = None

    def host_ids(self) -> np.ndarray:
        """The ids as int32 numpy, once the copy is done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.ids.numpy() if isinstance(self.ids, torch.Tensor) else self.ids


class StepWorker:
    def __init__(self, runner: ModelRunner, sampling: SamplingTable, threaded: bool) -> None:
        self.runner, self.sampling = runner, sampling
        self._prev: torch.Tensor | None = None  # the last step's sampled ids, on the device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ferryman-forward") if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, plan: Any, args: SampleArgs) -> Future[Sampled]:
        """Runs the step after every step submitted before it (in the worker thread)."""
        assert self._pool is not None, "submit() needs a threaded worker"
        return self._pool.submit(self.run, plan, args)

    def run(self, plan: Any, args: SampleArgs) -> Sampled:
        """The step's forward and sampling, here and now."""
        self.sampling.write_rows(args)
        logits = self.runner.execute(plan, self._prev)
        if not len(plan.sample_req_ids):
            return Sampled(np.zeros(0, np.int32), None)
        b = np.searchsorted(plan.qo_indptr, plan.logits_indices, side="right") - 1  # each sample's row
        tokens, lps = self.sampling.sample(
            logits, plan.rows[b], plan.sample_seq_indices, plan.seq_lens[b], args
        )
        self._prev = tokens
        if tokens.device.type != "cuda" or self._pool is None:
            return Sampled(tokens.cpu().numpy(), lps)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return Sampled(host, lps, ready)
