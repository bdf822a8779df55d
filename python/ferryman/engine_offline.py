"""The offline batch API of ``Engine`` (vLLM's ``LLM.generate`` / ``LLM.chat``): a mixin over
``add_request`` / ``step``, and the model's default ``SamplingParams`` they use when given none
(vLLM's ``LLM.get_default_sampling_params``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, cast

from ferryman._core import InvalidRequestError, Scheduler
from ferryman.outputs import RequestOutput, StepResult
from ferryman.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class OfflineMixin:
    if TYPE_CHECKING:
        scheduler: Scheduler
        tokenizer: Any
        generation_defaults: dict[str, Any]
        _inflight: Any
        _num_added: int
        _core_ids: dict[str, int]
        _held: list[RequestOutput]

        def add_request(
            self,
            request_id: str,
            prompt: Prompt,
            params: SamplingParams | None = None,
            arrival_time: float | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> None: ...
        def tokenize(
            self, prompt: Prompt, ids: list[int] | None = None, add_special_tokens: bool = True
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

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. A prompt or
        parameter set that is refused refuses the whole call: nothing of it stays queued.
        Requests added with ``add_request`` advance too; their outputs of these steps come with
        the next ``step()``'s, before its own. A text prompt gets the tokenizer's special tokens
        (a BOS where its file adds one), as in vLLM."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], Integral)):
            plist = [cast(Prompt, prompts)]
        else:
            plist = list(cast(Sequence[Prompt], prompts))
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(plist)
        if len(params) != len(plist):
            raise ValueError(f"{len(plist)} prompts but {len(params)} sampling parameter sets")
        return self._run(plist, [None] * len(plist), params, use_tqdm)

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
                final_only = dataclasses.replace(sp, output_kind="final_only")
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
            while len(final) < len(ids) and self.has_unfinished_requests():
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
            raise
        finally:
            if bar is not None:
                bar.close()
        while self._inflight is not None and not self.scheduler.has_unfinished_requests():
            self.step()  # a step planned before the last stop: only dropped samples are left
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput:
        """Applies the model's chat template to ``messages`` and generates the reply (the rendered
        text is tokenized without the tokenizer's special tokens: the template has its own)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template refuses the conversation (a message without content, ...)
            raise InvalidRequestError(f"chat template: {e}") from None
        ids = self.tokenize(prompt, add_special_tokens=False)[1]
        return self._run([prompt], [ids], [sampling_params or self.default_sampling_params()], use_tqdm)[0]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
