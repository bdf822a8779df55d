"""What a huge prompt costs the requests beside it: while one stream decodes 200 tokens, POST a
prompt of N words (refused for its length once tokenized) and time ``GET /health`` sent just
after it, and the stream's gaps between chunks.

    ferryman serve --model smollm2 --port 8021 &
    python benchmarks/long_prompt.py http://127.0.0.1:8021 --words 2000000
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def run(url: str, words: int) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        gaps: list[float] = []

        async def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            last = None
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        async def big() -> tuple[int, float]:
            await asyncio.sleep(2.0)  # the stream is decoding by then
            t = time.perf_counter()
            r = await c.post("/v1/completions", json={"prompt": "word " * words, "max_tokens": 4})
            return r.status_code, time.perf_counter() - t

        async def health() -> float:
            await asyncio.sleep(2.3)
            t = time.perf_counter()
            await c.get("/health")
            return time.perf_counter() - t

        _, (status, big_s), health_s = await asyncio.gather(stream(), big(), health())
    gaps.sort()
    said = f"long prompt: {status} after {big_s:.2f} s; /health {health_s * 1e3:.0f} ms;"
    if not gaps:  # the server refused the stream (a context under ~216 tokens?) or sent one chunk
        return f"{said} the stream sent fewer than two chunks"
    return (
        f"{said} stream gaps "
        f"median {gaps[len(gaps) // 2] * 1e3:.0f} ms, max {gaps[-1] * 1e3:.0f} ms ({len(gaps)} chunks)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--words", type=int, default=2_000_000)
    a = p.parse_args()
    try:
        print(asyncio.run(run(a.url, a.words)))
    except httpx.TransportError as e:
        p.exit(1, f"long_prompt.py: no server answers at {a.url}: {e!r}\n")


if __name__ == "__main__":
    main()
