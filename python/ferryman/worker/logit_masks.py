"""Masks: what each live request may never sample, by its core id. ``allowed_token_ids`` (every
other id) and one-token bad words are a fixed mask, written to the request's batch row when it
takes one (``LogitState.blocked``); a bad word of several tokens bars its last token wherever the
sequence's output so far ends with its other tokens (vLLM's rule), checked when a step is planned
from the core's tokens, so such a request needs the step before applied: it runs without
overlap (``SamplingTable.synced``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ferryman._core import InvalidRequestError

if TYPE_CHECKING:
    from ferryman.sampling_params import SamplingParams

History = Callable[[int, int], np.ndarray]  # (core id, fork) -> its output ids so far


def output_history(scheduler: Any) -> History:
    """Each live sequence's output ids so far, from the core (the penalties' counts, the bad
    words' prefixes); of the scheduler alone, as a bound method of the engine would keep it alive."""
    return functools.partial(_history, scheduler)


def _history(scheduler: Any, core_id: int, seq_index: int) -> np.ndarray:
    out = scheduler.output_token_ids(core_id, seq_index)
    return np.zeros(0, np.int32) if out is None else out


def request_masks(
    p: SamplingParams, tokenizer: Any, vocab_size: int, eos_ids: list[int]
) -> list[list[int]] | None:
    """The token ids of ``p``'s bad words (``bad_words_token_ids``; None without any), checked
    against its ``allowed_token_ids``: ``InvalidRequestError`` when those leave no token to sample
    (every one a one-token bad word, or, while ``min_tokens`` holds the stop ids back, a stop id).
    A step can still find none (words of several tokens; a grammar): the request then fails
    (``engine_faults.NO_TOKEN``)."""
    words = bad_words_token_ids(p.bad_words, tokenizer.encode, vocab_size) if p.bad_words else None
    if p.allowed_token_ids is None:
        return words
    left = set(p.allowed_token_ids) - {w[0] for w in words or () if len(w) == 1}
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
    if not left or (p.min_tokens and left <= stops):
        why = "one-token bad words" if not left else "stop ids, which min_tokens holds back"
        raise InvalidRequestError(f"allowed_token_ids leave no token to sample: all are {why}")
    return words


def bad_words_token_ids(
    words: list[str], encode: Callable[..., list[int]], vocab_size: int
) -> list[list[int]]:
    """vLLM's: the ids of each word as written (leading spaces dropped), and after a space when
    that spells it with as many tokens and another first one (a word inside the text), by
    ``encode`` (a tokenizer's, without special tokens); ``InvalidRequestError`` if an id is
    outside the model's vocabulary."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        out.append(plain)
        spaced = encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    bad = next((t for ids in out for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"bad_words: token id {bad} out of range [0, {vocab_size})")
    return out


class Masks:
    """The live requests' masks, by core id (``SamplingTable.masks``)."""

    def __init__(self) -> None:
        # core id -> (allowed ids or None, one-token bad words)
        self.fixed: dict[int, tuple[np.ndarray | None, np.ndarray]] = {}
        self.words: dict[int, list[tuple[np.ndarray, int]]] = {}  # core id -> [(prefix, last id)]

    def set(self, i: int, allowed: list[int] | None, bad_words: list[list[int]] | None) -> bool:
        """Request ``i``'s masks (``bad_words``: each word's token ids); whether it needs each
        step applied before the next is planned (a word of several tokens)."""
        single = [w[0] for w in bad_words or () if len(w) == 1]
        if allowed is not None or single:
            only = None if allowed is None else np.unique(np.asarray(allowed, np.int64))
            self.fixed[i] = (only, np.unique(np.asarray(single, np.int64)))
        if longer := [(np.asarray(w[:-1], np.int64), w[-1]) for w in bad_words or () if len(w) > 1]:
            self.words[i] = longer
        return bool(longer)

    def clear(self, i: int) -> None:
        self.fixed.pop(i, None)
        self.words.pop(i, None)

    def __contains__(self, i: int) -> bool:
        return i in self.fixed or i in self.words

    def pairs(self, sids: list[int], forks: list[int], history: History) -> list[tuple[int, int]]:
        """The (sample, token) pairs the words of several tokens forbid in a step whose sample
        ``s`` is of request ``sids[s]``, fork ``forks[s]``."""
        out = []
        for s, (r, k) in enumerate(zip(sids, forks, strict=True)):
            words = self.words.get(r)
            if words is None:
                continue
            ids = history(r, k)
            for prefix, last in words:
                n = len(prefix)
                if n <= len(ids) and np.array_equal(ids[len(ids) - n :], prefix):
                    out.append((s, last))
        return out
