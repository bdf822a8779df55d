"""Where one decode step's GPU time goes: one step of the random Llama-3-8B-shaped bf16 model of
``gpu_bench.py`` (context 512), after warm-up, under ``torch.profiler`` with CUDA activity, at
batch 1 and 256, with the runner's CUDA graphs and eager (``runner.graphs = None``, as
``gpu_bench.py`` does). Prints one JSON object (``scripts/gpu_check.sh`` runs this on a GPU).

Per configuration:
- ``step_ms``: wall time of the profiled step (schedule, forward, argmax, the host copy that
  syncs, update), profiler overhead included; ``step_ms_unprofiled``: median of the warm-up steps;
- ``busy_ms``: the union of the device activities' intervals (kernels, memcpy, memset);
  ``span_ms``: first start to last end; ``gaps_ms`` = span - busy (the GPU idle inside the step);
- ``by_class``: total device time and count per kernel class (``classify``; overlapping streams
  can make the sum exceed busy);
- ``top``: the 15 kernels with the most total time (name cut to 100 characters).

``graph_kernels_visible``: whether the kernels inside a CUDA graph replay show up one by one (a
graph step shows at least half as many kernels as the eager step); if false, a graph step's
classes cover only what runs outside the replay.

``--smoke`` runs the same code on CPU with a tiny model, with the CPU ``aten::`` ops standing in
for kernels (what CI checks).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from gpu_bench import decode_steps, prepare, random_llama, sync
from torch.profiler import DeviceType, ProfilerActivity, profile

# first match wins, in this order; names are lower-cased before matching. The KV write (an
# index_put) counts as a copy. torch.cat's kernel is
# RoPE's rotate_half (and the cos/sin table), not a copy of data.
CLASSES: list[tuple[str, tuple[str, ...]]] = [
    # FlashInfer's fused elementwise kernels (their names start "flashinfer::" too)
    ("norm_rope_act", ("norm::", "activation::", "rotary", "rmsnorm")),
    ("attention", ("flashinfer", "batchdecode", "batchprefill", "attention")),
    ("gemm", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "splitkreduce", "aten::mm")),
    ("sampler", ("argmax", "argmin", "topk", "sort", "softmax", "multinomial", "exponential")),
    ("norm_rope_act", ("catarraybatchedcopy", "aten::cat")),
    ("copies", ("memcpy", "memset", "index", "scatter", "gather", "copy", "aten::to")),
    ("norm_rope_act", ("elementwise", "reduce", "norm", "rope", "rotary", "silu", "act_and_mul", "aten::")),
]
CLASS_NAMES = [*dict.fromkeys(c for c, _ in CLASSES), "other"]


def classify(name: str) -> str:
    low = name.lower()
    for cls, needles in CLASSES:
        if any(n in low for n in needles):
            return cls
    return "other"


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarise(kernels: list[tuple[str, int, int]], wall_s: float, top: int = 15) -> dict[str, Any]:
    """``kernels``: (name, start ns, duration ns) of the step's device activities."""
    iv = [(s, s + d) for _, s, d in kernels]
    busy = busy_ns(iv)
    span = (max(e for _, e in iv) - min(s for s, _ in iv)) if iv else 0
    by_class: dict[str, dict[str, float]] = {c: {"us": 0.0, "count": 0} for c in CLASS_NAMES}
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, _, d in kernels:
        c = by_class[classify(name)]
        c["us"] += d / 1e3
        c["count"] += 1
        by_name[name][0] += 1
        by_name[name][1] += d / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "step_ms": round(wall_s * 1e3, 3),
        "kernels": len(kernels),
        "busy_ms": round(busy / 1e6, 3),
        "span_ms": round(span / 1e6, 3),
        "gaps_ms": round((span - busy) / 1e6, 3),
        "busy_of_step": round(busy / 1e9 / wall_s, 3) if wall_s else None,
        "by_class": {c: {"us": round(v["us"], 1), "count": v["count"]} for c, v in by_class.items()},
        "top": [
            {"name": n.removeprefix("void ")[:100], "count": c, "total_us": round(us, 1)}
            for n, (c, us) in ranked
        ],
    }


def device_events(prof: profile, smoke: bool) -> list[tuple[str, int, int]]:
    """(name, start ns, duration ns) of the device activities (on CPU: the ``aten::`` ops)."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    out = []
    for e in prof.profiler.kineto_results.events():
        if smoke:
            if e.device_type() != DeviceType.CPU or not e.name().startswith("aten::"):
                continue
        elif e.device_type() != DeviceType.CUDA:
            continue
        if e.duration_ns() > 0:
            out.append((e.name(), e.start_ns(), e.duration_ns()))
    return out


def one_step(s: Any, runner: Any) -> None:
    out = s.schedule()
    s.update(runner.execute(out).argmax(-1).to(torch.int32).cpu().numpy())


def profile_step(s: Any, runner: Any, smoke: bool, warmup: int) -> dict[str, Any]:
    step_s, _ = decode_steps(s, runner, warmup)
    acts = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
    with profile(activities=acts):  # the profiler's own start-up cost, not measured
        one_step(s, runner)
    sync()
    with profile(activities=acts) as prof:
        sync()
        t = time.perf_counter()
        one_step(s, runner)
        sync()
        wall = time.perf_counter() - t
    r = summarise(device_events(prof, smoke), wall)
    r["step_ms_unprofiled"] = round(float(np.median(step_s)) * 1e3, 3)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny dry run on CPU (what CI checks)")
    a = p.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs the same code on CPU)")
    dev = torch.device("cpu" if a.smoke else "cuda")
    report: dict[str, Any] = {
        "gpu": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": a.context,
        "sampler": "argmax of the float32 logits, as gpu_bench.py",
        "classes": {c: list(n) for c, n in CLASSES},
        "runs": [],
    }
    if not a.smoke:  # start CUPTI before any graph is captured, in case its tracing needs that
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.ones(1, device=dev).add_(1)
        sync()
    model = random_llama(dev, a.smoke)
    visible = []
    for b in (int(x) for x in a.batches.split(",")):
        # room for warm-up + 2 profiled steps in each mode
        s, runner, _, _ = prepare(model, b, a.context, a.warmup + 3)
        graphs = runner.graphs
        rows = {}
        if graphs is not None:
            rows["graphs"] = profile_step(s, runner, a.smoke, a.warmup)
            rows["graphs"]["graph_steps"] = runner.num_graph_steps
        runner.graphs = None
        rows["eager"] = profile_step(s, runner, a.smoke, a.warmup)
        if "graphs" in rows:
            visible.append(rows["graphs"]["kernels"] >= 0.5 * rows["eager"]["kernels"])
        report["runs"] += [{"batch": b, "mode": m, **r} for m, r in rows.items()]
        del s, runner, graphs
        gc.collect()
        if not a.smoke:
            torch.cuda.empty_cache()
    report["graph_kernels_visible"] = all(visible) if visible else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
