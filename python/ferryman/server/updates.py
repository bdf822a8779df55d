"""What the engine thread hands a request's stream: ``Update`` objects (each sequence's
``Delta``), the errors its iterator may end with, and that iterator (``RequestUpdates``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from ferryman.engine import EngineDeadError
from ferryman.outputs import Logprob

__all__ = ["Delta", "DrainingError", "EngineDeadError", "RequestFailedError", "RequestUpdates", "Update"]


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


class RequestFailedError(RuntimeError):
    """The engine failed this request (its logits were not finite, or its step raised); other
    requests go on."""


class DrainingError(RuntimeError):
    """The server is shutting down and accepts no new request."""


class RequestUpdates:
    """``AsyncEngine.add``'s iterator. Closing it aborts its request unless finished, even before the first
    ``__anext__``: an async generator that never started skips its ``finally`` when closed (a
    request submitted with others that were then refused would run to its end for no one)."""

    def __init__(self, gen: AsyncGenerator[Update, None], abort: Callable[[], None]) -> None:
        self._gen, self._abort, self._started = gen, abort, False

    def __aiter__(self) -> RequestUpdates:
        return self

    def __anext__(self) -> Awaitable[Update]:
        self._started = True
        return self._gen.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._abort()
        await self._gen.aclose()
