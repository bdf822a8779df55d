"""What generate() and step() return (vLLM's RequestOutput / CompletionOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` sequences of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step, or its final result."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
