"""How the engine fails requests (docs/faults.md): a step that raised fails the requests it
scheduled or preempted and the engine goes on, until ``MAX_STEP_FAILURES`` steps fail within
``FAILURE_WINDOW_S`` seconds; a request whose logits are not finite fails alone (``NON_FINITE``).
A mixin of ``Engine``: it owns the failure window, the engine the state it touches."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ferryman._core import Scheduler
from ferryman.output_processor import OutputProcessor
from ferryman.outputs import PreemptionEvent, RequestOutput, StepResult, StepStats
from ferryman.worker.tp_workers import RankFailedError

T = TypeVar("T")
MAX_STEP_FAILURES = 3  # failed steps within FAILURE_WINDOW_S that mark the engine dead
FAILURE_WINDOW_S = 60.0
NON_FINITE = "the model's logits for this request are not finite (NaN or inf); the request failed"
# the request's own masks forbade every token (the client's doing: 400 from the server)
NO_TOKEN = "no token is left to sample: allowed_token_ids, bad_words, min_tokens and the grammar forbid all"


class EngineDeadError(RuntimeError):
    """The engine stopped after an error it cannot recover from; it can no longer generate."""


class FaultsMixin:
    _interrupt: BaseException | None = None  # a Ctrl-C kept through a wait (`_through_ctrl_c`)

    if TYPE_CHECKING:
        scheduler: Scheduler
        _outputs: OutputProcessor
        _inflight: Any  # engine._InFlight | None
        _free_ids: list[int]
        _failures: deque[float]
        _events: dict[int, list[PreemptionEvent]]
        _held: list[RequestOutput]

        runner: Any
        dead: BaseException | None

        def _release(self, core_id: int) -> None: ...

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel workers at once (dropping the engine does too, once
        it is collected, and so does the interpreter's exit); the engine cannot step after it."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        if self.dead is None:
            self.dead = EngineDeadError("the engine was shut down")

    def _through_ctrl_c(self, wait: Callable[[], T]) -> T:
        """``wait()`` (for the device's samples, or for the apply beside the forward) run to its
        end even when a Ctrl-C lands in it, as it does there on CUDA with async scheduling: the
        interrupt is kept and raised by ``_reraise_interrupt`` once the step is applied."""
        while True:
            try:
                return wait()
            except Exception:
                raise
            except BaseException as e:
                self._interrupt = e

    def _reraise_interrupt(self, res: StepResult) -> StepResult:
        """``res``, or, with a Ctrl-C kept, its outputs held for the next ``step()`` and the
        interrupt raised."""
        if self._interrupt is None:
            return res
        e, self._interrupt = self._interrupt, None
        self._held.extend(res.outputs)
        raise e

    def _inflight_failed(self, error: BaseException, done: StepResult | None = None) -> StepResult:
        """The planned step raised while it ran: fails it; no step is left in flight. ``done``:
        the step applied beside it, whose result this one's failures join."""
        failed = self._inflight
        assert failed is not None
        self._inflight = None
        self._free_ids.extend(failed.release)
        if done is not None and not isinstance(error, Exception):
            self._held.extend(done.outputs)  # interrupted: re-raised below, handed out later
        res = self._step_failed(failed.plan, error)
        if done is None:
            return res
        done.outputs.extend(res.outputs)
        done.preemptions.extend(res.preemptions)
        done.failed_stats = res.stats  # its swaps and tokens were planned: they count
        return done

    def _step_failed(self, plan: Any, error: BaseException) -> StepResult:
        """A step (the core's only pending one) raised in its forward or sampling: fails the
        requests it scheduled or preempted (a swap-out it planned may not have run), then
        applies it with every sample dropped; its result holds those failures. Raises
        ``EngineDeadError`` when too many steps failed lately. An interruption (Ctrl-C: not an
        ``Exception``) is no fault of the engine's: it fails the step's requests alike, holds
        their outputs for the next ``step()`` and is re-raised."""
        if isinstance(error, RankFailedError):  # a tensor-parallel rank is gone: nothing can run
            raise EngineDeadError(str(error)) from error
        now = time.monotonic()
        ids = [*plan.req_ids.tolist(), *plan.preempted_req_ids.tolist()]
        what = "failed" if isinstance(error, Exception) else "was interrupted"
        outputs = self._fail(ids, f"the step running this request {what}: {error!r}")
        self.scheduler.update(np.zeros(len(plan.sample_req_ids), np.int32))  # all dropped: aborted
        if not isinstance(error, Exception):
            self._held.extend(outputs)
            self._events.pop(plan.step, None)
            self._interrupt = None  # one Ctrl-C, raised once
            raise error
        self._failures.append(now)
        while self._failures[0] < now - FAILURE_WINDOW_S:
            self._failures.popleft()
        if len(self._failures) >= MAX_STEP_FAILURES:
            raise EngineDeadError(
                f"{len(self._failures)} steps failed within {FAILURE_WINDOW_S:.0f} s; the last: {error!r}"
            ) from error
        return StepResult(outputs, StepStats.of(plan, 0), self._events.pop(plan.step, []))

    def _fail_non_finite(
        self, plan: Any, sampled: Any, ids: np.ndarray
    ) -> tuple[list[RequestOutput], np.ndarray]:
        """Fails the requests of the step's samples whose logits were not finite (id -1; on the
        CPU the sampler said whether any is, so the ids are not read when none is) or whose own
        masks forbade every token (-2), and the ids with theirs 0: their requests are aborted, so
        ``update()`` drops those samples."""
        if sampled.any_bad is False:
            return [], ids
        bad = ids < 0
        if not bad.any():
            return [], ids
        sid = plan.sample_req_ids
        failed = self._fail(sid[ids == -1].tolist(), NON_FINITE) + self._fail(
            sid[ids == -2].tolist(), NO_TOKEN
        )
        return failed, np.where(bad, 0, ids)

    def _so_far(self, core_id: int, seq_index: int) -> tuple[list[int], str]:
        """A live sequence's output tokens and released text, from the core."""
        ids = self.scheduler.output_token_ids(core_id, seq_index)
        text = self.scheduler.output_text(core_id, seq_index)
        return ([] if ids is None else ids.tolist()), text or ""

    def _fail(self, core_ids: Sequence[int], message: str) -> list[RequestOutput]:
        """Fails these live requests (every sequence of each): their final outputs, with
        ``error``; their blocks are freed."""
        outputs = []
        now = time.monotonic()
        for core_id in dict.fromkeys(core_ids):
            st = self._outputs.reqs.get(core_id)
            if st is None:  # finished or aborted already
                continue
            outputs.append(self._outputs.failed(st, message, now, partial(self._so_far, core_id)))
            self._release(core_id)
            self.scheduler.abort_request(core_id)
        return outputs
