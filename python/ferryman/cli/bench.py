"""``ferryman bench throughput`` (offline, the Engine against transformers' batched generate on the
same random prompts; see ``ferryman.bench``) and ``ferryman bench serve`` (a load generator
against a running server; see ``ferryman.bench_serve``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
from typing import Any

from ferryman.engine_args import EngineArgs, add_cli_args
from ferryman.report import print_report


def register(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = b.add_parser("throughput", help="offline throughput vs transformers' batched generate")
    add_cli_args(
        t,
        EngineArgs,
        only=(
            "model",
            "num_device_blocks",
            "num_host_blocks",
            "preemption_mode",
            "max_num_batched_tokens",
            "async_scheduling",
            "dtype",
        ),
        help_overrides={"num_device_blocks": "device KV blocks (default: every request fits)"},
    )
    t.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    t.add_argument("--input-len", default="32:256", help="LO:HI prompt tokens, uniform (default: 32:256)")
    t.add_argument("--output-len", default="16:256", help="LO:HI output tokens, uniform (default: 16:256)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random workload (default: 0)")
    t.add_argument("--token-range", default="100:1000", help="LO:HI token ids of the random prompts")
    t.add_argument("--pool-fraction", type=float, default=None, help="a second run's pool, see --pool-basis")
    t.add_argument(
        "--pool-basis",
        default="demand",
        choices=["demand", "peak"],
        help="--pool-fraction of the total demand (every request's prompt + output, i.e. the ample pool) "
        "or of the ample run's peak use (stricter) (default: demand)",
    )
    t.add_argument(
        "--temperature", type=float, default=0.0, help="every request's temperature (default: 0, greedy)"
    )
    t.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: 1, off)")
    t.add_argument("--top-k", type=int, default=-1, help="every request's top_k (default: -1, off)")
    t.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    t.add_argument(
        "--vs-sync",
        action="store_true",
        help="also run each variant's pool with async scheduling off, interleaved: ratio async / sync",
    )
    t.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="run every variant this many times, interleaved; ratios are medians (each run listed)",
    )
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(run=run_throughput)
    s = b.add_parser("serve", help="load generator against a running server")
    _add_serve_args(s)
    s.set_defaults(run=run_serve)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    p.add_argument("--input-len", default="32:256", help="LO:HI random prompt tokens")
    p.add_argument("--output-len", default="16:256", help="LO:HI max_tokens")
    p.add_argument("--token-range", default="100:1000", help="LO:HI token ids of random prompts")
    p.add_argument("--dataset", default=None, help="JSON list of prompts instead of random ones")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_throughput(a: argparse.Namespace) -> int:
    from ferryman import bench

    if a.num_prompts < 1 or (a.pool_fraction is not None and not 0 < a.pool_fraction <= 1):
        raise ValueError("--num-prompts must be >= 1 and --pool-fraction in (0, 1]")
    if a.pool_fraction is not None and a.num_device_blocks is not None:
        raise ValueError("--pool-fraction sizes the pool itself: give it or --num-device-blocks, not both")
    if a.vs_sync and a.async_scheduling is False:
        raise ValueError("--vs-sync runs with async scheduling on and off: drop --no-async-scheduling")
    work = bench.workload(a.token_range, a.num_prompts, a.input_len, a.output_len, a.seed)
    demand = bench.demand_blocks(work)
    sampling = bench.Sampling(a.temperature, a.top_p, a.top_k)
    kw: dict[str, Any] = {
        "sampling": sampling,
        "num_host_blocks": a.num_host_blocks,
        "preemption_mode": a.preemption_mode,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_model_len": max(len(p) + m for p, m in work),
        # --vs-sync compares on with off: on, where the default (off on the CPU) would compare off with off
        "async_scheduling": True if a.vs_sync else a.async_scheduling,
        "dtype": a.dtype,
    }
    report: dict[str, object] = {
        "dtype": a.dtype,
        "num_prompts": a.num_prompts,
        "sampling": dataclasses.asdict(sampling),
        "input_len": a.input_len,
        "output_len": a.output_len,
    }
    blocks = demand if a.num_device_blocks is None else a.num_device_blocks  # 0: refused by the engine
    longest = max(bench.request_blocks(work))  # a tight pool still fits each request
    vs_ample: list[float] = []
    vs_hf: list[float] = []
    vs_sync: list[float] = []
    for rep in range(a.repeats):  # each repeat runs every variant again, interleaved
        ample: dict[str, float] = {}
        if a.pool_fraction:
            ample = bench.run_ferryman(a.model, work, num_device_blocks=demand, **kw)
            basis = ample["peak_blocks_used"] if a.pool_basis == "peak" else demand
            blocks = max(longest, int(basis * a.pool_fraction))
        ours = bench.run_ferryman(a.model, work, num_device_blocks=blocks, **kw)
        if a.vs_sync:
            sync = bench.run_ferryman(
                a.model, work, num_device_blocks=blocks, **{**kw, "async_scheduling": False}
            )
            vs_sync.append(round(ours["output_tokens_per_s"] / sync["output_tokens_per_s"], 3))
            if rep == 0:
                report["ferryman_sync"] = sync
        if a.pool_fraction:
            vs_ample.append(round(ours["output_tokens_per_s"] / ample["output_tokens_per_s"], 3))
        hf: dict[str, Any] = {}
        if not a.no_hf:
            hf = bench.run_transformers(a.model, work, sampling, a.dtype)
            base = ample or ours  # transformers is compared with the ample-pool run
            vs_hf.append(round(base["output_tokens_per_s"] / hf["output_tokens_per_s"], 3))
        if rep == 0:  # the first repeat's full figures; later ones add their ratios
            if a.pool_fraction:
                report["ferryman_ample"] = ample
                report["pool_basis"] = a.pool_basis
            report["ferryman"] = ours
            if hf:
                report["transformers"] = hf
    if vs_ample:
        report["ratio_vs_ample"] = statistics.median(vs_ample)
    if vs_hf:
        report["ratio_vs_transformers"] = statistics.median(vs_hf)
    if vs_sync:
        report["ratio_async_vs_sync"] = statistics.median(vs_sync)
        report["ratio_async_vs_sync_runs"] = vs_sync
    if a.repeats > 1:
        report["repeats"] = a.repeats
        report["ratio_vs_ample_runs"] = vs_ample
        report["ratio_vs_transformers_runs"] = vs_hf
    print_report(report, a.json)
    return 0


def run_serve(a: argparse.Namespace) -> int:
    from ferryman import bench_serve

    report = asyncio.run(bench_serve.run(a))
    print_report(report, a.json)
    return 0 if report["failed"] == 0 else 1
