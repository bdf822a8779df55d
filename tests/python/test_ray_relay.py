"""The relay of ``--routing prefix`` without Ray (``server/ray_relay.py``): the text Serve's
prefix-aware router matches, and HTTP carried through ``run_asgi`` into a real FastAPI app: its
messages as the app sends them, a route prefix the app strips, and a client that leaves
cancelling the app's handler. Through Ray Serve itself: ``test_ray_serve.py``."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ferryman.server.ray_relay import Forwarded, relay_app, routing_text


def test_the_routing_text_of_each_kind_of_body() -> None:
    assert routing_text(json.dumps({"prompt": "Once upon"}).encode()) == "Once upon"
    assert routing_text(json.dumps({"prompt": [5, 17, 3]}).encode()) == "5,17,3,"
    assert routing_text(json.dumps({"prompt": [[5, 17], [9]]}).encode()) == "5,17,"
    assert routing_text(json.dumps({"prompt": ["first", "second"]}).encode()) == "first"
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief. "},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        ]
    }
    assert routing_text(json.dumps(chat).encode()) == "Be brief. Hi"
    response = {
        "instructions": "Be brief. ",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": " sunny"},
        ],
    }
    assert routing_text(json.dumps(response).encode()) == "Be brief. Hi sunny"
    assert routing_text(json.dumps({"input": "Hi"}).encode()) == "Hi"
    for body in (b"not json", b"[1, 2]", b"{}", b"[" * 100_000 + b"]" * 100_000):
        assert routing_text(body) == ""


def forwarded(path: str, body: bytes = b"", root_path: str = "") -> Forwarded:
    return Forwarded("POST", path, root_path, b"", [(b"content-type", b"application/json")], body, "")


def app_with_a_stream(cancelled: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, str]:
        return {"got": (await request.body()).decode()}

    @app.post("/v1/forever")
    async def forever() -> StreamingResponse:
        async def chunks():  # type: ignore[no-untyped-def]
            try:
                yield b"data: first\n\n"
                await asyncio.sleep(3600)
                yield b"data: never\n\n"
            except asyncio.CancelledError:
                cancelled.set()
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


class ReplicaStream:
    """What a Serve response generator is to the ingress: the replica's messages, cancellable."""

    def __init__(self, app: FastAPI, req: Forwarded) -> None:
        from ferryman.server.ray_relay import run_asgi

        self.messages = run_asgi(app, req)  # type: ignore[arg-type]
        self.cancelled = False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> dict[str, object]:
        return dict(await self.messages.__anext__())

    def cancel(self) -> None:
        self.cancelled = True
        self.closing = asyncio.ensure_future(self.messages.aclose())  # type: ignore[attr-defined]


def test_a_request_goes_through_whole_and_a_route_prefix_is_stripped() -> None:
    app = app_with_a_stream(asyncio.Event())
    calls: list[tuple[Forwarded, bool]] = []

    def call(req: Forwarded, by_prompt: bool) -> ReplicaStream:
        calls.append((req, by_prompt))
        return ReplicaStream(app, req)

    ingress = relay_app(call)

    async def run() -> list[dict[str, object]]:
        body = json.dumps({"prompt": "Once"}).encode()
        events = [
            {"type": "http.request", "body": body[:5], "more_body": True},
            {"type": "http.request", "body": body[5:], "more_body": False},
        ]
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return events.pop(0) if events else {"type": "http.disconnect"}

        async def send(m: dict[str, object]) -> None:
            sent.append(dict(m))

        scope = {"type": "http", "method": "POST", "path": "/llm/v1/echo", "root_path": "/llm"}
        scope["headers"] = [(b"content-type", b"application/json")]
        await ingress(scope, receive, send)  # type: ignore[arg-type]
        return sent

    sent = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:])) == {"got": '{"prompt": "Once"}'}  # type: ignore[misc, arg-type]
    ((req, by_prompt),) = calls
    assert (req.path, req.root_path, by_prompt) == ("/llm/v1/echo", "/llm", False)  # not a generation route


def test_a_client_that_leaves_cancels_the_app_and_the_replica_stream() -> None:
    cancelled = asyncio.Event()
    app = app_with_a_stream(cancelled)
    streams: list[ReplicaStream] = []

    def call(req: Forwarded, by_prompt: bool) -> ReplicaStream:
        streams.append(ReplicaStream(app, req))
        return streams[-1]

    async def run() -> list[dict[str, object]]:
        sent: list[dict[str, object]] = []
        first = asyncio.Event()
        events = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, object]:
            if events:
                return events.pop(0)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(m: dict[str, object]) -> None:
            sent.append(dict(m))
            if m.get("body"):
                first.set()

        scope = {"type": "http", "method": "POST", "path": "/v1/forever", "headers": []}
        handler = asyncio.ensure_future(relay_app(call)(scope, receive, send))  # type: ignore[arg-type]
        await asyncio.wait_for(first.wait(), 10)
        handler.cancel()  # what Serve does when the client hangs up
        await asyncio.gather(handler, return_exceptions=True)
        await asyncio.wait_for(cancelled.wait(), 10)
        return sent

    sent = asyncio.run(run())
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: first\n\n"]
    assert streams[0].cancelled


def test_a_response_is_routed_by_its_text() -> None:
    """/v1/responses was forwarded as a route that fills no KV cache: by load alone."""
    app, calls = app_with_a_stream(asyncio.Event()), []

    def call(req: Forwarded, by_prompt: bool) -> ReplicaStream:
        calls.append((req, by_prompt))
        return ReplicaStream(app, req)

    body = json.dumps({"instructions": "Be brief. ", "input": "Hi"}).encode()

    async def run() -> None:
        events = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            return events.pop(0) if events else {"type": "http.disconnect"}

        async def send(_: dict[str, object]) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/responses", "root_path": ""}
        scope["headers"] = [(b"content-type", b"application/json")]
        await relay_app(call)(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(run())
    ((req, by_prompt),) = calls
    assert by_prompt and req.prompt == "Be brief. Hi"
