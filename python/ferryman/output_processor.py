"""Output processing: turns the core's ``StepOutputs`` (per sample row its token, its releasable
new text and finish reason, plus the whole output of every sequence that finished; a row with no
output token is a sample the core dropped, e.g. of a fork that stopped while its next token was
already planned) into the
``RequestOutput`` objects a caller is handed, per request's ``output_kind``. The core owns
tokens, text and stop conditions; this owns only what the core does not: the caller's ids and
prompt, metrics, logprobs, and the live outputs of "cumulative" requests.

Cost per step: O(1) Python plus O(finished sequences) while every live request is "final_only"
without logprobs (what ``generate()`` makes); otherwise one pass over the step's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ferryman.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ferryman.sampling_params import SamplingParams

Logprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)
    logprobs: list[list[Logprobs]] = field(default_factory=list)  # per fork, "final_only" only
    num_finished: int = 0
    per_row: bool = False  # each of its rows needs Python work, not just its finish (set by add)
    prompt_logprobs: list[Logprobs | None] | None = None  # by prompt position, as they come
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, with them
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was first scheduled


class OutputProcessor:
    def __init__(self, eos_token_ids: list[int] | None = None, tokenizer: Any = None) -> None:
        """``tokenizer``: decodes each logprob's token alone (``Logprob.decoded_token``)."""
        self.reqs: dict[int, RequestState] = {}  # by core id
        self._num_per_row = 0
        self._eos = frozenset(eos_token_ids or ())  # an EOS ends with stop_reason None (vLLM's)
        self._decode: Callable[[int], str] | None = None
        if tokenizer is not None:
            self._decode = lambda t: str(tokenizer.decode([t]))
        self._texts: dict[int, str] = {}  # token id -> its decode, as logprobs meet them

    def _named(self, lp: Logprobs) -> Logprobs:
        """``lp`` with each entry's ``decoded_token`` set (where there is a tokenizer)."""
        if self._decode is not None:
            texts = self._texts
            for t, v in lp.items():
                text = texts.get(t)
                if text is None:
                    text = texts[t] = self._decode(t)
                v.decoded_token = text
        return lp

    def add(self, core_id: int, st: RequestState) -> None:
        st.per_row = st.params.output_kind != "final_only" or st.params.logprobs is not None
        st.outputs = [CompletionOutput(index=k) for k in range(st.params.n)]
        if st.params.logprobs is not None and st.params.output_kind == "final_only":
            st.logprobs = [[] for _ in range(st.params.n)]
        if st.params.prompt_logprobs is not None:
            st.prompt_logprobs = [None] * len(st.prompt_token_ids)
            st.prompt_ranks = [None] * len(st.prompt_token_ids)
        self.reqs[core_id] = st
        self._num_per_row += st.per_row

    def first_scheduled(self, plan: Any, now: float) -> None:
        """A plan's sequences that take a batch row: a request scheduled for its first time gets
        that time, and the prompt tokens its first chunk found computed (prefix-cache hits)."""
        rows: dict[int, int] | None = None
        for r in plan.added_req_ids.tolist():
            st = self.reqs.get(r)
            if st is None or st.metrics.first_scheduled_time is not None:
                continue
            st.metrics.first_scheduled_time = now
            if rows is None:
                rows = {rid: b for b, rid in reversed(list(enumerate(plan.req_ids.tolist())))}
            b = rows.get(r)
            if b is not None:
                st.num_cached_tokens = int(plan.seq_lens[b]) - int(plan.qo_indptr[b + 1] - plan.qo_indptr[b])

    def add_prompt_logprobs(self, entries: list[tuple[int, int, Logprobs, int]]) -> None:
        """(core id, prompt position, logprobs, rank) of prompt tokens a step computed (a
        position computed again after a recompute preemption gets the same values)."""
        for core_id, pos, lp, rank in entries:
            st = self.reqs.get(core_id)
            if st is not None and st.prompt_logprobs is not None and st.prompt_ranks is not None:
                st.prompt_logprobs[pos], st.prompt_ranks[pos] = self._named(lp), rank

    def remove(self, core_id: int) -> RequestState | None:
        st = self.reqs.pop(core_id, None)
        if st is not None:
            self._num_per_row -= st.per_row
        return st

    def process(self, res: Any, lps: list[Logprobs | None] | None, now: float) -> list[RequestOutput]:
        """The outputs of one ``update()`` (``lps``: each row's logprobs, or None)."""
        reqs = self.reqs
        ids_np = res.req_ids
        if res.num_first_tokens:  # only steps that finish a prompt
            for rid in ids_np[res.num_output_tokens == 1].tolist():
                st = reqs.get(rid)
                if st is not None and st.metrics.first_token_time is None:
                    st.metrics.first_token_time = now
                    if st.metrics.first_scheduled_time is None:  # a prompt the prefix cache held whole
                        st.metrics.first_scheduled_time = now
        fin = res.finished_rows.tolist()
        if not self._num_per_row and not fin:
            return []
        ids, ks, reasons = ids_np.tolist(), res.seq_indices.tolist(), res.finish_reasons
        touched: dict[int, RequestState] = {}
        deltas: dict[int, list[CompletionOutput]] = {}
        if self._num_per_row:
            toks, texts, nout = res.new_token_ids.tolist(), res.deltas, res.num_output_tokens.tolist()
            for i, rid in enumerate(ids):
                st = reqs.get(rid)
                if st is None or not st.per_row or not nout[i]:  # 0 outputs: a dropped sample
                    continue
                k, tok, lp = ks[i], toks[i], None if lps is None else lps[i]
                if lp is not None:
                    lp = self._named(lp)
                kind = st.params.output_kind
                if kind == "cumulative":
                    o = st.outputs[k]
                    o.text += texts[i]
                    o.token_ids.append(tok)
                    o.finish_reason = reasons[i]
                    if lp is not None:
                        _add_logprob(o, lp, tok)
                    touched[rid] = st
                elif kind == "delta":
                    if reasons[i] is not None:  # known finished, should the request fail later
                        st.outputs[k].finish_reason = reasons[i]
                    o = CompletionOutput(k, texts[i], [tok], reasons[i])
                    if lp is not None:  # the sum is a running one (vLLM's), kept on the sequence
                        run = st.outputs[k]
                        run.cumulative_logprob = (run.cumulative_logprob or 0.0) + lp[tok]
                        o.logprobs, o.cumulative_logprob = [lp], run.cumulative_logprob
                    deltas.setdefault(rid, []).append(o)
                    touched[rid] = st
                elif lp is not None:
                    st.logprobs[k].append(lp)
        if fin:
            offs, all_toks, texts = res.output_token_offsets.tolist(), res.output_token_ids, res.output_texts
            stops = res.stop_string_indices.tolist()
            for f, row in enumerate(fin):
                st = reqs.get(ids[row])
                if st is None:
                    continue
                st.num_finished += 1
                touched[ids[row]] = st
                k, kind = ks[row], st.params.output_kind
                last = int(all_toks[offs[f + 1] - 1]) if offs[f + 1] > offs[f] else -1
                eos = stops[f] < 0 and not st.params.ignore_eos and last in self._eos
                why = None if eos else _stop_reason(st.params, reasons[row], stops[f], last)
                if kind == "final_only":
                    o = CompletionOutput(k, texts[f], all_toks[offs[f] : offs[f + 1]].tolist(), reasons[row])
                    if st.logprobs:
                        o.logprobs = st.logprobs[k]
                        o.cumulative_logprob = sum(d[t] for d, t in zip(o.logprobs, o.token_ids, strict=True))
                    st.outputs[k] = o
                for o in deltas.get(ids[row], []) if kind == "delta" else [st.outputs[k]]:
                    if o.index == k:
                        o.stop_reason = why
        results = []
        for rid, st in touched.items():
            done = st.num_finished == st.params.n
            kind = st.params.output_kind
            if kind == "final_only" and not done:
                continue
            if done:  # the engine removes it (and frees its id)
                st.metrics.finished_time = now
            outs = deltas.get(rid, []) if kind == "delta" else st.outputs
            if st.params.max_tokens == 0:  # prompt logprobs only: its one sampled token is not output
                outs = [CompletionOutput(o.index, finish_reason=o.finish_reason) for o in outs]
            results.append(
                RequestOutput(
                    st.request_id,
                    st.prompt,
                    st.prompt_token_ids,
                    outs,
                    done,
                    st.metrics,
                    st.prompt_logprobs,
                    None,  # positional: keywords made this call ~0.2 us slower, once per request per step
                    st.prompt_ranks,
                    st.num_cached_tokens,
                )
            )
        return results

    def failed(
        self, st: RequestState, message: str, now: float, so_far: Callable[[int], tuple[list[int], str]]
    ) -> RequestOutput:
        """The final output of a request that failed: its sequences not yet finished end with
        finish_reason "error" (a "delta" request gets an empty last delta for each; a
        "final_only" one the tokens and text each had, from ``so_far(seq_index)``, the core's)."""
        st.metrics.finished_time = now
        kind = st.params.output_kind
        if kind == "delta":
            outs = [
                CompletionOutput(k, finish_reason="error")
                for k, o in enumerate(st.outputs)
                if o.finish_reason is None
            ]
        else:
            outs = st.outputs
            for k, o in enumerate(outs):
                if kind == "final_only" and o.finish_reason is None:
                    o.token_ids, o.text = so_far(k)
                    if st.logprobs and o.token_ids:  # none without tokens, as the other kinds
                        o.logprobs = st.logprobs[k][: len(o.token_ids)]
                        o.cumulative_logprob = sum(
                            d[t] for d, t in zip(o.logprobs, o.token_ids, strict=False)
                        )
                o.finish_reason = o.finish_reason or "error"
        return RequestOutput(
            st.request_id,
            st.prompt,
            st.prompt_token_ids,
            outs,
            True,
            st.metrics,
            st.prompt_logprobs,
            message,
            st.prompt_ranks,
            st.num_cached_tokens,
        )


def _stop_reason(params: Any, reason: str | None, stop_string: int, last_token: int) -> str | int | None:
    """vLLM's ``stop_reason`` of a finished sequence: the stop string (by its index in ``stop``)
    or the stop token id that ended it; None otherwise (an EOS id is not a stop reason)."""
    if reason != "stop":
        return None
    if stop_string >= 0:
        return str(params.stop[stop_string])
    return last_token if last_token in params.stop_token_ids else None


def _add_logprob(o: CompletionOutput, lp: Logprobs, tok: int) -> None:
    if o.logprobs is None:
        o.logprobs, o.cumulative_logprob = [], 0.0
    o.logprobs.append(lp)
    o.cumulative_logprob = (o.cumulative_logprob or 0.0) + lp[tok]
