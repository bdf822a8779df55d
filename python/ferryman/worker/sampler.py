"""Vectorized sampling: greedy, temperature, top-k, top-p, min-p, one batched pass.

Random rows use an exponential race (argmax of p / E with E ~ Exp(1)) whose noise is a
counter-based hash of (request seed, position, token id), so a request's samples depend only on
its own seed and position — never on the batch it ran in or on other requests.

The engine runs these torch ops on CUDA; on CPU it runs the core's sampler
(``ferryman._core.sample_cpu``, a step's samples in one call), the same algorithm and noise per
row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferryman.outputs import Logprob

if TYPE_CHECKING:
    pass

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
    # the largest top-k of those rows (0: unknown); with top-p off, a top-k below the vocabulary
    # is selected (``topk``), not sorted
    top_k_max: int = 0


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

    One sort serves top-k and top-p; it is stable, so among tied logits top-p keeps the lowest
    token ids first (the order of the core's CPU sampler, which the engine runs on CPU instead of
    this). Top-k without top-p, where ``filters.top_k_max`` is known and below the vocabulary,
    selects each row's k-th largest with ``topk`` instead (the same threshold, no sort of the
    vocabulary; the race then covers whole rows). On CPU, when they filter, the race runs only
    over each row's survivors (a prefix of its sorted order; every other token has probability 0
    and cannot win), so its noise costs
    ``[R, W]`` with W the most survivors of any row, not ``[R, V]``; the probabilities are still
    computed over whole vocabulary rows and the race's padding is exact zeros, so a row's sample
    never depends on the batch. On CUDA the race covers the whole row: W would have to be read
    back from the device, a wait per step
    (``window`` overrides the choice; both give the same tokens)."""
    lg = logits / temperature[:, None]
    vocab = lg.shape[-1]
    order, width = None, vocab  # each row's token ids by descending logit, when a filter needs them
    if filters.top_k and not filters.top_p and 0 < filters.top_k_max < vocab:
        # the k-th largest by selection over the largest k of any row: the same threshold as
        # the sort's, ties kept alike; rows with top-k off keep every token
        best = lg.topk(filters.top_k_max, dim=-1).values
        kth = best.gather(1, (top_k.clamp(1, filters.top_k_max) - 1)[:, None])
        kth = kth.masked_fill((top_k <= 0)[:, None], float("-inf"))
        lg = lg.masked_fill(lg < kth, float("-inf"))
    elif filters.top_k or filters.top_p:
        sorted_lg, order = lg.sort(dim=-1, descending=True, stable=True)
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
    filters = Filters(bool((k > 0).any()), bool((p < 1).any()), bool((mp > 0).any()), int(k.max()))
    chosen = sample_random(logits[r], temperature[r], k, p, mp, seeds[r], positions[r], filters)
    return greedy.index_copy(0, r, chosen).to(torch.int32)


def gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> list[dict[int, Logprob] | None]:
    """For rows that ask for logprobs: the sampled token's and the top-N of the model's
    distribution (log-softmax of the raw logits, or of those a grammar masks), as
    ``ranked_logprobs`` gives them."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    out: list[dict[int, Logprob] | None] = [None] * len(wanted)
    if rows:
        dicts = ranked_logprobs(logits[rows], tokens[rows].long(), [wanted[i] or 0 for i in rows])
        for i, d in zip(rows, dicts, strict=True):
            out[i] = d
    return out


def ranked_logprobs(logits: torch.Tensor, targets: torch.Tensor, tops: list[int]) -> list[dict[int, Logprob]]:
    """Per row of ``logits`` (its log-softmax): ``{token_id: Logprob}`` of its top ``tops[i]``
    tokens, ranked 1..N in order, and of its target (``targets[i]``, int64 on the logits'
    device), ranked 1 + the tokens likelier (vLLM's ``Logprob.rank``); a -inf token (one a
    grammar forbids) is never among the top N, so fewer may come."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen_t = lp.gather(1, targets[:, None])
    ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    top = max(tops, default=0)
    vals, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], lp[:, :0].long())
    vals_l, ids_l = vals.tolist(), ids.tolist()
    out = []
    for i, (t, n) in enumerate(zip(targets.tolist(), tops, strict=True)):
        pairs = zip(ids_l[i][:n], vals_l[i][:n], strict=True)
        d = {k: Logprob(v, j + 1) for j, (k, v) in enumerate(pairs) if v != float("-inf")}
        d[t] = Logprob(chosen[i], int(ranks[i]))
        out.append(d)
    return out
