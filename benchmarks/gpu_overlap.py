"""The device's idle time between decode steps, with async scheduling on and off: the Engine on
a small random Llama of SmolLM2-135M's shape in float16 (``tests/python/tiny_models.py``, built in
a temp folder), ``--batch`` requests decoding together, CUDA graphs on (the default). After
every prompt is prefilled and ``--warmup`` decode steps, ``--steps`` decode steps run under
``torch.profiler`` with CUDA activity. Prints one JSON object; per mode:

- ``step_ms``: wall time per ``Engine.step()`` over the profiled steps (the profiler records
  the device's activity only; on CPU, ``--smoke``, the host's ops);
- ``gaps_per_step_ms``: the device's idle time within the span by gap length (under 10 µs: one
  kernel to the next; over 100 µs: waiting for the host);
- ``plain_step_ms``: the same over ``--steps`` steps before those with nothing attached, and
  ``idle_of_plain_step`` = 1 - busy / plain step: the device's idle share at the engine's own
  pace (the busy time measured under the profiler);
- ``busy_ms``: the union of the device activities' intervals, per step; ``span_ms``: first start
  to last end, per step; ``idle_of_span`` = 1 - busy / span: the share of the time the device
  waited for the host (the issue's target: at most 0.05 with overlap at batch 256);
- ``unprofiled``: ``--steps`` decode steps before those, without the profiler (whose per-op
  recording is host time too): the median step, and the host's time by phase (``host_phases``);
- ``python_top``: the Python functions with the most own time over ``--steps`` steps under
  cProfile (``python_profile``).

``async_logits_in_graph`` is the async run again with the LM head captured in the decode graphs
(``ModelRunner.capture_graphs(logits_in_graph=True)``: two launches fewer per step).

``--smoke`` runs the same code on CPU with a tiny model, the ``aten::`` ops standing in for
kernels (what CI checks; the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_bench import sync
from gpu_profile import busy_ns, device_events
from torch.profiler import ProfilerActivity, profile

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def tiny_models() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests/python/tiny_models.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(path: str, overlap: bool, a: argparse.Namespace, logits_in_graph: bool = False) -> dict[str, Any]:
    smoke = a.smoke
    kw: dict[str, Any] = {"device": "cpu"} if smoke else {"device": "cuda", "dtype": "float16"}
    max_tokens = a.warmup + 4 * a.steps + 16  # plain, phases, cProfile, profiled: all decoding
    eng = Engine(
        path,
        async_scheduling=overlap,
        block_size=16,
        max_num_seqs=a.batch,
        max_model_len=32 + max_tokens,
        num_device_blocks=a.batch * ((32 + max_tokens) // 16 + 2),
        num_host_blocks=0,
        calibrate=False,
        **kw,
    )
    if logits_in_graph:  # the LM head captured with the decode graphs
        eng.runner.capture_graphs(logits_in_graph=True)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="final_only")
    for i in range(a.batch):
        eng.add_request(str(i), [(7 * i + j) % 90 + 3 for j in range(32)], sp)  # the tiny vocabulary is 96
    for _ in range(64):  # until every prompt is in and the steps decode only
        st = eng.step().stats
        if st is not None and st.num_prefill_tokens == 0 and st.num_running == a.batch:
            break
    for _ in range(a.warmup):
        eng.step()
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):  # nothing attached: the engine's own step time
        eng.step()
    sync()
    plain = (time.perf_counter() - t) / a.steps
    host = host_phases(eng, a.steps)  # no profiler: its own per-op cost would count as host time
    py = python_profile(eng, a.steps)
    # the device's activity only: recording every host op too would lengthen the host's step
    acts = [ProfilerActivity.CPU] if smoke else [ProfilerActivity.CUDA]
    sync()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t
    events = device_events(prof, smoke)
    busy = busy_ns([(s, s + d) for _, s, d in events])
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events) if events else 0
    return {
        "step_ms": round(wall / a.steps * 1e3, 3),
        "plain_step_ms": round(plain * 1e3, 3),
        "idle_of_plain_step": round(1 - busy / a.steps / 1e9 / plain, 4),
        "busy_ms": round(busy / a.steps / 1e6, 3),
        "span_ms": round(span / a.steps / 1e6, 3),
        "idle_of_span": round(1 - busy / span, 4) if span else None,
        "gaps_per_step_ms": gap_sizes([(s, s + d) for _, s, d in events], a.steps),
        "cuda_graph_steps": eng.stats()["num_cuda_graph_steps"],
        "fast_plans": eng.runner.graphs.num_fast_plans if eng.runner.graphs is not None else 0,
        "unprofiled": host,
        "python_top": py,
    }


def gap_sizes(intervals: list[tuple[int, int]], steps: int) -> dict[str, float]:
    """The device's idle time between its activities, per step, by the gap's length: under
    10 µs (one kernel to the next, as inside a graph replay), 10-100 µs, and longer (the device
    waiting for the host)."""
    out = {"under_10us": 0, "10_to_100us": 0, "over_100us": 0}
    end = None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            gap = s - end
            out["under_10us" if gap < 10_000 else "10_to_100us" if gap < 100_000 else "over_100us"] += gap
        end = e if end is None else max(end, e)
    return {k: round(v / steps / 1e6, 3) for k, v in out.items()}


def python_profile(eng: Engine, steps: int, top: int = 25) -> list[list[Any]]:
    """cProfile over ``steps`` steps: the ``top`` functions by own time, as ``[function, calls
    per step, own µs per step, cumulative µs per step]`` (cProfile's hooks inflate Python-heavy
    code, so read this for where the host's time goes, not for its size)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(steps):
        eng.step()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}:{fn}" if line else fn
        rows.append([where, round(nc / steps, 1), round(tt / steps * 1e6, 1), round(ct / steps * 1e6, 1)])
    return sorted(rows, key=lambda r: -r[2])[:top]


def host_phases(eng: Engine, steps: int) -> dict[str, float]:
    """Median ms per step, no profiler: the whole step, and the host's time in each phase
    (``host_overhead.py``'s wrappers, exclusive): ``forward`` is ``runner.execute``, which on CUDA
    only queues the step, less its parts timed apart (the block table, the KV plans, a graph's
    FlashInfer plan and replay, the logits); ``sample`` the sampler's launches; ``rest`` the
    step's other Python and any wait for the device (the sampled ids' copy or event)."""
    from host_overhead import Timer, _patch, instrument

    timer = Timer()
    instrument(eng, timer)
    # inside the runner's ``forward`` (each exclusive of the others)
    _patch(eng.runner, "block_table", {"step": "block_table"}, timer)
    _patch(eng.runner, "kv", {"run_plans": "kv_plans"}, timer)
    _patch(eng.runner, "graphs", {"run": "graph_plan_and_replay"}, timer)
    _patch(eng.runner, "model", {"compute_logits": "logits"}, timer)
    _patch(eng, "_sampling", {"args": "sample_args", "write_rows": "sample_write_rows"}, timer)
    walls, phases = [], []
    for _ in range(steps):
        timer.reset()
        t = time.perf_counter_ns()
        eng.step()
        walls.append(time.perf_counter_ns() - t)
        phases.append(dict(timer.ns))
    labels = sorted({k for p in phases for k in p})
    out = {"step_ms": round(statistics.median(walls) / 1e6, 3)}
    for k in labels:
        out[f"{k}_ms"] = round(statistics.median(p.get(k, 0) for p in phases) / 1e6, 3)
    rest = [w - sum(p.values()) for w, p in zip(walls, phases, strict=True)]
    out["rest_ms"] = round(statistics.median(rest) / 1e6, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny dry run on CPU (what CI checks)")
    a = p.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs the same code on CPU)")
    # SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64 over 3 KV heads, vocabulary
    # 49152) in float16: FlashInfer compiles each head size and dtype on first use (minutes on a
    # bare machine), and tests/gpu compiles float16 at head size 64
    shape = {} if a.smoke else {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30}
    if not a.smoke:
        shape |= {"num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 1024}
        shape |= {"vocab_size": 49152}
    report: dict[str, Any] = {
        "device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
        "batch": a.batch,
        "steps": a.steps,
        "model": shape or "tiny",
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny_models().build("llama", Path(tmp), **shape))
        for overlap in (False, True):
            report["async" if overlap else "sync"] = run(path, overlap, a)
        if not a.smoke:  # graphs are CUDA's; a failure of this mode, never run yet, keeps the others
            print(json.dumps(report), flush=True)  # the figures so far, should the next run time out
            try:
                report["async_logits_in_graph"] = run(path, True, a, logits_in_graph=True)
            except Exception as e:
                report["async_logits_in_graph"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
