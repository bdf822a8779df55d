"""Per-row logit state beyond the filters: penalties (each penalized row's output-token counts
and prompt marks), logit biases (a padded per-row table), fixed masks (``allowed_token_ids``,
one-token bad words), ``min_tokens`` and bad words of several tokens; and prompt logprobs. The
tensors live on the device, allocated only once a request needs them; a row's state is written
when a sequence takes it (from the core's tokens, so it survives preemption), and counts grow by
each step's sampled tokens. ``SamplingTable`` (``sampling_table.py``) decides per step what
applies (``adjust_args``, ``prompt_args``, on the host when the step is planned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferryman.outputs import Logprob
from ferryman.worker.sampler import ranked_logprobs
from ferryman.worker.transfer import to_device

_NONE = np.zeros(0, np.int64)


@dataclass(slots=True)
class Adjust:
    """What a step changes in its logits before sampling (none of it on most steps): sample
    indices of each kind, the rows taking penalized, biased or masked requests with their state,
    and the (sample, token) pairs ``min_tokens`` and the bad words forbid."""

    penalized: np.ndarray  # int64 samples whose requests have penalties
    count: np.ndarray  # int64 samples whose token adds to their row's counts
    biased: np.ndarray  # int64 samples with a logit bias
    suppress: tuple[np.ndarray, np.ndarray] | None  # (samples, token ids) min_tokens holds back
    penalty_rows: list[tuple[int, np.ndarray, np.ndarray]]  # (row, prompt ids, output ids)
    bias_rows: list[tuple[int, np.ndarray, np.ndarray]]  # (row, token ids, biases)
    masked: np.ndarray  # int64 samples whose rows have a fixed mask
    mask_rows: list[tuple[int, np.ndarray | None, np.ndarray]]  # (row, allowed or None, barred)
    barred: tuple[np.ndarray, np.ndarray] | None  # (samples, token ids) the bad words forbid

    @property
    def forbids(self) -> bool:
        """Whether a request forbids tokens outright (allowed_token_ids, bad words) in this step."""
        return len(self.masked) > 0 or self.barred is not None


@dataclass(slots=True)
class PromptArgs:
    """The prompt positions a step computes for requests that want prompt logprobs: each entry's
    token index in the step's inputs (whose logits predict the next prompt token), that target
    token, the request's core id, the target's prompt position and how many top logprobs."""

    at: np.ndarray  # int64
    targets: np.ndarray  # int64
    req_ids: np.ndarray  # int64
    positions: np.ndarray  # int64
    top: np.ndarray  # int64


def prompt_logprobs(logits: torch.Tensor, a: PromptArgs) -> list[tuple[int, int, dict[int, Logprob], int]]:
    """(core id, prompt position, {token: Logprob}, the target's rank) from the logits of
    ``a.at``'s rows: the target's logprob and the top N (log-softmax of the raw logits), ranked as
    ``ranked_logprobs`` ranks them; the target's rank is vLLM's ``Logprob.rank`` (1: the most
    likely)."""
    targets = torch.from_numpy(a.targets).to(logits.device)
    dicts = ranked_logprobs(logits, targets, a.top.tolist())
    out = []
    for r, pos, t, d in zip(a.req_ids.tolist(), a.positions.tolist(), a.targets.tolist(), dicts, strict=True):
        out.append((r, pos, d, int(d[t].rank or 0)))
    return out


def prompt_args(table: Any, out: Any) -> PromptArgs | None:
    """The step's prompt positions whose next token's logprob is wanted."""
    rids = out.req_ids
    parts = []
    for b in np.flatnonzero(table.prompt_lp[rids] >= 0).tolist():
        r = int(rids[b])
        qs, qe, end = int(out.qo_indptr[b]), int(out.qo_indptr[b + 1]), int(out.seq_lens[b])
        start, prompt = end - (qe - qs), table.prompts[r]
        pos = np.arange(start, min(end, len(prompt) - 1))  # its logits predict pos + 1
        if len(pos):
            parts.append(
                (qs + pos - start, prompt[pos + 1], np.full(len(pos), r), pos + 1, table.prompt_lp[r])
            )
    if not parts:
        return None
    at, targets, req_ids, positions = (
        np.concatenate([p[j] for p in parts]).astype(np.int64) for j in range(4)
    )
    top = np.concatenate([np.full(len(p[0]), p[4], np.int64) for p in parts])
    return PromptArgs(at, targets, req_ids, positions, top)


def adjust_args(table: Any, out: Any) -> Adjust | None:
    """What the planned step ``out`` changes in its logits, from the table's requests."""
    sid = out.sample_req_ids
    sids = sid.tolist()
    penalized = np.flatnonzero(table.penalized[sid])
    biased = np.flatnonzero([r in table.bias for r in sids]) if table.bias else _NONE
    fixed = table.masks.fixed
    masked = np.flatnonzero([r in fixed for r in sids]) if fixed else _NONE
    suppress = barred = None
    b = np.searchsorted(out.qo_indptr, out.logits_indices, side="right") - 1  # each sample's row
    if table.suppress:
        num_out = out.seq_lens[b] - table.prompt_len[sid]  # output tokens before this sample
        early = np.flatnonzero(num_out < table.min_tokens[sid])
        suppress = _pairs(
            [(s, t) for s in early.tolist() for t in table.suppress.get(sids[s], _NONE).tolist()]
        )
    if table.masks.words:
        barred = _pairs(table.masks.pairs(sids, out.sample_seq_indices.tolist(), table.history))
    count = penalized[:0]
    if len(penalized):  # a sample counts for its row unless it is another fork's first token
        count = penalized[out.seq_indices[b[penalized]] == out.sample_seq_indices[penalized]]
    penalty_rows, bias_rows, mask_rows = [], [], []
    for row, r, k in zip(
        out.rows_added.tolist(), out.added_req_ids.tolist(), out.added_seq_indices.tolist(), strict=True
    ):
        if table.penalized[r] and table.history is not None:
            penalty_rows.append((row, table.prompts[r], table.history(r, k).astype(np.int64)))
        if r in table.bias:
            bias_rows.append((row, *table.bias[r]))
        if r in fixed:
            mask_rows.append((row, *fixed[r]))
    rows = penalty_rows or bias_rows or mask_rows
    if not (len(penalized) or len(biased) or len(masked) or suppress or barred or rows):
        return None
    return Adjust(penalized, count, biased, suppress, penalty_rows, bias_rows, masked, mask_rows, barred)


def _pairs(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(samples, token ids) of (sample, token) pairs; None for none."""
    if not pairs:
        return None
    return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)


class LogitState:
    """The device tensors of penalties and biases, by batch row."""

    def __init__(self, device: torch.device, vocab_size: int, max_rows: int) -> None:
        self.device, self.vocab_size, self.max_rows = device, vocab_size, max_rows
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32 output-token counts
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab] bool prompt tokens
        self.bias_ids: torch.Tensor | None = None  # [rows, W] int64, padded with token 0
        self.bias_vals: torch.Tensor | None = None  # [rows, W] float32, padded with 0
        self.blocked: torch.Tensor | None = None  # [rows, vocab] bool: never sampled

    def write_rows(self, adj: Adjust, top: int) -> None:
        """The rows the step gives penalized, biased or masked requests get their state."""
        dev, rows = self.device, max(top, self.max_rows)
        if adj.mask_rows:
            self.blocked = _grown(self.blocked, rows, self.vocab_size, torch.bool, dev)
        for row, allowed, barred in adj.mask_rows:
            assert self.blocked is not None
            self.blocked[row] = allowed is not None
            if allowed is not None:
                self.blocked[row, to_device(allowed, dev)] = False
            self.blocked[row, to_device(barred, dev)] = True
        if adj.penalty_rows:
            self.counts = _grown(self.counts, rows, self.vocab_size, torch.int32, dev)
            self.in_prompt = _grown(self.in_prompt, rows, self.vocab_size, torch.bool, dev)
        for row, prompt, output in adj.penalty_rows:  # the counts of what the sequence holds now
            assert self.counts is not None and self.in_prompt is not None
            self.counts[row].zero_()
            out_ids = to_device(output, dev)
            self.counts[row].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
            self.in_prompt[row].zero_()
            self.in_prompt[row, to_device(prompt, dev)] = True
        if not adj.bias_rows:
            return
        width = max(len(ids) for _, ids, _ in adj.bias_rows)
        self.bias_ids = _grown(self.bias_ids, rows, width, torch.int64, dev)
        self.bias_vals = _grown(self.bias_vals, rows, width, torch.float32, dev)
        for row, ids, vals in adj.bias_rows:  # padded with token 0, bias 0
            self.bias_ids[row].zero_()
            self.bias_vals[row].zero_()
            self.bias_ids[row, : len(ids)] = to_device(ids, dev)
            self.bias_vals[row, : len(vals)] = to_device(vals, dev)

    def masked(self, logits: torch.Tensor, rows: np.ndarray, adj: Adjust) -> torch.Tensor:
        """The logits with only what the requests forbid outright (``allowed_token_ids``, bad
        words) at -inf (a copy): what a grammar falls back to when ``min_tokens`` leaves it
        nothing. -inf is added, never written (as a grammar's mask): a NaN or +inf logit stays
        non-finite, so the fault check still sees it."""
        lg, dev = logits.clone(), logits.device
        if len(adj.masked):
            assert self.blocked is not None
            idx, r = _on(adj.masked, rows, dev)
            bias = torch.where(self.blocked[r], float("-inf"), 0.0).to(lg.dtype)
            lg.index_copy_(0, idx, lg.index_select(0, idx) + bias)
        if adj.barred is not None:
            _forbid(lg, adj.barred, dev)
        return lg

    def apply(
        self, logits: torch.Tensor, rows: np.ndarray, adj: Adjust, by_row: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The logits with the masks (``masked``), ``min_tokens``, the logit biases and the
        penalties applied (a copy)."""
        lg, dev = self.masked(logits, rows, adj), logits.device
        if adj.suppress is not None:
            _forbid(lg, adj.suppress, dev)
        if len(adj.biased):
            assert self.bias_ids is not None and self.bias_vals is not None
            idx, r = _on(adj.biased, rows, dev)
            lg.index_copy_(
                0, idx, lg.index_select(0, idx).scatter_add_(1, self.bias_ids[r], self.bias_vals[r])
            )
        if len(adj.penalized):
            assert self.counts is not None and self.in_prompt is not None
            idx, r = _on(adj.penalized, rows, dev)
            x, cnt = lg.index_select(0, idx), self.counts[r]
            rp = by_row["repetition_penalty"][r][:, None]
            x = torch.where((cnt > 0) | self.in_prompt[r], torch.where(x > 0, x / rp, x * rp), x)
            x = x - by_row["frequency_penalty"][r][:, None] * cnt
            x = x - by_row["presence_penalty"][r][:, None] * (cnt > 0)
            lg.index_copy_(0, idx, x)
        return lg

    def count(self, tokens: torch.Tensor, rows: np.ndarray, adj: Adjust) -> None:
        """Adds this step's sampled tokens to their rows' counts (penalized sequences only)."""
        if not len(adj.count) or self.counts is None:
            return
        dev = tokens.device
        r = to_device(rows[adj.count].astype(np.int64), dev)
        t = tokens[to_device(adj.count, dev)].long()
        self.counts.index_put_((r, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)


def _on(samples: np.ndarray, rows: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples, and their batch rows, on the device."""
    return to_device(samples, dev), to_device(rows[samples].astype(np.int64), dev)


def _forbid(lg: torch.Tensor, pairs: tuple[np.ndarray, np.ndarray], dev: torch.device) -> None:
    """-inf added (not written: NaN and +inf stay non-finite) at the (sample, token) pairs."""
    at = (to_device(pairs[0], dev), to_device(pairs[1], dev))
    lg[at] = lg[at] - float("inf")


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
