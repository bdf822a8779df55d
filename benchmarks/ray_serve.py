"""Data-parallel replicas on Ray Serve under load: starts a local Ray cluster, runs
``build_application`` (``ferryman/server/ray_serve.py``) with ``--replicas`` engines, and drives
``--streams`` concurrent streamed completions through the ``openai`` client (``--rounds`` of
them, all greedy, ``--max-tokens`` each, no EOS). Prints one JSON line: errors, requests, output
tokens per second over the load's wall time, time to first token, and how many requests each
replica served (from the ``x-ferryman-replica`` header).

    python benchmarks/ray_serve.py                    # the tests' tiny Llama, 2 replicas, 32 streams
    python benchmarks/ray_serve.py --replicas 1       # the same load on one engine under Serve
    python benchmarks/ray_serve.py --routing prefix   # Serve's prefix-aware router (one more hop)
    python benchmarks/ray_serve.py --model PATH --num-cpus 8

Needs ray[serve]. Each replica takes one CPU of the local cluster (``--num-cpus``, default: all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tiny import tiny_model

from ferryman.engine_args import EngineArgs

HEADER = "x-ferryman-replica"


async def drive(url: str, model: str, streams: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    import openai

    replicas: Counter[str] = Counter()
    errors: list[str] = []
    ttft: list[float] = []
    tokens = 0

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        try:
            async with client.completions.with_streaming_response.create(
                model=model,
                prompt=f"Request {i}: tell me about ferries.",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ) as resp:
                replicas[resp.headers[HEADER]] += 1
                first = True
                async for chunk in await resp.parse():
                    if first and chunk.choices:
                        ttft.append(time.perf_counter() - t0)
                        first = False
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
        except Exception as e:
            errors.append(repr(e))

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        started = time.perf_counter()
        for r in range(rounds):
            await asyncio.gather(*(one(client, r * streams + i) for i in range(streams)))
        wall = time.perf_counter() - started
    ttft.sort()
    return {
        "errors": len(errors),
        "first_errors": errors[:3],
        "requests": streams * rounds,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[int(0.99 * (len(ttft) - 1))], 3) if ttft else None,
        "per_replica_requests": sorted(replicas.values(), reverse=True),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (default: the tests' random Llama) or a path")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams (default: 32)")
    ap.add_argument("--rounds", type=int, default=2, help="waves of --streams requests (default: 2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-cpus", type=int, default=None, help="the local Ray cluster's CPUs")
    ap.add_argument("--routing", choices=("load", "prefix"), default="load", help="how Serve picks a replica")
    a = ap.parse_args(argv)
    import ray
    from ray import serve

    from ferryman.server.ray_serve import DEFAULT_NAME, build_application

    model = tiny_model(Path(tempfile.mkdtemp())) if a.model == "tiny" else a.model
    args = EngineArgs(model=model, device="cpu", calibrate=False, max_model_len=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        app = build_application(args, num_replicas=a.replicas, num_cpus=1, routing=a.routing)
        serve.run(app, name=DEFAULT_NAME)
        startup = time.perf_counter() - t0
        url = f"http://127.0.0.1:{port}"
        result = asyncio.run(drive(url, model, a.streams, a.rounds, a.max_tokens))
    finally:
        serve.shutdown()
        ray.shutdown()
    head = {"model": a.model, "replicas": a.replicas, "routing": a.routing, "streams": a.streams}
    head["max_tokens"] = a.max_tokens
    print(json.dumps({**head, "deploy_s": round(startup, 1), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
