"""AsyncEngine: one background thread owns the ``Engine`` and runs its steps while asyncio code
submits and aborts requests, each streaming its deltas through its own queue.

Ownership: only the engine thread touches the ``Engine`` (and so the core); the event loop talks
to it through a command queue and receives ``Update`` objects, copies made on the engine thread,
through ``loop.call_soon_threadsafe``. A forward pass therefore never blocks the event loop
(torch releases the GIL while it computes). Text prompts are tokenized before that, one at a time
on a thread of their own (``offload``; ferryman's tokenizer encodes without the GIL), so a long
prompt stalls neither the steps nor the event loop.

The engine thread's side (commands, steps, posting updates) is ``engine_thread.py``. Every
request runs with ``output_kind="delta"``: the core releases text only once no stop string
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
from dataclasses import replace
from functools import partial
from typing import Any

from ferryman.engine import Engine, EngineDeadError, Prompt
from ferryman.sampling_params import SamplingParams
from ferryman.server.engine_thread import EngineThread
from ferryman.server.metrics import Metrics
from ferryman.server.updates import (
    Delta,
    DrainingError,
    RequestFailedError,
    RequestUpdates,
    Stream,
    Update,
)
from ferryman.trace import TraceWriter

__all__ = ["AsyncEngine", "Delta", "DrainingError", "EngineDeadError", "RequestFailedError", "Update"]


class AsyncEngine(EngineThread):
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
        return (await self.add_all([(request_id, prompt)], params, arrival, special))[0]

    async def add_all(
        self, prompts: list[tuple[str, Prompt]], params: SamplingParams, arrival: float, special: bool = True
    ) -> list[AsyncIterator[Update]]:
        """``add`` for (request id, prompt) pairs sharing ``params``, all or none: when one is
        refused, none runs (vLLM checks a batch's prompts before it submits any)."""
        if not prompts:
            return []
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self.draining:
            raise DrainingError("the server is shutting down")
        with self._lock:
            self._pending_adds += len(prompts)  # counted as waiting from here (the overload check)
        loop, n = asyncio.get_running_loop(), params.n
        streams = [Stream(loop, asyncio.Queue(), [0] * n, [None] * n) for _ in prompts]
        try:
            group = []
            for (rid, prompt), stream in zip(prompts, streams, strict=True):
                ids = None
                if isinstance(prompt, str) and self.engine.tokenizer is not None:
                    cut = params.truncate_prompt_tokens is not None
                    ids = (await self.offload(partial(self.engine.tokenize, prompt, None, special, cut)))[1]
                group.append((rid, prompt, ids, stream))
            if not self._put(("add", group, replace(params, output_kind="delta"), arrival)):
                raise EngineDeadError(f"engine stopped: {self.error!r}")
        except BaseException:
            with self._lock:
                self._pending_adds -= len(prompts)
            raise
        try:
            firsts = [await s.queue.get() for s in streams]
        except BaseException:  # cancelled while they were being added: they must not run for no one
            for (rid, _), s in zip(prompts, streams, strict=True):
                self._cmds.put(("abort", rid, s))
            self._wake.set()
            raise
        if isinstance(firsts[0], BaseException):
            raise firsts[0]
        # dropped unread: the abort is only queued (what a finalizer may do: no lock, no event)
        return [
            RequestUpdates(s.queue, partial(self.abort, rid), partial(self._cmds.put, ("abort", rid, s)))
            for (rid, _), s in zip(prompts, streams, strict=True)
        ]

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
