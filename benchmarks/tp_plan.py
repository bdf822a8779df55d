"""What sending each step's plan to the tensor-parallel workers costs against the whole step
(``worker/tp_workers.py``: one ``broadcast_object_list`` of the plan's arrays from rank 0, gloo on
CPU). Prints one JSON line.

    python benchmarks/tp_plan.py                      # SmolLM2 over 3 ranks (2 does not divide its 9 heads)
    python benchmarks/tp_plan.py --model tiny --tp 2  # the tests' random Llama
    python benchmarks/tp_plan.py --model tiny --tp 2 --backend ray  # rank 1 as a Ray actor
    python benchmarks/tp_plan.py --model tiny --tp 2 --async-scheduling  # + the in-flight ids

``--requests`` greedy requests (default 16) of a short prompt decode ``--max-tokens`` tokens
together; after ``--warmup`` steps (the workers finish loading during the first), each
``engine.step()`` is timed and so is the broadcast inside it (the runner's ``plan_send_s``; with
``--async-scheduling`` it includes the broadcast of the in-flight tokens' ids after the plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiny import tiny_model

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or a model path")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--backend", choices=("mp", "ray"), default="mp", help="distributed_executor_backend")
    ap.add_argument("--async-scheduling", action="store_true", help="overlap (off by default on CPU)")
    a = ap.parse_args(argv)
    model = tiny_model(Path(tempfile.mkdtemp())) if a.model == "tiny" else a.model
    eng = Engine(
        model,
        device="cpu",
        calibrate=False,
        tensor_parallel_size=a.tp,
        max_model_len=256,
        distributed_executor_backend=a.backend,
        async_scheduling=a.async_scheduling,
    )
    runner: Any = eng.runner  # a TensorParallelRunner
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        for i in range(a.requests):
            eng.add_request(f"r{i}", f"Question {i}: what is tensor parallelism?", sp)
        for _ in range(a.warmup):
            eng.step()
        steps, sends = [], []
        while eng.has_unfinished_requests():
            before, t0 = runner.plan_send_s, time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
            sends.append(runner.plan_send_s - before)
        share = [s / t for s, t in zip(sends, steps, strict=True)]
        print(
            json.dumps(
                {
                    "model": a.model,
                    "tensor_parallel_size": a.tp,
                    "backend": a.backend,
                    "async_scheduling": a.async_scheduling,
                    "inputs_sent": runner.num_inputs_filled,
                    "requests": a.requests,
                    "timed_steps": len(steps),
                    "step_ms_median": round(statistics.median(steps) * 1e3, 3),
                    "plan_send_ms_median": round(statistics.median(sends) * 1e3, 3),
                    "plan_send_share_median": round(statistics.median(share), 4),
                    "plan_send_share_max": round(max(share), 4),
                }
            )
        )
    finally:
        runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
