"""Request and response bodies of the OpenAI-compatible API (the fields ferryman serves), as
pydantic models. Extensions beyond OpenAI's fields follow vLLM's names: ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``priority``. Unknown fields are ignored, as OpenAI clients
send some the server has no use for.

The request models are the published schema (``/openapi.json``), and they accept exactly what it
allows: types are strict as JSON's are (no ``"5"`` or ``true`` for an integer, no ``1`` for a
boolean; ``2.0`` is an integer, as JSON Schema has it), no prompt or part of one is empty, and
every integer has bounds the engine can represent (``priority`` and token ids are 32-bit in the
core; ``max_tokens``, ``seed`` and ``top_k`` stay within JSON's exact integers, +-(2**53 - 1)), so
a value the schema allows never fails deeper down. What depends on the model (token ids below its
vocabulary size, prompt plus ``max_tokens`` within ``max_model_len``) or on the server's
configuration (``n`` within ``max_num_seqs``) the engine checks, answering 400 as well."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le, MinLen
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ferryman.sampling_params import SamplingParams

log = logging.getLogger("ferryman.server")

I32_MAX = 2**31 - 1
# JSON's interoperable integers (I-JSON): a double holds each exactly, so a bound means the same to
# every client and validator (near 2**63, 9.223372036854776e18 both is and is not within int64).
JSON_INT_MAX = 2**53 - 1


def _json_integer(v: Any) -> Any:
    """JSON Schema's integers include numbers written with a zero fraction (``2.0``)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# Last in an ``Annotated``, so it runs first and the bounds before it stay in the JSON schema.
JSON_INT = BeforeValidator(_json_integer)


def _json_false(v: Any) -> Any:
    """``false`` and nothing else (a ``Literal[False]`` alone takes ``0``)."""
    if v is not False:
        raise PydanticCustomError("literal_error", "Input should be False")
    return v


def _token_id(v: int) -> int:
    if not 0 <= v <= I32_MAX:
        raise PydanticCustomError("token_id", "token id {v} out of range [0, 2**31)", {"v": v})
    return v


def _not_empty(v: Any) -> Any:
    if v == "" or v == [] or (isinstance(v, list) and any(p == "" or p == [] for p in v)):
        raise PydanticCustomError("empty_prompt", "prompt must not be empty")
    return v


def _prompt_shape(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    if all(isinstance(p, str) for p in v):
        return "texts"
    return "token_id_lists" if all(isinstance(p, list) for p in v) else "token_ids"


TokenId = Annotated[
    int,
    AfterValidator(_token_id),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": I32_MAX}),
    JSON_INT,
]
TokenIds = Annotated[list[TokenId], MinLen(1)]
Text = Annotated[str, MinLen(1)]
# One shape or another by the JSON type (so an error names the shape meant); an empty prompt or
# part is refused first, with one message.
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], MinLen(1), Tag("texts")]
    | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[TokenIds], MinLen(1), Tag("token_id_lists")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_type",
        custom_error_message="prompt must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists",
    ),
    BeforeValidator(_not_empty),
]
BiasTokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # a token id, as JSON keys are strings
# keys that are not token ids are refused, so the schema says so (pydantic's own leaves them open)
LogitBias = Annotated[
    dict[BiasTokenId, Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema(
        {
            "type": "object",
            "patternProperties": {r"^[0-9]{1,9}$": {"type": "number", "minimum": -100, "maximum": 100}},
            "additionalProperties": False,
        }
    ),
]
MaxTokens = Annotated[int, Ge(1), Le(JSON_INT_MAX), JSON_INT]
TopLogprobs = Annotated[int, Ge(0), Le(20), JSON_INT]


def _refuse(v: Any, info: ValidationInfo) -> Any:
    if v is not None:
        raise PydanticCustomError("unsupported", f"{info.field_name} is not supported by ferryman")
    return v


# An OpenAI field ferryman does not implement: the schema allows only null (or leaving it out),
# and a value is refused with a message that names the field (never silently ignored).
Unsupported = Annotated[None, BeforeValidator(_refuse)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _warn_unknown(self) -> Any:
        """Unknown fields are ignored with a logged warning (vLLM's behaviour)."""
        if self.model_extra:
            log.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    n: Annotated[int, Ge(1), Le(128), JSON_INT] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Ge(-1), Le(JSON_INT_MAX), JSON_INT] = -1
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Ge(-JSON_INT_MAX), Le(JSON_INT_MAX), JSON_INT] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    priority: Annotated[int, Ge(-I32_MAX - 1), Le(I32_MAX), JSON_INT] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=JSON_INT_MAX)] = 1.0
    # OpenAI's: token ids (as JSON object keys) to a bias added to their logits
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Ge(0), Le(JSON_INT_MAX), JSON_INT] = 0

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            priority=self.priority,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: MaxTokens | None = 16
    logprobs: TopLogprobs | None = None
    echo: Annotated[Literal[False], BeforeValidator(_json_false)] = False
    suffix: Unsupported = None
    best_of: Unsupported = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormatText(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # OpenAI fields that would change the answer and are not implemented: refused by name
    tools: Unsupported = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    response_format: ResponseFormatText | None = None
    audio: Unsupported = None
    modalities: list[Literal["text"]] | None = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    reasoning_effort: Unsupported = None
    store: Annotated[Literal[False], BeforeValidator(_json_false)] | None = None
    metadata: dict[str, str] | None = None  # descriptive only (OpenAI keeps it with `store`)
    service_tier: Literal["auto", "default"] | None = None  # one tier here

    def sampling_params(self) -> SamplingParams:
        n = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_completion_tokens or self.max_tokens, n)


class TokenizeCompletionRequest(_Body):
    """vLLM's ``/tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """vLLM's ``/tokenize`` of chat messages, through the model's template."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ------------------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ferryman"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
