"""What the engine thread hands a request's stream: ``Update`` objects (each sequence's
``Delta``), and the errors its iterator may end with."""

from __future__ import annotations

from dataclasses import dataclass

from ferryman.engine import EngineDeadError

__all__ = ["Delta", "DrainingError", "EngineDeadError", "RequestFailedError", "Update"]


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
    error: str | None = None  # the request failed (its iterator raises RequestFailedError)
    # with prompt logprobs, once (on the first update): the prompt's ids and their logprobs
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


class RequestFailedError(RuntimeError):
    """The engine failed this request (its logits were not finite, or its step raised); other
    requests go on."""


class DrainingError(RuntimeError):
    """The server is shutting down and accepts no new request."""
