"""Errors in OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: ``ApiError``, the
handlers that map FastAPI's own refusals (invalid JSON or fields: 400, never FastAPI's 422; a
body it cannot decode; an unknown path) to it, and the error answers the schema publishes."""

from __future__ import annotations

import hmac
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ferryman.server import response_models as api  # not protocol, which imports this module

# The answers the schema publishes besides 200: errors in OpenAI's body (and no FastAPI 422: a
# body the request models refuse gets 400).
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": api.ErrorResponse, "description": "Refused: 400 invalid, 404 unknown model"},
    "5XX": {"model": api.ErrorResponse, "description": "Failed, overloaded, draining or stopped"},
}


def generation(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {"model": body, "content": {"text/event-stream": {}}, "description": "The body, or its SSE stream"}
    return {200: ok, **ERRORS}


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate (JSON's ``"\ud800"`` decodes to one) written as its
    escape: a message quoting the request must still encode as UTF-8 in the answer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        message = _encodable(message)
        param = None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.body = (
            status,
            api.ErrorResponse(error=api.ErrorInfo(message=message, type=type_, param=param, code=code)),
        )


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body.model_dump(), status_code=e.status)


def _member(loc: Any) -> bool:
    """A location part naming a union member (a model behind its validators), not a field."""
    return isinstance(loc, str) and loc.startswith(("function-after[", "function-before[", "function-wrap["))


class JsonBodies:
    """ASGI middleware: a POST body sent as something else than JSON (``curl -d`` sends a form
    type unless told) is a 415 that says so, not a validation error about a dictionary (vLLM's
    rule); one sent with no type is read as JSON (``requests.post(url, data=json.dumps(...))``
    sends none; FastAPI read it so until it turned strict). Plain ASGI, not
    ``BaseHTTPMiddleware``: that one hides a client's disconnect from the handlers
    (``Request.is_disconnected``), which the non-streamed routes abort on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type")
            if given is None:
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
            elif not _is_json(given.decode("latin-1")):
                said = "the request body must be JSON, sent with Content-Type: application/json"
                response = error_response(
                    ApiError(415, f"{said} (got {given.decode('latin-1')!r})", "invalid_request_error")
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKey:
    """ASGI middleware: the ``/v1`` routes need ``Authorization: Bearer <key>`` (vLLM's rule; the
    others, health and metrics among them, stay open), else a 401 in OpenAI's body. Plain ASGI,
    as ``JsonBodies``: a client that leaves a request it waits on still aborts it."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.want):
                refused = ApiError(401, "invalid or missing API key", "invalid_request_error")
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServerFaults:
    """ASGI middleware: an exception no handler answered (a fault of the server's own) is a 500 in
    OpenAI's body, logged. Inside ``RequestIds`` and CORS, so it carries their headers: Starlette's
    own handler for ``Exception`` answers outside every middleware. Plain ASGI, as ``JsonBodies``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def watched(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if scope["type"] != "http" or started:  # too late for an answer of its own
                raise
            logging.getLogger("ferryman.server").exception("unexpected error answering %s", scope["path"])
            await error_response(ApiError(500, f"internal error: {e!r}", "server_error"))(
                scope, receive, send
            )


class RequestIds:
    """ASGI middleware: every HTTP response carries ``x-request-id`` (OpenAI's header, which its
    client reads as ``_request_id``): the client's own, when it sent one that is printable ASCII
    of at most 128 characters, else a new one. Plain ASGI, as ``JsonBodies``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        ok = 0 < len(given) <= 128 and all(0x21 <= c <= 0x7E for c in given)
        value = given if ok else uuid.uuid4().hex.encode()

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, tagged)


def install_error_handlers(app: FastAPI, api_key: str | None = None, request_ids: bool = True) -> None:
    """The error handlers and middleware (``api_key``: ``ApiKey``; None or "" is no key, as in
    vLLM: no client sends an empty bearer token; ``request_ids``: ``RequestIds``)."""
    app.add_middleware(JsonBodies)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(ServerFaults)
    if request_ids:
        app.add_middleware(RequestIds)  # around them: their 415s, 401s and 500s carry the header too

    @app.exception_handler(RecursionError)
    async def _deep(_: Request, e: RecursionError) -> JSONResponse:
        """A request nested past what the server's recursive passes over it take (a schema, a
        tool's parameters): the request's doing."""
        return error_response(ApiError(400, "the request nests too deeply", "invalid_request_error"))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        """What FastAPI answers itself (a body it cannot decode, an unknown path, a method the
        path does not serve), in OpenAI's error body too."""
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        response = error_response(ApiError(e.status_code, str(e.detail), type_))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = list(e.errors())
        if any(err.get("type") == "json_invalid" for err in errs):
            return error_response(
                ApiError(400, "the request body is not valid JSON", "invalid_request_error")
            )
        # a union's member appears in the location as pydantic names it ("function-after[...]"):
        # not a field the client wrote
        fields = [
            ".".join(str(x) for x in err.get("loc", ()) if x != "body" and not _member(x)) for err in errs
        ]
        msg = "; ".join(f"{f or 'body'}: {err.get('msg')}" for f, err in zip(fields, errs, strict=True))
        param = fields[0] if fields and fields[0] else None
        return error_response(ApiError(400, msg or "invalid request", "invalid_request_error", param))


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters (``; charset=utf-8``) aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")
