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
    # with SamplingParams.logprobs=N: per token, {token_id: logprob} for the sampled token and the
    # model's top N (log-softmax of the raw logits)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) of a request's life, as vLLM reports them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step, or its final result."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
