"""Random sampling on the CPU: the core's sampler (``ferryman._core.sample_random_cpu``; the
engine runs the same sampler through ``sample_cpu``) against the torch sampler
(``ferryman.worker.sampler.sample_random``, what it runs on CUDA, and ran on CPU before), side by
side on the same logits.

For each batch size and vocabulary, rows of random logits (``--scale`` sets how peaked they are:
N(0, scale²) before the temperature) are sampled under each filter set; each figure is the median
of ``--repeats`` timed calls, in ms per call, alternating the two samplers. Both must return the
same tokens (checked; the script exits 1 if not).

    python benchmarks/sampler_cpu.py                          # SmolLM2's vocabulary and a tiny one
    python benchmarks/sampler_cpu.py --vocab 49152 --batch 1,8 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from args import count

from ferryman import _core
from ferryman.worker.sampler import Filters, sample_random

FILTERS = {  # name -> (top_k, top_p, min_p)
    "temperature": (-1, 1.0, 0.0),
    "top_k=50": (50, 1.0, 0.0),
    "top_p=0.9": (-1, 0.9, 0.0),
    "top_k=50,top_p=0.9": (50, 0.9, 0.0),
    "min_p=0.05": (-1, 1.0, 0.05),
}


def timed(f: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    out: object = None
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = f()
        times.append((time.perf_counter() - t) * 1e3)
    return times, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", default="49152,259", help="comma-separated vocabulary sizes")
    p.add_argument("--batch", default="1,8,64", help="comma-separated rows per call")
    p.add_argument("--scale", type=float, default=4.0, help="logits ~ N(0, scale^2)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--repeats", type=count, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    ok = True
    for vocab in (int(v) for v in a.vocab.split(",")):
        for batch in (int(b) for b in a.batch.split(",")):
            logits = torch.randn(batch, vocab, generator=g) * a.scale
            arr = logits.numpy()
            for name, (k, tp, mp) in FILTERS.items():
                t = torch.full((batch,), a.temperature)
                kk = torch.full((batch,), k, dtype=torch.int64)
                pp, mpp = torch.full((batch,), tp), torch.full((batch,), mp)
                seeds, pos = torch.arange(batch, dtype=torch.int64) * 7919, torch.full((batch,), 100)
                filters = Filters(k > 0, tp < 1, mp > 0)
                cols = [x.numpy() for x in (t, kk, pp, mpp, seeds, pos)]
                rows = np.arange(batch, dtype=np.int64)
                torch_ms: list[float] = []
                core_ms: list[float] = []
                by_torch = partial(sample_random, logits, t, kk, pp, mpp, seeds, pos, filters)
                by_core = partial(_core.sample_random_cpu, arr, rows, *cols)
                for _ in range(a.repeats):  # alternate, one call each
                    tt, want = timed(by_torch, 1)
                    tc, got = timed(by_core, 1)
                    torch_ms += tt
                    core_ms += tc
                same = torch.equal(torch.as_tensor(got), want)  # type: ignore[arg-type]
                ok &= same
                mt, mc = statistics.median(torch_ms), statistics.median(core_ms)
                rows_out.append(
                    {
                        "vocab": vocab,
                        "batch": batch,
                        "filters": name,
                        "torch_ms": round(mt, 3),
                        "core_ms": round(mc, 3),
                        "speedup": round(mt / mc, 1),
                        "same_tokens": same,
                    }
                )
    if a.json:
        print(json.dumps({"scale": a.scale, "temperature": a.temperature, "rows": rows_out}))
    else:
        print(f"logits ~ N(0, {a.scale}^2), temperature {a.temperature}; medians of {a.repeats}, ms per call")
        print(f"{'vocab':>6} {'batch':>5} {'filters':<20} {'torch':>9} {'core':>8} {'x':>6} same")
        for r in rows_out:
            print(
                f"{r['vocab']:>6} {r['batch']:>5} {r['filters']:<20} {r['torch_ms']:>9.2f} "
                f"{r['core_ms']:>8.3f} {r['speedup']:>6.1f} {r['same_tokens']}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
