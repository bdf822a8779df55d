"""The OpenAI-compatible server, started for real (``python -m ferryman serve``) on a free loopback
port with a tiny random Llama and a byte-level tokenizer: completions and chat, streaming and not,
through httpx and the official ``openai`` client; errors; disconnects; overload; and a load test
against a KV pool small enough that every preemption mode preempts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_models import build

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("server"), tokenizer=True)


class Server:
    def __init__(
        self, model: Path, *args: str, log: Path, env: dict[str, str] | None = None, new_session: bool = False
    ) -> None:
        """``new_session``: in a process group of its own (which a test may signal whole)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ferryman", "serve", "--model", str(model), "--port", str(self.port)]
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [*cmd, "--no-calibrate", "--log-level", "warning", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
        self.log = log
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up: {log.read_text()}")

    def metric(self, name: str, missing: float | None = None) -> float:
        """Sum of a metric's samples on /metrics (all label sets); ``missing`` if it has none yet
        (a labelled series appears on first use), else absence fails."""
        total, found = 0.0, False
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith((name + " ", name + "{")) or ("{" in name and line.startswith(name)):
                total += float(line.rpartition(" ")[2])
                found = True
        if not found and missing is not None:
            return missing
        assert found, name
        return total

    def wait_metric(self, name: str, value: float, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} stayed at {self.metric(name)}, wanted {value}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    s = Server(  # with overlap (off by default on CPU): checked against the synchronous `offline`
        model_dir,
        "--block-size",
        "4",
        "--num-device-blocks",
        "64",
        "--num-host-blocks",
        "64",
        "--async-scheduling",
        log=log,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Engine:
    return Engine(str(model_dir), block_size=4, num_device_blocks=512, num_host_blocks=0, calibrate=False)


def sse(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The JSON events of a stream; asserts it ends with [DONE]."""
    events, done = [], False
    for line in lines:
        if line.startswith("data: "):
            assert not done
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[6:]))
    assert done
    return events


GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def test_completions_plain_and_streamed_match_the_offline_engine(server: Server, offline: Engine) -> None:
    want = offline.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[
        0
    ]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello there", **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == want.outputs[0].text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 12,
        "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    req = {"prompt": "Hello there", **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=req) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse(resp.iter_lines())
    assert "".join(c["text"] for e in events for c in e["choices"]) == want.outputs[0].text
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    continuous = {**req, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=continuous) as resp:
        so_far = [e["usage"]["completion_tokens"] for e in sse(resp.iter_lines()) if e["choices"]]
    assert so_far == list(range(1, 13))  # vLLM's continuous_usage_stats: the usage so far, per chunk
    # per choice (its prompt's tokens, its own completion tokens), as vLLM: request-wide sums were
    # sent; and only beside include_usage
    two = {**continuous, "prompt": ["Hello there", "hi"], "n": 2, "max_tokens": 3, "seed": 1}
    with httpx.stream("POST", server.url + "/v1/completions", json=two) as resp:
        chunks = [e for e in sse(resp.iter_lines()) if e["choices"]]
    per_choice: dict[int, list[tuple[int, int]]] = {}
    for e in chunks:
        per_choice.setdefault(e["choices"][0]["index"], []).append(
            (e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
        )
    counts = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["count"] for p in two["prompt"]]
    assert per_choice == {c: [(counts[c // 2], k) for k in (1, 2, 3)] for c in range(4)}
    alone = {**two, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=alone) as resp:
        assert all("usage" not in e or e["usage"] is None for e in sse(resp.iter_lines()))
    # a stop string spanning tokens: the stream never sends text the final result cuts
    text = want.outputs[0].text
    stop = text[4:7]
    req = {"prompt": "Hello there", **GREEDY, "stop": [stop], "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=req) as resp:
        events = sse(resp.iter_lines())
    assert "".join(c["text"] for e in events for c in e["choices"]) == text[: text.index(stop)]
    assert events[-1]["choices"][-1]["finish_reason"] == "stop"
    # several prompts (token ids and text) in one request, n=2: choices indexed prompt * n + k
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": [[72, 105], [65, 66, 67]], "n": 2, **GREEDY}
    )
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    assert r.json()["usage"]["completion_tokens"] == 48


def test_chat_plain_and_streamed(server: Server, offline: Engine) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = offline.chat(msgs, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": msgs, **GREEDY, "logprobs": True, "top_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.outputs[0].text, "tool_calls": None}
    lp = choice["logprobs"]["content"]
    assert len(lp) == 12 and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in lp)
    # each token's own bytes: they join into the text where a character spans tokens (a byte-level
    # tokenizer: every token is one byte), while the tokens' own texts there are "�"
    tok = offline.tokenizer
    specials = {tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token}
    joined = b"".join(bytes(t["bytes"]) for t in lp if t["token"] not in specials)
    assert joined.decode("utf-8", "replace") == want.outputs[0].text
    assert all(len(t["bytes"]) == 1 for t in lp if t["token"] not in specials)
    req = {"messages": msgs, **GREEDY, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=req) as resp:
        events = sse(resp.iter_lines())
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"]["content"] or "" for e in events) == want.outputs[0].text


def test_openai_client(server: Server, offline: Engine) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    want = offline.generate(["Once"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    extra = {"ignore_eos": True}
    c = client.completions.create(model=model, prompt="Once", max_tokens=8, temperature=0, extra_body=extra)
    assert (
        c.choices[0].text == want.outputs[0].text and c.usage is not None and c.usage.completion_tokens == 8
    )
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, extra_body=extra
    )
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True, extra_body=extra
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert chat.choices[0].message.content == streamed and len(streamed) > 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)


CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    (CMPL, "{not json", 400, "not valid JSON"),
    (CMPL, "[1, 2, 3]", 400, "body"),
    (CMPL, {"max_tokens": 3}, 400, "prompt"),
    (CMPL, {"prompt": {"text": "x"}}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "empty"),
    (CMPL, {"prompt": [[]]}, 400, "empty"),
    (CMPL, {"prompt": [1, 2, 99999]}, 400, "out of range"),
    (CMPL, {"prompt": "x" * 300}, 400, "max_model_len"),
    (CMPL, {"prompt": "x", "max_tokens": 1000}, 400, "max_model_len"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "x", "temperature": 5}, 400, "temperature"),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (CMPL, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "x", "stop": 7}, 400, "stop"),
    (CMPL, {"prompt": "x", "stop_token_ids": [-1]}, 400, "out of range"),
    (CMPL, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    (CMPL, {"prompt": "x", "echo": 1}, 400, "echo"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "0 only with echo"),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        400,
        "type",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, 400, "top_logprobs"),
    # OpenAI fields not implemented are refused by name, never silently ignored
    (CMPL, {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    (CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of is not supported"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "functions": [{}]},
        400,
        "functions is not supported",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "needs tools"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (CMPL, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (CMPL, {"prompt": "x", "allowed_token_ids": [1, 10**6]}, 400, "allowed_token_ids: token id 1000000"),
    (CMPL, {"prompt": "x", "bad_words": [" "]}, 400, "bad_words must be a list of words"),
    (CMPL, {"prompt": "x", "bad_words": "x"}, 400, "bad_words"),
    # vLLM's fields not implemented are refused by name too
    (CMPL, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    (CMPL, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "best_of": 3}, 400, "best_of is not supported"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
        400,
        "prompt_logprobs is",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"},
        400,
        "chat_template is",
    ),
    # JSON can carry a lone surrogate, which is no text (json.dumps escapes it: "\\ud800")
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "a\ud800"}]}), 400, "not valid Unicode"),
    (CMPL, json.dumps({"prompt": ["ok", "\udfff"]}), 400, "nicode"),
    # ... and a message quoting one still encodes (it was a plain-text 500)
    (CMPL, json.dumps({"prompt": "x", "model": "x\ud800"}), 404, "x\\ud800"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "\udfff"}), 404, "does not"),
    ("/tokenize", json.dumps({"prompt": "\ud800"}), 400, "not valid Unicode"),
    (
        "/tokenize",
        json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}),
        400,
        "not valid Unicode",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "needs logprobs"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
        400,
        "add_generation_prompt",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: Server, path: str, body: Any, status: int, needle: str
) -> None:
    if isinstance(body, str):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_disconnects_mid_stream_abort_and_free_blocks_while_others_finish(
    server: Server, offline: Engine
) -> None:
    """16 streams; every other client hangs up after its first chunk."""
    prompts = [[65 + i, 66, 67, 68 + i] for i in range(16)]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    aborted_before = server.metric('ferryman_requests_finished_total{reason="abort"', missing=0.0)
    tokens_before = server.metric("ferryman_generation_tokens_total")

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        body = {
            "prompt": prompts[i],
            "max_tokens": 120,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        text = []
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if i % 2 == 0:
                        return None  # leaving the block closes the connection
                    text.extend(c["text"] for c in json.loads(line[6:])["choices"])
        return "".join(text)

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    got = asyncio.run(run())
    assert [g for g in got[1::2]] == [w.outputs[0].text for w in want[1::2]]
    server.wait_metric("ferryman_num_requests_running", 0)
    server.wait_metric("ferryman_num_requests_waiting", 0)
    server.wait_metric("ferryman_kv_device_blocks_free", 64)
    aborted = server.metric('ferryman_requests_finished_total{reason="abort"') - aborted_before
    generated = server.metric("ferryman_generation_tokens_total") - tokens_before
    assert 1 <= aborted <= 8
    assert generated < 16 * 120  # the hung-up requests stopped generating


def test_a_batch_with_one_bad_prompt_runs_none_of_them(server: Server) -> None:
    """All or none, as vLLM checks a batch's prompts before it submits any: the good prompt before
    a too-long one was accepted, prefilled and aborted, counted in the metrics of a 400."""
    names = ["ferryman_prompt_tokens_total", 'ferryman_requests_finished_total{reason="abort"']
    before = [server.metric(n, missing=0.0) for n in names]
    r = httpx.post(server.url + CMPL, json={"prompt": ["a short one", "x" * 300], "max_tokens": 4})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    assert not r.json()["error"]["message"].startswith("request "), r.text  # no internal id
    assert [server.metric(n, missing=0.0) for n in names] == before
    server.wait_metric("ferryman_num_requests_running", 0)
    server.wait_metric("ferryman_kv_device_blocks_free", 64)


def test_finished_sequences_are_counted_alike_whether_they_end_or_are_dropped(server: Server) -> None:
    """A request of n = 2 counts 2 in ``requests_finished`` whether its sequences reach their
    length or its client hangs up (the hang-up counted 1 for the request)."""

    def count(reason: str) -> float:
        return server.metric(f'ferryman_requests_finished_total{{reason="{reason}"', missing=0.0)

    body = {"prompt": [65, 66, 67], "max_tokens": 100, "n": 2, "ignore_eos": True, "seed": 1}
    length, abort = count("length"), count("abort")
    assert httpx.post(server.url + CMPL, json={**body, "max_tokens": 3}).status_code == 200
    assert count("length") - length == 2
    with httpx.stream("POST", server.url + CMPL, json={**body, "stream": True}) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: {"))  # then hang up
    server.wait_metric("ferryman_num_requests_running", 0)
    server.wait_metric("ferryman_kv_device_blocks_free", 64)
    assert count("abort") - abort == 2


def test_bench_serve_against_the_server(server: Server) -> None:
    from ferryman import bench_serve
    from ferryman.cli import build_parser

    a = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "12",
            "--rate",
            "50",
            "--input-len",
            "4:20",
            "--output-len",
            "4:12",
            "--token-range",
            "0:256",
            "--ignore-eos",
            "--no-progress",
        ]
    )
    report = asyncio.run(bench_serve.run(a))
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(m for _, m in bench_serve.workload(a))
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"] and report["request_throughput"] > 0

    # one request at a rate of one per 1000 s: no wait after the last arrival (the duration
    # counted a random gap after it); an unlimited rate is JSON's null, not Infinity
    def but(**kw: Any) -> Any:
        return type(a)(**{**vars(a), **kw})

    report = asyncio.run(bench_serve.run(but(num_prompts=1, rate=0.001)))
    assert report["completed"] == 1 and report["duration_s"] < 30
    everything = asyncio.run(bench_serve.run(but(rate=float("inf"))))
    assert everything["rate"] is None and json.loads(json.dumps(everything, allow_nan=False))
    with pytest.raises(ConnectionError, match="without /v1"):
        asyncio.run(bench_serve.run(but(base_url=server.url + "/v1")))


def test_overload_answers_503(model_dir: Path, tmp_path: Path) -> None:
    s = Server(
        model_dir,
        "--block-size",
        "4",
        "--num-device-blocks",
        "64",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "2",
        log=tmp_path / "server.log",
    )
    body = {"prompt": "abc", "max_tokens": 250, "temperature": 0.0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        # one runs at a time and takes far longer than 16 requests take to arrive
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))

    try:
        codes = [r.status_code for r in asyncio.run(burst())]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        s.wait_metric("ferryman_num_requests_running", 0)
        s.wait_metric("ferryman_kv_device_blocks_free", 64)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        # a client gives up on 12 prompts, 11 of them waiting: their aborts empty the engine with
        # no step after them, and the overload check must not go on counting them
        many = body | {"prompt": [[65 + i, 66, 67] for i in range(12)]}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(s.url + "/v1/completions", json=many, timeout=1.0)
        s.wait_metric("ferryman_kv_device_blocks_free", 64)
        s.wait_metric("ferryman_num_requests_waiting", 0)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


def load_prompts() -> list[list[int]]:
    return [[(7 * i + j) % 250 + 3 for j in range(4 + (i * 5) % 29)] for i in range(64)]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_load_64_streams_on_a_tiny_pool(model_dir: Path, offline: Engine, tmp_path: Path, mode: str) -> None:
    prompts = load_prompts()
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    trace = tmp_path / "trace.jsonl"
    s = Server(
        model_dir,
        "--block-size",
        "4",
        "--num-device-blocks",
        "24",
        "--num-host-blocks",
        "96",
        "--preemption-mode",
        mode,
        "--trace",
        str(trace),
        *(["--async-scheduling"] if mode != "auto" else []),  # overlap on and off, against `offline`
        log=tmp_path / "server.log",
    )

    async def one(client: httpx.AsyncClient, p: list[int]) -> tuple[str, int]:
        body = {
            "prompt": p,
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) async for line in resp.aiter_lines() if line.startswith("data: {")]
        text = "".join(c["text"] for e in events for c in e["choices"])
        return text, events[-1]["usage"]["completion_tokens"]

    async def all_of_them() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    try:
        got = asyncio.run(all_of_them())
        assert [t for t, _ in got] == [w.outputs[0].text for w in want]
        assert all(n == 16 for _, n in got)
        s.wait_metric("ferryman_num_requests_running", 0)
        s.wait_metric("ferryman_kv_device_blocks_free", 24)
        s.wait_metric("ferryman_kv_host_blocks_free", 96)
        events = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "preemption"]
        assert len(events) > 0, "the pool was meant to force preemption"
        assert s.metric("ferryman_preemptions_total") == len(events)
        for m in ("swap", "recompute"):
            n = sum(1 for e in events if e["mode"] == m)
            if n:
                assert s.metric(f'ferryman_preemptions_total{{mode="{m}"') == n
        if mode != "auto":
            assert {e["mode"] for e in events} <= {mode}
        # every block swapped out came back in or was dropped with its host copy (its request
        # ended while swapped: with overlap, a victim's last token may be in flight); the host
        # pool is empty now
        out, back, dropped = (
            s.metric("ferryman_blocks_swapped_out_total"),
            s.metric("ferryman_blocks_swapped_in_total"),
            s.metric("ferryman_swap_blocks_dropped_total"),
        )
        assert out == back + dropped, (out, back, dropped)
        s.metric("ferryman_swap_prefix_lost_total")
        s.metric("ferryman_swap_fallbacks_total")
    finally:
        s.stop()
    if mode == "swap":
        from ferryman.plot import plot_trace

        png = plot_trace(trace, tmp_path / "trace.png")
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenize_detokenize_and_tokenizer_info(server: Server, offline: Engine) -> None:
    tok = offline.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = list(tok.encode("Hello there"))
    assert (
        body["tokens"] == want
        and body["count"] == len(want)
        and body["max_model_len"] == offline.max_model_len
    )
    assert body["token_strs"] == tok.convert_ids_to_tokens(want)
    msgs = [{"role": "user", "content": "Hi!"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs})
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == list(tok.encode(text, add_special_tokens=False))
    r = httpx.post(server.url + "/detokenize", json={"tokens": want})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello there"}
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for path, bad in [
        ("/tokenize", {}),
        ("/tokenize", {"prompt": 3}),
        ("/detokenize", {"tokens": [10**6]}),
        ("/detokenize", {"tokens": [-1]}),
    ]:
        r = httpx.post(server.url + path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_echo_with_logprobs_as_lm_eval_asks(server: Server, offline: Engine) -> None:
    """lm-eval's ``local-completions`` loglikelihood request: token-id prompts, echo, logprobs 1,
    max_tokens 1 (or 0); the prompt tokens' logprobs come first, the first null."""
    prompts = [[72, 101, 108, 108, 111], [65, 66, 67, 68]]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice, p, w in zip(r.json()["choices"], prompts, want, strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == offline.tokenizer.decode(p) + w.outputs[0].text
        assert len(lp["token_logprobs"]) == len(p) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        assert w.prompt_logprobs is not None
        for pos in range(1, len(p)):
            d = w.prompt_logprobs[pos]
            assert d is not None and lp["token_logprobs"][pos] == pytest.approx(d[p[pos]], abs=1e-5)
        assert lp["text_offset"][: len(p)] == sorted(lp["text_offset"][: len(p)])
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 0, "prompt_logprobs": 2})
    choice = r.json()["choices"][0]
    assert choice["text"] == offline.tokenizer.decode(prompts[0]) and len(choice["logprobs"]["tokens"]) == 5
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"][1]) >= 2
    # vLLM's shape: {token id: {logprob, rank, decoded_token}}; the top 2 rank 1 and 2
    want2 = offline.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert want2.prompt_logprobs is not None and want2.prompt_logprob_ranks is not None
    for pos, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
        d = want2.prompt_logprobs[pos]
        assert d is not None and set(entry) == {str(t) for t in d}
        top = sorted(d, key=lambda t: -d[t])[:2]
        for t, e in entry.items():
            assert e["logprob"] == pytest.approx(d[int(t)], abs=1e-5)
            assert e["decoded_token"] == offline.tokenizer.decode([int(t)])
            want_rank = (
                want2.prompt_logprob_ranks[pos] if int(t) == prompts[0][pos] else top.index(int(t)) + 1
            )
            assert e["rank"] == want_rank, (pos, t, e)
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse(resp.iter_lines())
    texts: dict[int, str] = {}
    for e in events:  # the echoed prompt comes with each choice's first chunk
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in plain}
    # max_tokens 0, streamed: the prompt's logprobs come in its chunk, as they do unstreamed
    zero = {**body, "max_tokens": 0}
    plain0 = httpx.post(server.url + "/v1/completions", json=zero).json()["choices"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**zero, "stream": True}) as resp:
        streamed = [c for e in sse(resp.iter_lines()) for c in e["choices"]]
    for c in plain0:
        got = [s["logprobs"] for s in streamed if s["index"] == c["index"] and s["logprobs"]["tokens"]]
        assert len(got) == 1 and got[0]["tokens"] == c["logprobs"]["tokens"]
        assert got[0]["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5)


def test_echoed_logprobs_sizes_and_offsets_are_each_their_own(server: Server) -> None:
    """With echo, ``logprobs`` and ``prompt_logprobs`` each give the top N asked for (the engine
    computes one top N, the larger), and ``text_offset`` runs on over the tokens' strings from 0
    (vLLM's), also where a character is split over tokens (each then reads "\ufffd")."""
    base = {"prompt": "h\u00e9llo \u65e5\u672c", "max_tokens": 3, "temperature": 0, "echo": True}
    for top, prompt_top in ((3, 1), (1, 3)):
        # tokens named by id: two tokens reading "\ufffd" would share a key of top_logprobs
        body = {**base, "logprobs": top, "prompt_logprobs": prompt_top, "return_tokens_as_token_ids": True}
        choice = httpx.post(server.url + CMPL, json=body).json()["choices"][0]
        echoed = choice["logprobs"]["top_logprobs"]
        assert echoed[0] is None and choice["prompt_logprobs"][0] is None
        assert all(top <= len(e) <= top + 1 for e in echoed[1:]), (body, echoed)
        assert all(prompt_top <= len(e) <= prompt_top + 1 for e in choice["prompt_logprobs"][1:]), body
    body = {**base, "logprobs": 0}
    plain = httpx.post(server.url + CMPL, json=body).json()["choices"][0]["logprobs"]
    assert "\ufffd" in plain["tokens"]  # the prompt splits a character over tokens
    assert plain["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in plain["tokens"][:-1]]))
    with httpx.stream("POST", server.url + CMPL, json={**body, "stream": True}) as resp:
        chunks = [c["logprobs"] for e in sse(resp.iter_lines()) for c in e["choices"] if c["logprobs"]]
    assert [o for c in chunks for o in c["text_offset"]] == plain["text_offset"]


def test_vllm_and_openai_request_fields(server: Server, offline: Engine) -> None:
    """null means the default; stop strings with min_tokens and include_stop_str_in_output (the
    offline engine as the oracle); best_of == n; continue_final_message."""
    base = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def text(**extra: Any) -> str:
        r = httpx.post(server.url + CMPL, json={**base, **extra})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    full = text()
    assert text(n=None, top_p=None, stream=None, echo=None, seed=None, logprobs=None, min_tokens=None) == full
    assert text(best_of=1) == full
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = offline.generate("Hello", greedy)[0].outputs[0]
    assert out.text == full
    stop = next(c for c in full if c.isascii() and c.isprintable() and full.index(c) >= 1)
    at = full.index(stop)
    assert text(stop=[stop]) == full[:at]
    assert text(stop=[stop], include_stop_str_in_output=True) == full[: at + 1]
    # the first token whose text holds the stop string: with min_tokens that many, it is passed
    first = next(k for k in range(1, 13) if stop in offline.tokenizer.decode(out.token_ids[:k]))
    held = text(stop=[stop], min_tokens=first)
    sp = dataclasses.replace(greedy, stop=[stop], min_tokens=first)
    assert held == offline.generate("Hello", sp)[0].outputs[0].text
    assert held.startswith(full[: at + 1]) and len(held) > at
    assert text(stop=[stop], min_tokens=12) == full

    # vLLM's stop_reason: the stop string or stop token id that ended the choice, else null
    def choice(**extra: Any) -> dict[str, Any]:
        return dict(httpx.post(server.url + CMPL, json={**base, **extra}).json()["choices"][0])

    tid = out.token_ids[3]
    for extra, why in (({"stop": ["\u2603", stop]}, stop), ({"stop_token_ids": [tid]}, tid), ({}, None)):
        c = choice(**extra)
        assert (c["stop_reason"], c["finish_reason"]) == (why, "length" if why is None else "stop"), extra
    assert (
        offline.generate("Hello", dataclasses.replace(greedy, stop=[stop]))[0].outputs[0].stop_reason == stop
    )
    # a streamed choice's text_offset runs on across chunks, as one response's does
    lp = {**base, "max_tokens": 6, "logprobs": 0}
    for extra in ({}, {"echo": True}):
        plain = httpx.post(server.url + CMPL, json={**lp, **extra}).json()["choices"][0]["logprobs"]
        with httpx.stream("POST", server.url + CMPL, json={**lp, **extra, "stream": True}) as resp:
            chunks = [c["logprobs"] for e in sse(resp.iter_lines()) for c in e["choices"] if c["logprobs"]]
        assert [o for c in chunks for o in c["text_offset"]] == plain["text_offset"], extra
    # the last message left open: the prompt ends with its text, not with the end of its turn
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    usage: dict[bool, int] = {}
    for cont in (False, True):
        body = {"messages": msgs, "max_tokens": 2, "add_generation_prompt": False}
        body["continue_final_message"] = cont
        r = httpx.post(server.url + CHAT, json=body)
        assert r.status_code == 200, r.text
        usage[cont] = r.json()["usage"]["prompt_tokens"]
    assert usage[True] < usage[False]
    # /tokenize of messages counts what the chat endpoint sends, continue_final_message included
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    assert httpx.post(server.url + "/tokenize", json=body).json()["count"] == usage[True]
    # vLLM's truncate_prompt_tokens keeps the prompt's last k tokens; return_tokens_as_token_ids
    ids = offline.tokenizer.encode("Hello there, how are you", add_special_tokens=False)
    r = httpx.post(server.url + CMPL, json={**base, "prompt": ids, "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == text(prompt=ids[-3:])
    lp = {**base, "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    r = httpx.post(server.url + CMPL, json=lp).json()["choices"][0]["logprobs"]
    assert r["tokens"] == [f"token_id:{t}" for t in out.token_ids[:3]]
    assert all(k.startswith("token_id:") for d in r["top_logprobs"] for k in d)
    # the server's own request id is not in a refusal's message
    r = httpx.post(server.url + CMPL, json={"prompt": [1, 2, 10**6]})
    assert r.status_code == 400 and "cmpl-" not in r.json()["error"]["message"], r.text


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_its_arguments() -> None:
    from ferryman.chat_template import render
    from ferryman.server.chat_prompt import ChatPrompt

    class Tok:  # a tokenizer's chat-template side: a template text, rendered by ferryman's jinja2
        chat_template = "{% if think %}<think>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"

        def apply_chat_template(
            self, msgs: Any, tools: Any, add_generation_prompt: bool, tokenize: bool, **kw: Any
        ) -> str:
            return render(self.chat_template, msgs, tools, add_generation_prompt, **kw)

    msgs = [{"role": "user", "content": "hi"}]
    assert ChatPrompt.model_validate({"messages": msgs}).render(Tok()) == "hi"
    body = {"messages": msgs, "chat_template_kwargs": {"think": True, "messages": [], "tokenize": True}}
    assert ChatPrompt.model_validate(body).render(Tok()) == "<think>hi"
