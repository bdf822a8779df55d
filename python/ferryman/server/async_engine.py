"""AsyncEngine: one background thread owns the ``Engine`` and runs its steps while asyncio code
submits and aborts requests, each streaming its deltas through its own queue.

Ownership: only the engine thread touches the ``Engine`` (and so the core); the event loop talks
to it through a command queue and receives ``Update`` objects, copies made on the engine thread,
through ``loop.call_soon_threadsafe``. A forward pass therefore never blocks the event loop
(torch releases the GIL while it computes).

Stop strings: text that might be the start of a stop string is held back until the next token
decides it (``detokenizer.releasable``), so a stream never sends text the final result cuts.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ferryman.detokenizer import releasable
from ferryman.engine import Engine, Prompt
from ferryman.outputs import RequestOutput
from ferryman.sampling_params import SamplingParams
from ferryman.server.metrics import Metrics
from ferryman.trace import TraceWriter, step_record


@dataclass(slots=True)
class Delta:
    """What one of the n sequences added since the last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass(slots=True)
class Update:
    deltas: list[Delta]
    finished: bool
    num_prompt_tokens: int


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the server can no longer generate."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    stop: list[str]  # the request's stop strings (their possible starts are held back)
    text_sent: list[int] = field(default_factory=list)
    tokens_sent: list[int] = field(default_factory=list)
    finish_sent: list[bool] = field(default_factory=list)


_ACCEPTED = object()


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        *,
        metrics: Metrics | None = None,
        trace: TraceWriter | None = None,
        max_waiting: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.trace = trace
        self.max_waiting = max_waiting
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._engine_waiting = 0
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ferryman-engine", daemon=True)

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.trace is not None:
            self.trace.close()

    def num_waiting(self) -> int:
        """Requests accepted but not yet scheduled (the overload check counts these)."""
        with self._lock:
            return self._pending_adds + self._engine_waiting

    def overloaded(self) -> bool:
        return self.max_waiting is not None and self.num_waiting() >= self.max_waiting

    async def add(
        self, request_id: str, prompt: Prompt, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncIterator[Update]:
        """Submits a request; raises what ``Engine.add_request`` raises (before anything streams),
        then returns its updates. Closing the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._pending_adds += 1
        self._put(
            (
                "add",
                request_id,
                prompt,
                params,
                arrival_time or time.monotonic(),
                _Stream(loop, q, params.stop),
            )
        )
        first = await q.get()
        if isinstance(first, BaseException):
            raise first
        return self._updates(request_id, q)

    def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    async def _updates(self, request_id: str, q: asyncio.Queue[Any]) -> AsyncIterator[Update]:
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def _put(self, cmd: tuple[Any, ...]) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                if busy and self.metrics is not None:
                    self.metrics.set_state(self.engine.scheduler.stats())
                if busy and self.trace is not None:
                    self.trace.flush()
                busy = False
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            busy = True
            try:
                self._step()
            except Exception as e:  # a bug: fail every stream rather than hang them
                self.error = e
                for s in self._streams.values():
                    s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineDeadError(f"engine stopped: {e!r}"))
                self._streams.clear()
                return

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, arrival, stream = cmd
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival)
                except Exception as e:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
                else:
                    with self._lock:
                        self._engine_waiting += 1
                    n = params.n
                    stream.text_sent, stream.tokens_sent, stream.finish_sent = [0] * n, [0] * n, [False] * n
                    self._streams[rid] = stream
                    if self.metrics is not None:
                        self.metrics.on_added(self.engine.num_prompt_tokens(rid))
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _ACCEPTED)
                finally:
                    with self._lock:
                        self._pending_adds -= 1
            elif cmd[0] == "abort" and self._streams.pop(cmd[1], None) is not None:
                self.engine.abort_request(cmd[1])
                if self.metrics is not None:
                    self.metrics.requests_finished.labels(reason="abort").inc()

    def _step(self) -> None:
        started = time.perf_counter()
        outs = self.engine.step()
        step_s = time.perf_counter() - started
        plan = self.engine.last_schedule
        events = self.engine.scheduler.drain_events()
        new_tokens = 0
        for ro in outs:
            new_tokens += self._deliver(ro)
        stats = self.engine.scheduler.stats()
        with self._lock:
            self._engine_waiting = stats["num_waiting"]
        if plan is None:
            return
        if self.metrics is not None:
            self.metrics.on_step(plan, events, stats, new_tokens, step_s)
        if self.trace is not None:
            cfg = self.engine.scheduler.config
            self.trace.write(step_record(plan, cfg, events, time.monotonic() - self._t0, step_s))
            for e in events:
                self.trace.write({"type": "preemption", **e})

    def _deliver(self, ro: RequestOutput) -> int:
        """Sends the new part of ``ro`` to its stream; returns the number of new tokens."""
        s = self._streams.get(ro.request_id)
        if s is None:
            return 0
        deltas, n_new = [], 0
        for o in ro.outputs:
            k = o.index
            done = o.finish_reason is not None
            end = releasable(o.text, s.text_sent[k], s.stop, done)
            toks = o.token_ids[s.tokens_sent[k] :]
            if end == s.text_sent[k] and not toks and done == s.finish_sent[k]:
                continue
            lps = None if o.logprobs is None else o.logprobs[s.tokens_sent[k] :]
            deltas.append(Delta(k, o.text[s.text_sent[k] : end], list(toks), lps, o.finish_reason))
            n_new += len(toks)
            s.text_sent[k], s.tokens_sent[k], s.finish_sent[k] = end, len(o.token_ids), done
        if ro.finished:
            del self._streams[ro.request_id]
            if self.metrics is not None:
                self.metrics.on_finished(ro)
        if deltas or ro.finished:
            s.loop.call_soon_threadsafe(
                s.queue.put_nowait, Update(deltas, ro.finished, len(ro.prompt_token_ids))
            )
        return n_new
