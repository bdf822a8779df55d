"""Runs ``ferryman bench serve`` against real ``ferryman serve`` processes over a matrix of arrival
rates, KV pool sizes and preemption modes, and prints a Markdown table (and a JSON line per run).

    python benchmarks/serve_matrix.py --model smollm2 --rates 0.5,4 --tight-blocks 48

Each cell starts a fresh server (so counters and the prefix cache start empty), waits for
``/health``, runs the same seeded workload, and stops the server. With an ample pool no request is
ever preempted, so the mode does not matter there and only one ample run per rate is made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
from args import count

from ferryman import bench_serve
from ferryman.cli import build_parser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start(model: str, port: int, blocks: int | None, mode: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ferryman", "serve", "--model", model, "--port", str(port)]
    cmd += ["--preemption-mode", mode, "--log-level", "warning"]
    if blocks is not None:
        cmd += ["--num-device-blocks", str(blocks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rates", default="0.5,4")
    p.add_argument("--tight-blocks", type=int, default=48, help="device KV blocks of the tight pool")
    p.add_argument("--modes", default="recompute,swap,auto")
    p.add_argument("--num-prompts", type=count, default=32)
    p.add_argument("--input-len", default="32:128")
    p.add_argument("--output-len", default="16:64")
    a = p.parse_args()
    try:
        rates = [float(r) for r in a.rates.split(",")]
    except ValueError:
        p.error(f"--rates: comma-separated request rates, got {a.rates!r}")
    if not all(r > 0 for r in rates):
        p.error(f"--rates must be > 0 (inf: all at once), got {a.rates!r}")
    cells: list[tuple[float, str, int | None, str]] = []
    for rate in rates:
        cells.append((rate, "ample", None, "auto"))
        cells += [(rate, "tight", a.tight_blocks, m) for m in a.modes.split(",")]
    rows = []
    for rate, pool, blocks, mode in cells:
        port = free_port()
        proc = start(a.model, port, blocks, mode)
        try:
            args = build_parser().parse_args(
                [
                    "bench",
                    "serve",
                    "--base-url",
                    f"http://127.0.0.1:{port}",
                    "--num-prompts",
                    str(a.num_prompts),
                    "--rate",
                    str(rate),
                    "--input-len",
                    a.input_len,
                    "--output-len",
                    a.output_len,
                    "--ignore-eos",
                    "--no-progress",
                ]
            )
            r = asyncio.run(bench_serve.run(args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        r.update(rate=rate, pool=pool, blocks=blocks or "default", mode=mode if pool == "tight" else "-")
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(
        "\n| rate (req/s) | pool | mode | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | req/s |"
        " preemptions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        pre = ", ".join(f"{k} {int(v)}" for k, v in r["preemptions"].items() if v) or "0"
        print(
            f"| {r['rate']} | {r['pool']} ({r['blocks']}) | {r['mode']} | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | "
            f"{r['output_token_throughput']:.1f} | {r['request_throughput']:.2f} | {pre} |"
        )


if __name__ == "__main__":
    main()
