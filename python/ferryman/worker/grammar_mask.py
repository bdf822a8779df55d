"""Structured outputs in the sampler: a grammar's bitmask of allowed tokens (from the core's
``SchedulerOutput.grammar_masks``) turned into a -inf bias on the logits of the rows it constrains.

Masks are added, never written over the logits, so a NaN or +inf logit stays non-finite and the
fault check still sees it."""

from __future__ import annotations

import numpy as np
import torch

from ferryman.worker.transfer import to_device


def apply_grammar(
    logits: torch.Tensor, samples: np.ndarray, masks: np.ndarray, fallback: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` with -inf added where a grammar forbids the token: row ``samples[i]`` takes
    bitmask ``masks[i]`` (bit ``t % 32`` of word ``t // 32`` for token t; tokens past the mask are
    forbidden). Added, not written: a NaN or +inf logit stays non-finite, so the fault check still
    sees it. A row left with no token (``min_tokens`` holding back the only one the grammar allows:
    its end) takes the mask over ``fallback`` (the logits with only what its request forbids
    outright) instead: the grammar wins over ``min_tokens``. A new tensor (logprobs mask the raw
    logits apart, without the adjustments); no wait for the device."""
    dev = logits.device
    bias = grammar_bias(masks, logits.shape[1], dev).to(logits.dtype)
    rows = to_device(samples.astype(np.int64), dev)
    masked = logits.index_select(0, rows) + bias
    if fallback is not None:
        dead = masked.amax(dim=-1, keepdim=True) == float("-inf")
        masked = torch.where(dead, fallback.index_select(0, rows) + bias, masked)
    return logits.index_copy(0, rows, masked)


def grammar_bias(masks: np.ndarray, vocab: int, dev: torch.device, numpy: bool | None = None) -> torch.Tensor:
    """float32 ``[G, vocab]``: 0 where bitmask row ``masks[g]`` allows the token, -inf elsewhere
    (and past the mask's bits). On CPU with numpy's bit unpacking (one pass; ``numpy`` forces
    either way), else with torch ops on ``dev``."""
    if dev.type == "cpu" if numpy is None else numpy:
        bits = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(np.where(bits.astype(bool), np.float32(0), np.float32("-inf"))).to(dev)
    words = to_device(masks.view(np.int32), dev)
    bits_t = (words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=dev)) & 1
    allowed = bits_t.reshape(len(masks), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        pad = torch.zeros((len(masks), vocab - allowed.shape[1]), dtype=torch.bool, device=dev)
        allowed = torch.cat([allowed, pad], dim=1)
    return torch.zeros(allowed.shape, dtype=torch.float32, device=dev).masked_fill_(~allowed, float("-inf"))
