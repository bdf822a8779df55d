"""``ferryman bench serve``: an async load generator against a running OpenAI-compatible server.

Requests arrive as a Poisson process at ``--rate`` per second (``inf``: all at once). Each streams
``/v1/completions`` with random token-id prompts (lengths from ``--input-len``) or prompts from a
JSON dataset (a list of strings or of ``{"prompt", "max_tokens"}``). Per request it measures TTFT
(first streamed chunk), ITL (gaps between chunks), TPOT ((end - first chunk) / (tokens - 1)) and
end-to-end latency; tokens come from the stream's ``usage``. Preemptions are the difference of
the server's ``ferryman_preemptions_total`` before and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def _span(flag: str, s: str, least: int = 1) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) with ``least <= LO <= HI``; ``ValueError`` naming ``flag`` otherwise."""
    lo, _, hi = s.partition(":")
    try:
        span = int(lo), int(hi or lo)
    except ValueError:
        span = (least - 1, 0)
    if not least <= span[0] <= span[1]:
        raise ValueError(f"{flag} {s!r}: want LO:HI with {least} <= LO <= HI")
    return span


def check(a: argparse.Namespace) -> None:
    """``ValueError`` for flags no run can use, before any request is sent."""
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    if not a.rate > 0:  # NaN too
        raise ValueError(f"--rate must be > 0 requests per second (or inf), got {a.rate}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    if not a.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {a.timeout}")
    _span("--output-len", a.output_len)
    if not a.dataset:
        _span("--input-len", a.input_len)
        lo, hi = _span("--token-range", a.token_range, 0)
        if lo == hi:
            raise ValueError(f"--token-range {a.token_range!r}: token ids are drawn from LO to HI - 1")


def workload(a: argparse.Namespace) -> list[tuple[Any, int]]:
    rng = random.Random(a.seed)
    olo, ohi = _span("--output-len", a.output_len)
    if a.dataset:
        with open(a.dataset, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{a.dataset}: expected a non-empty JSON list of prompts")
        out = []
        for i in range(a.num_prompts):
            r = rows[i % len(rows)]
            if isinstance(r, str):
                out.append((r, rng.randint(olo, ohi)))
            elif isinstance(r, dict) and isinstance(r.get("prompt"), str | list):
                mt = r.get("max_tokens")
                if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
                    raise ValueError(f"{a.dataset}: row {i % len(rows)}: max_tokens must be an integer >= 1")
                out.append((r["prompt"], mt or rng.randint(olo, ohi)))
            else:  # a KeyError / TypeError traceback before
                each = 'each is a prompt string or {"prompt": ...}'
                raise ValueError(f"{a.dataset}: row {i % len(rows)} is {r!r:.60}; {each}")
        return out
    (tlo, thi), (ilo, ihi) = _span("--token-range", a.token_range, 0), _span("--input-len", a.input_len)
    return [
        ([rng.randrange(tlo, thi) for _ in range(rng.randint(ilo, ihi))], rng.randint(olo, ohi))
        for _ in range(a.num_prompts)
    ]


def preemptions(metrics_text: str) -> dict[str, float]:
    """``ferryman_preemptions_total`` by mode, from a /metrics page."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("ferryman_preemptions_total{") and 'mode="' in line:
            labels, _, value = line.rpartition(" ")
            mode = labels.split('mode="', 1)[1].split('"', 1)[0]
            out[mode] = out.get(mode, 0.0) + float(value)
    return out


async def _one(client: Any, url: str, body: dict[str, Any]) -> Result:
    r = Result()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for line in _lines(resp):
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    r.error = str(err.get("message", "error") if isinstance(err, dict) else err)
                    return r
                now = time.perf_counter()
                if chunk.get("choices"):
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    r.output_tokens = chunk["usage"]["completion_tokens"]
        r.e2e = time.perf_counter() - start
        r.ok = True
    except Exception as e:  # a failed request is counted, not fatal to the benchmark
        r.error = repr(e)
    return r


def _first_model(resp: Any, base_url: str) -> str:
    """The first model id a /v1/models answer names, or a one-line error."""
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        hint = " (give the server's root, without /v1)" if base_url.rstrip("/").endswith("/v1") else ""
        raise ConnectionError(
            f"{base_url}/v1/models answered HTTP {resp.status_code} without a model{hint}; or pass --model"
        ) from None


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _summary(name: str, xs: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in ms; None (no figure) when nothing was measured."""
    ms = [x * 1000 for x in xs]
    return {
        f"{name}_mean_ms": round(sum(ms) / len(ms), 2) if ms else None,
        **{f"{name}_p{q}_ms": round(_pct(ms, q), 2) if ms else None for q in (50, 90, 99)},
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import httpx

    check(a)
    work = workload(a)
    rng = random.Random(a.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=a.timeout, limits=limits) as client:
        try:
            model = a.model or _first_model(await client.get("/v1/models"), a.base_url)
            before = preemptions((await client.get("/metrics")).text)
        except httpx.TransportError as e:  # said in one line (an OSError: exit status 1)
            raise ConnectionError(f"no server answers at {a.base_url}: {e!r}") from None
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        bar = None
        if not a.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(work), desc="bench serve", unit="req")

        async def fire(prompt: Any, max_tokens: int) -> Result:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": a.ignore_eos,
            }
            if sem is None:
                res = await _one(client, "/v1/completions", body)
            else:
                async with sem:
                    res = await _one(client, "/v1/completions", body)
            if bar is not None:
                bar.update(1)
            return res

        started = time.perf_counter()
        tasks = []
        for i, (prompt, m) in enumerate(work):
            if i > 0 and a.rate != float("inf"):  # arrivals: none waited for after the last
                await asyncio.sleep(rng.expovariate(a.rate))
            tasks.append(asyncio.create_task(fire(prompt, m)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        if bar is not None:
            bar.close()
        try:
            after = preemptions((await client.get("/metrics")).text)
        except httpx.TransportError:  # the server went away during the run: the report stands
            after = before
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict[str, Any] = {
        "model": model,
        "num_prompts": len(work),
        "rate": a.rate if a.rate != float("inf") else None,  # JSON has no Infinity: null, all at once
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        **_summary("ttft", [r.ttft for r in ok]),
        **_summary("tpot", tpot),
        **_summary("itl", [x for r in ok for x in r.itl]),
        **_summary("e2e", [r.e2e for r in ok]),
        "preemptions": {
            k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in sorted(set(after) | set(before))
        },
    }
    return report


async def _lines(resp: Any) -> AsyncIterator[str]:
    """A response's lines split on "\\n" only (``aiter_lines`` also splits on U+0085, U+2028 and
    U+2029, which a JSON string may hold raw)."""
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf
