"""Incremental detokenization: text grows by one token's delta per step without re-decoding the
whole output.

Each sequence keeps two offsets into its output ids (vLLM's scheme): ``prefix`` marks where the
decode window starts and ``read`` where the already-emitted text ends. A step decodes only
``ids[prefix:read]`` and ``ids[prefix:]`` and emits the difference. Decoding from a token boundary
a few tokens back (rather than from the new token alone) keeps word-boundary spaces and merges
right for SentencePiece and byte-level BPE tokenizers. While the window ends inside a multi-byte
character (the decode ends in U+FFFD), nothing is emitted until the next token completes it.

Invariant: the concatenation of all deltas, with ``final=True`` on the last step, equals
``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("_prefix", "_read", "_tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def step(self, ids: list[int], final: bool = False) -> str:
        """The text the tokens after the last emitted one add; ``final`` flushes an incomplete
        character as the full decode would show it."""
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(ids)
        return delta


def releasable(text: str, sent: int, stop: list[str], finished: bool) -> int:
    """How much of ``text`` a stream may send: all once finished, else all but the characters
    that could still begin a stop string (the longest one minus one), never less than ``sent``.
    So a stream never sends text that the final result then cuts."""
    if finished:
        return len(text)
    hold = max((len(s) for s in stop), default=1) - 1
    return max(sent, len(text) - hold)
