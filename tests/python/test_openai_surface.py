"""What OpenAI-client code relies on beyond the bodies' fields, in process over ASGI on a tiny
Llama with the tests' byte-level tokenizer (a ChatML template): ``n > 1`` streams one choice per
chunk (clients read ``chunk.choices[0]``), ``GET /v1/models/{id}``, CORS for browser clients,
the developer role as the system message, and OpenAI fields that change nothing here
(``store``, ``reasoning_effort`` under a template that does not read it) accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tiny_models import build

import ferryman
from ferryman import Engine
from ferryman.chat_template import render
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.chat_prompt import ChatPrompt

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build("llama", tmp_path_factory.mktemp("surface"), tokenizer=True)
    return Engine(str(path), block_size=4, num_device_blocks=128, calibrate=False)


@pytest.fixture(scope="module")
def spare(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """An engine of its own for apps that generate beside ``client``'s: two engine threads must
    never step one Engine."""
    path = build("llama", tmp_path_factory.mktemp("spare"), tokenizer=True)
    return Engine(str(path), block_size=4, num_device_blocks=64, calibrate=False)


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(build_app(AsyncEngine(engine), "tiny")) as c:
        yield c


def events(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=body | {"stream": True}) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_streams_one_choice_per_chunk(client: TestClient, path: str) -> None:
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"max_tokens": 6, "n": 3, "seed": 7, "temperature": 1.0, "ignore_eos": True}
    body |= {"messages": HI} if chat else {"prompt": ["hi", "there"]}
    whole = client.post(path, json=body).json()
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    for e in events(client, path, body):
        assert len(e["choices"]) == 1, e
        c = e["choices"][0]
        piece = (c["delta"].get("content") or "") if chat else c["text"]
        texts[c["index"]] = texts.get(c["index"], "") + piece
        if c["finish_reason"] is not None:
            ends[c["index"]] = c["finish_reason"]
    want = {c["index"]: c["message"]["content"] if chat else c["text"] for c in whole["choices"]}
    assert texts == want and len(want) == (3 if chat else 6)
    assert ends == dict.fromkeys(want, "length")


def test_a_model_is_retrieved_by_its_id(client: TestClient, engine: Engine) -> None:
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with TestClient(build_app(AsyncEngine(engine), "org/tiny")) as c:  # a Hub id: slashes in the name
        assert c.get("/v1/models/org/tiny").json()["id"] == "org/tiny"
        assert c.get("/v1/models/tiny").json()["error"]["code"] == "model_not_found"


def test_browsers_may_call_from_the_allowed_origins(client: TestClient, engine: Engine) -> None:
    ask = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    preflight = ask | {"Access-Control-Request-Headers": "content-type"}
    r = client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = client.get("/v1/models", headers={"Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] == "*"
    only = build_app(AsyncEngine(engine), "tiny", allowed_origins=["http://ok.example"])
    closed = build_app(AsyncEngine(engine), "tiny", allowed_origins=[])
    with TestClient(only) as c:
        assert c.options("/v1/models", headers=ask).status_code == 400  # a disallowed origin
        ok = c.get("/v1/models", headers={"Origin": "http://ok.example"})
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
    with TestClient(closed) as c:
        assert "access-control-allow-origin" not in c.get("/v1/models", headers=ask).headers


def test_further_served_names_version_and_ping(spare: Engine) -> None:
    """vLLM's several --served-model-name (any may be asked for; answers carry the first),
    GET /version and /ping (GET and POST: what /health answers)."""
    with TestClient(build_app(AsyncEngine(spare), "tiny", aliases=["alias"])) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        r = c.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert c.get("/v1/models/alias").json()["id"] == "alias"
        assert c.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404
        assert c.get("/version").json()["version"] == ferryman.__version__
        assert c.get("/ping").json() == c.post("/ping").json() == {"status": "ok"}


def test_an_api_key_guards_the_v1_routes(spare: Engine) -> None:
    """vLLM's --api-key: /v1 needs the bearer token (401 in OpenAI's body otherwise, with CORS
    headers so a browser can read it); the other routes (/health, /tokenize, ...) stay open."""
    app = build_app(AsyncEngine(spare), "tiny", api_key="s3cret")
    body = {"prompt": "hi", "max_tokens": 2}
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=body, headers=headers | {"Origin": "http://x.example"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "invalid or missing API key"
            assert r.headers["access-control-allow-origin"] == "*" and len(r.headers["x-request-id"]) == 32
        assert c.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
        assert c.get("/health").status_code == 200
    # an empty key is no key (vLLM's): no client can send "Bearer " with nothing after it
    with TestClient(build_app(AsyncEngine(spare), "tiny", api_key="")) as c:
        assert c.get("/v1/models").status_code == 200


def test_a_content_part_that_is_not_text_is_refused_in_one_sentence(client: TestClient) -> None:
    for part in (
        {"type": "image_url", "image_url": {"url": "http://x.example/a.png"}},
        {"type": "input_audio"},
    ):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        said = "messages.0.content: Value error, only text content parts are supported, got a part of type "
        said += repr(part["type"])
        assert r.status_code == 400 and r.json()["error"]["message"] == said
    # an assistant's refusal part is its text (OpenAI's spec and vLLM's): a replayed refusal got 400
    refused = [{"type": "refusal", "refusal": "I cannot share that."}]
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": refused}]
    as_text = [turns[0], {"role": "assistant", "content": "I cannot share that."}]
    counts = []
    for messages in (turns, as_text):
        r = client.post("/tokenize", json={"messages": [*messages, {"role": "user", "content": "y"}]})
        assert r.status_code == 200, r.text
        counts.append(r.json()["tokens"])
    assert counts[0] == counts[1]


def test_the_developer_role_is_the_system_message(client: TestClient) -> None:
    def count(role: str) -> list[int]:
        msgs = [{"role": role, "content": "be brief"}, *HI]
        return list(client.post("/tokenize", json={"messages": msgs}).json()["tokens"])

    assert count("developer") == count("system")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "x"}, *HI]})
    assert r.status_code == 200

    class Tok:  # a template that knows the developer role keeps it
        chat_template = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{{ developer_note }}"

        def apply_chat_template(self, msgs: Any, tools: Any, add_generation_prompt: bool, **kw: Any) -> str:
            kw.pop("tokenize")
            return render(self.chat_template, msgs, tools, add_generation_prompt, **kw)

    body = {"messages": [{"role": "developer", "content": "x"}, *HI], "add_generation_prompt": False}
    assert ChatPrompt.model_validate(body).render(Tok()) == "developer:x|user:hi|"


def test_openai_fields_that_change_nothing_here_are_accepted(client: TestClient) -> None:
    base = {"messages": HI, "max_tokens": 3, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=base).json()
    for extra in ({"store": True}, {"reasoning_effort": "low"}, {"store": False, "metadata": {"k": "v"}}):
        r = client.post("/v1/chat/completions", json=base | extra)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    bad = client.post("/v1/chat/completions", json=base | {"reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]

    class Tok:  # gpt-oss style: the template reads reasoning_effort
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}[{{ reasoning_effort }}]"

        def apply_chat_template(self, msgs: Any, tools: Any, add_generation_prompt: bool, **kw: Any) -> str:
            kw.pop("tokenize")
            return render(self.chat_template, msgs, tools, add_generation_prompt, **kw)

    assert ChatPrompt.model_validate({"messages": HI, "reasoning_effort": "high"}).render(Tok()) == "hi[high]"


def test_a_body_that_is_not_json_is_a_415_that_says_so(client: TestClient) -> None:
    data = json.dumps({"prompt": "hi", "max_tokens": 1})
    for given in ("application/x-www-form-urlencoded", "text/plain"):
        r = client.post("/v1/completions", content=data, headers={"Content-Type": given})
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = client.post(
        "/v1/completions", content=data, headers={"Content-Type": "text/plain", "Origin": "http://a.b"}
    )
    assert r.status_code == 415 and r.headers["access-control-allow-origin"] == "*"
    ok = client.post(
        "/v1/completions", content=data, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200
    # no type at all is read as JSON (requests.post(url, data=json.dumps(...)) sends none): it was
    # a 400 about a dictionary
    assert "content-type" not in client.build_request("POST", "/v1/completions", content=data).headers
    assert client.post("/v1/completions", content=data).status_code == 200


def test_a_request_nested_too_deeply_is_a_400(client: TestClient) -> None:
    """Nested past Python's recursion limit, a response_format (the schema's copy in
    ``SamplingParams.clone``) was a plain-text 500."""
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(500):
        deep = {"type": "array", "items": deep}
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}
    r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


@pytest.mark.parametrize("key", [None, "k"])
def test_a_client_that_leaves_a_plain_request_aborts_it(tmp_path: Path, key: str | None) -> None:
    """Over a real socket (uvicorn): the middlewares must not hide the disconnect the
    non-streamed routes abort on (Starlette's BaseHTTPMiddleware did; with --api-key the key's
    check was one, and every such request ran to its end)."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    path = build("llama", tmp_path, tokenizer=True, max_position_embeddings=4096)
    eng = Engine(str(path), block_size=16, num_device_blocks=512, max_model_len=4096, calibrate=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(AsyncEngine(eng), "t", api_key=key)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/health")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                url + "/v1/completions", json=body, timeout=1.0, headers={"Authorization": f"Bearer {key}"}
            )
        deadline = time.monotonic() + 60
        while eng._core_ids and time.monotonic() < deadline:
            time.sleep(0.1)
        # aborted, not run to its 4,000 tokens
        assert eng.scheduler.stats()["num_forks_aborted"] == 1, "the request ran on after its client left"
    finally:
        server.should_exit = True
        thread.join(10)


def test_every_response_carries_a_request_id(client: TestClient) -> None:
    """``x-request-id`` (OpenAI's header; its client reads it as ``_request_id``): the client's
    own echoed, else a new one per request; on errors and streams too."""
    body = {"messages": HI, "max_tokens": 2}
    a = client.post("/v1/chat/completions", json=body).headers["x-request-id"]
    b = client.post("/v1/chat/completions", json=body).headers["x-request-id"]
    assert a != b and len(a) == 32
    mine = {"x-request-id": "trace-42"}
    assert client.post("/v1/chat/completions", json=body, headers=mine).headers["x-request-id"] == "trace-42"
    assert client.get("/v1/models", headers=mine).headers["x-request-id"] == "trace-42"
    bad = client.post("/v1/chat/completions", content=b"x", headers={"content-type": "text/plain", **mine})
    assert bad.status_code == 415 and bad.headers["x-request-id"] == "trace-42"
    odd = client.get("/v1/models", headers={"x-request-id": "a b"}).headers["x-request-id"]
    assert odd != "a b" and len(odd) == 32  # not printable without spaces: a new one
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=mine) as r:
        assert r.headers["x-request-id"] == "trace-42"
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())


def test_faults_of_the_servers_own_answer_in_openais_body_with_the_headers(spare: Engine) -> None:
    """An exception no route answers is a 500 in OpenAI's body with x-request-id and CORS headers
    (Starlette's handler for Exception answered outside every middleware: no headers, and a
    browser saw a CORS failure); a RecursionError anywhere is the request's nesting: a 400."""
    app = build_app(AsyncEngine(spare), "tiny", allowed_origins=["*"])

    def fails(kind: str) -> None:
        raise RecursionError("deep") if kind == "deep" else KeyError(kind)

    app.add_api_route("/fails/{kind}", fails)
    with TestClient(app, raise_server_exceptions=False) as c:
        headers = {"x-request-id": "r-1", "Origin": "http://x.example"}
        r = c.get("/fails/bug", headers=headers)
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal error: KeyError('bug')",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        assert r.headers["x-request-id"] == "r-1" and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/fails/deep", headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"] == "the request nests too deeply"


def test_the_openai_clients_stream_state_assembles_the_plain_answer(client: TestClient) -> None:
    """Each choice's stream opens with a role-only chunk (OpenAI's and vLLM's shape): a first chunk
    that carried content and logprobs made the openai client count its logprobs twice for every
    choice after the first (``ChatCompletionStreamState``, which ``.stream()`` helpers use)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    body = {"messages": HI, "max_tokens": 5, "n": 2, "seed": 9, "temperature": 1.0, "logprobs": True}
    body |= {"top_logprobs": 1, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=body).json()
    state = ChatCompletionStreamState()
    chunks = events(client, "/v1/chat/completions", body)
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    opening = [c["choices"][0] for c in chunks[:2]]
    said = [(o["index"], {k: v for k, v in o["delta"].items() if v}, o["logprobs"]) for o in opening]
    assert said == [(k, {"role": "assistant"}, None) for k in (0, 1)]
    final = state.current_completion_snapshot  # get_final_completion refuses a "length" finish
    for got, want in zip(final.choices, plain["choices"], strict=True):
        assert got.message.content == want["message"]["content"]
        assert got.logprobs is not None
        tokens = [t.token for t in got.logprobs.content or []]
        assert tokens == [t["token"] for t in want["logprobs"]["content"]]
