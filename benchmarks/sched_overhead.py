"""Scheduler overhead through the Python binding, with a fake model.

Replays a workload trace (``workload_trace.py``: the format and the token of each position)
through ``ferryman._core.Scheduler``. Before step s, every request with
``arrival_step <= s`` is added; the fake model emits, for every sample, the token of position
``len(request)``. Only ``schedule()`` and ``update()`` are timed (binding crossing included:
numpy arrays out, the sampled int32 array in). The output arrays are wrapped for Python when
first read: by default the fake model reads only what it needs (``sample_req_ids``, the result's
``req_ids``); ``--read-all`` reads every array inside the timed window, as a model runner would.
Prints one JSON line; ``core_ns_per_output_token`` is the part spent inside Rust (the core's own
clock), the rest is the binding crossing.

    python benchmarks/sched_overhead.py --generate 1024 --out trace.json      # write a trace
    python benchmarks/sched_overhead.py --trace trace.json                    # ample pool
    python benchmarks/sched_overhead.py --trace trace.json --pool-fraction 0.25
    python benchmarks/sched_overhead.py --trace trace.json --read-all          # what a runner pays

``vllm_scheduler.py`` replays the same trace through vLLM v1's scheduler, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# numpy's BLAS threads spin on this 2-core machine kind and steal time from the measured thread
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from args import count
from workload_trace import blocks_needed, generate, prompt, tokens, trace_problem

from ferryman import RequestParams, Scheduler, SchedulerConfig

# every array of SchedulerOutput: what a model runner reads, give or take a few
OUTPUT_ARRAYS = [
    "req_ids",
    "rows",
    "rows_removed",
    "rows_added",
    "added_req_ids",
    "added_seq_indices",
    "table_rows",
    "table_cols",
    "table_blocks",
    "seq_indices",
    "input_ids",
    "qo_indptr",
    "seq_lens",
    "kv_indptr",
    "kv_last_page_len",
    "logits_indices",
    "sample_req_ids",
    "sample_seq_indices",
    "blocks_to_swap_out",
    "blocks_to_swap_in",
    "blocks_to_copy",
    "preempted_req_ids",
    "finished_req_ids",
]


def replay(
    trace: list[dict[str, int]], cfg: SchedulerConfig, seed: int, read_all: bool = False
) -> dict[str, Any]:
    s = Scheduler(cfg)
    trace = sorted(trace, key=lambda r: (r["arrival_step"], r["id"]))
    lens = np.zeros(max(r["id"] for r in trace) + 1, dtype=np.uint64)
    nxt = 0
    step_ns: list[int] = []
    num_tokens = num_generated = num_preemptions = 0
    min_free = cfg.num_device_blocks
    step = 0
    while nxt < len(trace) or s.has_unfinished_requests():
        while nxt < len(trace) and trace[nxt]["arrival_step"] <= step:
            r = trace[nxt]
            s.add_request(
                r["id"],
                prompt(seed, r["id"], r["prompt_len"]).tolist(),
                RequestParams(r["output_len"], ignore_eos=True),
            )
            lens[r["id"]] = r["prompt_len"]
            nxt += 1
        t0 = time.perf_counter_ns()
        out = s.schedule()
        if read_all:
            for name in OUTPUT_ARRAYS:
                getattr(out, name)
        t1 = time.perf_counter_ns()
        ids = out.sample_req_ids.astype(np.uint64)
        sampled = tokens(seed, ids, lens[ids])
        t2 = time.perf_counter_ns()
        res = s.update(sampled)
        if read_all:
            res.new_token_ids, res.seq_indices, res.finish_reasons  # noqa: B018
        t3 = time.perf_counter_ns()
        lens[res.req_ids] += np.uint64(1)
        step_ns.append((t1 - t0) + (t3 - t2))
        num_tokens += out.num_scheduled_tokens
        num_generated += len(res)
        num_preemptions += out.num_preemptions
        min_free = min(min_free, out.num_free_device_blocks)
        step += 1
    st = s.stats()
    assert st["num_free_device_blocks"] == cfg.num_device_blocks
    ns = np.array(step_ns, dtype=np.float64)
    total = float(ns.sum())
    return {
        "requests": len(trace),
        "num_device_blocks": cfg.num_device_blocks,
        "preemption_mode": cfg.preemption_mode,
        "steps": step,
        "preemptions": num_preemptions,
        "preemptions_recompute": st["num_preemptions_recompute"],
        "preemptions_swap": st["num_preemptions_swap"],
        "scheduled_tokens": num_tokens,
        "output_tokens": num_generated,
        "us_per_step_mean": round(total / len(ns) / 1e3, 2),
        "us_per_step_p50": round(float(np.percentile(ns, 50)) / 1e3, 2),
        "us_per_step_p99": round(float(np.percentile(ns, 99)) / 1e3, 2),
        "ns_per_output_token": round(total / num_generated, 1),
        "scheduler_ms_total": round(total / 1e6, 1),
        "core_ns_per_output_token": round(st["scheduler_ns"] / num_generated, 1),
        "peak_blocks_used": cfg.num_device_blocks - min_free,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="JSON trace to replay")
    p.add_argument("--generate", type=count, metavar="N", help="generate an N-request trace")
    p.add_argument("--arrivals-per-step", type=count, default=8)
    p.add_argument("--out", help="with --generate: write the trace here and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=count, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-device-blocks", type=int, help="default: every request fits at once")
    p.add_argument(
        "--pool-fraction",
        type=float,
        help="size the pool to this fraction of the peak blocks an ample run uses (e.g. 0.25)",
    )
    p.add_argument("--num-host-blocks", type=int, default=0)
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    p.add_argument(
        "--read-all",
        action="store_true",
        help="read every output array inside the timed window, as a model runner would (arrays are "
        "wrapped for Python on first read)",
    )
    a = p.parse_args(argv)
    if a.generate:
        trace = generate(a.generate, a.seed, a.arrivals_per_step)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(trace, f)
            return 0
    elif a.trace:
        try:
            with open(a.trace) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"--trace {a.trace}: {e}")
    else:
        p.error("give --trace FILE or --generate N")
    if (problem := trace_problem(trace)) is not None:
        p.error(f"--trace {a.trace}: {problem}")
    if a.block_size & (a.block_size - 1):
        p.error(f"--block-size must be a power of two, got {a.block_size}")

    def config(num_device_blocks: int) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=a.block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=a.num_host_blocks,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.max_num_seqs,
            max_model_len=max(r["prompt_len"] + r["output_len"] for r in trace),
            preemption_mode=a.preemption_mode,
        )

    need = blocks_needed(trace, a.block_size)
    blocks = a.num_device_blocks or sum(need)
    if a.pool_fraction:
        peak = replay(trace, config(sum(need)), a.seed)["peak_blocks_used"]
        blocks = max(int(peak * a.pool_fraction), max(need))
    print(json.dumps(replay(trace, config(blocks), a.seed, a.read_all) | {"read_all": a.read_all}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
