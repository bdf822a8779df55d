"""AsyncEngine: one background thread owns the ``Engine`` and runs its steps while asyncio code
submits and aborts requests, each streaming its deltas through its own queue.

Ownership: only the engine thread touches the ``Engine`` (and so the core); the event loop talks
to it through a command queue and receives ``Update`` objects, copies made on the engine thread,
through ``loop.call_soon_threadsafe``. A forward pass therefore never blocks the event loop
(torch releases the GIL while it computes). Text prompts are tokenized before that, one at a time
on a thread of their own (``offload``; ferryman's tokenizer encodes without the GIL), so a long
prompt stalls neither the steps nor the event loop.

Every request runs with ``output_kind="delta"``: the core releases text only once no stop string
can cut it, so each step's deltas go to the stream as they are.

Faults: a request the engine fails (non-finite logits, a step that raised) ends its iterator with
``RequestFailedError``; the others go on. When the engine dies (``EngineDeadError``, or any error
out of the engine thread), every open stream ends with ``EngineDeadError`` and ``on_dead`` is
called (the server then exits non-zero, so a supervisor restarts it); after ``shutdown()`` open
streams end alike, their requests aborted, and ``add()`` raises it. A request whose consumer's
event loop has closed, or whose ``add()`` was cancelled, is aborted. ``drain()`` (SIGTERM) stops
accepting, lets the running requests finish until a deadline, then aborts the rest: each of their
unfinished sequences ends with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from ferryman.engine import Engine, EngineDeadError, Prompt
from ferryman.engine_setup import make_current
from ferryman.outputs import RequestMetrics, RequestOutput
from ferryman.sampling_params import SamplingParams
from ferryman.server.metrics import Metrics
from ferryman.server.updates import (
    Delta,
    DrainingError,
    RequestFailedError,
    RequestUpdates,
    Stream,
    Update,
    update_of,
)
from ferryman.trace import TraceWriter, step_record

__all__ = ["AsyncEngine", "Delta", "DrainingError", "EngineDeadError", "RequestFailedError", "Update"]


_ACCEPTED = object()


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        *,
        metrics: Metrics | None = None,
        trace: TraceWriter | None = None,
        max_waiting: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_dead``: called on the engine thread once the engine has died."""
        self.engine = engine
        self.on_dead = on_dead
        self.draining = False
        self._drain: tuple[float, Callable[[], None]] | None = None  # deadline, then what
        self.metrics = metrics
        self.trace = trace
        self.max_waiting = max_waiting
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._closed = False  # the engine thread has ended: commands are refused
        self._pending_adds = 0
        self._engine_waiting = 0
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ferryman-engine", daemon=True)
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="ferryman-tokenize")

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
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

    async def offload(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn)

    def overloaded(self) -> bool:
        return self.max_waiting is not None and self.num_waiting() >= self.max_waiting

    async def add(
        self, request_id: str, prompt: Prompt, params: SamplingParams, arrival: float, special: bool = True
    ) -> AsyncIterator[Update]:
        """Submits a request; raises what ``Engine.add_request`` raises (before anything streams),
        then returns its updates. Closing the iterator early aborts the request. A text prompt is
        tokenized with the tokenizer's special tokens unless ``special`` is false."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self.draining:
            raise DrainingError("the server is shutting down")
        with self._lock:
            self._pending_adds += 1  # counted as waiting from here (the overload check)
        q: asyncio.Queue[Any] = asyncio.Queue()
        stream = Stream(asyncio.get_running_loop(), q, [0] * params.n, [None] * params.n)
        try:
            ids = None
            if isinstance(prompt, str) and self.engine.tokenizer is not None:
                ids = (await self.offload(lambda: self.engine.tokenize(prompt, None, special)))[1]
            params = replace(params, output_kind="delta")
            if not self._put(("add", request_id, prompt, ids, params, arrival, stream)):
                raise EngineDeadError(f"engine stopped: {self.error!r}")
        except BaseException:
            with self._lock:
                self._pending_adds -= 1
            raise
        try:
            first = await q.get()
        except BaseException:  # cancelled while it was being added: it must not run for no one
            self._cmds.put(("abort", request_id, stream))
            self._wake.set()
            raise
        if isinstance(first, BaseException):
            raise first
        # dropped unread: the abort is only queued (what a finalizer may do: no lock, no event)
        return RequestUpdates(
            q, lambda: self.abort(request_id), lambda: self._cmds.put(("abort", request_id, stream))
        )

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))  # after the close: never read, no harm
        self._wake.set()

    def drain(self, timeout: float, then: Callable[[], None]) -> None:
        """Stops accepting requests; once the running ones have finished, or ``timeout`` seconds
        have passed (the rest then end with finish_reason "abort"), calls ``then`` on the engine
        thread. Callable from a signal handler."""
        self.draining = True
        self._drain = (time.monotonic() + timeout, then)
        self._wake.set()

    def _put(self, cmd: tuple[Any, ...]) -> bool:
        """Queues an add for the engine thread; False once that thread has ended."""
        with self._lock:
            if self._closed:
                return False
            self._cmds.put(cmd)
        self._wake.set()
        return True

    # -- engine thread ---------------------------------------------------------------------------

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
                continue
            busy = True
            self._step()

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
                _, rid, prompt, ids, params, arrival, stream = cmd
                try:
                    self.engine.add_request(rid, prompt, params, arrival, prompt_token_ids=ids)
                except Exception as e:
                    stream.post(e)
                else:
                    with self._lock:
                        self._engine_waiting += 1
                    self._streams[rid] = stream
                    if self.metrics is not None:
                        self.metrics.on_added(self.engine.num_prompt_tokens(rid))
                    if not stream.post(_ACCEPTED):  # its caller's event loop is closed
                        self._abort(rid)
                finally:
                    with self._lock:
                        self._pending_adds -= 1
            elif cmd[0] == "abort":
                self._abort(cmd[1], cmd[2])

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
        if res.stats is None:
            return
        if self.metrics is not None:
            self.metrics.on_step(res.stats, res.preemptions, stats, new_tokens, step_s)
        if self.trace is not None:
            cfg = self.engine.scheduler.config
            self.trace.write(
                step_record(res.stats, cfg, res.preemptions, time.monotonic() - self._t0, step_s)
            )
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
