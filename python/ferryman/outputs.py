"""What generate() and step() return: vLLM's RequestOutput / CompletionOutput shape, and the
``StepResult`` of one ``Engine.step()`` with its typed step statistics and preemption events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Logprob(float):
    """One token's log probability: a float, with vLLM's ``Logprob`` fields, so code written for
    vLLM (``lp.logprob``, ``lp.rank``, ``lp.decoded_token``) and code that reads a float both
    work. ``rank``: 1 for the most likely token of the vocabulary (the top N are ranked 1..N in
    order; a sampled or prompt token by how many tokens the model found likelier); None where
    unknown. ``decoded_token``: the token's text (the tokenizer's decode of it alone), None
    without a tokenizer."""

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` sequences of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # with SamplingParams.logprobs=N: per token, {token_id: Logprob} for the sampled token and the
    # model's top N (log-softmax of the raw logits; under a grammar, of those its mask leaves)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # vLLM's: what stopped it with finish_reason "stop": the stop string matched, or the stop
    # token id (of stop_token_ids); None for an EOS, a length, a complete grammar
    stop_reason: str | int | None = None


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
    # with SamplingParams.prompt_logprobs: per prompt token, {token_id: Logprob} (None first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # set when the request failed (its logits were not finite, or its step raised): it is
    # finished, and its unfinished sequences have finish_reason "error"
    error: str | None = None
    # with prompt_logprobs: each prompt token's rank in the vocabulary (1: the most likely; None first)
    prompt_logprob_ranks: list[int | None] | None = None
    # vLLM's: the prompt tokens found in the prefix cache (not computed) when it was first scheduled
    num_cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class StepStats:
    """What one step planned and produced (the scheduler's figures for it)."""

    step: int
    schedule_ns: int
    num_scheduled_seqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    token_budget_left: int
    num_free_device_blocks: int
    num_free_host_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    num_blocks_copied: int
    num_generated_tokens: int

    @classmethod
    def of(cls, plan: Any, num_generated_tokens: int) -> StepStats:
        """From a ``SchedulerOutput`` and the number of tokens its step sampled."""
        return cls(
            plan.step,
            plan.schedule_ns,
            plan.num_scheduled_seqs,
            plan.num_scheduled_tokens,
            plan.num_prefill_tokens,
            plan.token_budget_left,
            plan.num_free_device_blocks,
            plan.num_free_host_blocks,
            plan.num_running,
            plan.num_waiting,
            plan.num_swapped,
            plan.num_preemptions,
            plan.num_blocks_swapped_out,
            plan.num_blocks_swapped_in,
            plan.num_blocks_copied,
            num_generated_tokens,
        )


@dataclass(slots=True, frozen=True)
class PreemptionEvent:
    """One preemption as the core decided it (docs/design.md: the telemetry contract)."""

    step: int
    req_id: int
    seq_index: int
    mode: str  # "recompute" | "swap"
    reason: str  # "config" | "cost" | "host_full" | "fork"
    for_req_id: int
    num_blocks_freed: int
    bytes_to_move: int
    num_tokens_to_recompute: int
    swap_cost_s: float
    recompute_cost_s: float
    token_budget_left: int
    num_free_device_blocks: int
    num_free_host_blocks: int
    num_preemptions: int
    request_id: str | None = None  # the caller's id, when the engine knows it


@dataclass(slots=True)
class StepResult:
    """One ``Engine.step()``: the outputs to hand out (per each request's ``output_kind``), the
    step's statistics, and the preemptions it made. With async scheduling, when the step planned
    after it fails, the result also holds that step's failed requests, its preemptions (whose
    ``step`` is that step's) and its statistics (``failed_stats``)."""

    outputs: list[RequestOutput]
    stats: StepStats | None = None  # always set by Engine.step(); None only where built by hand
    preemptions: list[PreemptionEvent] = field(default_factory=list)
    failed_stats: StepStats | None = None
