"""StepWorker: runs a planned step's forward and sampling, on the calling thread, in step order.

It keeps the last step's sampled ids on the device: with async scheduling a decode input still in
flight names one of them (``SchedulerOutput.inflight_*``), and the runner fills it there. With
``overlap`` on CUDA the sampled ids come back through a pinned buffer and an event instead of a
blocking copy, so the caller can apply the previous step while the device runs this one.

A sample row whose largest logit is not finite (NaN or +inf in the row, or all of it -inf; the
sampler reads this off the argmax it takes anyway) comes back as -1, one whose logits are finite but
whose request's own masks forbid every token as -2: the engine fails that request alone. The ids
kept on the device for the next step's inputs hold 0 there instead (always a valid embedding row;
the request is aborted before any step applies them).

``faults`` (test-only, ``FERRYMAN_TEST_FAULT_STEPS``): core step numbers at which ``run`` raises
``InjectedFault`` before the forward, so tests can make a step fail.

Torch compute stays on one thread (the caller's): a second thread running CPU kernels would start
a second OpenMP team, and on a machine with few cores both teams then give up spinning and wake
through the kernel on every parallel region (measured: the forward ~1.4x slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferryman._core import SchedulerOutput
from ferryman.outputs import Logprob
from ferryman.worker.logit_state import prompt_logprobs
from ferryman.worker.model_runner import ModelRunner
from ferryman.worker.sampling_table import SampleArgs, SamplingTable

Logprobs = list[dict[int, Logprob] | None] | None


@dataclass(slots=True)
class Sampled:
    """One step's sampled ids, maybe still on their way to the host, and their logprobs."""

    ids: np.ndarray | torch.Tensor  # numpy, or a pinned tensor that ``ready`` fills
    logprobs: Logprobs
    ready: torch.cuda.Event | None = None
    # (core id, position, logprobs, the prompt token's rank)
    prompt_logprobs: list[tuple[int, int, dict[int, Logprob], int]] | None = None
    any_bad: bool | None = None  # False: no id is -1 (not finite); None: not known without reading

    def host_ids(self) -> np.ndarray:
        """The ids as int32 numpy, once the copy is done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.ids.numpy() if isinstance(self.ids, torch.Tensor) else self.ids


@dataclass(slots=True)
class InFlight:
    """A planned step not yet applied (async scheduling): its plan, its samples once run, and
    the core ids to reuse once it is applied (a step planned before they were released may
    name them)."""

    plan: SchedulerOutput
    sampled: Sampled | None = None
    release: list[int] = field(default_factory=list)


class InjectedFault(RuntimeError):
    """A step made to fail on purpose (``FERRYMAN_TEST_FAULT_STEPS``)."""


def parse_fault_steps(spec: str | None) -> frozenset[int]:
    """``"3,7-9"`` -> {3, 7, 8, 9}; None or "" -> none."""
    steps: set[int] = set()
    for part in (spec or "").split(","):
        if part.strip():
            lo, _, hi = part.partition("-")
            steps.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(steps)


class StepWorker:
    def __init__(
        self,
        runner: ModelRunner,
        sampling: SamplingTable,
        overlap: bool,
        faults: frozenset[int] = frozenset(),
    ) -> None:
        self.runner, self.sampling, self.overlap, self.faults = runner, sampling, overlap, faults
        self._prev: torch.Tensor | None = None  # the last step's sampled ids, on the device

    def run(self, plan: SchedulerOutput, args: SampleArgs) -> Sampled:
        """The step's forward and sampling (on CUDA with ``overlap``: launched, not waited for)."""
        if plan.step in self.faults:
            raise InjectedFault(f"injected fault at step {plan.step}")
        self.sampling.write_rows(args)
        also = None if args.prompt is None else args.prompt.at
        logits = self.runner.execute(plan, self._prev, also)
        prompt_lps = None
        if args.prompt is not None:  # read back now: only requests that ask for them pay the wait
            num_samples = len(plan.sample_rows)
            prompt_lps = prompt_logprobs(logits[num_samples:], args.prompt)
            logits = logits[:num_samples]
        if not len(plan.sample_rows):  # the array the sampler reads next, made once
            return Sampled(np.zeros(0, np.int32), None, prompt_logprobs=prompt_lps)
        tokens, ok, lps = self.sampling.sample(
            logits, plan.sample_rows, plan.sample_seq_indices, plan.sample_positions, args
        )
        # the next step's in-flight inputs: every sampled id is a vocabulary index, a row whose
        # logits were not finite too (an argmax, or a candidate's id, is always one), so the
        # embedding may read it; that row's request fails when this step is applied
        self._prev = tokens
        if ok is not None:  # on CUDA never asked (that would wait for the device)
            tokens = torch.where(ok > 0, tokens, ok.to(tokens.dtype) - 1)  # -1 not finite, -2 none allowed
        if tokens.device.type != "cuda" or not self.overlap:
            any_bad = None if tokens.device.type == "cuda" else ok is not None  # on the CPU, known
            return Sampled(tokens.cpu().numpy(), lps, prompt_logprobs=prompt_lps, any_bad=any_bad)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream
        return Sampled(host, lps, ready, prompt_lps)
