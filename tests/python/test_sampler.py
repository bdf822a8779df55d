"""The samplers against a plain reference: the exponential race over the whole vocabulary, top-k
and top-p each by their own sort. The torch sampler sorts once and races only each row's
survivors, the core's CPU sampler (``sample_random_cpu``) selects instead of sorting and skips
tokens that cannot win; both must pick the same tokens, and a row's token must not depend on the
rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferryman import _core
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
            s, order = lg.sort(descending=True, stable=True)
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


def core_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> list[int]:
    """``sample``'s contract through the core's sampler: greedy rows by argmax, the rest random."""
    out = logits.argmax(dim=-1).numpy().copy()
    r = (temperature > 0).nonzero()[:, 0].numpy()
    cols = [t.numpy()[r] for t in (temperature, top_k, top_p, min_p, seeds, positions)]
    out[r] = _core.sample_random_cpu(logits.numpy(), r.astype(np.int64), *cols)
    return [int(t) for t in out]


@pytest.mark.parametrize("vocab", [7, 259, 4096])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_core_sampler_matches_the_reference(vocab: int, scale: float) -> None:
    """Flat, moderate and peaked rows; every filter alone and mixed, with ties in the logits."""
    g = torch.Generator().manual_seed(vocab + int(scale * 10))
    rows = 96
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[::11, : vocab // 2] = logits[::11, :1]  # rows with many tied logits
    logits[5::13, 1::3] = float("-inf")  # tokens a grammar or a bias removed
    temperature = torch.tensor([0.0 if i % 17 == 0 else 0.25 + (i % 6) * 0.3 for i in range(rows)])
    top_k = torch.tensor([[-1, 1, 5, 40, vocab + 3, 0][i % 6] for i in range(rows)], dtype=torch.int64)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99, 0.05][i % 5] for i in range(rows)])
    min_p = torch.tensor([[0.0, 0.0, 0.05, 0.3][i % 4] for i in range(rows)])
    seeds = torch.arange(rows, dtype=torch.int64) * 1009 - 300
    positions = torch.arange(rows, dtype=torch.int64) % 13 + 5
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    assert core_sample(*args) == reference(*args)
    # top-p alone over the whole vocabulary (the sorted prefix grows until the cut is inside)
    no_k = torch.full((rows,), -1, dtype=torch.int64)
    args = (logits, temperature, no_k, top_p, min_p, seeds, positions)
    assert core_sample(*args) == reference(*args)
    # -0 and +0 at the top are a tie, kept by id (as the torch sampler sorts them), not by sign
    zeros = torch.full((rows, vocab), -5.0)
    zeros[:, 0], zeros[:, vocab - 1] = -0.0, 0.0
    tight = torch.full((rows,), 1e-6)
    for k in (torch.ones(rows, dtype=torch.int64), no_k):
        args = (zeros, temperature.clamp(min=0.25), k, tight, torch.zeros(rows), seeds, positions)
        assert core_sample(*args) == reference(*args) == [int(t) for t in sample(*args)] == [0] * rows


def test_core_sampler_refuses_bad_arguments() -> None:
    lg = np.zeros((2, 5), np.float32)
    one = (np.ones(1, np.float32), np.zeros(1, np.int64), np.ones(1, np.float32), np.zeros(1, np.float32))
    seed_pos = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    # a flat row: the token whose noise is largest
    want = reference(*(torch.from_numpy(a) for a in (lg[1:], *one, *seed_pos)))
    assert _core.sample_random_cpu(lg, np.array([1]), *one, *seed_pos).tolist() == want
    with pytest.raises(_core.InvalidRequestError, match="out of range"):
        _core.sample_random_cpu(lg, np.array([2]), *one, *seed_pos)
    with pytest.raises(_core.InvalidRequestError, match="one entry per row"):
        _core.sample_random_cpu(lg, np.array([0, 1]), *one, *seed_pos)
    with pytest.raises(_core.InvalidRequestError, match="temperature"):
        _core.sample_random_cpu(lg, np.array([0]), np.zeros(1, np.float32), *one[1:], *seed_pos)
    with pytest.raises(_core.InvalidRequestError, match="contiguous"):
        _core.sample_random_cpu(np.zeros((2, 10), np.float32)[:, ::2], np.array([0]), *one, *seed_pos)


def _greedy_cols(num_rows: int) -> tuple[np.ndarray, ...]:
    """By-row sampling columns of ``num_rows`` greedy rows (temperature 0), ``sample_cpu``'s."""
    return (
        np.zeros(num_rows, np.float32),
        np.full(num_rows, -1, np.int64),
        np.ones(num_rows, np.float32),
        np.zeros(num_rows, np.float32),
        np.zeros(num_rows, np.int64),
    )


@pytest.mark.parametrize("vocab", [1, 7, 259, 49152])
def test_core_greedy_is_numpys_argmax_and_marks_rows_that_are_not_finite(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    lg = rng.integers(-3, 4, size=(64, vocab)).astype(np.float32)  # few values: many ties
    if vocab > 1:
        lg[1, vocab // 2] = np.nan
        lg[2, -1] = np.inf
        lg[4, 0] = -np.inf  # one -inf among finite logits: an ordinary row
    lg[3, :] = -np.inf
    lg[5, :] = 1e30 if vocab > 1 else -1e30
    lg[6, -1] = np.nan  # in the tail the eight lanes leave
    best = lg.argmax(axis=-1)
    want = np.where(np.isfinite(lg[np.arange(64), best]), best, -1)
    rows = np.arange(64, dtype=np.int32)
    got, num_bad = _core.sample_cpu(lg, rows, rows * 0, rows, *_greedy_cols(64), 7)
    assert got.dtype == np.int32 and got.tolist() == want.tolist()
    assert num_bad == int((want < 0).sum()) == (4 if vocab > 1 else 2)
    with pytest.raises(_core.InvalidRequestError, match="contiguous"):
        _core.sample_cpu(lg[::2], rows[:32], rows[:32], rows[:32], *_greedy_cols(64), 7)
    none = np.zeros(0, np.int32)
    got, _ = _core.sample_cpu(np.zeros((0, vocab), np.float32), none, none, none, *_greedy_cols(4), 7)
    assert got.tolist() == []


def test_core_step_sampler_draws_random_rows_by_their_batch_rows() -> None:
    """``sample_cpu``: sample i reads batch row ``rows[i]``'s parameters; random where its
    temperature is > 0 (``sample_random_cpu``'s token, with the fork's seed), else the argmax;
    a random row that is not finite is -1."""
    n, vocab, num_rows = 6, 300, 8
    lg = (np.random.default_rng(3).standard_normal((n, vocab)) * 4).astype(np.float32)
    lg[4, 9] = np.nan
    temperature, top_k, top_p, min_p, seed = _greedy_cols(num_rows)
    temperature[[2, 5, 7]] = 0.7, 1.3, 0.9
    top_k[5], top_p[7], min_p[2] = 20, 0.8, 0.05
    seed[:] = np.arange(num_rows) * 11 + 3
    rows = np.array([7, 0, 5, 2, 5, 1], np.int32)
    forks = np.array([0, 0, 2, 0, 1, 0], np.int32)
    positions = np.array([40, 41, 42, 43, 44, 45], np.int32)
    cols = (temperature, top_k, top_p, min_p, seed)
    got, num_bad = _core.sample_cpu(lg, rows, forks, positions, *cols, 1000003)
    assert num_bad == 1 and got[4] == -1
    rand = [0, 2, 3]  # samples whose rows sample at random
    r = rows[rand]
    want = _core.sample_random_cpu(
        lg,
        np.array(rand, np.int64),
        temperature[r],
        top_k[r],
        top_p[r],
        min_p[r],
        seed[r] + 1000003 * forks[rand].astype(np.int64),
        positions[rand].astype(np.int64),
    )
    assert got[rand].tolist() == want.tolist()
    assert got[[1, 5]].tolist() == lg[[1, 5]].argmax(axis=-1).tolist()
    with pytest.raises(_core.InvalidRequestError, match="out of range"):
        _core.sample_cpu(lg, rows + 8, forks, positions, *cols, 7)
    with pytest.raises(_core.InvalidRequestError, match="one entry per logits row"):
        _core.sample_cpu(lg, rows[:5], forks, positions, *cols, 7)
    bad_t = temperature.copy()
    bad_t[7] = np.inf
    with pytest.raises(_core.InvalidRequestError, match="not finite"):
        _core.sample_cpu(lg, rows, forks, positions, bad_t, *cols[1:], 7)
    with pytest.raises(_core.InvalidRequestError, match="same length"):
        _core.sample_cpu(lg, rows, forks, positions, temperature[:4], *cols[1:], 7)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_table_flags_rows_whose_largest_logit_is_not_finite(temperature: float) -> None:
    """NaN or +inf anywhere in a row, or a row all -inf, is a fault (``ok`` False); one -inf
    among finite logits is a token of probability zero and samples normally. On CPU the check
    reads numpy's argmax, greedy or random."""
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
        rows_added = ids.astype(np.int32)

    args = table.args(Plan())
    table.write_rows(args)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, 5] = float("-inf")
    rows = ids.astype(np.int32)  # the plan's sample_rows, sample_seq_indices, sample_positions
    tokens, ok, _ = table.sample(logits, rows, np.zeros(n, np.int32), np.full(n, 9, np.int32), args)
    assert ok.tolist() == [True, False, False, False, True]
    assert int(tokens[4]) != 5 and 0 <= int(tokens[0]) < vocab
    if temperature == 0.0:
        assert tokens[[0, 4]].tolist() == logits[[0, 4]].argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [7, 259, 4096])
def test_top_k_alone_by_selection_samples_what_the_sort_does(vocab: int) -> None:
    """Top-k without top-p, the largest k known on the host (what CUDA runs: ``topk`` of that
    width, no sort of the vocabulary) against the sorted path: the same tokens, with tied logits
    at the k-th, rows with top-k off, min-p on some rows and logits a grammar removed."""
    from ferryman.worker.sampler import Filters, sample_random

    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    logits[::5] = (logits[::5] * 2).round() / 2  # many ties, some at the k-th
    logits[3::7, 1::4] = float("-inf")
    temperature = torch.tensor([0.3 + (i % 5) * 0.4 for i in range(rows)])
    top_k = torch.tensor([[-1, 1, 3, 5, 0, vocab - 1][i % 6] for i in range(rows)], dtype=torch.int64)
    top_p = torch.ones(rows)
    min_p = torch.tensor([[0.0, 0.1][i % 2] for i in range(rows)])
    seeds = torch.arange(rows, dtype=torch.int64) * 7 + 1
    positions = torch.arange(rows, dtype=torch.int64) + 3
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    sorted_ = Filters(top_k=True, top_p=False, min_p=True)
    selected = Filters(top_k=True, top_p=False, min_p=True, top_k_max=int(top_k.max()))
    want = sample_random(*args, sorted_).tolist()
    assert sample_random(*args, selected).tolist() == want
    assert sample_random(*args, sorted_, window=False).tolist() == want
    # a top-k max at the vocabulary (or past it) sorts, as before
    assert sample_random(*args, Filters(True, False, True, top_k_max=vocab)).tolist() == want
