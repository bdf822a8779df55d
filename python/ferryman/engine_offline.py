"""The offline batch API of ``Engine`` (vLLM's ``LLM.generate`` / ``LLM.chat``): a mixin over
``add_request`` / ``step``, and the model's default ``SamplingParams`` they use when given none
(vLLM's ``LLM.get_default_sampling_params``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, cast

from ferryman._core import InvalidRequestError, Scheduler
from ferryman.chat_template import (
    developer_as_system,
    object_arguments,
    open_final_message,
    tag_final_message,
)
from ferryman.outputs import RequestOutput, StepResult
from ferryman.sampling_params import SamplingParams
from ferryman.tokenizer import plain_prompt

Prompt = str | Sequence[int]
# vLLM's prompt dicts: {"prompt": text} (TextPrompt) and {"prompt_token_ids": ids} (TokensPrompt)
PromptDict = dict[str, Any]


class OfflineMixin:
    if TYPE_CHECKING:
        scheduler: Scheduler
        tokenizer: Any
        generation_defaults: dict[str, Any]
        _inflight: Any
        _num_added: int
        _core_ids: dict[str, int]
        _held: list[RequestOutput]
        max_model_len: int

        def add_request(
            self,
            request_id: str,
            prompt: Prompt,
            params: SamplingParams | None = None,
            arrival_time: float | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> None: ...
        def tokenize(
            self,
            prompt: Prompt,
            ids: list[int] | None = None,
            add_special_tokens: bool = True,
            cut: bool = False,
        ) -> tuple[str | None, list[int]]: ...
        def step(self) -> StepResult: ...
        def abort_request(self, request_id: str) -> bool: ...
        def has_unfinished_requests(self) -> bool: ...

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` values over ferryman's
        defaults (temperature, top_p, top_k, min_p, repetition_penalty); its max_new_tokens caps
        the open length (``max_tokens=None``: up to ``max_model_len``), never raising it past."""
        d = dict(self.generation_defaults)
        if d.pop("max_tokens", None) is not None:
            d["max_tokens"] = None  # the engine caps it: min(its max_new_tokens, the room left)
        return SamplingParams(**d)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name for ``default_sampling_params``."""
        return self.default_sampling_params()

    def get_tokenizer(self) -> Any:
        """vLLM's: the engine's tokenizer (None for a model without one)."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: requests added whose last output was not yet handed out (one each, whatever its
        ``n``): live ones, and finished ones whose output another caller's steps hold for it."""
        return len(self._core_ids) + len({o.request_id for o in self._held if o.finished})

    def generate(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. A prompt or
        parameter set that is refused refuses the whole call: nothing of it stays queued.
        Requests added with ``add_request`` advance too; their outputs of these steps come with
        the next ``step()``'s, before its own. A text prompt gets the tokenizer's special tokens
        (a BOS where its file adds one), as in vLLM. As in vLLM's ``LLM``, a ``max_tokens`` past
        ``max_model_len`` is cut to the room the prompt leaves (finish_reason "length" there)."""
        one = isinstance(prompts, str | dict) or (len(prompts) > 0 and isinstance(prompts[0], Integral))
        plist = [plain_prompt(p) for p in ([prompts] if one else cast(Sequence[Any], prompts))]
        params = self._per_prompt(sampling_params, len(plist), "prompts")
        return self._run(plist, [None] * len(plist), params, use_tqdm)

    def _per_prompt(
        self, given: SamplingParams | Sequence[SamplingParams] | None, n: int, what: str
    ) -> list[SamplingParams]:
        """One parameter set per prompt: the given list, the one set for all, or the defaults."""
        sp = self.default_sampling_params() if given is None else given
        params = list(sp) if isinstance(sp, Sequence) else [sp] * n
        if len(params) != n:
            raise ValueError(f"{n} {what} but {len(params)} sampling parameter sets")
        bad = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            got = type(params[bad]).__name__
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {got}")
        return params

    def _run(
        self,
        plist: list[Prompt],
        token_ids: list[list[int] | None],
        params: Sequence[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """``generate()`` of prompts with their ids where given (``add_request``'s ``prompt_token_ids``)."""
        ids = [f"generate-{self._num_added + i}" for i in range(len(plist))]
        added: list[str] = []
        try:
            for rid, p, tids, sp in zip(ids, plist, token_ids, params, strict=True):
                tids = self.tokenize(p, tids, cut=sp.truncate_prompt_tokens is not None)[1]  # _fit reads them
                final_only = self._fit(dataclasses.replace(sp, output_kind="final_only"), tids)
                self.add_request(rid, p, final_only, prompt_token_ids=tids)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = _progress(len(plist)) if use_tqdm else None
        try:
            # not has_unfinished_requests(): outputs held for others must not keep this loop going
            busy = self.scheduler.has_unfinished_requests
            while len(final) < len(ids) and (busy() or self._inflight is not None):
                for ro in self.step().outputs:
                    if ro.request_id not in wanted:
                        self._held.append(ro)  # another caller's: handed out by the next step()
                    elif ro.finished:
                        final[ro.request_id] = ro
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # interrupted (Ctrl-C) or failed: none of its requests stays behind
            for rid in ids:
                if rid not in final:
                    self.abort_request(rid)
            self._held = [ro for ro in self._held if ro.request_id not in wanted]
            raise
        finally:
            if bar is not None:
                bar.close()
        while self._inflight is not None and not self.scheduler.has_unfinished_requests():
            # a step planned before the last stop: only dropped samples are left, and the outputs
            # held for add_request's callers, which step() hands back: held again, not lost
            self._held = self.step().outputs
        return [final[rid] for rid in ids]

    def _fit(self, sp: SamplingParams, ids: Sequence[int]) -> SamplingParams:
        """``sp`` with ``max_tokens`` cut to the room the (truncated) prompt leaves under
        ``max_model_len``, when it leaves some (the engine refuses a prompt that leaves none)."""
        room = self.max_model_len - len(sp.truncated(list(ids), self.max_model_len))
        if sp.max_tokens is None or sp.max_tokens <= room or room < 1:
            return sp
        return dataclasses.replace(sp, max_tokens=room, min_tokens=min(sp.min_tokens, room))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation, or a list of them, through the model's chat
        template; one output per conversation. Messages' content is text or OpenAI's text parts;
        ``continue_final_message`` leaves the last (assistant) message open for the model to
        continue; ``chat_template_kwargs`` are extra template variables. The rendered text is
        tokenized without the tokenizer's special tokens (the template writes its own)."""
        convs = cast(list[Any], [messages] if messages and isinstance(messages[0], dict) else messages)
        rendered = [
            self.render_chat(c, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
            for c in convs
        ]
        params = self._per_prompt(sampling_params, len(rendered), "conversations")
        texts: list[Prompt] = [text for text, _ in rendered]
        return self._run(texts, [ids for _, ids in rendered], params, use_tqdm)

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """One conversation's prompt as ``chat`` sends it: the template's text, and its ids
        without the tokenizer's special tokens (the template writes its own BOS)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt=False")
        template = str(self.tokenizer.chat_template)
        turns = developer_as_system(object_arguments([_flat_message(m) for m in conversation]), template)
        if continue_final_message:
            if not turns or turns[-1]["role"] != "assistant":
                raise InvalidRequestError("continue_final_message needs a last message of the assistant")
            turns = tag_final_message(turns)
        try:
            text = self.tokenizer.apply_chat_template(
                turns,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as e:  # the template refuses the conversation (a message without content, ...)
            raise InvalidRequestError(f"chat template: {e}") from None
        if continue_final_message:
            try:
                text = open_final_message(text)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
        # tokenized whatever its length: the params a chat runs with may truncate it (the core then
        # counts its tokens against max_model_len)
        return text, self.tokenize(text, add_special_tokens=False, cut=True)[1]


def _flat_message(m: Any) -> dict[str, Any]:
    """A chat message with OpenAI's text content parts joined into its text (a newline apart)."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"a chat message is a dict, got {type(m).__name__}")
    content = m.get("content")
    if not isinstance(content, list):
        return m
    parts = [c for c in content if not (isinstance(c, dict) and c.get("type") == "text")]
    if parts:
        raise InvalidRequestError(f"only text content parts are supported, got {parts[0]!r:.80}")
    return m | {"content": "\n".join(str(c.get("text", "")) for c in content)}  # vLLM's join


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
