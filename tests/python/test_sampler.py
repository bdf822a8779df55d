"""The sampler against a plain reference: the exponential race over the whole vocabulary, top-k
and top-p each by their own sort. The sampler sorts once and races only each row's survivors;
it must pick the same tokens, and a row's token must not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from ferryman.worker.sampler import Filters, _uniform, sample, sample_random


def reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> list[int]:
    out = []
    vocab = logits.shape[-1]
    for i in range(len(logits)):
        if temperature[i] == 0:
            out.append(int(logits[i].argmax()))
            continue
        lg = logits[i] / temperature[i]
        if top_k[i] > 0:
            kth = lg.sort(descending=True).values[min(int(top_k[i]), vocab) - 1]
            lg = lg.masked_fill(lg < kth, float("-inf"))
        if top_p[i] < 1:
            s, order = lg.sort(descending=True)
            probs = s.softmax(-1)
            drop = probs.cumsum(-1) - probs > top_p[i]
            lg = torch.full_like(lg, float("-inf")).scatter(0, order, s.masked_fill(drop, float("-inf")))
        probs = lg.softmax(-1)
        if min_p[i] > 0:
            probs = probs.masked_fill(probs < min_p[i] * probs.max(), 0.0)
        ids = torch.arange(vocab, dtype=torch.int64)
        noise = -torch.log(_uniform(seeds[i : i + 1], positions[i : i + 1], ids))[0]
        out.append(int((probs.double() / noise).argmax()))
    return out


@pytest.mark.parametrize("vocab", [7, 259, 4096])
def test_sample_matches_the_full_vocabulary_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.tensor([0.0 if i % 7 == 0 else 0.5 + (i % 5) * 0.3 for i in range(rows)])
    top_k = torch.tensor([[-1, 1, 5, 40, vocab + 3][i % 5] for i in range(rows)], dtype=torch.int64)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99][i % 4] for i in range(rows)])
    min_p = torch.tensor([[0.0, 0.0, 0.05][i % 3] for i in range(rows)])
    seeds = torch.arange(rows, dtype=torch.int64) * 1009 + 17
    positions = torch.arange(rows, dtype=torch.int64) % 13 + 5
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    want = reference(*args)
    assert sample(*args).tolist() == want
    # each row alone gives its token in the batch, whatever the others' filters and widths
    for i in range(0, rows, 9):
        one = tuple(a[i : i + 1] for a in args)
        assert sample(*one).tolist() == [want[i]]
    # only top-k rows (the race over candidates), and only unfiltered rows (the whole row)
    for k, p in ((torch.full((rows,), 8), torch.ones(rows)), (torch.full((rows,), -1), torch.ones(rows))):
        args = (logits, temperature, k.to(torch.int64), p, min_p, seeds, positions)
        assert sample(*args).tolist() == reference(*args)
    # the race over whole rows (what CUDA runs, so no width is read back) picks the same tokens
    r = (temperature > 0).nonzero()[:, 0]
    rows_r = (logits[r], temperature[r], top_k[r], top_p[r], min_p[r], seeds[r], positions[r])
    every = Filters(top_k=True, top_p=True, min_p=True)
    whole = sample_random(*rows_r, every, window=False)
    assert whole.tolist() == sample_random(*rows_r, every, window=True).tolist()
    assert whole.tolist() == [want[i] for i in r.tolist()]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_table_flags_rows_whose_largest_logit_is_not_finite(temperature: float) -> None:
    """NaN or +inf anywhere in a row, or a row all -inf, is a fault (``ok`` False); one -inf
    among finite logits is a token of probability zero and samples normally. Greedy rows on CPU
    take numpy's argmax, random rows torch's: both paths are checked."""
    import numpy as np

    from ferryman.sampling_params import SamplingParams
    from ferryman.worker.sampling_table import SamplingTable

    vocab, n = 16, 5
    table = SamplingTable(n, torch.device("cpu"), vocab)
    for i in range(n):
        table.set(i, SamplingParams(temperature=temperature, max_tokens=4), seed=i)
    ids = np.arange(n, dtype=np.int64)

    class Plan:  # what ``args`` reads of a planned step
        added_req_ids = sample_req_ids = ids
        rows_added = ids

    args = table.args(Plan())
    table.write_rows(args)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, 5] = float("-inf")
    tokens, ok, _ = table.sample(logits, ids, np.zeros(n, np.int64), np.full(n, 9, np.int64), args)
    assert ok.tolist() == [True, False, False, False, True]
    assert int(tokens[4]) != 5 and 0 <= int(tokens[0]) < vocab
    if temperature == 0.0:
        assert tokens[[0, 4]].tolist() == logits[[0, 4]].argmax(dim=-1).tolist()
