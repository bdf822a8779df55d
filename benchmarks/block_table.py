"""The runner's host-side derivation of a decode step's positions, slots and page lists from its
block table (``worker/block_table.py``): ``--rows`` requests of ``--context`` prompt tokens
decode together through the real scheduler; ``BlockTable.step`` is timed alone over ``--steps``
decode steps and the median printed in µs (one JSON line). On CUDA this runs on the host before
each step is queued, so it is host time the device may wait for.

    python benchmarks/block_table.py --rows 256 --context 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from args import count

from ferryman import RequestParams, Scheduler, SchedulerConfig
from ferryman.worker.block_table import BlockTable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=count, default=256)
    p.add_argument("--context", type=count, default=512)
    p.add_argument("--steps", type=count, default=100)
    a = p.parse_args()
    bs, rows, ctx = 16, a.rows, a.context
    # room to decode through the prefill steps (the first prompts decode meanwhile) and the timed ones
    out_len = a.steps + rows * ctx // 8192 + 8
    s = Scheduler(
        SchedulerConfig(
            block_size=bs,
            num_device_blocks=rows * (-(-(ctx + out_len) // bs) + 1),
            max_num_batched_tokens=8192,
            max_num_seqs=rows,
            max_model_len=ctx + out_len,
            enable_prefix_caching=False,
        )
    )
    for r in range(rows):
        s.add_request(r, list(range(1, ctx + 1)), RequestParams(out_len, ignore_eos=True))
    table = BlockTable(rows, 8, bs)  # grows to what the scheduler sends
    while True:  # prefill, until a step decodes only
        out = s.schedule()
        table.step(out)
        s.update(np.ones(len(out.logits_indices), np.int32))
        if out.num_prefill_tokens == 0:
            break
    times, pages = [], 0
    for _ in range(a.steps):
        out = s.schedule()
        assert len(out.rows) == rows, "every request decodes in every timed step"
        t = time.perf_counter()
        step = table.step(out)
        times.append(time.perf_counter() - t)
        pages = len(step.kv_indices)
        s.update(np.ones(len(out.logits_indices), np.int32))
    median_us = round(float(np.median(times)) * 1e6, 1)
    print(json.dumps({"rows": rows, "context": ctx, "pages_last_step": pages, "step_us": median_us}))


if __name__ == "__main__":
    main()
