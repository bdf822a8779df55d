"""Engine: loads a model, owns the KV tensors, and runs steps — ``schedule()`` in Rust, the plans
and the forward in torch, sampling, then ``update()`` in Rust, which also detokenizes and applies
stop strings; the output processor hands out ``RequestOutput`` objects. The API mirrors vLLM's
``LLM`` (``generate``) and ``LLMEngine`` (``add_request`` / ``step``).

With ``async_scheduling`` (the default with CUDA) ``step()`` keeps one step planned ahead: it plans step
N+1 (``schedule()`` while N is not yet applied), runs it, and meanwhile applies step N
(``update()``, text, outputs), whose outputs it returns. On CUDA, N+1 is launched without
waiting and N's sampled ids come back through pinned memory and an event, so the device computes
while the host applies; on CPU, torch computes N+1 on this thread while a helper thread applies N
(torch releases the GIL in its kernels). Decode inputs of N+1 that are N's samples are filled on
the device. A sequence that stops in step N has its extra token of N+1 dropped by the core; core
ids (which index the sampling table) are reused only once no planned step can name them.

Faults (``engine_faults.py``, docs/faults.md): a request whose logits are not finite, or whose
step raised, fails alone; repeated step failures, or an error from the core or the output path,
leave the engine dead (``EngineDeadError``). ``generate`` / ``chat``: ``engine_offline.py``."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ferryman._core import InvalidRequestError, RequestParams
from ferryman.engine_args import DEFAULT_MODEL, EngineArgs
from ferryman.engine_faults import MAX_STEP_FAILURES, EngineDeadError, FaultsMixin
from ferryman.engine_offline import OfflineMixin, Prompt
from ferryman.engine_setup import build_parts
from ferryman.output_processor import OutputProcessor, RequestState
from ferryman.outputs import PreemptionEvent, RequestMetrics, RequestOutput, StepResult, StepStats
from ferryman.sampling_params import SamplingParams
from ferryman.tokenizer import max_prompt_chars, prompt_ids
from ferryman.worker.logit_masks import output_history, request_masks
from ferryman.worker.sampling_table import SamplingTable
from ferryman.worker.step_worker import InFlight as _InFlight
from ferryman.worker.step_worker import Sampled, StepWorker, parse_fault_steps

__all__ = ["MAX_STEP_FAILURES", "Engine", "EngineDeadError", "Prompt"]


class Engine(FaultsMixin, OfflineMixin):
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """``model`` and every other knob of ``EngineArgs`` as keywords; an unknown keyword is a
        ``TypeError``, a bad value an ``InvalidRequestError`` naming it."""
        self.args = args = EngineArgs(model=model, **kwargs)
        parts = build_parts(args)
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.tokenizer, self.max_model_len = parts.model, parts.tokenizer, parts.max_model_len
        self.kv, self.runner, self.scheduler = parts.kv, parts.runner, parts.scheduler
        self.calibration, self.calibration_s = parts.calibration, parts.calibration_s
        self.generation_defaults = parts.generation_defaults
        mc = self.model.cfg
        self.eos_token_ids = list(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id, *self.eos_token_ids]
        if self.tokenizer is not None:
            self.scheduler.set_tokenizer(self.tokenizer.backend_tokenizer.to_str())
        self._rng = random.Random(args.seed)
        self._max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        self._outputs = OutputProcessor(self.eos_token_ids[:1], self.tokenizer)  # the primary EOS (vLLM's)
        self._sampling = SamplingTable(args.max_num_seqs, self.device, mc.vocab_size)
        # of the scheduler alone: a bound method made a cycle that kept dropped engines alive
        self._sampling.history = output_history(self.scheduler)
        self._core_ids: dict[str, int] = {}
        self._free_ids: list[int] = []  # core ids to reuse: they index the sampling table
        self._next_id = 0
        self._num_added = 0
        self.peak_blocks_used = 0
        self._events: dict[int, list[PreemptionEvent]] = {}  # planned steps' preemptions, by step
        self._held: list[RequestOutput] = []  # add_request's outputs of generate()'s steps
        self._inflight: _InFlight | None = None
        faults = parse_fault_steps(os.environ.get("FERRYMAN_TEST_FAULT_STEPS"))  # test-only
        self._worker = StepWorker(
            self.runner, self._sampling, overlap=self.scheduler.config.async_scheduling, faults=faults
        )
        self.dead: BaseException | None = None  # why the engine stopped, once it has
        self._failures: deque[float] = deque()  # times of recent failed steps
        # on CPU the forward computes on this thread, so applying the previous step (update(),
        # text, outputs: Rust and Python, no torch) goes to a helper thread beside it
        overlap_cpu = self._worker.overlap and self.device.type != "cuda"
        self._applier = ThreadPoolExecutor(1, thread_name_prefix="ferryman-apply") if overlap_cpu else None

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
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queues a request; raises ``InvalidRequestError`` (a ``ValueError``) if it can never run,
        ``EngineDeadError`` once the engine stopped. ``arrival_time`` (``time.monotonic()``)
        defaults to now. A text prompt is tokenized with its special tokens (``tokenize``) unless
        ``prompt_token_ids`` gives its ids (the server tokenizes off the engine's thread)."""
        if self.dead is not None:  # it would never run
            raise EngineDeadError(f"engine stopped: {self.dead!r}") from self.dead
        params = SamplingParams() if params is None else params.clone()  # vLLM's: caller may reuse it
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._core_ids:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise InvalidRequestError("stop strings and bad_words need a tokenizer, and this model has none")
        text, ids = self.tokenize(prompt, prompt_token_ids, cut=params.truncate_prompt_tokens is not None)
        ids = params.truncated(ids, self.max_model_len)
        params.check_engine(vocab := self.model.cfg.vocab_size, self.args.max_logprobs, self.args.policy)
        bad_words = request_masks(params, self.tokenizer, vocab, self.eos_token_ids)
        cap = self.generation_defaults.get("max_tokens") or 1 << 62
        room = min(max(1, self.max_model_len - len(ids)), cap)
        max_tokens = params.max_tokens if params.max_tokens is not None else room  # open: to the model's cap
        kind, grammar = params.structured_outputs.spec() if params.structured_outputs else (None, "")
        record = RequestParams(
            max(1, max_tokens),  # 0 (prompt logprobs only): one token is sampled, not output
            priority=params.priority,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            n=params.n,
            detokenize=self.tokenizer is not None,
            stop=params.stop,
            min_tokens=min(params.min_tokens, max(1, max_tokens)),  # an open max_tokens cuts it too
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_reading_prefix_cache=params.prompt_logprobs is not None,
            grammar_kind=kind,
            grammar=grammar,
        )
        core_id = self._free_ids.pop() if self._free_ids else self._next_id
        try:
            self.scheduler.add_request(core_id, ids, record)
        except InvalidRequestError as e:  # name the user's request id, not the core's number
            if core_id != self._next_id:
                self._free_ids.append(core_id)
            msg = str(e).removeprefix("invalid ").removeprefix(f"request {core_id}: ")
            raise InvalidRequestError(f"request {request_id!r}: {msg}") from None
        self._next_id = max(self._next_id, core_id + 1)
        self._num_added += 1
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 40)
        stop_ids = [*params.stop_token_ids, *([] if params.ignore_eos else self.eos_token_ids)]
        self._sampling.set(core_id, params, seed, ids, stop_ids, bad_words)
        self._outputs.add(core_id, RequestState(request_id, text, ids, params, RequestMetrics(arrival)))
        self._core_ids[request_id] = core_id

    def num_prompt_tokens(self, request_id: str) -> int:
        """Prompt length of a live request, in tokens."""
        return len(self._outputs.reqs[self._core_ids[request_id]].prompt_token_ids)

    def abort_request(self, request_id: str) -> bool:
        core_id = self._core_ids.get(request_id)
        if core_id is None:
            return False
        self._release(core_id)
        return self.scheduler.abort_request(core_id)

    def _release(self, core_id: int) -> None:
        st = self._outputs.remove(core_id)
        if st is not None:
            del self._core_ids[st.request_id]
        self._sampling.clear(core_id)
        # a step in flight may still name the id: reuse it only after the newest is applied
        (self._inflight.release if self._inflight is not None else self._free_ids).append(core_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None or bool(self._held)

    def stats(self) -> dict[str, Any]:
        """Cumulative counters and current gauges (events come with each ``StepResult``)."""
        st: dict[str, Any] = dict(self.scheduler.stats())
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

    def step(self) -> StepResult:
        """Runs one step: the outputs it produced (per request's ``output_kind``; finished ones
        marked), its statistics and its preemptions. With async scheduling, plans and runs the
        next step and meanwhile applies the one before it, whose outputs it returns. A step whose
        forward raises fails its requests (outputs with ``error``); raises ``EngineDeadError``
        once the engine cannot go on."""
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}") from self.dead
        try:
            res = self._reraise_interrupt(self._step())
            if self._held:  # the outputs steps inside a generate() made for add_request's requests
                res.outputs[:0], self._held = self._held, []
            return res
        except Exception as e:
            self.dead = e
            raise

    def _step(self) -> StepResult:
        # a grammar's mask, or a long bad word, needs the step before applied: no overlap then
        guided = bool(self._sampling.synced)
        if not self._worker.overlap or (guided and self._inflight is None):
            plan = self._plan()
            try:
                sampled = self._worker.run(plan, self._sampling.args(plan))
            except BaseException as e:  # Ctrl-C too: the core's step must be closed
                return self._step_failed(plan, e)
            return self._apply(plan, sampled)
        while True:
            prev = self._inflight
            more = prev is None or self.scheduler.has_unfinished_requests()
            nxt = _InFlight(self._plan()) if more and not guided else None
            self._inflight = nxt  # core ids released while applying `prev` wait for `nxt`
            if nxt is not None:
                args = self._sampling.args(nxt.plan)
            error: BaseException | None = None
            if prev is None:  # nothing to apply yet: fill the pipeline
                assert nxt is not None
                try:
                    nxt.sampled = self._worker.run(nxt.plan, args)
                except BaseException as e:
                    return self._inflight_failed(e)
                continue
            if nxt is not None and self._applier is not None:  # CPU: apply beside the forward
                applied = self._applier.submit(self._apply, prev.plan, prev.sampled)
                try:
                    nxt.sampled = self._worker.run(nxt.plan, args)
                except BaseException as e:
                    error = e
                finally:
                    result = self._through_ctrl_c(applied.result)
            else:  # CUDA: the device runs `nxt` (launched, not waited for) while `prev` is applied
                if nxt is not None:
                    try:
                        nxt.sampled = self._worker.run(nxt.plan, args)
                    except BaseException as e:
                        error = e
                result = self._apply(prev.plan, prev.sampled)
            self._free_ids.extend(prev.release)
            if error is not None:  # `prev` is applied: `nxt` is the core's only pending step
                return self._inflight_failed(error, result)
            return result

    def _plan(self) -> Any:
        """``schedule()`` and the bookkeeping of the planned step."""
        out = self.scheduler.schedule()
        if out.num_preemptions:  # the events of this plan, returned with its step's result
            reqs = self._outputs.reqs
            self._events[out.step] = [
                PreemptionEvent(**e, request_id=st.request_id if (st := reqs.get(e["req_id"])) else None)
                for e in self.scheduler.drain_events()
            ]
        if len(out.added_req_ids):  # sequences scheduled for the first time
            self._outputs.first_scheduled(out, time.monotonic())
        self.peak_blocks_used = max(
            self.peak_blocks_used, self.kv.num_device_blocks - out.num_free_device_blocks
        )
        return out

    def _apply(self, out: Any, sampled: Sampled | None) -> StepResult:
        """``update()`` with the step's samples, then its outputs, statistics and preemptions."""
        assert sampled is not None, "the step ran"
        ids = self._through_ctrl_c(sampled.host_ids)  # where CUDA's async path waits
        if sampled.prompt_logprobs:
            self._outputs.add_prompt_logprobs(sampled.prompt_logprobs)
        failed, ids = self._fail_non_finite(out, sampled, ids)
        res = self.scheduler.update(ids)
        outputs = self._outputs.process(res, sampled.logprobs, time.monotonic())
        for ro in outputs:
            if ro.finished:
                self._release(self._core_ids[ro.request_id])
        events = self._events.pop(out.step, [])
        return StepResult(outputs + failed, StepStats.of(out, res.num_generated), events)

    def tokenize(
        self, prompt: Prompt, ids: list[int] | None = None, add_special_tokens: bool = True, cut: bool = False
    ) -> tuple[str | None, list[int]]:
        """A prompt's text (None for token ids) and ids, as ``add_request`` takes them
        (``prompt_ids``; ``ids``: a text's ids tokenized before); safe to call from another thread.
        A text longer than any ``max_model_len`` tokens spell is refused before it is tokenized
        (a huge one took minutes and gigabytes), unless ``cut`` (``truncate_prompt_tokens``)."""
        if isinstance(prompt, str) and ids is not None:
            return prompt, ids
        if isinstance(prompt, str) and not cut and len(prompt) > self._max_prompt_chars:
            n, m = len(prompt), self.max_model_len
            raise InvalidRequestError(
                f"prompt of {n} characters, more than {m} tokens spell, exceeds max_model_len={m}"
            )
        return prompt_ids(self.tokenizer, self.model.cfg.vocab_size, prompt, add_special_tokens)
