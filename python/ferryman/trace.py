"""The step trace: one JSON object per line, written by ``ferryman serve --trace FILE`` (and by
``ferryman sim``), read by ``ferryman plot``.

Two record types, told apart by ``"type"``:

- ``"step"``: ``step``, ``t`` (seconds since the trace began), ``step_s`` (wall time of the whole
  step), ``schedule_ns`` (the core's time planning it), ``num_scheduled_tokens``,
  ``num_prefill_tokens``, ``token_budget`` and ``token_budget_left``, ``num_free_device_blocks``
  and ``num_device_blocks``, ``num_free_host_blocks`` and ``num_host_blocks``, ``num_running``,
  ``num_waiting``, ``num_swapped``, ``num_blocks_swapped_out``, ``num_blocks_swapped_in``,
  ``num_blocks_copied``, and ``preemptions``: ``[{"req_id", "mode", "reason"}]`` of this step;
- ``"preemption"``: one core telemetry event, a ``PreemptionEvent``'s fields (victim,
  chosen mode, reason, blocks freed, estimated swap and recompute costs, budget and free blocks at
  that moment).
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ferryman._core import SchedulerConfig
from ferryman.outputs import PreemptionEvent, StepStats


def step_record(
    plan: StepStats, config: SchedulerConfig, events: list[PreemptionEvent], t: float, step_s: float
) -> dict[str, Any]:
    """The ``"step"`` record of one planned step and the events it raised."""
    return {
        "type": "step",
        "step": plan.step,
        "t": round(t, 6),
        "step_s": round(step_s, 6),
        "schedule_ns": plan.schedule_ns,
        "num_scheduled_tokens": plan.num_scheduled_tokens,
        "num_prefill_tokens": plan.num_prefill_tokens,
        "token_budget": config.max_num_batched_tokens,
        "token_budget_left": plan.token_budget_left,
        "num_free_device_blocks": plan.num_free_device_blocks,
        "num_device_blocks": config.num_device_blocks,
        "num_free_host_blocks": plan.num_free_host_blocks,
        "num_host_blocks": config.num_host_blocks,
        "num_running": plan.num_running,
        "num_waiting": plan.num_waiting,
        "num_swapped": plan.num_swapped,
        "num_blocks_swapped_out": plan.num_blocks_swapped_out,
        "num_blocks_swapped_in": plan.num_blocks_swapped_in,
        "num_blocks_copied": plan.num_blocks_copied,
        "preemptions": [{"req_id": e.req_id, "mode": e.mode, "reason": e.reason} for e in events],
    }


class TraceWriter:
    """Appends records to a JSON-lines file; safe to call from the engine thread while another
    thread closes it."""

    def __init__(self, path: str | Path) -> None:
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_trace(path: str | Path) -> Iterator[dict[str, Any]]:
    """The trace's records; a last line cut short (no newline: a writer still running, or killed)
    is left out with a warning."""
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not raw.endswith("\n"):
                    warnings.warn(f"{path}:{n}: an unfinished last line, left out", stacklevel=2)
                    return
                raise ValueError(f"{path}:{n}: not a JSON trace line ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: a trace line is a JSON object, got {type(record).__name__}")
            yield record
