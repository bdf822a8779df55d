"""The bodies of OpenAI's Responses API (``POST /v1/responses``): the request, which
``ResponsesRequest.to_chat`` turns into the chat request it means (``instructions`` as the system
message, input items as turns, function calls and their outputs as an assistant's ``tool_calls``
and tool turns, ``text.format`` as ``response_format``), and the response object with its output
items. Only what the chat path serves is accepted; what it cannot (a stored conversation, tools
other than functions, background runs) is refused by name. Nothing is stored: every request
carries its whole conversation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge, Le, MinLen
from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError

from ferryman.server import protocol as api
from ferryman.server.errors import ApiError
from ferryman.server.response_models import ItemStatus
from ferryman.server.schema_types import (
    I32_MAX,
    JSON_INT,
    JSON_INT_MAX,
    Body,
    MaxTokens,
    TokenId,
    TopLogprobs,
    Unsupported,
    _json_false,
)
from ferryman.server.structured import Schema

FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class TextPart(Body):
    """A message's text: ``input_text``, or ``output_text`` (an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: Annotated[str, MinLen(1)]
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, MinLen(1)]
    output: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None


def _item_kind(v: Any) -> str | None:
    """An item's ``type``; a message may leave it out (OpenAI's easy input message)."""
    if isinstance(v, dict):
        kind = v.get("type", "message")
        return "message" if kind is None else kind if isinstance(kind, str) else None
    return getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="an input item must be a message, a function_call or a function_call_output",
    ),
]


def _input_shape(v: Any) -> str | None:
    return "text" if isinstance(v, str) else "items" if isinstance(v, list) else None


# one shape or the other by the JSON type, so an error names the shape meant
Input = Annotated[
    Annotated[str, MinLen(1), Tag("text")] | Annotated[list[InputItem], MinLen(1), Tag("items")],
    Discriminator(
        _input_shape,
        custom_error_type="input_type",
        custom_error_message="input must be a string or a list of input items",
    ),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class FormatText(Body):
    type: Literal["text"]


class FormatJsonObject(Body):
    type: Literal["json_object"]


class FormatJsonSchema(Body):
    type: Literal["json_schema"]
    name: str = "response"
    schema_: Schema = Field(alias="schema")  # "schema" would shadow pydantic's own attribute
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: (
        Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None
    ) = None
    verbosity: Unsupported = None


class ReasoningConfig(Body):
    # reaches the chat template as `reasoning_effort`, as the chat endpoint's field does
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Unsupported = None
    generate_summary: Unsupported = None


class StreamOptions(Body):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever sent


LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(Body):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    # logprobs of the output text, when `include` asks for them
    top_logprobs: TopLogprobs | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # nothing is stored here, whatever it says
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    background: Annotated[Literal[False], BeforeValidator(_json_false)] | None = None
    # what would need responses stored, or tools other than functions: refused by name
    previous_response_id: Unsupported = None
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    # vLLM's sampling extensions, as on the chat endpoint
    top_k: Annotated[int, Ge(-1), Le(JSON_INT_MAX), JSON_INT] = -1
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Ge(-JSON_INT_MAX), Le(JSON_INT_MAX), JSON_INT] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: Annotated[float, Field(ge=1e-3, le=1e3)] = 1.0
    ignore_eos: bool = False
    priority: Annotated[int, Ge(-I32_MAX - 1), Le(I32_MAX), JSON_INT] = 0

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: consecutive function calls (and an assistant
        message right before them) make one assistant turn with ``tool_calls``."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for it in items:
            if isinstance(it, MessageItem):
                out.append({"role": it.role, "content": it.text()})
            elif isinstance(it, FunctionCallItem):
                call = {
                    "id": it.call_id,
                    "type": "function",
                    "function": {"name": it.name, "arguments": it.arguments},
                }
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                text = it.output if isinstance(it.output, str) else "\n".join(p.text for p in it.output)
                out.append({"role": "tool", "tool_call_id": it.call_id, "content": text})
        return out

    def to_chat(self) -> api.ChatCompletionRequest:
        """The chat request this one asks for (its sampling fields, as set, so the model's
        generation defaults fill the rest as they do for chat)."""
        own = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids"}
        own |= {"repetition_penalty", "ignore_eos", "priority", "parallel_tool_calls", "stream"}
        body: dict[str, Any] = {k: getattr(self, k) for k in own & self.model_fields_set}
        body["messages"] = self.messages()
        body["max_completion_tokens"] = self.max_output_tokens
        if self.include and LOGPROBS in self.include:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"})} for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, FormatJsonSchema):
            spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        try:
            return api.ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # the fields above have the chat body's types: not expected
            raise ApiError(400, str(e), "invalid_request_error") from None

    def echo(self) -> dict[str, Any]:
        """The request's fields a response repeats."""
        choice = self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"
        fmt = (
            self.text.format
            if self.text is not None and self.text.format is not None
            else FormatText(type="text")
        )
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "user": self.user,
        }
