"""What the engine thread hands a request's stream: ``Update`` objects (each sequence's
``Delta``), the errors its iterator may end with, and that iterator (``RequestUpdates``); and
the stream as the engine thread holds it (``Stream``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ferryman.engine import EngineDeadError
from ferryman.engine_faults import NO_TOKEN
from ferryman.outputs import Logprob, RequestOutput

__all__ = [
    "Delta",
    "DrainingError",
    "EngineDeadError",
    "RequestFailedError",
    "RequestUpdates",
    "Stream",
    "Update",
    "update_of",
]


@dataclass(slots=True)
class Delta:
    """What one of the n sequences added since the last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


@dataclass(slots=True)
class Update:
    deltas: list[Delta]
    finished: bool
    num_prompt_tokens: int
    error: str | None = None  # the request failed (its iterator raises RequestFailedError)
    # with prompt logprobs, once (on the first update): the prompt's ids and their logprobs
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank, with them
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held (usage.prompt_tokens_details)


@dataclass(slots=True)
class Stream:
    """A request's stream on the engine thread: its consumer's loop and queue, and what went out."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    num_tokens: list[int]  # per sequence, sent so far
    reasons: list[str | None]  # per sequence, its finish reason once sent
    prompt_sent: bool = False  # its prompt logprobs (if any) went out

    def post(self, item: Any) -> bool:
        """Hands ``item`` to the consumer's loop; False when that loop is closed (no one reads)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


def update_of(ro: RequestOutput, s: Stream) -> Update:
    """``ro`` as its stream's next update (with the prompt's logprobs the first time only)."""
    deltas = [
        Delta(o.index, o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason) for o in ro.outputs
    ]
    u = Update(
        deltas, ro.finished, len(ro.prompt_token_ids), ro.error, num_cached_tokens=ro.num_cached_tokens
    )
    if ro.prompt_logprobs is not None and not s.prompt_sent:
        u.prompt_token_ids, u.prompt_logprobs = ro.prompt_token_ids, ro.prompt_logprobs
        u.prompt_logprob_ranks, s.prompt_sent = ro.prompt_logprob_ranks, True
    return u


class RequestFailedError(RuntimeError):
    """The engine failed this request (its logits were not finite, or its step raised: a server
    error; or its own masks forbade every token: the client's); other requests go on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        client = message == NO_TOKEN
        self.status, self.type = (400, "invalid_request_error") if client else (500, "server_error")


class DrainingError(RuntimeError):
    """The server is shutting down and accepts no new request."""


async def _read(q: asyncio.Queue[Any], abort: Callable[[], None]) -> AsyncGenerator[Update, None]:
    """A request's updates from its queue; left before its end, it aborts the request."""
    finished = False
    try:
        while not finished:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            if item.error is not None:
                raise RequestFailedError(item.error)
            yield item
    finally:
        if not finished:
            abort()


class RequestUpdates:
    """``AsyncEngine.add``'s iterator. Closing it aborts its request unless finished, even before the first
    ``__anext__``: an async generator that never started skips its ``finally`` when closed (a
    request submitted with others that were then refused would run to its end for no one); so
    does dropping it unread (a started one is closed by the event loop's finalizer)."""

    def __init__(self, q: asyncio.Queue[Any], abort: Callable[[], None], dropped: Callable[[], None]) -> None:
        """``dropped``: aborts from a finalizer (``__del__`` may run inside any lock's holder)."""
        # the generator holds no reference to this object: dropped, it goes at once (no cycle)
        self._gen, self._abort, self._dropped, self._started = _read(q, abort), abort, dropped, False

    def __aiter__(self) -> RequestUpdates:
        return self

    def __anext__(self) -> Awaitable[Update]:
        self._started = True
        return self._gen.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._started = True  # aborted here: not again when dropped
            self._abort()
        await self._gen.aclose()

    def __del__(self) -> None:
        if not self._started:  # dropped unread: its request must not run for no one
            self._dropped()
