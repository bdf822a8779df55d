"""ferryman: an LLM serving engine built around the step where the token budget has room but the
KV cache is full. The Rust core (``ferryman._core``) schedules and manages KV blocks; Python runs
the model."""

from typing import TYPE_CHECKING, Any

from ferryman._core import (
    EngineError,
    InvalidRequestError,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepOutputs,
    __version__,
)
from ferryman.engine_args import EngineArgs
from ferryman.outputs import CompletionOutput, RequestOutput
from ferryman.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferryman.engine import Engine


def __getattr__(name: str) -> Any:
    # Engine pulls in torch; import it only when asked for, so the core stays light.
    if name == "Engine":
        from ferryman.engine import Engine

        return Engine
    raise AttributeError(f"module 'ferryman' has no attribute {name!r}")


__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineArgs",
    "EngineError",
    "InvalidRequestError",
    "RequestOutput",
    "RequestParams",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepOutputs",
    "__version__",
]
