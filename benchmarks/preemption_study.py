"""The preemption study of docs/preemption.md: four scenarios on H200 + Llama-3-8B, each run in
`recompute`, `swap` and `auto` (fcfs) and in `auto` with the priority policy, through
`ferryman sim`. Prints the Markdown tables, writes one plot per scenario, and checks that `auto`
is within 2% of the better fixed mode in throughput and p99 TTFT (exit 1 if not).

    python benchmarks/preemption_study.py --out docs/img

The whole sweep (4 scenarios x 2,500 requests x 4 runs) also serves as the simulator's speed
benchmark: its wall time is printed at the end.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from args import count

from ferryman.sim import SimConfig, gpu, model_shape, simulate, synthetic
from ferryman.sim.sweep import plot, table

# The card is shared (gpu_memory_utilization 0.25): about 18 GB of KV, 8,607 blocks of 16 tokens,
# so that each scenario's load outgrows the pool and preemption decides the outcome.
BASE = SimConfig(gpu_memory_utilization=0.25, swap_space=32, max_num_seqs=256, max_num_batched_tokens=8192)
SCENARIOS: dict[str, dict[str, Any]] = {
    # a 1,024-token system prompt shared by every request (prefix caching), short turns
    "short chat": {
        "rate": 60.0,
        "prompt_len": "lognormal:200:0.7",
        "output_len": "lognormal:300:0.7",
        "shared_prefix": 1024,
    },
    "long prompts": {"rate": 2.5, "prompt_len": "uniform:4000:12000", "output_len": "uniform:300:1200"},
    "long generations": {"rate": 4.0, "prompt_len": "uniform:200:800", "output_len": "uniform:1000:3000"},
    "bursty": {
        "rate": 12.0,
        "prompt_len": "uniform:256:2048",
        "output_len": "uniform:128:1024",
        "arrival": "burst",
        "burst_size": 300,
    },
}
RUNS = [("recompute", "fcfs"), ("swap", "fcfs"), ("auto", "fcfs"), ("auto", "priority")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=count, default=2500)
    p.add_argument("--out", default=None, help="folder for the plots")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.num_requests < 2:
        p.error("--num-requests must be >= 2: the study compares interactive and batch requests")
    g, shape = gpu("h200"), model_shape("llama-3-8b")
    started = time.perf_counter()
    modes_wall = 0.0  # the sweep over the three modes alone (fcfs): the simulator's speed benchmark
    ok = True
    for name, sc in SCENARIOS.items():
        kw = dict(sc)
        # every 4th request is interactive (priority 0), the rest batch work (priority 1); fcfs
        # ignores the classes, the priority policy preempts batch work first
        work = synthetic(
            a.num_requests,
            kw.pop("rate"),
            kw.pop("prompt_len"),
            kw.pop("output_len"),
            vocab=shape.vocab_size,
            seed=a.seed,
            interactive_every=4,
            **kw,
        )
        rows = []
        for mode, policy in RUNS:
            r = simulate(g, shape, work, replace(BASE, preemption_mode=mode, policy=policy))
            r["value"] = mode if policy == "fcfs" else f"{mode}, priority"
            rows.append(r)
            if policy == "fcfs":
                modes_wall += r["sim_wall_s"]
        print(f"\n### {name}: {sc}  ({rows[0]['num_device_blocks']:,} device blocks)\n")
        print(table(rows, "mode"))
        by = {r["value"]: r for r in rows}
        fixed = [by["recompute"], by["swap"]]
        best_tp = max(r["output_token_throughput"] for r in fixed)
        best_ttft = min(r["ttft_p99_ms"] for r in fixed)
        auto = by["auto"]
        tp_ok = auto["output_token_throughput"] >= 0.98 * best_tp
        ttft_ok = auto["ttft_p99_ms"] <= 1.02 * best_ttft
        ok &= tp_ok and ttft_ok
        pa = by["auto, priority"]
        print(
            f"\ninteractive requests (priority 0), p99 TTFT: fcfs {auto['ttft_p99_ms_priority_0']:,.0f} ms, "
            f"priority {pa['ttft_p99_ms_priority_0']:,.0f} ms; batch (priority 1): "
            f"{auto['ttft_p99_ms_priority_1']:,.0f} ms, {pa['ttft_p99_ms_priority_1']:,.0f} ms"
        )
        verdict = "ok" if tp_ok and ttft_ok else "NOT within 2%"
        tp, ttft = auto["output_token_throughput"] / best_tp, auto["ttft_p99_ms"] / best_ttft
        print(f"\nauto / best fixed: throughput {tp:.3f}, p99 TTFT {ttft:.3f}  {verdict}")
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            png = Path(a.out) / f"preemption-{name.replace(' ', '-')}.png"
            print(f"\n![{name}]({png.name}) <- {plot(rows, 'mode', png, f'H200, Llama-3-8B: {name}')}")
    n = len(SCENARIOS) * a.num_requests
    print(
        f"\nsimulator speed: the {n:,}-request sweep of recompute/swap/auto took {modes_wall:.1f} s of "
        f"simulation; everything, priority runs and plots included, {time.perf_counter() - started:.1f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
