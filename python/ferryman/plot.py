"""``ferryman plot TRACE -o out.png``: the picture of "budget left, KV gone". Three panels over
steps: device and host KV use, token-budget use, and queue sizes; each preemption is marked on the
KV panel by its chosen mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferryman.trace import read_trace

_MODE_STYLE = {"swap": ("tab:blue", "v"), "recompute": ("tab:red", "x")}


def plot_trace(trace: str | Path, out: str | Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in read_trace(trace) if r.get("type") == "step"]
    if not steps:
        raise ValueError(f"{trace}: no step records")
    need = [
        *("step", "num_free_device_blocks", "num_device_blocks", "num_free_host_blocks", "num_host_blocks"),
        *("num_scheduled_tokens", "num_prefill_tokens", "token_budget", "preemptions"),
        *("num_running", "num_waiting", "num_swapped"),
    ]
    broken = next(((i, why) for i, r in enumerate(steps) if (why := _fault(r, need))), None)
    if broken is not None:
        raise ValueError(f"{trace}: step record {broken[0]} {broken[1]}: not a ferryman trace")
    x = [r["step"] for r in steps]

    def pct(num: str, den: str, free: bool = False) -> list[float]:
        vals = []
        for r in steps:
            d = max(1, r[den])
            vals.append(100.0 * ((d - r[num]) if free else r[num]) / d)
        return vals

    fig, (kv, budget, queues) = plt.subplots(3, 1, sharex=True, figsize=(11, 8), constrained_layout=True)
    kv.plot(x, pct("num_free_device_blocks", "num_device_blocks", free=True), label="device KV used", lw=1)
    if any(r["num_host_blocks"] for r in steps):
        kv.plot(x, pct("num_free_host_blocks", "num_host_blocks", free=True), label="host KV used", lw=1)
    marks: dict[str, list[Any]] = {}
    for r in steps:
        for p in r["preemptions"]:
            marks.setdefault(p["mode"], []).append(r["step"])
    for mode, at in sorted(marks.items()):
        color, marker = _MODE_STYLE.get(mode, ("tab:gray", "o"))
        kv.scatter(
            at, [101] * len(at), color=color, marker=marker, label=f"preempt: {mode} ({len(at)})", zorder=3
        )
    kv.set_ylabel("KV blocks used (%)")
    kv.set_ylim(0, 105)
    kv.legend(loc="lower right", fontsize="small")
    budget.plot(
        x,
        [100.0 * r["num_scheduled_tokens"] / max(1, r["token_budget"]) for r in steps],
        lw=1,
        label="scheduled / budget",
    )
    budget.plot(
        x,
        [100.0 * r["num_prefill_tokens"] / max(1, r["token_budget"]) for r in steps],
        lw=1,
        label="of which prefill",
    )
    budget.set_ylabel("token budget used (%)")
    budget.set_ylim(0, 105)
    budget.legend(loc="upper right", fontsize="small")
    for key, label in (("num_running", "running"), ("num_waiting", "waiting"), ("num_swapped", "swapped")):
        queues.plot(x, [r[key] for r in steps], label=label, lw=1)
    queues.set_ylabel("requests")
    queues.set_xlabel("step")
    queues.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"ferryman step trace: {Path(trace).name} ({len(steps)} steps)")
    out = png_name(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)


def png_name(out: str | Path) -> Path:
    """The file matplotlib writes for ``out``: a name without a suffix gets ".png" (said as it is)."""
    out = Path(out)
    return out if out.suffix else out.with_name(out.name + ".png")


def _fault(r: dict[str, Any], need: list[str]) -> str | None:
    """What makes step record ``r`` unplottable (a key missing, a count that is not a number,
    preemptions that are not events with a mode), or None."""
    missing = next((k for k in need if k not in r), None)
    if missing is not None:
        return f"has no {missing!r}"
    counts = (k for k in need if k != "preemptions")
    wrong = next((k for k in counts if isinstance(r[k], bool) or not isinstance(r[k], int | float)), None)
    if wrong is not None:
        return f"has {wrong!r} = {r[wrong]!r}, not a number"
    p = r["preemptions"]
    if not isinstance(p, list) or not all(isinstance(e, dict) and isinstance(e.get("mode"), str) for e in p):
        return "has 'preemptions' that are not a list of events with a mode"
    return None
