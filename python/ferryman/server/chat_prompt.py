"""Chat messages and the one prompt a conversation renders to: ``ChatPrompt`` holds every field
that shapes it (the messages, ``tools`` and ``tool_choice``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``), and both ``POST /v1/chat/completions`` and
``POST /tokenize`` of messages render through ``ChatPrompt.render``, so ``/tokenize`` counts what
the chat endpoint sends the model (its ``usage.prompt_tokens``).

Invariant: a conversation the template or these rules refuse is an ``ApiError`` 400 naming the
field, never a 500."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ferryman.chat_template import developer_as_system, open_final_message, tag_final_message
from ferryman.server import tools
from ferryman.server.errors import ApiError
from ferryman.server.schema_types import Body, Unsupported
from ferryman.server.tools import Tool, ToolCallIn, ToolChoice


class ContentPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """A part of another type (an image, audio) in one sentence, not the union's every miss;
        an assistant's ``refusal`` part is its text (OpenAI's and vLLM's)."""
        if not isinstance(v, list):
            return v
        out = []
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal":
                part = {"type": "text", "text": part.get("refusal")}
            elif isinstance(kind, str) and kind != "text":
                raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
            out.append(part)
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)  # vLLM's join
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        m |= {k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None}
        return m


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


class ChatPrompt(Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # vLLM's: the template's assistant header after the messages; or, instead, the last message
    # (an assistant's) left open, so the answer continues it
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: extra keywords the chat template sees (Qwen3's enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Unsupported = None  # vLLM's, a template sent in the request: not served
    # OpenAI's: reaches the template as the variable `reasoning_effort` (gpt-oss reads it; a
    # template that does not is unchanged by it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: the tokenizer's own BOS/EOS around the rendered text (the template has its own)
    add_special_tokens: bool = False

    def effective_tool_choice(self) -> ToolChoice:
        return tools.choose(self.tools, self.tool_choice)

    def check_prompt(self) -> None:
        """``ValueError`` for fields that contradict each other."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant's")

    def render(self, tokenizer: Any) -> str:
        """The prompt text through ``tokenizer``'s chat template."""
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not template:
            raise _invalid("this model has no chat template", "messages")
        try:
            self.check_prompt()
            choice = self.effective_tool_choice()
        except ValueError as e:
            raise _invalid(str(e), "messages") from None
        turns = [m.for_template() for m in self.messages]
        if self.continue_final_message:
            turns = tag_final_message(turns)
        turns = developer_as_system(turns, str(template))
        msgs, tool_dicts = tools.render_messages(turns, self.tools, choice, str(template))
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items() if k not in _RESERVED}
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        try:
            prompt = str(
                tokenizer.apply_chat_template(
                    msgs,
                    tools=tool_dicts,
                    add_generation_prompt=self.add_generation_prompt,
                    tokenize=False,
                    **kwargs,
                )
            )
        except Exception as e:  # the template itself rejects the conversation
            raise _invalid(f"chat template: {e}", "messages") from None
        if self.continue_final_message:
            try:
                prompt = open_final_message(prompt)
            except ValueError as e:
                raise _invalid(str(e), "messages") from None
        return prompt


# what chat_template_kwargs cannot override: apply_chat_template's own arguments (ferryman's and
# transformers'), and the names the template's environment defines
_RESERVED = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "template"}
    | {"special_tokens", "return_dict", "continue_final_message", "padding", "truncation", "max_length"}
    | {"return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask"}
    | {"raise_exception", "strftime_now", "namespace", "dict", "range", "lipsum", "cycler", "joiner"}
)
