"""CPU float32 projections: plain ``F.linear`` (MKL sgemm) against oneDNN's packed weights, the
layout ``LlamaForCausalLM.pack_cpu_weights()`` moves the model to, and what running them at padded
row counts (``ferryman.models.cpu_linear``) costs and saves.

Times the 210 projections of SmolLM2-135M's 30 layers (random weights of the real shapes), plus
its tied LM head, at several row counts (a decode step's batch), interleaving the variants and
keeping the median of the repeats. Prints one JSON line per row count with milliseconds, the
effective weight bandwidth and the ratio.

``--padding``: per row count, the packed projections run at exactly that many rows (a primitive
of its own) against ``packed_linear``, which runs them at ``padded_rows(rows)``; the ratio is
what the padding costs (1.0 where the row count is a padded size itself).

``--cache``: the five weight shapes ferryman runs (stacked q/k/v, o, stacked gate/up, down, the
LM head) run once at every row count from 1 to ``--cache-rows``, in a fresh process per variant
(exact row counts, padded row counts); prints the distinct row counts oneDNN saw and how much
native memory in use (glibc's ``mallinfo2``) and RSS grew: what oneDNN's per-shape primitives,
held in its caches, cost.

    python benchmarks/cpu_linear.py [--rows 1,4,12,16,32,64,256] [--repeats 5]
    python benchmarks/cpu_linear.py --padding --rows 17,33,65,129,257,1025
    python benchmarks/cpu_linear.py --cache [--cache-rows 300]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ferryman.models import cpu_linear

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def weights(layers: int) -> list[torch.Tensor]:
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    out = [torch.randn(*s) * 0.02 for _ in range(layers) for s in shapes]
    out.append(torch.randn(VOCAB, HIDDEN) * 0.02)
    return out


def exact(x: torch.Tensor, packed: torch.Tensor, _: torch.Tensor) -> object:
    return cpu_linear._run(x, packed, None)


def padded(x: torch.Tensor, packed: torch.Tensor, _: torch.Tensor) -> object:
    return cpu_linear.packed_linear(x, packed, None)


def plain(x: torch.Tensor, _: torch.Tensor, w: torch.Tensor) -> object:
    return F.linear(x, w)


def timings(a: argparse.Namespace, variants: dict[str, Run]) -> None:
    ws = weights(LAYERS)
    packed = [cpu_linear.pack(w) for w in ws]
    nbytes = sum(w.numel() * 4 for w in ws)
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        with torch.inference_mode():
            for _ in range(a.repeats + 1):  # the first round warms up
                for name, run in variants.items():
                    t = time.perf_counter()
                    for w, pw in zip(ws, packed, strict=True):
                        run(xs[w.shape[1]], pw, w)
                    times[name].append(time.perf_counter() - t)
        (n1, first), (n2, second) = ((n, statistics.median(v[1:])) for n, v in times.items())
        row: dict[str, object] = {"rows": m}
        if a.padding:
            row["padded_rows"] = cpu_linear.padded_rows(m)
        row |= {f"{n1}_ms": round(first * 1e3, 1), f"{n2}_ms": round(second * 1e3, 1)}
        row |= {f"{n1}_GBps": round(nbytes / first / 1e9, 2), f"{n2}_GBps": round(nbytes / second / 1e9, 2)}
        row[f"{n2}_over_{n1}" if a.padding else "speedup"] = round(
            second / first if a.padding else first / second, 3
        )
        print(json.dumps(row), flush=True)


def in_use_mib() -> tuple[float, float]:
    """(native memory in use per glibc, RSS) in MiB."""

    class MallInfo2(ctypes.Structure):
        names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
        _fields_ = [(n, ctypes.c_size_t) for n in (*names, "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    mi = libc.mallinfo2()
    status = Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]
    return (mi.uordblks + mi.hblkhd) / 2**20, int(status) / 1024


def cache_run(variant: str, rows: int) -> None:
    # the five weight shapes ferryman runs (q/k/v and gate/up stacked, every layer alike)
    shapes = [
        (HIDDEN + 2 * KV, HIDDEN),
        (HIDDEN, HIDDEN),
        (2 * INTER, HIDDEN),
        (HIDDEN, INTER),
        (VOCAB, HIDDEN),
    ]
    ws = [torch.randn(*s) * 0.02 for s in shapes]
    packed = [cpu_linear.pack(w) for w in ws]
    run = exact if variant == "exact" else padded
    with torch.inference_mode():
        for w, pw in zip(ws, packed, strict=True):
            run(torch.randn(1, w.shape[1]), pw, w)
        (mem0, rss0), seen = in_use_mib(), set()
        for m in range(1, rows + 1):
            for w, pw in zip(ws, packed, strict=True):
                run(torch.randn(m, w.shape[1]), pw, w)
            seen.add(m if variant == "exact" else cpu_linear.padded_rows(m))
        mem1, rss1 = in_use_mib()
    built = len(seen) * len(ws) - len(ws)  # row count 1 ran before the first reading
    print(
        json.dumps(
            {
                "variant": variant,
                "rows": f"1..{rows}",
                "weight_shapes": len(ws),
                "distinct_row_counts": len(seen),
                "in_use_growth_mib": round(mem1 - mem0, 1),
                "rss_growth_mib": round(rss1 - rss0, 1),
                "in_use_mib_per_new_shape": round((mem1 - mem0) / max(built, 1), 3),
            }
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,12,16,32,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--padding", action="store_true", help="exact against padded row counts")
    p.add_argument("--cache", action="store_true", help="memory held per distinct row count")
    p.add_argument("--cache-rows", type=int, default=300)
    p.add_argument("--cache-variant", choices=["exact", "padded"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.cache_variant:
        cache_run(a.cache_variant, a.cache_rows)
    elif a.cache:
        for variant in ("exact", "padded"):
            cmd = [sys.executable, __file__, "--cache-variant", variant, "--cache-rows", str(a.cache_rows)]
            subprocess.run(cmd, check=True)
    elif a.padding:
        timings(a, {"exact": exact, "padded": padded})
    else:
        timings(a, {"plain": plain, "packed": padded})


if __name__ == "__main__":
    main()
