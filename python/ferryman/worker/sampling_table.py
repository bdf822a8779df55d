"""SamplingTable: every live request's sampling parameters, and what each step's sampling needs
from them (``SampleArgs``, taken when the step is planned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferryman._core import sample_cpu
from ferryman.outputs import Logprob
from ferryman.sampling_params import GREEDY_BELOW
from ferryman.worker.grammar_mask import apply_grammar as apply_grammar  # looked up here per call
from ferryman.worker.logit_masks import History, Masks
from ferryman.worker.logit_state import Adjust, LogitState, PromptArgs, adjust_args, prompt_args
from ferryman.worker.sampler import Filters, gather_logprobs, sample_random
from ferryman.worker.transfer import to_device

if TYPE_CHECKING:
    from ferryman.sampling_params import SamplingParams

ROW_COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
RANDOM_COLUMNS = ROW_COLUMNS[:5]  # what random sampling reads; the penalties are applied before it
FORK_SEED_STRIDE = 1000003  # fork k of a request samples with seed + k * this
_NO_ROWS = np.zeros(0, np.int64)  # a step's rows added, or its random samples, when it has none
_NO_FILTERS = Filters(False, False, False)
_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # RANDOM_COLUMNS'


@dataclass(slots=True)
class SampleArgs:
    """What sampling one step needs from the table, taken when the step is planned (with async
    scheduling the previous step is applied, releasing requests, while this one runs): the
    parameters of the rows this step takes, which samples are random and the filters they use
    (on CUDA; known on the host, so sampling never asks the device), and the logprobs each
    sample wants."""

    rows_added: np.ndarray  # int64 [A]
    added: dict[str, np.ndarray]  # column -> [A] values
    random: np.ndarray  # int64: the samples with temperature > 0 (off the CPU; there always empty:
    # the CPU sampler reads each sample's row's own temperature)
    filters: Filters  # what those use
    wanted: list[int | None] | None  # per sample: top-N logprobs, or None; None: no sample wants
    adjust: Adjust | None = None  # penalties, biases, min_tokens: None when no sample has any
    # samples a grammar constrains, and their masks (uint32 [G, W], bit t of token t): None if none
    grammar: tuple[np.ndarray, np.ndarray] | None = None
    prompt: PromptArgs | None = None  # prompt positions whose logprobs are wanted

    @property
    def any_random(self) -> bool:
        return len(self.random) > 0


class SamplingTable:
    """Every live request's sampling parameters, written once: as numpy columns indexed by its
    core id (a small integer the engine reuses), and, when it takes a row of the persistent batch,
    copied into per-row tensors on the device (``write_rows``), which the sampler reads by row. No
    step builds parameter tensors from Python lists; counts let an all-greedy step skip them.

    ``args(out)`` runs when a step is planned; ``write_rows`` and ``sample`` when it runs, in
    step order."""

    def __init__(
        self, max_num_seqs: int, device: torch.device, vocab_size: int = 0, capacity: int = 64
    ) -> None:
        """``vocab_size``: the logits' width (penalty counts are kept per row and token)."""
        self.temperature = np.zeros(capacity, np.float32)
        self.top_k = np.full(capacity, -1, np.int64)
        self.top_p = np.ones(capacity, np.float32)
        self.min_p = np.zeros(capacity, np.float32)
        self.seed = np.zeros(capacity, np.int64)
        self.logprobs = np.full(capacity, -1, np.int64)
        self.prompt_lp = np.full(capacity, -1, np.int64)
        self.presence_penalty = np.zeros(capacity, np.float32)
        self.frequency_penalty = np.zeros(capacity, np.float32)
        self.repetition_penalty = np.ones(capacity, np.float32)
        self.penalized = np.zeros(capacity, np.bool_)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.prompt_len = np.zeros(capacity, np.int64)
        self.num_random = 0  # live requests with temperature > 0
        self.num_logprobs = 0  # live requests that want logprobs
        self.num_adjusted = 0  # live requests with penalties, a logit bias or min_tokens
        self.num_prompt_lp = 0  # live requests that want prompt logprobs
        # live requests whose sampling needs the step before applied (a grammar, a long bad word)
        self.synced: set[int] = set()
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # core id -> token ids, biases
        self.suppress: dict[int, np.ndarray] = {}  # core id -> ids min_tokens holds back
        self.masks = Masks()  # allowed_token_ids, bad words
        self.prompts: dict[int, np.ndarray] = {}  # core id -> prompt ids, for penalized requests
        self.history: History | None = None  # a sequence's output so far (the engine's core)
        self.device, self.vocab_size, self.max_rows = device, vocab_size, max_num_seqs
        self.by_row = {
            c: torch.zeros(max_num_seqs, dtype=_dtype(getattr(self, c)), device=device) for c in ROW_COLUMNS
        }
        self.logit_state = LogitState(device, vocab_size, max_num_seqs)  # penalties, biases
        self._by_row_cpu: _Columns | None = None  # numpy views of by_row's random columns (CPU)

    def set(
        self,
        i: int,
        p: SamplingParams,
        seed: int,
        prompt: list[int] | None = None,
        stop_ids: list[int] | None = None,
        bad_words: list[list[int]] | None = None,
    ) -> None:
        """Request ``i``'s parameters (``prompt``: its ids, for the repetition penalty and
        ``min_tokens``; ``stop_ids``: the ids it holds back, EOS included; ``bad_words``: ids)."""
        if i >= len(self.seed):
            for name in (*ROW_COLUMNS, "logprobs", "prompt_lp", "penalized", "min_tokens", "prompt_len"):
                col = getattr(self, name)
                fill = {"repetition_penalty": 1, "logprobs": -1, "prompt_lp": -1}.get(name, 0)
                grow = np.full(max(i + 1, 2 * len(col)) - len(col), fill)
                setattr(self, name, np.concatenate([col, grow.astype(col.dtype)]))
        temperature = p.temperature if p.temperature >= GREEDY_BELOW else 0.0  # greedy below
        self.temperature[i], self.top_k[i], self.top_p[i], self.min_p[i] = (
            temperature,
            p.top_k,
            p.top_p,
            p.min_p,
        )
        self.seed[i] = seed
        self.logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.num_random += temperature > 0
        self.num_logprobs += p.logprobs is not None
        self.presence_penalty[i], self.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
        self.repetition_penalty[i], self.penalized[i] = p.repetition_penalty, p.penalized
        self.min_tokens[i], self.prompt_len[i] = p.min_tokens, len(prompt or ())
        self.prompt_lp[i] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.num_prompt_lp += p.prompt_logprobs is not None
        if p.penalized or p.prompt_logprobs is not None:
            self.prompts[i] = np.asarray(prompt or [], np.int64)
        if p.logit_bias:
            self.bias[i] = (
                np.fromiter(p.logit_bias, np.int64),
                np.fromiter(p.logit_bias.values(), np.float32),
            )
        if p.min_tokens and stop_ids:
            ids = np.unique(np.asarray(stop_ids, np.int64))
            # an id outside the vocabulary is never sampled: nothing to hold back (and no column)
            self.suppress[i] = ids[ids < self.vocab_size] if self.vocab_size else ids
        if self.masks.set(i, p.allowed_token_ids, bad_words) or p.structured_outputs is not None:
            self.synced.add(i)
        self.num_adjusted += self._adjusted(i)

    def clear(self, i: int) -> None:
        self.num_random -= bool(self.temperature[i] > 0)
        self.num_logprobs -= bool(self.logprobs[i] >= 0)
        self.num_adjusted -= self._adjusted(i)
        self.num_prompt_lp -= bool(self.prompt_lp[i] >= 0)
        self.prompt_lp[i] = -1
        self.temperature[i], self.logprobs[i], self.penalized[i] = 0.0, -1, False
        self.bias.pop(i, None)
        self.suppress.pop(i, None)
        self.prompts.pop(i, None)
        self.masks.clear(i)
        self.synced.discard(i)

    def _adjusted(self, i: int) -> bool:  # its logits change before sampling (``Adjust``)
        return bool(self.penalized[i]) or any(i in d for d in (self.bias, self.suppress, self.masks))

    def args(self, out: Any) -> SampleArgs:
        """What sampling the planned step ``out`` (a ``SchedulerOutput``) needs from the table."""
        ids = out.added_req_ids
        added = {c: getattr(self, c)[ids] for c in ROW_COLUMNS} if len(ids) else {}
        wanted = None
        if self.num_logprobs:
            wanted = [None if n < 0 else n for n in self.logprobs[out.sample_req_ids].tolist()]
        random, filters = _NO_ROWS, _NO_FILTERS
        if self.num_random and self.device.type != "cpu":  # the CPU sampler reads rows' own
            sid = out.sample_req_ids
            random = np.flatnonzero(self.temperature[sid] > 0)
            r = sid[random]
            k = self.top_k[r]
            filters = Filters(
                bool((k > 0).any()),
                bool((self.top_p[r] < 1).any()),
                bool((self.min_p[r] > 0).any()),
                int(k.max()) if len(k) else 0,
            )
        adjust = adjust_args(self, out) if self.num_adjusted else None
        prompt = prompt_args(self, out) if self.num_prompt_lp else None
        grammar = None
        if self.synced and len(out.grammar_sample_indices):
            masks = out.grammar_masks.reshape(len(out.grammar_sample_indices), out.grammar_mask_words)
            grammar = (out.grammar_sample_indices, masks)
        rows_added = out.rows_added.astype(np.int64) if len(ids) else _NO_ROWS
        return SampleArgs(rows_added, added, random, filters, wanted, adjust, prompt=prompt, grammar=grammar)

    def write_rows(self, a: SampleArgs) -> None:
        """The rows the step takes get their requests' parameters, one copy per column."""
        if not len(a.rows_added):
            return
        top = int(a.rows_added.max()) + 1
        if top > len(self.by_row["seed"]):  # a scheduler with more rows than we were told
            self.by_row = {
                c: torch.cat([t, torch.zeros(top - len(t), dtype=t.dtype, device=t.device)])
                for c, t in self.by_row.items()
            }
            self._by_row_cpu = None
        r = to_device(a.rows_added, self.device)
        for c, t in self.by_row.items():
            t[r] = to_device(a.added[c], self.device)
        if a.adjust is not None:
            self.logit_state.write_rows(a.adjust, top)

    def sample(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        seq_indices: np.ndarray,
        positions: np.ndarray,
        a: SampleArgs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[dict[int, Logprob] | None] | None]:
        """One token per row of ``logits`` (sample i: batch row ``rows[i]``, fork ``seq_indices[i]``,
        the token at ``positions[i]``); whether each row's largest logit is finite (read off
        greedy's maximum, no pass of its own; None on the CPU when all are), or where masks
        applied an int8 status (1 fine, 0 not finite, -1 every token forbidden by the request);
        and the samples' logprobs when any wants them."""
        raw = model = logits  # logprobs are the model's own: before penalties, biases and temperature
        if a.adjust is not None:
            logits = self.logit_state.apply(logits, rows, a.adjust, self.by_row)
        if a.grammar is not None:  # over what min_tokens leaves it, or else what is not forbidden
            hard = None
            if a.adjust is not None:
                hard = self.logit_state.masked(model, rows, a.adjust) if a.adjust.forbids else model
            logits = apply_grammar(logits, *a.grammar, fallback=hard)
            if a.wanted is not None:  # but under the grammar's mask, as vLLM reports them
                raw = logits if a.adjust is None else apply_grammar(raw, *a.grammar)
        if logits.device.type == "cpu":
            tokens, ok = self._sample_cpu(logits, rows, seq_indices, positions)
        else:
            best, best_t = logits.max(dim=-1)  # argmax's index (the first largest), and its value
            ok = torch.isfinite(best)
            if not a.any_random:
                tokens = best_t.to(torch.int32)
            else:  # the random samples' parameters by their rows; no device-side test of any
                dev = logits.device
                sel = a.random
                r = to_device(rows[sel].astype(np.int64), dev)
                p = {c: self.by_row[c][r] for c in RANDOM_COLUMNS}
                forks = to_device(seq_indices[sel].astype(np.int64), dev)
                idx = to_device(sel, dev)
                chosen = sample_random(
                    logits.index_select(0, idx),
                    p["temperature"],
                    p["top_k"],
                    p["top_p"],
                    p["min_p"],
                    p["seed"] + FORK_SEED_STRIDE * forks,
                    to_device(positions[sel].astype(np.int64), dev),
                    a.filters,
                )
                tokens = best_t.index_copy(0, idx, chosen).to(torch.int32)
        if a.adjust is not None:
            self.logit_state.count(tokens, rows, a.adjust)
        if ok is not None and a.adjust is not None and a.adjust.forbids:  # emptied by its own masks
            ok = torch.where(ok, 1, torch.where(torch.isfinite(model.amax(dim=-1)), -1, 0)).to(torch.int8)
        if a.wanted is None:
            return tokens, ok, None
        return tokens, ok, gather_logprobs(raw, tokens, a.wanted)

    def _sample_cpu(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        seq_indices: np.ndarray,
        positions: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``sample``'s tokens and finiteness on the CPU (None: every row finite), in one core
        call (``sample_cpu``; numpy and torch took some twenty, each slow on caches the forward
        has just flushed): the argmax, which checks the largest logit in the same pass, and the
        random samples by their rows' parameters (the same algorithm and noise as
        ``sample_random``, a pass per row instead of torch's sorts). A row that is not finite
        holds token 0."""
        arr = np.ascontiguousarray(logits.numpy())
        if self._by_row_cpu is None:
            t, k, p, m, s = (self.by_row[c].numpy() for c in RANDOM_COLUMNS)
            self._by_row_cpu = (t, k, p, m, s)
        tokens, num_bad = sample_cpu(arr, rows, seq_indices, positions, *self._by_row_cpu, FORK_SEED_STRIDE)
        ok = None
        if num_bad:
            ok = torch.from_numpy(tokens >= 0)
            tokens = np.maximum(tokens, 0)
        return torch.from_numpy(tokens), ok


def _dtype(col: np.ndarray) -> torch.dtype:
    return torch.int64 if col.dtype == np.int64 else torch.float32
