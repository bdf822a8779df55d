"""Engine: loads a model, owns the KV tensors, and runs steps — ``schedule()`` in Rust, the plans
and the forward in torch, sampling, then ``update()`` in Rust; detokenizes and applies stop
strings. The API mirrors vLLM's ``LLM`` (``generate``) and ``LLMEngine`` (``add_request`` /
``step``)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from ferryman._core import InvalidRequestError, SchedulerOutput
from ferryman.detokenizer import IncrementalDetokenizer
from ferryman.engine_args import DEFAULT_MODEL, EngineArgs
from ferryman.engine_setup import build_parts
from ferryman.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ferryman.sampling_params import SamplingParams
from ferryman.worker.sampler import gather_logprobs, sample

Prompt = str | Sequence[int]


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    outputs: list[CompletionOutput]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics


class Engine:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """``model`` and every other knob of ``EngineArgs`` as keywords; an unknown keyword is a
        ``TypeError``, a bad value an ``InvalidRequestError`` naming it."""
        self.args = args = EngineArgs(model=model, **kwargs)
        parts = build_parts(args)
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.tokenizer, self.max_model_len = parts.model, parts.tokenizer, parts.max_model_len
        self.kv, self.runner, self.scheduler = parts.kv, parts.runner, parts.scheduler
        self.calibration, self.calibration_s = parts.calibration, parts.calibration_s
        mc = self.model.cfg
        self.eos_token_ids = list(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id, *self.eos_token_ids]
        self._rng = random.Random(args.seed)
        self._reqs: dict[int, _Request] = {}
        self._core_ids: dict[str, int] = {}
        self._next_id = 0
        self.peak_blocks_used = 0
        self.last_schedule: SchedulerOutput | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> Engine:
        """The engine these arguments describe (what ``ferryman serve`` and the CLI build)."""
        return cls(**dataclasses.asdict(args))

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request; raises ``InvalidRequestError`` (a ``ValueError``) if it can never run.
        ``arrival_time`` (``time.monotonic()``) defaults to now."""
        params = params or SamplingParams()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if request_id in self._core_ids:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        text, ids = self._tokenize(prompt)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        # the core takes one EOS id; the model's other EOS ids stop the request as stop ids
        extra_eos = [] if params.ignore_eos else self.eos_token_ids[1:]
        stop_ids = [*params.stop_token_ids, *extra_eos]
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(ids))
        core_id = self._next_id
        try:
            self.scheduler.add_request(
                core_id,
                ids,
                max_tokens,
                priority=params.priority,
                eos_token_id=eos,
                stop_token_ids=stop_ids,
                ignore_eos=params.ignore_eos,
                n=params.n,
            )
        except InvalidRequestError as e:  # name the user's request id, not the core's number
            msg = str(e).removeprefix(f"request {core_id}: ")
            raise InvalidRequestError(f"request {request_id!r}: {msg}") from None
        self._next_id += 1
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 40)
        outs = [CompletionOutput(index=k) for k in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer) for _ in range(params.n)]
        self._reqs[core_id] = _Request(
            request_id, text, ids, params, seed, outs, detoks, RequestMetrics(arrival)
        )
        self._core_ids[request_id] = core_id

    def num_prompt_tokens(self, request_id: str) -> int:
        """Prompt length of a live request, in tokens."""
        return len(self._reqs[self._core_ids[request_id]].prompt_token_ids)

    def abort_request(self, request_id: str) -> bool:
        core_id = self._core_ids.pop(request_id, None)
        if core_id is None:
            return False
        self._reqs.pop(core_id, None)
        return self.scheduler.abort_request(core_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = dict(self.scheduler.stats())
        st["events"] = self.scheduler.drain_events()
        cfg = self.scheduler.config
        st["cost_model"] = {
            "bytes_per_block": cfg.bytes_per_block,
            "host_link_bytes_per_s": cfg.host_link_bytes_per_s,
            "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
            "calibrated": sorted(self.calibration),
        }
        st["num_cuda_graph_steps"] = self.runner.num_graph_steps
        return st

    # -- stepping ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the requests that produced a token (finished ones marked)."""
        out = self.scheduler.schedule()
        self.last_schedule = out
        now = time.monotonic()
        for r in np.unique(out.req_ids).tolist():
            sreq = self._reqs.get(r)
            if sreq is not None and sreq.metrics.first_scheduled_time is None:
                sreq.metrics.first_scheduled_time = now
        used = self.kv.num_device_blocks - out.num_free_device_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        logits = self.runner.execute(out)
        sampled, logprobs = self._sample(logits, out.sample_req_ids, out.sample_seq_indices)
        res = self.scheduler.update(sampled)
        touched: dict[int, _Request] = {}
        ids, ks, toks = res.req_ids.tolist(), res.seq_indices.tolist(), res.new_token_ids.tolist()
        rows = zip(ids, ks, toks, res.finish_reasons, strict=True)
        for row, (rid, k, tok, reason) in enumerate(rows):
            req = self._reqs.get(rid)
            if req is None:
                continue
            self._append(rid, req, req.outputs[k], tok, reason)
            lp = logprobs[row]
            if lp is not None:
                o = req.outputs[k]
                if o.logprobs is None:
                    o.logprobs, o.cumulative_logprob = [], 0.0
                o.logprobs.append(lp)
                o.cumulative_logprob = (o.cumulative_logprob or 0.0) + lp[tok]
            touched[rid] = req
        results = []
        now = time.monotonic()
        for rid, req in touched.items():
            done = all(o.finish_reason is not None for o in req.outputs)
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            if done:
                m.finished_time = now
            results.append(
                RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.outputs, done, m)
            )
            if done:
                del self._reqs[rid]
                self._core_ids.pop(req.request_id, None)
        return results

    def _sample(
        self, logits: torch.Tensor, req_ids: np.ndarray, seq_indices: np.ndarray
    ) -> tuple[np.ndarray, list[dict[int, float] | None]]:
        """One token per sample row, and per row the logprobs it asked for (else None)."""
        if len(req_ids) == 0:
            return np.zeros(0, dtype=np.int32), []
        reqs = [self._reqs[r] for r in req_ids.tolist()]
        ks = seq_indices.tolist()
        ps = [r.params for r in reqs]
        dev = logits.device
        positions = [
            len(r.prompt_token_ids) + len(r.outputs[k].token_ids) for r, k in zip(reqs, ks, strict=True)
        ]
        tokens = sample(
            logits,
            torch.tensor([p.temperature for p in ps], device=dev),
            torch.tensor([p.top_k for p in ps], device=dev),
            torch.tensor([p.top_p for p in ps], device=dev),
            torch.tensor([p.min_p for p in ps], device=dev),
            torch.tensor([r.seed + 1000003 * k for r, k in zip(reqs, ks, strict=True)], device=dev),
            torch.tensor(positions, device=dev),
        )
        return tokens.cpu().numpy(), gather_logprobs(logits, tokens, [p.logprobs for p in ps])

    def _append(self, rid: int, req: _Request, out: CompletionOutput, tok: int, reason: str | None) -> None:
        out.token_ids.append(tok)
        if self.tokenizer is not None:
            start = len(out.text)
            out.text += req.detoks[out.index].step(out.token_ids, final=reason is not None)
            # a stop string can only end inside the new text, so search just the tail it may span
            hits = [out.text.find(s, max(0, start - len(s) + 1)) for s in req.params.stop]
            hits = [at for at in hits if at >= 0]
            if hits:
                out.text = out.text[: min(hits)]
                if reason is None:
                    self.scheduler.finish_request(rid, "stop", out.index)
                reason = "stop"
        out.finish_reason = reason

    # -- offline batch -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            plist = [cast(Prompt, prompts)]
        else:
            plist = list(cast(Sequence[Prompt], prompts))
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(plist)
        ids = [f"generate-{self._next_id + i}" for i in range(len(plist))]
        for rid, p, sp in zip(ids, plist, params, strict=True):
            self.add_request(rid, p, sp)
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(plist)) if use_tqdm else None
        while len(final) < len(ids) and self.has_unfinished_requests():
            for ro in self.step():
                if ro.finished:
                    final[ro.request_id] = ro
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput:
        """Applies the model's chat template to ``messages`` and generates the reply."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate([prompt], sampling_params, use_tqdm)[0]

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompts as token-id lists")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return prompt, ids
        ids = [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} out of range [0, {vocab})")
        return None, ids


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
