"""Data-parallel replicas on Ray Serve, started for real: ``python -m ferryman serve
--data-parallel-size 2 --ray`` on a tiny random Llama with a byte-level tokenizer (a local Ray
cluster, two replicas, each its own engine), driven through the official ``openai`` client:
completion and chat against the offline engine's greedy text, a stream whose deltas concatenate
to it, both replicas used under a burst (routing by load), prefix-aware routing (a shared prefix keeps
its replica, a new one goes to the other), a client that hangs up mid-stream (its replica aborts
the request while the others answer), and SIGTERM stopping Serve and Ray with status 0; all of
it under both ``--routing load`` and ``--routing prefix`` (the ingress relaying to replicas).

One server per routing serves the whole file (starting Ray and two replicas is most of its time). Each
replica names itself in the ``x-ferryman-replica`` response header, so a replica's own /metrics
are found by asking until it answers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_models import build

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None,
    reason="ray[serve] is not installed (pip install 'ray[serve]'); ferryman serve --ray needs it",
)

REPLICA_HEADER = "x-ferryman-replica"
ENGINE_FLAGS = ["--no-calibrate", "--num-device-blocks", "256", "--num-host-blocks", "0"]


class RayServer:
    """``ferryman serve --ray`` in a subprocess; up once it says it is serving (after Serve has
    deployed every replica)."""

    def __init__(
        self, model: Path, replicas: int, log: Path, routing: str, until_health: bool = False
    ) -> None:
        """``until_health``: up once ``/health`` answers, which Serve's proxy may before the
        command has seen its deployment through."""
        self.routing = routing
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ferryman", "serve", "--model", str(model), "--port", str(self.port)]
        cmd += [*ENGINE_FLAGS, "--data-parallel-size", str(replicas), "--ray", "--routing", routing]
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 (closed in stop())
        # RAY_ADDRESS unset: the command starts its own local cluster and stops it on exit
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while not (self._healthy() if until_health else "ferryman: serving" in log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ferryman serve --ray did not come up:\n{log.read_text()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode

    def replica_metrics(
        self, done: Callable[[dict[str, dict[str, float]]], bool]
    ) -> dict[str, dict[str, float]]:
        """Each replica's /metrics (each metric's samples summed over labels, and the requests
        finished by abort as ``abort``), asking until ``done`` holds for what was seen (bounded)."""
        seen: dict[str, dict[str, float]] = {}
        for _ in range(400):
            r = httpx.get(self.url + "/metrics")
            assert r.status_code == 200, r.text
            values: dict[str, float] = {}
            for line in r.text.splitlines():
                if line.startswith("ferryman_"):
                    name, value = line.rsplit(" ", 1)
                    key = name.partition("{")[0]
                    if key == "ferryman_requests_finished_total" and 'reason="abort"' in name:
                        values["abort"] = float(value)
                    values[key] = values.get(key, 0.0) + float(value)
            seen[r.headers[REPLICA_HEADER]] = values
            if done(seen):
                return seen
            time.sleep(0.05)
        raise AssertionError(f"replica metrics never settled: {seen}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("ray"), tokenizer=True)


@pytest.fixture(scope="module", params=["load", "prefix"])
def server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RayServer]:
    """One server per routing: every test runs against each (pytest groups them by server)."""
    s = RayServer(model_dir, 2, tmp_path_factory.mktemp("logs") / "ray_serve.log", request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Engine:
    return Engine(str(model_dir), num_device_blocks=256, num_host_blocks=0, calibrate=False)


def greedy(offline: Engine, prompt: str, n: int) -> str:
    return (
        offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        .outputs[0]
        .text
    )


EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model(server: RayServer) -> str:
    return str(httpx.get(server.url + "/v1/models").json()["data"][0]["id"])


def test_sigterm_as_soon_as_health_answers_stops_serve_and_ray_with_status_0(
    model_dir: Path, tmp_path: Path
) -> None:
    """The handlers came after serve.run returned, while /health already answered: a SIGTERM in
    between fell to Ray's handler, which aborted the command (-6) and left Ray's agents running.
    First in the file: no other server (nor its Ray cluster) runs beside it."""
    s = RayServer(model_dir, 1, tmp_path / "log", "load", until_health=True)
    assert s.stop() == 0, s.log.read_text()
    assert "SIGTERM received" not in s.log.read_text()


# serve.run waiting for good (a replica the cluster has no room for): Serve stands in here, as the
# wait is the point; the signal handling around it is ferryman's own
NEVER_DEPLOYS = """
import os, signal, sys, threading, time
import ferryman.server.ray_serve as rs
from unittest import mock
sys.modules["ray"] = mock.MagicMock()
rs.build_application = lambda *a, **k: None
rs.serve = mock.MagicMock()
rs.serve.run = lambda *a, **k: time.sleep(3600)
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIG%s)).start()
print("rc", rs.serve_replicas(mock.MagicMock(), num_replicas=1), flush=True)
"""


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_while_deploying_stops_the_command(sig: str) -> None:
    """The handlers only set a flag that nothing read until serve.run returned: a deployment that
    never completes could then only be killed (-9), skipping Serve's and Ray's shutdown."""
    out = subprocess.run(
        [sys.executable, "-c", NEVER_DEPLOYS % sig], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "rc 0", out.stdout + out.stderr
    assert "stopped while deploying" in out.stderr


def test_completion_and_chat_match_the_offline_engine(server: RayServer, offline: Engine) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id  # the listing, through the client
    c = client.completions.create(model=model, prompt="Once", max_tokens=10, temperature=0, extra_body=EXTRA)
    assert c.choices[0].text == greedy(offline, "Once", 10)
    assert c.usage is not None and c.usage.completion_tokens == 10
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, temperature=0, extra_body=EXTRA
    )
    want = offline.chat(msgs, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    with pytest.raises(openai.BadRequestError):  # a replica's 400, with OpenAI's error body
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)


def test_streamed_deltas_concatenate_to_the_greedy_text(
    server: RayServer, offline: Engine, model: str
) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    stream = client.completions.create(
        model=model, prompt="Hello there", max_tokens=24, temperature=0, stream=True, extra_body=EXTRA
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == greedy(offline, "Hello there", 24)


def test_concurrent_requests_use_both_replicas(server: RayServer, offline: Engine, model: str) -> None:
    """Routing by load: bursts of streams spread over both replicas."""
    import openai

    if server.routing != "load":
        pytest.skip("prefix routing keeps these shared-prefix prompts together while loads allow")

    prompts = [f"Story {i}:" for i in range(8)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        async with client.completions.with_streaming_response.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body=EXTRA
        ) as resp:
            text = [ch.choices[0].text async for ch in await resp.parse() if ch.choices]
            return resp.headers[REPLICA_HEADER], "".join(text)

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    # Serve's router picks the less loaded of two replicas by queue lengths it samples, which a
    # loaded machine can leave stale for a whole burst (seen once in CI): up to three bursts
    used: set[str] = set()
    for _ in range(3):
        got = asyncio.run(run())
        assert [text for _, text in got] == [greedy(offline, p, 16) for p in prompts]
        used |= {replica for replica, _ in got}
        if len(used) == 2:
            break
    assert used == set(server.replica_metrics(lambda s: len(s) == 2))


def test_a_shared_prefix_keeps_its_replica_and_a_new_one_goes_to_the_other(
    server: RayServer, offline: Engine, model: str
) -> None:
    """Serve's prefix-aware router, reading the prompt the ingress hands on: requests one after
    another (loads equal) whose prompts share a long prefix land on the replica that served the
    first; a prompt sharing nothing with what either has seen goes to the one that has seen less
    text, so the second group lands on the other replica. Each answer is the offline engine's."""
    import openai

    if server.routing != "prefix":
        pytest.skip("routing by load ignores the prompt")

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

    def ask(prompt: str) -> tuple[str, str]:
        r = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=EXTRA
        )
        return r.headers[REPLICA_HEADER], r.parse().choices[0].text

    first = "The quick brown fox jumps over the lazy dog while the old cat watches it. "
    second = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod. "
    groups = [[f"{prefix}Part {i}" for i in range(3)] for prefix in (first, second)]
    got = [[ask(p) for p in g] for g in groups]
    replicas = [{r for r, _ in g} for g in got]
    assert all(len(r) == 1 for r in replicas), replicas
    assert replicas[0] != replicas[1]
    assert replicas[0] | replicas[1] == set(server.replica_metrics(lambda s: len(s) == 2))
    for g, answers in zip(groups, got, strict=True):
        assert [t for _, t in answers] == [greedy(offline, p, 8) for p in g]


def test_disconnect_mid_stream_aborts_on_its_replica_while_others_answer(
    server: RayServer, offline: Engine, model: str
) -> None:
    import openai

    before = server.replica_metrics(lambda s: len(s) == 2)

    async def hang_up(client: openai.AsyncOpenAI) -> str:
        async with client.completions.with_streaming_response.create(
            model=model, prompt="Long", max_tokens=200, temperature=0, stream=True, extra_body=EXTRA
        ) as resp:
            async for _ in await resp.parse():
                break  # leaving the block closes the connection after the first chunk
            return resp.headers[REPLICA_HEADER]

    async def answer(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        r = await client.completions.with_raw_response.create(
            model=model, prompt=f"Other {i}", max_tokens=12, temperature=0, extra_body=EXTRA
        )
        return r.headers[REPLICA_HEADER], r.parse().choices[0].text

    async def run() -> tuple[str, list[tuple[str, str]]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            replica, *others = await asyncio.gather(hang_up(client), *(answer(client, i) for i in range(4)))
            return replica, others

    replica, others = asyncio.run(run())
    assert [text for _, text in others] == [greedy(offline, f"Other {i}", 12) for i in range(4)]
    after = server.replica_metrics(
        lambda s: replica in s and s[replica].get("abort", 0) > before[replica].get("abort", 0)
    )
    assert after[replica]["abort"] == before[replica].get("abort", 0) + 1
    # the aborted request stopped before its 200 tokens; nothing is left running
    generated = after[replica]["ferryman_generation_tokens_total"]
    generated -= before[replica]["ferryman_generation_tokens_total"]
    assert generated - 12 * sum(r == replica for r, _ in others) < 200
    settled = server.replica_metrics(
        lambda s: len(s) == 2 and all(v["ferryman_num_requests_running"] == 0 for v in s.values())
    )
    assert all(v["ferryman_num_requests_running"] == 0 for v in settled.values())


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(server: RayServer, model: str) -> None:
    """Serve cancels the handler of a client that hung up; the handler cancels the request's
    collection and waits for it before closing its stream, which aborts it (it used to close a
    stream still being read, which failed, and the request ran to its end). The client sends a
    240-token request and closes its socket 50 ms later, long before 240 decode steps end."""
    before = server.replica_metrics(lambda s: len(s) == 2)
    body = json.dumps(
        {"model": model, "prompt": "Leave", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    ).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.05)

    def total(s: dict[str, dict[str, float]], key: str) -> float:
        return sum(v.get(key, 0) for v in s.values())

    after = server.replica_metrics(lambda s: len(s) == 2 and total(s, "abort") > total(before, "abort"))
    assert total(after, "abort") == total(before, "abort") + 1
    generated = "ferryman_generation_tokens_total"
    assert total(after, generated) - total(before, generated) < 240


def test_each_answer_carries_one_request_id_and_responses_are_served(server: RayServer) -> None:
    """Serve's proxy tags answers with x-request-id itself: the replica's app added a second."""
    ask = {"input": "hi", "max_output_tokens": 2, "temperature": 0}
    r = httpx.post(server.url + "/v1/responses", json=ask, headers={"x-request-id": "mine-1"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    assert r.headers.get_list("x-request-id") == ["mine-1"]
    assert len(httpx.get(server.url + "/health").headers.get_list("x-request-id")) == 1


def test_sigterm_stops_serve_and_ray_with_status_0(server: RayServer) -> None:
    """A request in flight finishes first: serve.shutdown alone killed Serve's proxy, cutting it."""
    from test_server import sse

    ends: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.set()
            ends.extend(
                c["finish_reason"]
                for e in sse(iter([first, *lines]))
                for c in e["choices"]
                if c["finish_reason"]
            )

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(timeout=60)
    assert server.stop() == 0
    t.join(timeout=60)
    assert ends == ["length"]
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
