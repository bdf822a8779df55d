"""HTTP through a deployment handle, so that Ray Serve's prefix-aware router can read the prompt.

Serve's router sees the arguments of a handle call, never the bytes of an HTTP request. So the
application's HTTP ingress (``relay_app``, no engine) reads each request whole and hands it to
an engine replica as a ``Forwarded``: the request itself and ``prompt``, the text the router
matches. The replica runs it through its own copy of the single-server app (``run_asgi``) and
streams the ASGI messages back, which the ingress sends on unchanged: every route, error body,
stream and header is the single server's.

- **Routing text**: of a POST to ``/v1/completions``, ``/v1/chat/completions`` or
  ``/v1/responses`` only, a completion's prompt (token ids as ``"1,2,3,"``, so a shared prefix
  of ids is a shared prefix of text), a chat's message contents in order, a response's
  instructions and input texts. A request that has none (a GET, ``/tokenize``,
  a body that is not JSON) travels as a keyword argument, which the prefix router skips: it
  routes by load alone, never into the prefix tree.
- **Disconnects**: a client that hangs up cancels the ingress's handler; it cancels the handle
  call, which cancels the replica's stream; the app sees ``http.disconnect`` and its task is
  cancelled, which aborts the engine's request as under a plain server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Message, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One HTTP request as the ingress hands it on. ``prompt`` is what Serve's prefix-aware
    router matches (its attribute name is the router's)."""

    method: str
    path: str
    root_path: str  # the route prefix the path still starts with (the app strips it)
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_text(body: bytes) -> str:
    """The text of a completion's prompt, a chat's messages or a response's input, "" when the
    body has none."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # the replica answers such a body with its 400
        return ""
    if not isinstance(data, dict):
        return ""
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]  # a batch routes by its first prompt
        if isinstance(first, str):
            return first
        ids = first if isinstance(first, list) else prompt
        return "".join(f"{t}," for t in ids if isinstance(t, int))
    if isinstance(messages, list):
        return "".join(_text(m.get("content")) for m in messages if isinstance(m, dict))
    items = data.get("input")  # a response's: its instructions, then its input's texts
    if isinstance(items, list):
        items = "".join(_text(m.get("content", m.get("output"))) for m in items if isinstance(m, dict))
    if isinstance(items, str):
        return _text(data.get("instructions")) + items
    return ""


async def run_asgi(app: Asgi, req: Forwarded) -> AsyncGenerator[Message, None]:
    """``req`` through ``app``: the response's ASGI messages, as the app sends them. Closing the
    iterator early (the client left) tells the app the client disconnected and cancels it."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": req.root_path,
        "query_string": req.query_string,
        "headers": req.headers,
        "client": None,
        "server": None,
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def serve() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(serve())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # the app's own errors surface here
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def relay_app(call: Callable[[Forwarded, bool], Any]) -> Asgi:
    """The ingress: each HTTP request read whole and handed to ``call(forwarded, by_prompt)``,
    which returns the replica's stream of ASGI messages (a Serve response generator), sent on
    as they come. Lifespan events are acknowledged (the ingress holds nothing)."""

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                await send({"type": event["type"] + ".complete"})
                if event["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return
            chunks.append(event.get("body", b""))
            if not event.get("more_body", False):
                break
        body = b"".join(chunks)
        generating = scope["method"] == "POST" and scope["path"].endswith(("/completions", "/v1/responses"))
        text = routing_text(body) if generating else ""  # only what fills a KV cache steers
        req = Forwarded(
            scope["method"], scope["path"], scope.get("root_path", ""), scope.get("query_string", b""),
            [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])], body, text,
        )  # fmt: skip
        stream = call(req, bool(text))
        finished = False
        try:
            async for message in stream:
                await send(message)
            finished = True
        finally:
            if not finished:  # the client left, or sending failed: the replica stops too
                stream.cancel()

    return app
