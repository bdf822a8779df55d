"""Where an Engine run's time goes, step by step: the `ferryman bench throughput` workload on one
pool size, timing every ``Engine.step()``.

Prints one JSON line (steps, decode-only steps and their time, mixed steps and their time, mean
rows per decode step, preemptions), then one line per batch-size bucket of decode-only steps
(count, mean step time, tokens/s). The pool is ``--num-device-blocks``, or else the whole
demand (every request fits).

    python benchmarks/step_profile.py                          # ample: 1,202 blocks
    python benchmarks/step_profile.py --num-device-blocks 199  # 25% of the ample peak use
    python benchmarks/step_profile.py --fixed-batches 1,12,48  # decode step time vs batch size

``--fixed-batches`` instead runs, for each B, B requests of ``--context`` random prompt tokens
decoding 12 tokens each, and prints the median decode step at that batch: the fixed cost per step
and the cost per row, which decide how throughput follows the number of requests that fit.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from args import count

from ferryman import bench
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

BUCKETS = [(1, 8), (8, 16), (16, 24), (24, 32), (32, 48), (48, 65), (65, 257)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=count, default=64)
    p.add_argument("--input-len", default="32:256")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--token-range", default="100:1000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-device-blocks", type=int, default=None)
    p.add_argument("--fixed-batches", default=None, help="comma-separated batch sizes (see above)")
    p.add_argument("--context", type=int, default=300)
    a = p.parse_args()
    if a.fixed_batches:
        fixed_batches(a.model, [int(b) for b in a.fixed_batches.split(",")], a.context, a.seed)
        return
    work = bench.workload(a.token_range, a.num_prompts, a.input_len, a.output_len, a.seed)
    blocks = a.num_device_blocks or bench.demand_blocks(work)
    engine = Engine(a.model, num_device_blocks=blocks, max_model_len=max(len(t) + m for t, m in work))
    for i, (tokens, m) in enumerate(work):
        engine.add_request(str(i), tokens, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
    rows: list[tuple[int, int, float]] = []  # (rows, prefill tokens, seconds)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        out = engine.step().stats
        assert out is not None
        rows.append((out.num_scheduled_seqs, out.num_prefill_tokens, time.perf_counter() - t))
    total = time.perf_counter() - started
    r = np.array(rows)
    dec = r[:, 1] == 0
    print(
        json.dumps(
            {
                "num_device_blocks": blocks,
                "seconds": round(total, 1),
                "steps": len(r),
                "decode_steps": int(dec.sum()),
                "decode_seconds": round(float(r[dec, 2].sum()), 1),
                "mixed_seconds": round(float(r[~dec, 2].sum()), 1),
                "mean_rows_per_decode_step": round(float(r[dec, 0].mean()), 1),
                "preemptions": engine.stats()["num_preemptions"],
            }
        )
    )
    for lo, hi in BUCKETS:
        m = dec & (r[:, 0] >= lo) & (r[:, 0] < hi)
        if m.any():
            ms = 1e3 * float(r[m, 2].mean())
            tps = float(r[m, 0].sum() / r[m, 2].sum())
            print(
                json.dumps(
                    {
                        "rows": f"{lo}-{hi - 1}",
                        "steps": int(m.sum()),
                        "ms_per_step": round(ms, 1),
                        "tokens_per_s": round(tps, 1),
                    }
                )
            )


def fixed_batches(model: str, batches: list[int], context: int, seed: int) -> None:
    steps = 12
    need = max(batches) * (-(-(context + steps) // 16))
    engine = Engine(model, num_device_blocks=need + 8, calibrate=False)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for b in batches:
        for i in range(b):
            engine.add_request(f"{b}-{i}", rng.integers(100, 1000, context).tolist(), params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            out = engine.step().stats
            assert out is not None
            if out.num_prefill_tokens == 0 and out.num_scheduled_seqs == b:
                times.append(time.perf_counter() - t)
        print(
            json.dumps(
                {
                    "batch": b,
                    "context": context,
                    "decode_steps": len(times),
                    "median_step_ms": round(1e3 * float(np.median(times)), 1),
                }
            )
        )


if __name__ == "__main__":
    main()
