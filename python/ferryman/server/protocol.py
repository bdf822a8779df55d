"""Request and response bodies of the OpenAI-compatible API (the fields ferryman serves), as
pydantic models. Extensions beyond OpenAI's fields follow vLLM's names: ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``priority``; structured outputs in both OpenAI's and vLLM's
fields (``structured.py``). Unknown fields are ignored, as OpenAI clients
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

from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import BeforeValidator, Field

from ferryman.sampling_params import SamplingParams
from ferryman.server.chat_prompt import ChatMessage as ChatMessage
from ferryman.server.chat_prompt import ChatPrompt
from ferryman.server.chat_prompt import ContentPart as ContentPart
from ferryman.server.response_models import (
    AssistantMessage as AssistantMessage,
)
from ferryman.server.response_models import (
    ChatChoice as ChatChoice,
)
from ferryman.server.response_models import (
    ChatChunkChoice as ChatChunkChoice,
)
from ferryman.server.response_models import (
    ChatCompletionChunk as ChatCompletionChunk,
)
from ferryman.server.response_models import (
    ChatCompletionResponse as ChatCompletionResponse,
)
from ferryman.server.response_models import (
    ChatLogprobs as ChatLogprobs,
)
from ferryman.server.response_models import (
    ChatTokenLogprob as ChatTokenLogprob,
)
from ferryman.server.response_models import (
    CompletionChoice as CompletionChoice,
)
from ferryman.server.response_models import (
    CompletionLogprobs as CompletionLogprobs,
)
from ferryman.server.response_models import (
    CompletionResponse as CompletionResponse,
)
from ferryman.server.response_models import (
    DeltaMessage as DeltaMessage,
)
from ferryman.server.response_models import (
    DeltaToolCall as DeltaToolCall,
)
from ferryman.server.response_models import (
    DetokenizeResponse as DetokenizeResponse,
)
from ferryman.server.response_models import (
    ErrorInfo as ErrorInfo,
)
from ferryman.server.response_models import (
    ErrorResponse as ErrorResponse,
)
from ferryman.server.response_models import (
    FunctionCall as FunctionCall,
)
from ferryman.server.response_models import (
    ModelCard as ModelCard,
)
from ferryman.server.response_models import (
    ModelList as ModelList,
)
from ferryman.server.response_models import (
    PromptLogprob as PromptLogprob,
)
from ferryman.server.response_models import (
    PromptTokensDetails as PromptTokensDetails,
)
from ferryman.server.response_models import (  # re-exported: the API's bodies in one place
    TokenizeResponse as TokenizeResponse,
)
from ferryman.server.response_models import (
    ToolCall as ToolCall,
)
from ferryman.server.response_models import (
    TopLogprob as TopLogprob,
)
from ferryman.server.response_models import (
    Usage as Usage,
)
from ferryman.server.schema_types import (
    I32_MAX,
    JSON_INT,
    JSON_INT_MAX,
    LogitBias,
    MaxTokens,
    Prompt,
    TokenId,
    TokenIds,
    TopLogprobs,
    Unsupported,
    _json_false,
    _json_true,
)
from ferryman.server.schema_types import Body as _Body
from ferryman.server.structured import StructuredFields
from ferryman.server.tools import constraint


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Sampling(StructuredFields):
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
    # bounded so a penalized logit stays finite in float32
    repetition_penalty: Annotated[float, Field(ge=1e-3, le=1e3)] = 1.0
    # OpenAI's: token ids (as JSON object keys) to a bias added to their logits
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Ge(0), Le(JSON_INT_MAX), JSON_INT] = 0
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    # vLLM's: only the prompt's last k tokens are kept (-1: the last max_model_len)
    truncate_prompt_tokens: Annotated[int, Ge(1), Le(JSON_INT_MAX), JSON_INT] | Literal[-1] | None = None
    # vLLM's: logprobs name tokens as "token_id:{id}" instead of their text
    return_tokens_as_token_ids: bool = False
    # vLLM's fields that would change the answer and are not implemented: refused by name
    allowed_token_ids: TokenIds | None = None  # vLLM's: only these ids are sampled
    bad_words: list[str] | None = None  # vLLM's: words never sampled
    prompt_embeds: Unsupported = None
    # special tokens are always left out of the text: only the default is served
    skip_special_tokens: Annotated[Literal[True], BeforeValidator(_json_true)] | None = None
    spaces_between_special_tokens: Annotated[Literal[True], BeforeValidator(_json_true)] | None = None
    use_beam_search: Annotated[Literal[False], BeforeValidator(_json_false)] | None = None

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's sampling; ``defaults`` (the model's generation_config.json, in
        ``SamplingParams`` names) fill the fields the request leaves unset, as vLLM's server does."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        unset = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        # the model's max_new_tokens caps a length the request left open (never raises one): the
        # engine caps "up to max_model_len" with it, a completion's default 16 here (vLLM's rule)
        cap = unset.pop("max_tokens", None)
        if (
            cap is not None
            and max_tokens is not None
            and not {"max_tokens", "max_completion_tokens"} & (self.model_fields_set)
        ):
            max_tokens = min(max_tokens, cap)
        return SamplingParams(
            **{
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "max_tokens": max_tokens,
                **unset,
            },
            n=self.n,
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            priority=self.priority,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            min_tokens=self.min_tokens,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


def _check_best_of(best_of: int | None, n: int) -> None:
    if best_of is not None and best_of != n:
        raise ValueError(f"best_of is not supported (only best_of == n, here {n}), got {best_of}")


class CompletionRequest(_Sampling):
    prompt: Prompt
    # 0 only with echo (the prompt's logprobs, nothing generated)
    max_tokens: Annotated[int, Ge(0), Le(JSON_INT_MAX), JSON_INT] | None = 16
    logprobs: TopLogprobs | None = None
    # vLLM's: a text prompt gets the tokenizer's special tokens (a BOS where its file adds one)
    add_special_tokens: bool = True
    # the prompt before the completion in each choice (with logprobs: the prompt tokens' too,
    # the first null, as OpenAI answers)
    echo: bool = False
    # vLLM's: the top N logprobs of every prompt position
    prompt_logprobs: TopLogprobs | None = None
    suffix: Unsupported = None
    # of best_of sequences the n most likely are returned: only best_of == n (a no-op) is served
    best_of: Annotated[int, Ge(1), Le(128), JSON_INT] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo)")
        _check_best_of(self.best_of, self.n)
        if self.echo and self.truncate_prompt_tokens is not None:  # which prompt would it echo?
            raise ValueError("echo is not supported with truncate_prompt_tokens")
        plp = self.prompt_logprobs
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):  # echo needs them
            plp = max(self.logprobs or 0, plp or 0)
        return self._params(self.max_tokens, self.logprobs, plp, defaults)


class ChatCompletionRequest(_Sampling, ChatPrompt):
    # the prompt's fields (messages, tools, tool_choice, add_generation_prompt, ...): ChatPrompt
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # OpenAI fields that would change the answer and are not implemented: refused by name
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    modalities: list[Literal["text"]] | None = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    store: bool | None = None  # OpenAI's: keep the completion on their side; nothing is stored here
    metadata: dict[str, str] | None = None  # descriptive only (OpenAI keeps it with `store`)
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    # vLLM's chat fields that are not served: refused by name (best_of == n is a no-op)
    echo: Annotated[Literal[False], BeforeValidator(_json_false)] | None = None
    prompt_logprobs: Unsupported = None
    best_of: Annotated[int, Ge(1), Le(128), JSON_INT] | None = None

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self.check_prompt()
        _check_best_of(self.best_of, self.n)
        n = (self.top_logprobs or 0) if self.logprobs else None
        p = self._params(self.max_completion_tokens or self.max_tokens, n, None, defaults)
        so = constraint(self.tools or [], self.effective_tool_choice(), self.parallel_tool_calls is not False)
        if so is not None:
            if p.structured_outputs is not None:
                raise ValueError("tool_choice and a structured output cannot both constrain a request")
            p.structured_outputs = so
        return p
