"""CPU float32 projections: plain ``F.linear`` (MKL sgemm) against oneDNN's packed weights, the
layout ``LlamaForCausalLM.pack_cpu_weights()`` moves the model to.

Times the 210 projections of SmolLM2-135M's 30 layers (random weights of the real shapes), plus
its tied LM head, at several row counts (a decode step's batch), interleaving the two variants
and keeping the median of the repeats. Prints one JSON line per row count with milliseconds,
the effective weight bandwidth and the ratio.

    python benchmarks/cpu_linear.py [--rows 1,4,12,16,32,64,256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from ferryman.models.llama import _pack, _packed_linear

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,12,16,32,64,256")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [torch.randn(*s) * 0.02 for _ in range(LAYERS) for s in shapes]
    weights.append(torch.randn(VOCAB, HIDDEN) * 0.02)
    packed = [_pack(w) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times: dict[str, list[float]] = {"plain": [], "packed": []}
        with torch.inference_mode():
            for _ in range(a.repeats + 1):  # the first round warms up
                t = time.perf_counter()
                for w in weights:
                    F.linear(xs[w.shape[1]], w)
                times["plain"].append(time.perf_counter() - t)
                t = time.perf_counter()
                for w, pw in zip(weights, packed, strict=True):
                    _packed_linear(xs[w.shape[1]], pw, None)
                times["packed"].append(time.perf_counter() - t)
        plain, fast = (statistics.median(v[1:]) for v in times.values())
        print(
            json.dumps(
                {
                    "rows": m,
                    "plain_ms": round(plain * 1e3, 1),
                    "packed_ms": round(fast * 1e3, 1),
                    "plain_GBps": round(nbytes / plain / 1e9, 2),
                    "packed_GBps": round(nbytes / fast / 1e9, 2),
                    "speedup": round(plain / fast, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
