"""Host time of ``Engine.step()`` outside the model forward, per output token, at a full decode batch.

Measured with async scheduling off (the forward then runs inline, so it can be subtracted).
A tiny random Llama (``tests/python/tiny_models.py``, with its byte-level BPE tokenizer) is built
in a temp folder; ``--requests`` requests (default 256) of a 16-token text prompt all decode
together on CPU. After a warm-up (every prompt prefilled, then a few decode steps), ``--steps``
decode steps are timed. Host time = wall time of ``engine.step()`` minus the time inside
``engine.runner.execute(...)`` (the forward, synchronous on CPU). Where the engine has them, the
host time is split by wrapping, on the instance: ``scheduler.schedule``, ``scheduler.update``
(with contract v2 it also detokenizes and matches stop strings), the sampling
(``engine._sampling.sample``, before contract v2 ``engine._sample``) without the core's CPU
sampling kernel inside it (``sample_cpu``), that kernel (``sampler``: on a GPU this is the
device's work, so ``host_without_sampler_us_per_token`` is the host figure without it), and the
output objects
(``engine._outputs.process``, contract v2); the rest is the step's other Python (before contract
v2: detokenization, stop strings, output objects). A phase whose attribute is missing is left out
(its time falls into the rest), so the same script measures the engine before and after a
redesign (an object whose attributes cannot be set, the PyO3 scheduler, is replaced on its holder
by a proxy). Times are exclusive (a
wrapped call inside another counts once, in the inner one). Each timed call costs about 1 µs of
timer (``perf_counter_ns`` is ~0.2 µs in a VM): a few µs per step, ~0.02 µs per token at 256.
``--split-append`` also times ``engine._append`` (detokenization and stop strings, called per
token) apart from the rest; that wrapper adds ~1 µs per token to the host figure, so it is off by
default.

Figures are medians over the timed steps, each step's time divided by its output tokens (one per
request); the median of each phase is taken on its own, so the phases need not add up to the
host median exactly. Scenarios: ``greedy``; ``sampled`` (temperature 0.8, top_p 0.9, top_k 50,
seeded); ``stops`` (greedy with two stop strings that never match). Every request has
``ignore_eos`` and enough ``max_tokens`` to decode through every timed step, and the pool holds
them all: the report says how many preemptions happened (none is expected).

    python benchmarks/host_overhead.py                              # all scenarios, 256 x 64
    python benchmarks/host_overhead.py --scenarios greedy --json
    python benchmarks/host_overhead.py --output-kind final_only       # what generate() pays
    python benchmarks/host_overhead.py --split-append               # detokenization apart
    python benchmarks/host_overhead.py --requests 8 --steps 4 --json  # the CI smoke (test_engine)
    python benchmarks/host_overhead.py --model smollm2 --requests 32 --scenarios sampled
                                                                  # a real vocabulary (49,152)

``--model`` runs another checkpoint instead of the tiny one (a path, or ``smollm2``: the
embedded default); its prompts are the same strings, however many tokens they make.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ferryman.engine import Engine
from ferryman.engine_args import EngineArgs
from ferryman.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("greedy", "sampled", "stops")
PHASES = ("schedule", "update", "sample", "sampler", "outputs")  # then "rest"
PROMPT_LEN, BLOCK = 16, 16
WARMUP_DECODE_STEPS = 4
NEVER = ["\x00never-stop-1\x00", "\x00never-stop-2\x00"]  # a random model never prints these
# the host time is the step's wall time minus the forward's: measured with overlap off (an engine
# from before async scheduling has no such knob and is synchronous anyway)
SYNC = {"async_scheduling": False} if "async_scheduling" in EngineArgs.__dataclass_fields__ else {}


class Timer:
    """Exclusive nanoseconds per label over the current step (``reset`` between steps)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.rows: int | None = None  # rows of the logits the forward returned: output tokens
        self._open: list[int] = []  # child time of each open call

    def reset(self) -> None:
        self.ns, self.rows = {}, None

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._open.append(0)
            t0 = time.perf_counter_ns()
            try:
                result = fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                child = self._open.pop()
                self.ns[label] = self.ns.get(label, 0) + dt - child
                if self._open:
                    self._open[-1] += dt
            if label == "forward" and hasattr(result, "shape"):
                self.rows = (self.rows or 0) + int(result.shape[0])
            return result

        return timed


class _Proxy:
    """Stands in for an object whose attributes cannot be set (a PyO3 class): the timed methods,
    and every other attribute from the original."""

    def __init__(self, inner: Any, timed: dict[str, Callable[..., Any]]) -> None:
        self.__dict__.update(timed)
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _patch(holder: Any, attr: str, names: dict[str, str], timer: Timer) -> list[str]:
    """Wraps ``holder.<attr>.<name>`` for each name it has (label: ``names[name]``); returns the
    labels wrapped."""
    obj = getattr(holder, attr, None)
    timed = {n: timer.wrap(label, getattr(obj, n)) for n, label in names.items() if hasattr(obj, n)}
    if not timed:
        return []
    try:
        for n, fn in timed.items():
            setattr(obj, n, fn)
    except (AttributeError, TypeError):
        setattr(holder, attr, _Proxy(obj, timed))
    return [names[n] for n in timed]


def instrument(engine: Engine, timer: Timer, split_append: bool = False) -> list[str]:
    if not _patch(engine, "runner", {"execute": "forward"}, timer):
        raise SystemExit("engine.runner.execute not found: cannot separate the forward")
    found = _patch(engine, "scheduler", {"schedule": "schedule", "update": "update"}, timer)
    found += _patch(engine, "_sampling", {"sample": "sample"}, timer)  # contract v2
    # the core's CPU sampling kernel inside it, where the engine has one: on a GPU that work is
    # the device's, so it is reported apart ("sampler"; "sample" keeps the Python around it)
    mod = sys.modules.get("ferryman.worker.sampling_table")
    if mod is not None and hasattr(mod, "sample_cpu"):
        kernel = mod.__dict__.setdefault("_unwrapped_sample_cpu", mod.sample_cpu)  # one wrap per run
        setattr(mod, "sample_cpu", timer.wrap("sampler", kernel))  # noqa: B010
        found.append("sampler")
    found += _patch(engine, "_outputs", {"process": "outputs"}, timer)
    for attr, label, on in (("_sample", "sample", True), ("_append", "append", split_append)):
        if on and hasattr(engine, attr):  # before contract v2 (_append: per token, ~1 µs/token of timer)
            setattr(engine, attr, timer.wrap(label, getattr(engine, attr)))
            found.append(label)
    return found


def build_model(root: Path, max_len: int) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests/python/tiny_models.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path: Path = mod.build("llama", root, tokenizer=True, max_position_embeddings=max(256, max_len))
    return path


def params(scenario: str, i: int, max_tokens: int, output_kind: str) -> SamplingParams:
    common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    if "output_kind" in SamplingParams.__dataclass_fields__:  # contract v2; before it: cumulative
        common["output_kind"] = output_kind
    if scenario == "sampled":
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, **common)
    stop = NEVER if scenario == "stops" else []
    return SamplingParams(temperature=0.0, stop=stop, **common)


def prompt(i: int) -> str:
    return f"request {i:05d} asks about item {7 * i}"[:PROMPT_LEN]  # one token per byte


def _decoding(engine: Engine, res: Any, timer: Timer, requests: int) -> bool:
    """The step that returned ``res`` was decode-only, every request sampling (from its
    ``StepResult.stats``, or ``last_schedule`` before contract v2; without either: only that every
    request sampled, and the warm-up's decode steps make sure)."""
    st = getattr(res, "stats", None)
    if st is not None:
        return bool(st.num_prefill_tokens == 0 and st.num_generated_tokens == requests)
    out = getattr(engine, "last_schedule", None)
    if out is None:
        return timer.rows in (None, requests)
    return bool(out.num_prefill_tokens == 0 and len(out.sample_req_ids) == requests)


def run(
    model: str, scenario: str, requests: int, steps: int, split: bool = False, kind: str = "cumulative"
) -> dict[str, Any]:
    max_tokens = steps + 64  # warm-up (prefill steps + WARMUP_DECODE_STEPS) fits in the 64
    per_req = -(-(PROMPT_LEN + max_tokens) // BLOCK) + 1
    engine = Engine(
        model,
        device="cpu",
        max_num_seqs=requests,
        block_size=BLOCK,
        num_device_blocks=requests * per_req + 16,
        num_host_blocks=0,
        max_model_len=PROMPT_LEN + max_tokens,
        calibrate=False,
        seed=0,
        **SYNC,
    )
    for i in range(requests):
        engine.add_request(f"r{i}", prompt(i), params(scenario, i, max_tokens, kind))
    timer = Timer()
    phases = instrument(engine, timer, split)
    for _ in range(32):  # prefill every prompt (chunked by the token budget)
        timer.reset()
        res = engine.step()
        if _decoding(engine, res, timer, requests):
            break
    else:
        raise SystemExit(f"{scenario}: the batch never became decode-only")
    for _ in range(WARMUP_DECODE_STEPS):
        engine.step()
    rows: list[dict[str, int]] = []
    for s in range(steps):
        timer.reset()
        t0 = time.perf_counter_ns()
        res = engine.step()
        wall = time.perf_counter_ns() - t0
        if timer.rows not in (None, requests) or not _decoding(engine, res, timer, requests):
            raise SystemExit(f"{scenario}: step {s} produced {timer.rows} tokens, not {requests}")
        ns = dict(timer.ns)
        host = wall - ns.get("forward", 0)
        row = {"step": wall, "forward": ns.get("forward", 0), "host": host}
        row |= {p: ns.get(p, 0) for p in phases}
        row["rest"] = host - sum(ns.get(p, 0) for p in phases)
        rows.append(row)
    st = engine.stats()
    preempted = int(st.get("num_preemptions", 0))
    if st.get("num_requests_finished", 0) or not engine.has_unfinished_requests():
        raise SystemExit(f"{scenario}: a request finished (a stop string matched?) during the run")

    def med(key: str, per_token: bool = True) -> float:
        v = statistics.median(r[key] for r in rows)
        return round(v / requests / 1e3, 3) if per_token else round(v / 1e6, 3)

    deciles = statistics.quantiles([r["host"] for r in rows], n=10) if len(rows) > 1 else []
    for r in rows:
        r["host_without_sampler"] = r["host"] - r.get("sampler", 0)
    return {
        "host_us_per_token": med("host"),
        # what the host path costs with the CPU sampler's kernel taken out (the device's work)
        "host_without_sampler_us_per_token": med("host_without_sampler"),
        "phases_us_per_token": {p: med(p) for p in [*phases, "rest"]},
        "phases_missing": [p for p in PHASES if p not in phases],
        "forward_ms_per_step": med("forward", per_token=False),
        "step_ms": med("step", per_token=False),
        "host_us_per_token_p10_p90": [round(q / requests / 1e3, 3) for q in deciles[::8]],
        "preemptions": preempted,
    }


def table(report: dict[str, Any]) -> str:
    seen = {p for r in report["scenarios"].values() for p in r["phases_us_per_token"]}
    cols = [*PHASES, *(["append"] if "append" in seen else []), "rest"]
    head = (
        f"{'scenario':<9}{'host':>8}{'-sampler':>9}"
        + "".join(f"{c:>10}" for c in cols)
        + f"{'fwd ms':>9}{'step ms':>9}"
    )
    lines = [
        f"{report['model']}: {report['requests']} requests decoding, {report['steps']} timed steps, "
        f"torch threads {report['torch_threads']}: medians, host and phases in µs per output token",
        head,
    ]
    for name, r in report["scenarios"].items():
        ph = r["phases_us_per_token"]
        cells = "".join(f"{ph[c]:>10.3f}" if c in ph else f"{'-':>10}" for c in cols)
        lines.append(
            f"{name:<9}{r['host_us_per_token']:>8.3f}{r['host_without_sampler_us_per_token']:>9.3f}"
            f"{cells}{r['forward_ms_per_step']:>9.2f}"
            f"{r['step_ms']:>9.2f}"
        )
    total = sum(r["preemptions"] for r in report["scenarios"].values())
    lines.append("no request was preempted" if total == 0 else f"WARNING: {total} preemptions")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256, help="requests decoding together")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated of {SCENARIOS}")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--model", help="a checkpoint (path, or 'smollm2') instead of the tiny random Llama")
    p.add_argument(
        "--output-kind",
        default="cumulative",
        choices=["cumulative", "delta", "final_only"],
        help="the requests' SamplingParams.output_kind (contract v2; before it every step built cumulative "
        "outputs): cumulative is step()'s default, delta what the server streams, final_only what "
        "generate() uses",
    )
    p.add_argument(
        "--split-append",
        action="store_true",
        help="also time engine._append (detokenization + stop strings, per token) apart from the rest "
        "(adds ~1 µs/token of timer to the host figure)",
    )
    a = p.parse_args(argv)
    names = [s for s in a.scenarios.split(",") if s]
    if not names or any(s not in SCENARIOS for s in names):
        p.error(f"--scenarios: pick from {SCENARIOS}")
    if a.requests < 1 or a.steps < 1:
        p.error("--requests and --steps must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(build_model(Path(tmp), PROMPT_LEN + a.steps + 64))
        scenarios = {s: run(model, s, a.requests, a.steps, a.split_append, a.output_kind) for s in names}
    report = {
        "model": a.model or "tiny random Llama",
        "output_kind": a.output_kind,
        "requests": a.requests,
        "steps": a.steps,
        "torch_threads": torch.get_num_threads(),
        "scenarios": scenarios,
    }
    for r in scenarios.values():
        assert math.isfinite(r["host_us_per_token"]), r
    print(json.dumps(report) if a.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
