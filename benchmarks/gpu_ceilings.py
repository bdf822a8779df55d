"""The two ceilings a decode step is judged against, measured on the device itself: memory
bandwidth (one large device-to-device copy, bytes read + written) and what cuBLAS reaches on the
projections of the Llama-3-8B-shaped model of ``gpu_bench.py`` (bf16 ``F.linear``) at batch 1, 32
and 256. Prints one JSON object (``scripts/gpu_check.sh`` runs it on a GPU).

Each projection is timed with CUDA events over ``--reps`` launches, cycling through enough copies
of the weight that none is read from L2 again (the model's 32 layers never are); per shape:
``us`` (median of 5 rounds), ``GBps`` (weight + activations moved over that time) and
``of_copy`` (that bandwidth over the copy's). ``--smoke`` runs the same code on CPU with tiny
shapes (what CI checks; the figures mean nothing there). The skinny GEMM kernel's times beside
cuBLAS's, per projection and row count, are in ``gpu_bench.py``'s ``skinny_us`` (from
``ModelRunner.use_skinny_gemm``'s measurement, CUDA graphs on the model's own weights).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# (name, out features, in features) of one Llama-3-8B layer as the model stacks them, and its head
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HEAD = ("lm_head", 128256, 4096)


def timed(fn: Any, reps: int, dev: torch.device) -> float:
    """Median seconds per call over 5 rounds of ``reps`` calls."""
    rounds = []
    for _ in range(5):
        if dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            rounds.append((time.perf_counter() - t) / reps)
    return float(np.median(rounds))


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one device-to-device copy of ``nbytes``."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * nbytes / timed(lambda: b.copy_(a), 10, dev)


def projection(
    dev: torch.device, name: str, n_out: int, n_in: int, batch: int, copies: int, reps: int
) -> dict[str, Any]:
    ws = [torch.randn(n_out, n_in, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    x = torch.randn(batch, n_in, dtype=torch.bfloat16, device=dev)
    i = [0]

    def one() -> None:
        F.linear(x, ws[i[0] % copies])
        i[0] += 1

    one()
    s = timed(one, reps, dev)
    moved = 2 * (n_out * n_in + batch * (n_in + n_out))
    return {"name": name, "batch": batch, "us": round(s * 1e6, 2), "GBps": round(moved / s / 1e9, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="a tiny dry run on CPU (what CI checks)")
    p.add_argument("--out", help="also write the report here after every shape (a timeout keeps those)")
    a = p.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs the same code on CPU)")
    dev = torch.device("cpu" if a.smoke else "cuda")
    div = 64 if a.smoke else 1
    copy = copy_bandwidth(dev, (1 << 20) if a.smoke else (2 << 30))
    report: dict[str, Any] = {
        "device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_GBps": round(copy / 1e9, 1),
        "projections": [],
    }
    l2 = 0 if a.smoke else torch.cuda.get_device_properties(dev).L2_cache_size
    for b in (int(x) for x in a.batches.split(",")):
        for name, n_out, n_in in [*SHAPES, HEAD]:
            n_out, n_in = max(n_out // div, 8), max(n_in // div, 8)
            copies = max(2, -(-4 * l2 // (2 * n_out * n_in)))  # 4x the L2 between two reads of one
            row = projection(dev, name, n_out, n_in, b, copies, 4 if a.smoke else a.reps)
            row["of_copy"] = round(row["GBps"] * 1e9 / copy, 3)
            report["projections"].append(row)
            if a.out:
                Path(a.out).write_text(json.dumps(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
