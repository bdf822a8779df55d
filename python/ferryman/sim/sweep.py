"""Sweeping one knob of ``SimConfig`` over values on the same workload: a table and a plot."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ferryman.engine_args import value_type
from ferryman.plot import png_name
from ferryman.sim.presets import GpuSpec, ModelShape
from ferryman.sim.simulator import SimConfig, simulate
from ferryman.sim.workload import Workload

# knob -> how to read a value from the command line: every non-switch field of SimConfig
SWEEP_KNOBS: dict[str, type] = {
    f.name: value_type(SimConfig, f)[0] for f in fields(SimConfig) if value_type(SimConfig, f)[0] is not bool
}

COLUMNS = (
    ("output_token_throughput", "output tok/s", "{:,.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:,.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:,.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:,.2f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:,.2f}"),
    ("preemptions_recompute", "recompute", "{:,}"),
    ("preemptions_swap", "swap", "{:,}"),
    ("bytes_swapped", "GB swapped", None),
    ("tokens_recomputed", "tokens recomputed", "{:,}"),
    ("kv_utilization", "KV used", "{:.0%}"),
)


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    knob, _, values = spec.partition("=")
    knob = knob.strip().replace("-", "_")
    if knob not in SWEEP_KNOBS or not values:
        raise ValueError(f"--sweep takes KNOB=V1,V2,... with KNOB one of {sorted(SWEEP_KNOBS)}")
    try:
        return knob, [SWEEP_KNOBS[knob](v) for v in values.split(",")]
    except ValueError as e:
        raise ValueError(f"--sweep {knob}: {e}") from None


def sweep(
    gpu: GpuSpec, shape: ModelShape, work: Workload, base: SimConfig, knob: str, values: list[Any]
) -> list[dict[str, Any]]:
    rows = []
    for v in values:
        r = simulate(gpu, shape, work, replace(base, **{knob: v}))
        r["knob"], r["value"] = knob, v
        rows.append(r)
    return rows


def table(rows: list[dict[str, Any]], knob: str) -> str:
    head = [knob, *(label for _, label, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["value"])]
        for key, _, fmt in COLUMNS:
            cells.append(f"{r[key] / 1e9:,.1f}" if fmt is None else fmt.format(r[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], knob: str, out: str | Path, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["value"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    a.bar(labels, [r["output_token_throughput"] for r in rows], color="tab:blue")
    a.set_ylabel("output tokens/s")
    a.set_xlabel(knob)
    b.bar(labels, [r["ttft_p99_ms"] / 1e3 for r in rows], color="tab:red", label="p99")
    b.bar(labels, [r["ttft_p50_ms"] / 1e3 for r in rows], color="tab:orange", label="p50")
    b.set_ylabel("TTFT (s)")
    b.set_xlabel(knob)
    b.legend()
    fig.suptitle(title or f"ferryman sim: sweep of {knob}")
    out = png_name(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
