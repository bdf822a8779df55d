"""Vectorized sampling: greedy, temperature, top-k, top-p, min-p, one batched pass.

Random rows use an exponential race (argmax of p / E with E ~ Exp(1)) whose noise is a
counter-based hash of (request seed, position, token id), so a request's samples depend only on
its own seed and position — never on the batch it ran in or on other requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ferryman.sampling_params import SamplingParams

_M52 = (1 << 52) - 1
_M35 = (1 << 35) - 1


def _uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) noise of each row's ``token_ids`` (``[S, C]``, or ``[C]`` for every row),
    a hash of (seed, position, token id) in int64 counters (wrapping arithmetic)."""
    x = seeds[:, None] * 6364136223846793005 + positions[:, None] * 1442695040888963407 + token_ids
    for _ in range(3):
        x = x ^ ((x >> 29) & _M35)
        x = x * 2685821657736338717
    u = ((x >> 11) & _M52).double() / float(1 << 52)
    return u.clamp_(1e-12, 1.0 - 1e-12)


@dataclass(slots=True, frozen=True)
class Filters:
    """Which filters any random row of a step uses, known on the host (so the device is never
    asked, which would wait for it)."""

    top_k: bool
    top_p: bool
    min_p: bool


def sample_random(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    filters: Filters,
    window: bool | None = None,
) -> torch.Tensor:
    """One token (int64) per row of float32 ``logits [R, V]``, every row random (temperature
    > 0); per-row parameters are 1-D tensors (``top_k <= 0`` means off).

    One sort serves top-k and top-p. On CPU, when they filter, the race runs only over each
    row's survivors (a prefix of its sorted order; every other token has probability 0 and
    cannot win), so its noise costs ``[R, W]`` with W the most survivors of any row, not
    ``[R, V]``; the probabilities are still computed over whole vocabulary rows and the race's
    padding is exact zeros, so a row's sample never depends on the batch. On CUDA the race
    covers the whole row: W would have to be read back from the device, a wait per step
    (``window`` overrides the choice; both give the same tokens)."""
    lg = logits / temperature[:, None]
    vocab = lg.shape[-1]
    order, width = None, vocab  # each row's token ids by descending logit, when a filter needs them
    if filters.top_k or filters.top_p:
        sorted_lg, order = lg.sort(dim=-1, descending=True)
        if filters.top_k:
            kk = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = sorted_lg.gather(1, (kk - 1)[:, None])
            lg = lg.masked_fill(lg < kth, float("-inf"))
            sorted_lg = sorted_lg.masked_fill(sorted_lg < kth, float("-inf"))
        if filters.top_p:
            probs = sorted_lg.softmax(dim=-1)
            # the smallest prefix reaching p; rows with p = 1 keep all (rounding must not cut them)
            drop = (probs.cumsum(dim=-1) - probs > top_p[:, None]) & (top_p < 1)[:, None]
            sorted_lg = sorted_lg.masked_fill(drop, float("-inf"))
            lg = lg.scatter(1, order, sorted_lg)
        if lg.device.type == "cpu" if window is None else window:  # survivors: a prefix of `order`
            width = int((sorted_lg > float("-inf")).sum(dim=-1).max())
    probs = lg.softmax(dim=-1)
    if filters.min_p:
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if order is not None and width < vocab:  # the race over each row's candidates only
        cand = order[:, :width]
        race = probs.gather(1, cand).double() / -torch.log(_uniform(seeds, positions, cand))
        return cand.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
    ids = torch.arange(vocab, dtype=torch.int64, device=lg.device)
    return (probs.double() / -torch.log(_uniform(seeds, positions, ids))).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One int32 token per row of ``logits [S, V]``: the argmax where ``temperature == 0``,
    else ``sample_random``'s (the filters read from the tensors: a reference entry point;
    ``SamplingTable`` passes what the host knows)."""
    greedy = logits.argmax(dim=-1)
    rand = temperature > 0
    if not bool(rand.any()):
        return greedy.to(torch.int32)
    r = rand.nonzero()[:, 0]
    k, p, mp = top_k[r], top_p[r], min_p[r]
    filters = Filters(bool((k > 0).any()), bool((p < 1).any()), bool((mp > 0).any()))
    chosen = sample_random(logits[r], temperature[r], k, p, mp, seeds[r], positions[r], filters)
    return greedy.index_copy(0, r, chosen).to(torch.int32)


def gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> list[dict[int, float] | None]:
    """For rows that ask for logprobs: the sampled token's and the top-N of the model's
    distribution (log-softmax of the raw logits), as ``{token_id: logprob}``."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    out: list[dict[int, float] | None] = [None] * len(wanted)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows], dim=-1)
    top = max(wanted[i] or 0 for i in rows)
    vals, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, tokens[rows].long()[:, None])[:, 0]
    for j, i in enumerate(rows):
        n = wanted[i] or 0
        d = {int(t): float(v) for t, v in zip(ids[j, :n].tolist(), vals[j, :n].tolist(), strict=True)}
        d[int(tokens[i])] = float(chosen[j])
        out[i] = d
    return out


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
_NONE = np.zeros(0, np.int64)
History = Callable[[int, int], "tuple[np.ndarray, np.ndarray]"]  # (core id, fork) -> prompt, output ids


@dataclass(slots=True)
class Adjust:
    """What a step changes in its logits before sampling (none of it on most steps): sample
    indices of each kind, the rows taking penalized or biased requests with their state, and
    the (sample, token) pairs ``min_tokens`` forbids."""

    penalized: np.ndarray  # int64 samples whose requests have penalties
    count: np.ndarray  # int64 samples whose token adds to their row's counts
    biased: np.ndarray  # int64 samples with a logit bias
    suppress: tuple[np.ndarray, np.ndarray] | None  # (samples, token ids) not to sample
    penalty_rows: list[tuple[int, np.ndarray, np.ndarray]]  # (row, prompt ids, output ids)
    bias_rows: list[tuple[int, np.ndarray, np.ndarray]]  # (row, token ids, biases)


@dataclass(slots=True)
class SampleArgs:
    """What sampling one step needs from the table, taken when the step is planned (with async
    scheduling the previous step is applied, releasing requests, while this one runs): the
    parameters of the rows this step takes, which samples are random and the filters they use
    (known on the host, so sampling never asks the device), and the logprobs each sample wants."""

    rows_added: np.ndarray  # int64 [A]
    added: dict[str, np.ndarray]  # column -> [A] values
    random: np.ndarray  # int64: the samples with temperature > 0
    filters: Filters  # what those use
    wanted: list[int | None] | None  # per sample: top-N logprobs, or None; None: no sample wants
    adjust: Adjust | None = None  # penalties, biases, min_tokens: None when no sample has any

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
        self.presence_penalty = np.zeros(capacity, np.float32)
        self.frequency_penalty = np.zeros(capacity, np.float32)
        self.repetition_penalty = np.ones(capacity, np.float32)
        self.penalized = np.zeros(capacity, np.bool_)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.prompt_len = np.zeros(capacity, np.int64)
        self.num_random = 0  # live requests with temperature > 0
        self.num_logprobs = 0  # live requests that want logprobs
        self.num_adjusted = 0  # live requests with penalties, a logit bias or min_tokens
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # core id -> token ids, biases
        self.suppress: dict[int, np.ndarray] = {}  # core id -> ids min_tokens holds back
        self.prompts: dict[int, np.ndarray] = {}  # core id -> prompt ids, for penalized requests
        self.history: History | None = None  # a sequence's output so far (the engine's core)
        self.device, self.vocab_size, self.max_rows = device, vocab_size, max_num_seqs
        self.by_row = {
            c: torch.zeros(max_num_seqs, dtype=_dtype(getattr(self, c)), device=device) for c in ROW_COLUMNS
        }
        # allocated when a request first needs them: [rows, vocab] output-token counts and
        # prompt-token marks (penalties), [rows, W] logit biases
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.bias_ids: torch.Tensor | None = None
        self.bias_vals: torch.Tensor | None = None

    def set(
        self,
        i: int,
        p: SamplingParams,
        seed: int,
        prompt: list[int] | None = None,
        stop_ids: list[int] | None = None,
    ) -> None:
        """Request ``i``'s parameters (``prompt``: its ids, for the repetition penalty and
        ``min_tokens``; ``stop_ids``: the ids ``min_tokens`` holds back, EOS included)."""
        if i >= len(self.seed):
            for name in (*ROW_COLUMNS, "logprobs", "penalized", "min_tokens", "prompt_len"):
                col = getattr(self, name)
                grow = np.full(max(i + 1, 2 * len(col)) - len(col), 1 if name == "repetition_penalty" else 0)
                setattr(self, name, np.concatenate([col, grow.astype(col.dtype)]))
        self.temperature[i], self.top_k[i], self.top_p[i], self.min_p[i] = (
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
        )
        self.seed[i] = seed
        self.logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.num_random += p.temperature > 0
        self.num_logprobs += p.logprobs is not None
        self.presence_penalty[i], self.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
        self.repetition_penalty[i], self.penalized[i] = p.repetition_penalty, p.penalized
        self.min_tokens[i], self.prompt_len[i] = p.min_tokens, len(prompt or ())
        if p.penalized:
            self.prompts[i] = np.asarray(prompt or [], np.int64)
        if p.logit_bias:
            self.bias[i] = (
                np.fromiter(p.logit_bias, np.int64),
                np.fromiter(p.logit_bias.values(), np.float32),
            )
        if p.min_tokens and stop_ids:
            self.suppress[i] = np.unique(np.asarray(stop_ids, np.int64))
        self.num_adjusted += p.penalized or bool(p.logit_bias) or i in self.suppress

    def clear(self, i: int) -> None:
        self.num_random -= bool(self.temperature[i] > 0)
        self.num_logprobs -= bool(self.logprobs[i] >= 0)
        self.num_adjusted -= bool(self.penalized[i]) or i in self.bias or i in self.suppress
        self.temperature[i], self.logprobs[i], self.penalized[i] = 0.0, -1, False
        self.bias.pop(i, None)
        self.suppress.pop(i, None)
        self.prompts.pop(i, None)

    def args(self, out: Any) -> SampleArgs:
        """What sampling the planned step ``out`` (a ``SchedulerOutput``) needs from the table."""
        ids = out.added_req_ids
        added = {c: getattr(self, c)[ids] for c in ROW_COLUMNS} if len(ids) else {}
        wanted = None
        if self.num_logprobs:
            wanted = [None if n < 0 else n for n in self.logprobs[out.sample_req_ids].tolist()]
        random, filters = np.zeros(0, np.int64), Filters(False, False, False)
        if self.num_random:
            sid = out.sample_req_ids
            random = np.flatnonzero(self.temperature[sid] > 0)
            r = sid[random]
            filters = Filters(
                bool((self.top_k[r] > 0).any()),
                bool((self.top_p[r] < 1).any()),
                bool((self.min_p[r] > 0).any()),
            )
        adjust = self._adjust_args(out) if self.num_adjusted else None
        return SampleArgs(out.rows_added.astype(np.int64), added, random, filters, wanted, adjust)

    def _adjust_args(self, out: Any) -> Adjust | None:
        sid = out.sample_req_ids
        penalized = np.flatnonzero(self.penalized[sid])
        biased = np.flatnonzero([r in self.bias for r in sid.tolist()]) if self.bias else penalized[:0]
        suppress = None
        if self.suppress:
            b = np.searchsorted(out.qo_indptr, out.logits_indices, side="right") - 1
            num_out = out.seq_lens[b] - self.prompt_len[sid]  # output tokens before this sample
            early = np.flatnonzero(num_out < self.min_tokens[sid])
            pairs = [(s, t) for s in early.tolist() for t in self.suppress.get(int(sid[s]), _NONE).tolist()]
            if pairs:
                suppress = (
                    np.array([p[0] for p in pairs], np.int64),
                    np.array([p[1] for p in pairs], np.int64),
                )
        count = penalized[:0]
        if len(penalized):
            b = np.searchsorted(out.qo_indptr, out.logits_indices[penalized], side="right") - 1
            count = penalized[out.seq_indices[b] == out.sample_seq_indices[penalized]]  # not forks yet
        penalty_rows, bias_rows = [], []
        for row, r, k in zip(
            out.rows_added.tolist(), out.added_req_ids.tolist(), out.added_seq_indices.tolist(), strict=True
        ):
            if self.penalized[r] and self.history is not None:
                output = self.history(r, k)[1]
                penalty_rows.append((row, self.prompts[r], output.astype(np.int64)))
            if r in self.bias:
                bias_rows.append((row, *self.bias[r]))
        if not (len(penalized) or len(biased) or suppress or penalty_rows or bias_rows):
            return None
        return Adjust(penalized, count, biased, suppress, penalty_rows, bias_rows)

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
        r = torch.from_numpy(a.rows_added).to(self.device)
        for c, t in self.by_row.items():
            t[r] = torch.from_numpy(a.added[c]).to(self.device)
        if a.adjust is not None:
            self._write_adjust_rows(a.adjust, top)

    def _write_adjust_rows(self, adj: Adjust, top: int) -> None:
        dev, rows = self.device, max(top, self.max_rows)
        if adj.penalty_rows:
            self.counts = _grown(self.counts, rows, self.vocab_size, torch.int32, dev)
            self.in_prompt = _grown(self.in_prompt, rows, self.vocab_size, torch.bool, dev)
        for row, prompt, output in adj.penalty_rows:  # the counts of what the sequence holds now
            assert self.counts is not None and self.in_prompt is not None
            self.counts[row].zero_()
            out_ids = torch.from_numpy(output).to(dev)
            self.counts[row].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
            self.in_prompt[row].zero_()
            self.in_prompt[row, torch.from_numpy(prompt).to(dev)] = True
        if not adj.bias_rows:
            return
        width = max(len(ids) for _, ids, _ in adj.bias_rows)
        self.bias_ids = _grown(self.bias_ids, rows, width, torch.int64, dev)
        self.bias_vals = _grown(self.bias_vals, rows, width, torch.float32, dev)
        for row, ids, vals in adj.bias_rows:  # padded with token 0, bias 0
            self.bias_ids[row].zero_()
            self.bias_vals[row].zero_()
            self.bias_ids[row, : len(ids)] = torch.from_numpy(ids).to(dev)
            self.bias_vals[row, : len(vals)] = torch.from_numpy(vals).to(dev)

    def _adjusted(self, logits: torch.Tensor, rows: np.ndarray, adj: Adjust) -> torch.Tensor:
        """The logits with ``min_tokens``, the logit biases and the penalties applied (a copy)."""
        lg, dev = logits.clone(), logits.device

        def on(samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.from_numpy(samples).to(dev), torch.from_numpy(rows[samples].astype(np.int64)).to(dev)

        if adj.suppress is not None:
            lg[torch.from_numpy(adj.suppress[0]).to(dev), torch.from_numpy(adj.suppress[1]).to(dev)] = float(
                "-inf"
            )
        if len(adj.biased):
            assert self.bias_ids is not None and self.bias_vals is not None
            idx, r = on(adj.biased)
            lg.index_copy_(
                0, idx, lg.index_select(0, idx).scatter_add_(1, self.bias_ids[r], self.bias_vals[r])
            )
        if len(adj.penalized):
            assert self.counts is not None and self.in_prompt is not None
            idx, r = on(adj.penalized)
            x, cnt = lg.index_select(0, idx), self.counts[r]
            rp = self.by_row["repetition_penalty"][r][:, None]
            x = torch.where((cnt > 0) | self.in_prompt[r], torch.where(x > 0, x / rp, x * rp), x)
            x = x - self.by_row["frequency_penalty"][r][:, None] * cnt
            x = x - self.by_row["presence_penalty"][r][:, None] * (cnt > 0)
            lg.index_copy_(0, idx, x)
        return lg

    def _count(self, tokens: torch.Tensor, rows: np.ndarray, adj: Adjust) -> None:
        """Adds this step's sampled tokens to their rows' counts (penalized sequences only)."""
        if not len(adj.count) or self.counts is None:
            return
        dev = tokens.device
        r = torch.from_numpy(rows[adj.count].astype(np.int64)).to(dev)
        t = tokens[torch.from_numpy(adj.count).to(dev)].long()
        self.counts.index_put_((r, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)

    def sample(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        seq_indices: np.ndarray,
        positions: np.ndarray,
        a: SampleArgs,
    ) -> tuple[torch.Tensor, list[dict[int, float] | None] | None]:
        """One token per row of ``logits``: sample i is of batch row ``rows[i]``, fork
        ``seq_indices[i]``, sampling the token at ``positions[i]``; and the samples' logprobs
        when any wants them."""
        raw = logits  # logprobs are the model's own
        if a.adjust is not None:
            logits = self._adjusted(logits, rows, a.adjust)
        if not a.any_random and logits.device.type == "cpu":
            # numpy's argmax: ~6x faster than torch's on CPU at [256, vocab] (no thread pool)
            tokens = torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int32))
        elif not a.any_random:
            tokens = logits.argmax(dim=-1).to(torch.int32)
        else:  # the random samples' parameters by their rows; no device-side test of any of them
            dev = logits.device
            sel = a.random
            r = torch.from_numpy(rows[sel].astype(np.int64)).to(dev)
            p = {c: t[r] for c, t in self.by_row.items()}
            forks = torch.from_numpy(seq_indices[sel].astype(np.int64)).to(dev)
            idx = torch.from_numpy(sel).to(dev)
            chosen = sample_random(
                logits.index_select(0, idx),
                p["temperature"],
                p["top_k"],
                p["top_p"],
                p["min_p"],
                p["seed"] + 1000003 * forks,
                torch.from_numpy(positions[sel].astype(np.int64)).to(dev),
                a.filters,
            )
            tokens = logits.argmax(dim=-1).index_copy(0, idx, chosen).to(torch.int32)
        if a.adjust is not None:
            self._count(tokens, rows, a.adjust)
        if a.wanted is None:
            return tokens, None
        return tokens, gather_logprobs(raw, tokens, a.wanted)


def _grown(
    t: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``t`` with at least ``rows`` x ``cols`` (zeros added; what it held kept)."""
    if t is not None and t.shape[0] >= rows and t.shape[1] >= cols:
        return t
    old = (0, 0) if t is None else t.shape
    new = torch.zeros(max(rows, old[0]), max(cols, old[1]), dtype=dtype, device=device)
    if t is not None:
        new[: old[0], : old[1]] = t
    return new


def _dtype(col: np.ndarray) -> torch.dtype:
    return torch.int64 if col.dtype == np.int64 else torch.float32
