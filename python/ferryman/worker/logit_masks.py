"""Masks: what each live request may never sample, by its core id. ``allowed_token_ids`` (every
other id) and one-token bad words are a fixed mask, written to the request's batch row when it
takes one (``LogitState.blocked``); a bad word of several tokens bars its last token wherever the
sequence's output so far ends with its other tokens (vLLM's rule), checked when a step is planned
from the core's tokens, so such a request needs the step before applied: it runs without
overlap (``SamplingTable.synced``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

History = Callable[[int, int], np.ndarray]  # (core id, fork) -> its output ids so far


class Masks:
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
