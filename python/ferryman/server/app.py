"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncEngine``.

Every error a client can cause is answered with OpenAI's error body ``{"error": {"message",
"type", "param", "code"}}``: 400 for invalid JSON, fields or requests the engine rejects (prompt
longer than ``max_model_len``, a request that can never fit), 404 for an unknown model, 503 when
the bounded waiting queue is full, the server is shutting down or the engine has stopped. Other
requests keep being served. A request the engine fails (its logits were not finite, its step
raised) is answered 500 with that body, or, once streaming, ends with an error event and
``[DONE]``. A client that disconnects has its request aborted and its KV blocks freed within a
step.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ferryman._core import __version__
from ferryman.sampling_params import SamplingParams
from ferryman.server import handling, responses
from ferryman.server import protocol as api
from ferryman.server.async_engine import (
    AsyncEngine,
    Delta,
    DrainingError,
    EngineDeadError,
    Update,
)
from ferryman.server.chat_route import ChatRoutes, add_chat_route
from ferryman.server.errors import ERRORS, ApiError, generation, install_error_handlers
from ferryman.server.responses_route import add_responses_route
from ferryman.server.tokenize_routes import add_tokenizer_routes

T = TypeVar("T")


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    allowed_origins: Sequence[str] = ("*",),
    api_key: str | None = None,
    aliases: Sequence[str] = (),
    request_ids: bool = True,
) -> FastAPI:
    """The API over ``engine``; browsers on ``allowed_origins`` may call it (CORS, vLLM's default:
    every origin, no credentials; none: no CORS headers). With ``api_key``, every ``/v1`` route
    needs ``Authorization: Bearer <api_key>`` (401 otherwise), as vLLM's ``--api-key``. Requests
    may name the model ``served_model_name`` or one of its ``aliases`` (vLLM's further served
    names); answers carry the first. ``request_ids``: every answer carries ``x-request-id``
    (off behind a proxy that adds it, as Ray Serve's)."""
    names = [served_model_name, *aliases]

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="ferryman", lifespan=lifespan)
    install_error_handlers(
        app, api_key, request_ids
    )  # inside CORS (added before it): refusals get its headers

    if allowed_origins:  # outermost (added last), so its headers are on every answer, errors included
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    tokenizer = engine.engine.tokenizer
    defaults = dict(engine.engine.generation_defaults)  # the model's generation_config.json
    max_model_len = engine.engine.max_model_len

    def token_str(t: int) -> str:
        return str(tokenizer.decode([t])) if tokenizer is not None else str(t)

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check(model: str | None) -> None:
        check_model(model)
        if engine.error is not None:
            raise ApiError(503, f"engine stopped: {engine.error!r}", "server_error")
        if engine.draining:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if engine.overloaded():
            raise ApiError(
                503, "server overloaded: the waiting queue is full, retry later", "server_overloaded"
            )

    async def submit(
        prefix: str, prompts: list[str | list[int]], params: SamplingParams, special: bool
    ) -> tuple[str, list[AsyncIterator[Update]]]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        try:  # all or none: a batch with one bad prompt runs none of them
            streams = await engine.add_all(
                [(f"{rid}-{i}", p) for i, p in enumerate(prompts)], params, arrival, special
            )
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error") from None
        except DrainingError as e:
            raise ApiError(503, str(e), "server_error", code="shutting_down") from None
        except ValueError as e:  # InvalidRequestError and bad sampling values
            # the engine names its request id, an internal one here: the client's is the response's
            said = re.sub(rf"^request '{re.escape(rid)}-\d+': ", "", str(e))
            raise ApiError(400, said, "invalid_request_error") from None
        return rid, streams

    @app.get("/health", responses={503: {"description": "Draining, or the engine stopped"}})
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route: what ``/health`` answers."""
        return await health()

    for method in ("GET", "POST"):  # one operation each (one id for both is a duplicate)
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    vocab = engine.engine.model.cfg.vocab_size
    add_tokenizer_routes(app, tokenizer, vocab, max_model_len, check_model, engine.offload)

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=n, max_model_len=max_model_len) for n in names])

    @app.get("/v1/models/{model:path}", responses=ERRORS)  # a served name may hold slashes
    async def model(model: str) -> api.ModelCard:
        """OpenAI's model retrieval: the served model's card, else 404."""
        check_model(model)
        return api.ModelCard(id=model, max_model_len=max_model_len)

    @app.get(
        "/metrics",
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}, **ERRORS},
    )
    async def metrics() -> Response:
        if engine.metrics is None:
            raise ApiError(404, "metrics are off", "invalid_request_error")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None, responses=generation(api.CompletionResponse))
    async def completions(body: api.CompletionRequest, request: Request) -> Response | api.CompletionResponse:
        check(body.model)
        params = handling.params(lambda: body.sampling_params(defaults))
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "prompt must not be empty", "invalid_request_error", "prompt")
        rid, streams = await submit("cmpl", prompts, params, body.add_special_tokens)
        n, created = params.n, int(time.time())  # one creation time for every chunk of a stream
        name = responses.token_namer(token_str, body.return_tokens_as_token_ids)

        def echo_head(i: int) -> str:
            p = prompts[i]
            return p if isinstance(p, str) else str(tokenizer.decode(p)) if tokenizer is not None else ""

        def with_prompt(
            i: int, text: str, lp: api.CompletionLogprobs | None, pdata: responses.PromptData | None
        ) -> tuple[str, api.CompletionLogprobs | None, list[dict[str, api.PromptLogprob] | None] | None, int]:
            """Choice text and logprobs of prompt i with the echoed prompt (and its logprobs) first,
            vLLM's ``prompt_logprobs`` when asked, and the text offset the echoed tokens end at.
            The engine computed one top N of the prompt for both (the larger): each gets its own."""
            plp, shift = None, 0
            if pdata is not None and body.prompt_logprobs is not None:
                toks, lps, ranks = pdata
                plp = responses.prompt_logprobs(
                    toks, responses.cut_top(toks, lps, body.prompt_logprobs), ranks, token_str
                )
            if not body.echo:
                return text, lp, plp, shift
            if lp is not None and pdata is not None:
                full = responses.echo_logprobs(
                    pdata[0], responses.cut_top(pdata[0], pdata[1], body.logprobs or 0), name
                )
                shift = sum(len(t) for t in full.tokens)  # vLLM's: offsets run on over the prompt's tokens
                lp = api.CompletionLogprobs(
                    tokens=full.tokens + lp.tokens,
                    token_logprobs=full.token_logprobs + lp.token_logprobs,
                    top_logprobs=full.top_logprobs + lp.top_logprobs,
                    text_offset=full.text_offset + [o + shift for o in lp.text_offset],
                )
            return echo_head(i) + text, lp, plp, shift

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
            # each choice's text_offset so far: its chunks' offsets run on as one response's do
            offsets: dict[int, int] = {}

            def choice(i: int, d: Delta, u: Update) -> api.CompletionChoice:
                c = i * n + d.index
                first, start = c not in offsets, offsets.get(c, 0)
                # with logprobs asked for, a chunk without tokens has empty ones (vLLM's), so an
                # echo with max_tokens 0 still carries the prompt's below
                lps = [] if d.logprobs is None and params.logprobs is not None else d.logprobs
                lp = responses.completion_logprobs(d.token_ids, lps, name, start)
                offsets[c] = start + (sum(len(t) for t in lp.tokens) if lp is not None else 0)
                text, plp = d.text, None
                if first:  # the echoed prompt goes out with the choice's first chunk
                    pdata = None
                    if u.prompt_token_ids is not None and u.prompt_logprobs is not None:
                        pdata = (u.prompt_token_ids, u.prompt_logprobs, u.prompt_logprob_ranks or [])
                    text, lp, plp, shift = with_prompt(i, text, lp, pdata)
                    offsets[c] += shift
                return api.CompletionChoice(
                    index=c,
                    text=text,
                    logprobs=lp,
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                    prompt_logprobs=plp,
                )

            def chunk(choices: list[Any], usage: api.Usage | None) -> api.CompletionResponse:
                return api.CompletionResponse(
                    id=rid, created=created, model=served_model_name, choices=choices, usage=usage
                )

            events = responses.sse_events(streams, choice, chunk, include_usage, continuous)
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect() -> api.CompletionResponse:
            acc = await responses.accumulate(streams, n)
            choices = []
            for c in range(len(prompts) * n):
                lp = responses.completion_logprobs(
                    acc.toks.get(c, []), acc.lps.get(c) if params.logprobs is not None else None, name, 0
                )
                text, lp, plp, _ = with_prompt(
                    c // n, "".join(acc.text.get(c, [])), lp, acc.prompts.get(c // n)
                )
                choices.append(
                    api.CompletionChoice(
                        index=c,
                        text=text,
                        logprobs=lp,
                        finish_reason=acc.reasons.get(c),
                        stop_reason=acc.stop_reasons.get(c),
                        prompt_logprobs=plp,
                    )
                )
            return api.CompletionResponse(
                id=rid, created=created, model=served_model_name, choices=choices, usage=acc.usage()
            )

        return await handling.run_collect(request, collect(), streams)

    chat = ChatRoutes(tokenizer, served_model_name, check, submit, token_str, defaults)
    add_chat_route(app, chat)
    add_responses_route(app, chat)

    return app
