"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a text prompt, or chat messages through the
model's template), ``POST /detokenize``, ``GET /tokenizer_info`` (lm-eval probes it). A model
without a tokenizer answers 400. Their request bodies are here, with the rest of the API's in
``protocol.py``. Tokenizing runs on the engine's tokenizer thread (``offload``), so a long
prompt does not stall the server; text that is not valid Unicode is a 400."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from ferryman.server import protocol as api
from ferryman.server.chat_prompt import ChatPrompt
from ferryman.server.errors import ERRORS, ApiError
from ferryman.server.schema_types import Body, TokenId
from ferryman.tokenizer import check_text


class TokenizeCompletionRequest(Body):
    """vLLM's ``/tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """vLLM's ``/tokenize`` of chat messages: the prompt the chat endpoint would send the model
    (with ``tools``, ``continue_final_message``, ... as it has them)."""

    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


def add_tokenizer_routes(
    app: FastAPI,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    check_model: Callable[[str | None], None],
    offload: Callable[[Callable[[], Any]], Awaitable[Any]],
) -> None:
    """``offload(fn)``: ``fn()`` on the thread the engine tokenizes prompts on."""

    def need_tokenizer(model: str | None) -> Any:
        check_model(model)
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "invalid_request_error")
        return tokenizer

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> api.TokenizeResponse:
        """vLLM's: the ids of a text prompt, or of chat messages through the model's template."""
        tok = need_tokenizer(body.model)
        if isinstance(body, TokenizeChatRequest):
            text, special = body.render(tok), body.add_special_tokens
        else:
            text, special = body.prompt, body.add_special_tokens
        try:
            check_text(text)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        ids = list(await offload(lambda: tok.encode(text, add_special_tokens=special)))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return api.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> api.DetokenizeResponse:
        tok = need_tokenizer(body.model)
        vocab = vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} out of range [0, {vocab})", "invalid_request_error", "tokens"
            )
        return api.DetokenizeResponse(prompt=str(tok.decode(body.tokens)))

    @app.get("/tokenizer_info", responses=ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: what a client needs to tokenize as the server does (lm-eval probes it)."""
        tok = need_tokenizer(None)
        name = getattr(tok, "tokenizer_class", None) or type(tok).__name__  # ChatTokenizer: its file's
        info: dict[str, Any] = {"tokenizer_class": str(name), "model_max_length": max_model_len}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
            v = getattr(tok, k, None)
            if v is not None:
                info[k] = str(v)
        return info
