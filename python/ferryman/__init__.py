"""ferryman: an LLM serving engine built around the step where the token budget has room but the
KV cache is full. The Rust core (``ferryman._core``) schedules and manages KV blocks; Python runs
the model."""

from ferryman._core import (
    EngineError,
    InvalidRequestError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepOutputs,
    __version__,
)

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepOutputs",
    "__version__",
]
