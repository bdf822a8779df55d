"""A soak test of ``ferryman serve``: many requests against one server on a tiny model and a tight
KV pool, then checks that nothing leaked. Prints one JSON line and exits 1 if a check fails.

    python benchmarks/soak.py                        # 10,000 requests (minutes on a CPU)
    python benchmarks/soak.py --smoke                # 200 requests, a quick check
    python benchmarks/soak.py --requests 1000 --concurrency 32 --preemption-mode swap

It writes the tiny random Llama of the tests (tests/python/tiny_models.py, byte-level tokenizer,
max_model_len 256) into a temp folder, starts ``python -m ferryman serve`` on it with a small
device pool (block size 4) and a host pool, so that requests are preempted (swapped or recomputed)
all the time, and drives ``/v1/completions`` with ``--concurrency`` requests in flight: a seeded
mix of token-id and text prompts of 1 to 160 tokens (some sharing a prefix), 1 to 96 output
tokens, greedy and sampled, n = 1 or 2, streamed and not. One request in ten is cancelled: its
stream is closed after its first few chunks, which the server must turn into an abort.

Every other request must answer 200 with the usage it was asked for (``ignore_eos``), streams must
end with ``[DONE]`` and carry no error event. The run is split at ``--rss-after`` requests (1,000):
the first part runs, the engine is waited on until idle and the server's resident memory (VmRSS of
/proc/PID/status) is read; then the rest runs and it is read again. Checks:

- errors: no request failed except the intended cancellations;
- blocks: after the run the device and host KV pools are all free again and no request is left
  running, waiting or swapped (``ferryman_kv_*_blocks_free`` and the queue gauges of /metrics);
- rss: RSS after the run is within ``--rss-tolerance`` (5%) of RSS after the first part;
- preempted: the pool was tight enough that at least one request was preempted.

The JSON line also holds throughput, preemptions by mode, the server's abort count and RSS read
after every further 1,000 requests (while busy, for the trend only).

Measured on 2 CPU cores (2026-12-01): 10,000 requests in about 6.3 minutes (26 requests/s), no
errors, all blocks back, RSS 908 MiB after the first 1,000 and 915 MiB after all (+0.7%). Before
the CPU projections ran at padded row counts (``models/cpu_linear.py``) the same run grew 18.5%
(1,210 to 1,434 MiB): oneDNN built and kept a primitive for every new step shape.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
from args import count

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
PREFIX = [(11 * j) % 200 + 32 for j in range(40)]  # shared by some token prompts (prefix cache)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "seven", "ferrymen", "row"]


@dataclass
class Job:
    index: int
    body: dict[str, Any]
    cancel_after: int | None  # close the stream after this many chunks (None: read it all)


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    cancel_missed: int = 0  # meant to be cancelled but finished before the chunk count was reached
    errors: int = 0
    output_tokens: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        self.error_samples: list[str] = []
        self.status_codes: Counter[int] = Counter()

    def fail(self, job: Job, why: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"#{job.index}: {why[:300]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def build_model(root: Path) -> Path:
    """The tests' tiny Llama with a byte tokenizer (259 tokens); loaded by path so that the
    benchmark does not depend on how tests/ is installed."""
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    build = cast(Callable[..., Path], importlib.import_module("tiny_models").build)
    return build("llama", root, tokenizer=True)


def mixed(rng: random.Random, *ranges: tuple[int, int]) -> int:
    """A length from the first range 60% of the time, the second 32%, the third 8%."""
    u = rng.random()
    lo, hi = ranges[0] if u < 0.6 else ranges[1] if u < 0.92 else ranges[2]
    return rng.randint(lo, hi)


def make_jobs(n: int, seed: int, cancel_fraction: float) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        plen = mixed(rng, (1, 24), (25, 96), (97, 160))  # mostly short, some medium, a few long
        max_tokens = mixed(rng, (1, 16), (17, 64), (65, 96))
        cancel = rng.random() < cancel_fraction
        if cancel:
            max_tokens = max(max_tokens, 24)  # long enough to still be generating when cut
        max_tokens = min(max_tokens, MAX_MODEL_LEN - plen)
        prompt: str | list[int]
        kind = rng.random()
        if kind < 0.45:
            prompt = [rng.randrange(256) for _ in range(plen)]
        elif kind < 0.6 and plen > len(PREFIX):
            prompt = PREFIX + [rng.randrange(256) for _ in range(plen - len(PREFIX))]
        else:  # text: one token per byte
            text = ""
            while len(text) < plen:
                text += rng.choice(WORDS) + " "
            prompt = text[:plen]
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        if not cancel and rng.random() < 0.05:
            body["n"] = 2
        stream = cancel or rng.random() < 0.75
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        jobs.append(Job(i, body, rng.randint(1, 3) if cancel else None))
    return jobs


async def sse_lines(resp: httpx.Response) -> AsyncGenerator[str, None]:
    """The lines of an event stream, split on LF only: httpx's ``aiter_lines`` also splits on
    U+0085, U+2028 and U+2029 (``str.splitlines``), which JSON leaves unescaped in generated text."""
    buf = b""
    async for data in resp.aiter_bytes():
        *lines, buf = (buf + data).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode()
    if buf:
        yield buf.removesuffix(b"\r").decode()


async def run_one(client: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    want = job.body["max_tokens"] * job.body.get("n", 1)
    try:
        if not job.body.get("stream"):
            r = await client.post("/v1/completions", json=job.body)
            tally.status_codes[r.status_code] += 1
            if r.status_code != 200:
                return tally.fail(job, f"HTTP {r.status_code}: {r.text}")
            got = r.json()["usage"]["completion_tokens"]
            if got != want:
                return tally.fail(job, f"{got} completion tokens, wanted {want}")
            tally.completed += 1
            tally.output_tokens += got
            return None
        async with client.stream("POST", "/v1/completions", json=job.body) as resp:
            tally.status_codes[resp.status_code] += 1
            if resp.status_code != 200:
                await resp.aread()
                return tally.fail(job, f"HTTP {resp.status_code}: {resp.text}")
            chunks, usage, done = 0, None, False
            async with aclosing(sse_lines(resp)) as lines:
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        return tally.fail(job, f"error event: {line}")
                    if event.get("usage"):
                        usage = event["usage"]
                    if event.get("choices"):
                        chunks += 1
                        if job.cancel_after is not None and chunks >= job.cancel_after:
                            tally.cancelled += 1
                            tally.output_tokens += chunks
                            return None  # leaving the blocks closes the connection mid-stream
        if not done:
            return tally.fail(job, f"stream ended without [DONE] after {chunks} chunks")
        if usage is None or usage["completion_tokens"] != want:
            return tally.fail(job, f"usage {usage}, wanted {want} completion tokens")
        tally.completed += 1
        tally.cancel_missed += job.cancel_after is not None
        tally.output_tokens += want
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
        tally.fail(job, f"{type(e).__name__}: {e}")
    finally:
        tally.done += 1
    return None


class Soak:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, concurrency: int) -> None:
        self.proc, self.url, self.concurrency = proc, url, concurrency
        self.rss_trace_mib: list[tuple[int, float]] = []

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        """/metrics summed per metric and, for labelled ones, per ``name{label="value"}`` too."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            name = key.partition("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
            if "{" in key:
                for label in key.partition("{")[2].rstrip("}").split(","):
                    k = f"{name}{{{label}}}"
                    out[k] = out.get(k, 0.0) + float(value)
        return out

    def wait_idle(self, timeout: float) -> dict[str, float]:
        """Polls /metrics until nothing runs, waits or is swapped and both pools are all free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["ferryman_num_requests_running"] == 0
                and m["ferryman_num_requests_waiting"] == 0
                and m["ferryman_num_requests_swapped"] == 0
                and m["ferryman_kv_device_blocks_free"] == m["ferryman_kv_device_blocks"]
                and m["ferryman_kv_host_blocks_free"] == m["ferryman_kv_host_blocks"]
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    async def drive(self, jobs: list[Job], tally: Tally, request_timeout: float) -> None:
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)

        async def worker(client: httpx.AsyncClient) -> None:
            while not queue.empty():
                await run_one(client, queue.get_nowait(), tally)
                if tally.done % 1000 == 0:
                    self.rss_trace_mib.append((tally.done, round(self.rss_mib(), 1)))

        async with httpx.AsyncClient(base_url=self.url, timeout=request_timeout, limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(self.concurrency)))


def start_server(model: Path, a: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ferryman", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--no-calibrate", "--log-level", "warning", "--block-size", str(a.block_size)]
    cmd += ["--num-device-blocks", str(a.num_device_blocks), "--num-host-blocks", str(a.num_host_blocks)]
    cmd += ["--preemption-mode", a.preemption_mode, "--seed", str(a.seed)]
    cmd += ["--async-scheduling" if a.async_scheduling else "--no-async-scheduling"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{log.read_text()}")


def soak(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = build_model(tmp)
    log = a.server_log or tmp / "server.log"
    proc, url = start_server(model, a, log)
    try:
        s = Soak(proc, url, a.concurrency)
        jobs = make_jobs(a.requests, a.seed, a.cancel_fraction)
        first = min(a.rss_after, a.requests)
        tally = Tally()
        t0 = time.monotonic()
        asyncio.run(s.drive(jobs[:first], tally, a.request_timeout))
        s.wait_idle(a.idle_timeout)
        rss_first = s.rss_mib()
        asyncio.run(s.drive(jobs[first:], tally, a.request_timeout))
        duration = time.monotonic() - t0
        m = s.wait_idle(a.idle_timeout)
        rss_end = s.rss_mib()
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    log_lines = log.read_text(errors="replace").splitlines()
    bad_log = [ln for ln in log_lines if "Traceback" in ln or "ERROR" in ln or "Exception" in ln]
    growth = (rss_end - rss_first) / rss_first
    dev_free, dev_total = m["ferryman_kv_device_blocks_free"], m["ferryman_kv_device_blocks"]
    host_free, host_total = m["ferryman_kv_host_blocks_free"], m["ferryman_kv_host_blocks"]
    preemptions = {
        mode: int(m.get(f'ferryman_preemptions_total{{mode="{mode}"}}', 0)) for mode in ("swap", "recompute")
    }
    checks = {
        "errors": tally.errors == 0 and alive,
        "blocks": dev_free == dev_total
        and host_free == host_total
        and m["ferryman_num_requests_running"] == 0
        and m["ferryman_num_requests_waiting"] == 0
        and m["ferryman_num_requests_swapped"] == 0,
        "rss": growth <= a.rss_tolerance,
        "preempted": sum(preemptions.values()) > 0,
    }
    return {
        "requests": a.requests,
        "errors": tally.errors,
        "cancelled": tally.cancelled,
        "completed": tally.completed,
        "cancel_missed": tally.cancel_missed,
        "duration_s": round(duration, 1),
        "throughput_rps": round(tally.done / duration, 2),  # requests that ended, in any way
        "output_tokens": tally.output_tokens,
        "output_tokens_per_s": round(tally.output_tokens / duration, 1),
        "concurrency": a.concurrency,
        "rss_baseline_requests": first,
        f"rss_after_{first}_mib": round(rss_first, 1),
        "rss_after_all_mib": round(rss_end, 1),
        "rss_growth_fraction": round(growth, 4),
        "rss_trace_mib": s.rss_trace_mib,
        "device_blocks_free": int(dev_free),
        "device_blocks_total": int(dev_total),
        "host_blocks_free": int(host_free),
        "host_blocks_total": int(host_total),
        "left_running_waiting_swapped": [
            int(m[f"ferryman_num_requests_{q}"]) for q in ("running", "waiting", "swapped")
        ],
        "preemption_mode": a.preemption_mode,
        "preemptions": preemptions,
        "blocks_swapped_out": int(m.get("ferryman_blocks_swapped_out_total", 0)),
        "server_finished_by_reason": {
            k.partition('reason="')[2].rstrip('"}'): int(v)
            for k, v in m.items()
            if k.startswith('ferryman_requests_finished_total{reason="')
        },
        "http_status": dict(sorted(tally.status_codes.items())),
        "server_alive": alive,
        "server_log_lines": len(log_lines),
        "server_log_error_lines": len(bad_log),
        "error_samples": tally.error_samples + bad_log[:5],
        "checks": checks,
        "ok": all(checks.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=count, default=10_000)
    p.add_argument("--smoke", action="store_true", help="200 requests (RSS measured after 100)")
    p.add_argument("--concurrency", type=count, default=64, help="requests in flight")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="streams closed after 1-3 chunks")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-device-blocks", type=int, default=64, help="device KV blocks (tight)")
    p.add_argument("--num-host-blocks", type=int, default=128, help="host KV blocks (for swap)")
    p.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default="auto")
    p.add_argument("--async-scheduling", action="store_true", help="overlap (off by default on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-after", type=int, default=1000, help="requests before the RSS baseline")
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed RSS growth after it")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--server-log", type=Path, help="keep the server's output here (default: a temp file)")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="wait for the engine to go idle")
    a = p.parse_args()
    if a.smoke:
        a.requests, a.rss_after = min(a.requests, 200), min(a.rss_after, 100)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    with tempfile.TemporaryDirectory(prefix="ferryman-soak-") as tmp:
        report = soak(a, Path(tmp))
    print(json.dumps(report), flush=True)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
