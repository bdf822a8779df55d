"""EngineThread: the side of ``AsyncEngine`` that runs on its engine thread, the only thread
that touches the ``Engine``: it takes the event loop's commands (adds, aborts) off the queue,
runs the steps, and posts each request's updates to its stream. The event-loop side, the
ownership rules and the faults: ``async_engine.py``.

Invariant: ``_streams`` holds exactly the requests accepted and not yet finished or aborted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ferryman.engine import Engine, EngineDeadError, Prompt
from ferryman.engine_setup import make_current
from ferryman.outputs import RequestMetrics, RequestOutput
from ferryman.sampling_params import SamplingParams
from ferryman.server.metrics import Metrics
from ferryman.server.updates import Delta, Stream, Update, update_of
from ferryman.trace import TraceWriter, step_record

ACCEPTED = object()  # a stream's first item when its request was accepted


class EngineThread:
    engine: Engine
    metrics: Metrics | None
    trace: TraceWriter | None
    error: BaseException | None
    on_dead: Callable[[BaseException], None] | None
    _cmds: queue.SimpleQueue[tuple[Any, ...]]
    _wake: threading.Event
    _stop: bool
    _streams: dict[str, Stream]
    _lock: threading.Lock
    _closed: bool
    _pending_adds: int
    _engine_waiting: int
    _t0: float
    _drain: tuple[float, Callable[[], None]] | None

    def _run(self) -> None:
        make_current(self.engine.device)  # this thread's too
        died: Exception | None = None
        try:
            self._loop()
        except Exception as e:  # the engine died: fail every stream rather than hang them
            died = e
        self.error = died or EngineDeadError("the engine was shut down")
        with self._lock:
            self._closed = True
        self._drain_commands()  # adds queued before the close join the streams failed below
        for rid, s in self._streams.items():
            if died is None:
                self.engine.abort_request(rid)  # shut down: nothing will run it
            s.post(EngineDeadError(f"engine stopped: {self.error!r}"))
        self._streams.clear()
        if died is not None and self.on_dead is not None:
            self.on_dead(died)

    def _loop(self) -> None:
        busy = False
        while not self._stop:
            self._drain_commands()
            if self._drain is not None and (not self._streams or time.monotonic() >= self._drain[0]):
                self._abort_all()
                then, self._drain = self._drain[1], None
                then()
            if not self.engine.has_unfinished_requests():
                with self._lock:  # aborts can empty the queue with no step to count it again
                    self._engine_waiting = 0
                if busy and self.metrics is not None:
                    self.metrics.set_state(self.engine.scheduler.stats())
                if busy and self.trace is not None:
                    self.trace.flush()
                busy = False
                self._wake.wait(0.1)
                self._wake.clear()
                self._check_ranks()
                continue
            busy = True
            self._step()

    def _check_ranks(self) -> None:
        """Raises ``EngineDeadError`` once a tensor-parallel worker has stopped (idle, no step
        would find out: /health said ok and the next request was lost to it)."""
        workers = getattr(self.engine.runner, "workers", None)
        gone = workers.dead() if workers is not None else []
        if gone:
            raise EngineDeadError(f"a tensor-parallel rank stopped (workers stopped: {', '.join(gone)})")

    def _abort_all(self) -> None:
        """Aborts every open request; each unfinished sequence ends with finish_reason "abort"."""
        for rid, s in list(self._streams.items()):
            num_prompt_tokens = self.engine.num_prompt_tokens(rid)
            self.engine.abort_request(rid)
            deltas = [Delta(k, "", [], None, "abort") for k, r in enumerate(s.reasons) if r is None]
            self._send(rid, s, Update(deltas, True, num_prompt_tokens), None)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(cmd[1], cmd[2])

    def _add(
        self, group: list[tuple[str, Prompt, Any, Stream]], params: SamplingParams, arrival: float
    ) -> None:
        added: list[str] = []
        try:
            for rid, prompt, ids, _ in group:
                self.engine.add_request(rid, prompt, params, arrival, prompt_token_ids=ids)
                added.append(rid)
        except Exception as e:
            for rid in added:  # no step has run since: nothing computed, nothing on /metrics
                self.engine.abort_request(rid)
            for *_, stream in group:
                stream.post(e)
            return
        finally:
            with self._lock:
                self._pending_adds -= len(group)
        for rid, _, _, stream in group:
            with self._lock:
                self._engine_waiting += 1
            self._streams[rid] = stream
            if self.metrics is not None:
                self.metrics.on_added(self.engine.num_prompt_tokens(rid))
            if not stream.post(ACCEPTED):  # its caller's event loop is closed
                self._abort(rid)

    def _abort(self, rid: str, stream: Stream | None = None) -> None:
        """Aborts ``rid`` if its stream is open (and is ``stream``, when given)."""
        s = self._streams.get(rid)
        if s is None or (stream is not None and s is not stream):
            return
        del self._streams[rid]
        self.engine.abort_request(rid)
        if self.metrics is not None:  # each sequence, as a finished request counts them
            self.metrics.on_finished(None, s.reasons, 0)

    def _step(self) -> None:
        started = time.perf_counter()
        res = self.engine.step()
        step_s = time.perf_counter() - started
        new_tokens = 0
        for ro in res.outputs:
            new_tokens += self._deliver(ro)
        stats = self.engine.scheduler.stats()
        with self._lock:
            self._engine_waiting = stats["num_waiting"]
        plans = [p for p in (res.stats, res.failed_stats) if p is not None]  # a failed one's too
        if not plans:
            return
        if self.metrics is not None:
            self.metrics.on_step(plans, res.preemptions, stats, new_tokens, step_s)
        if self.trace is not None:
            cfg, t = self.engine.scheduler.config, time.monotonic() - self._t0
            for p in plans:
                events = [e for e in res.preemptions if e.step == p.step]
                self.trace.write(step_record(p, cfg, events, t, step_s))
            for e in res.preemptions:
                self.trace.write({"type": "preemption", **asdict(e)})

    def _deliver(self, ro: RequestOutput) -> int:
        """Sends ``ro``'s deltas to its stream; returns the number of new tokens."""
        s = self._streams.get(ro.request_id)
        if s is None:
            return 0
        u = update_of(ro, s)
        self._send(ro.request_id, s, u, ro.metrics)
        return sum(len(d.token_ids) for d in u.deltas)

    def _send(self, request_id: str, s: Stream, u: Update, m: RequestMetrics | None) -> None:
        for d in u.deltas:
            s.num_tokens[d.index] += len(d.token_ids)
            s.reasons[d.index] = d.finish_reason
        if u.finished:
            del self._streams[request_id]
            if self.metrics is not None:
                self.metrics.on_finished(m, s.reasons, max(s.num_tokens))
        if not s.post(u) and not u.finished:  # its consumer's event loop is closed
            self._abort(request_id)
