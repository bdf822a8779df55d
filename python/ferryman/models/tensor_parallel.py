"""Tensor parallelism of the Llama family over ``torch.distributed`` (Megatron's split): each of
``world`` ranks holds a slice of every layer and they meet in one all-reduce after the attention
output and one after the MLP.

- q/k/v and gate/up are split by output rows (column-parallel): a rank computes ``num_heads /
  world`` query heads, their KV heads and ``intermediate_size / world`` of the MLP;
- o_proj and down_proj are split by input columns (row-parallel) and their partial outputs summed
  with an all-reduce;
- KV heads are split across ranks; with fewer KV heads than ranks each rank keeps the one KV head
  its query heads read (replicated), so every rank's KV pool holds only its own heads;
- the embedding and the LM head are split by vocabulary rows (padded to a multiple of
  ``world``): a token outside a rank's rows embeds as zeros before the all-reduce, and the
  logits' slices are gathered.

Norms, RoPE and biases of the row-parallel layers (none in this family) are whole on every rank.
Backend-neutral: gloo on CPU, NCCL on CUDA, the same calls. ``TensorParallel(0, 1)`` is one rank
with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ferryman.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world: int = 1
    group: Any = None  # a torch.distributed process group; None: the default one

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's sizes and the ranges of the whole model it holds."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # rows of its embedding / LM head slice
    q_heads: range
    kv_heads: range
    inter: range
    vocab: range  # may run past the real vocabulary (padding rows)


def shard_of(cfg: ModelConfig, tp: TensorParallel) -> Shard:
    """This rank's part; ``ValueError`` when the model does not split over ``tp.world`` ranks."""
    w, r = tp.world, tp.rank
    nq, nkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if nq % w or inter % w or (nkv % w and w % nkv):
        raise ValueError(
            f"tensor_parallel_size={w} must divide num_attention_heads ({nq}) and intermediate_size "
            f"({inter}), and divide or be a multiple of num_key_value_heads ({nkv})"
        )
    nq_l = nq // w
    if nkv >= w:
        kv = range(r * (nkv // w), (r + 1) * (nkv // w))
    else:  # fewer KV heads than ranks: the one this rank's query heads read
        first = (r * nq_l) // (nq // nkv)
        kv = range(first, first + 1)
    v_l = -(-cfg.vocab_size // w)
    return Shard(
        num_heads=nq_l,
        num_kv_heads=len(kv),
        intermediate_size=inter // w,
        vocab_size=v_l,
        q_heads=range(r * nq_l, (r + 1) * nq_l),
        kv_heads=kv,
        inter=range(r * (inter // w), (r + 1) * (inter // w)),
        vocab=range(r * v_l, (r + 1) * v_l),
    )


def our_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name as the model's loader uses it (``layers.N.q_proj.weight``)."""
    return checkpoint_name.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")


def shard_range(name: str, cfg: ModelConfig, s: Shard) -> tuple[int, int, int] | None:
    """(dimension, start, stop) of this rank's slice of tensor ``name`` (our names), or None for
    a tensor every rank holds whole (norms). A vocabulary range may run past the tensor's rows:
    the rest is zero padding."""
    d = cfg.head_dim
    kind = name.split(".")[-2] if name.startswith("layers.") else name.split(".")[0]
    ranges = {
        "q_proj": (0, s.q_heads.start * d, s.q_heads.stop * d),
        "k_proj": (0, s.kv_heads.start * d, s.kv_heads.stop * d),
        "v_proj": (0, s.kv_heads.start * d, s.kv_heads.stop * d),
        "o_proj": (1, s.q_heads.start * d, s.q_heads.stop * d),
        "gate_proj": (0, s.inter.start, s.inter.stop),
        "up_proj": (0, s.inter.start, s.inter.stop),
        "down_proj": (1, s.inter.start, s.inter.stop),
        "embed_tokens": (0, s.vocab.start, s.vocab.stop),
        "lm_head": (0, s.vocab.start, s.vocab.stop),
    }
    return ranges.get(kind)


def take(t: Any, shape: tuple[int, ...], r: tuple[int, int, int] | None) -> torch.Tensor:
    """Range ``r`` of ``t`` (a tensor, or a safetensors slice that reads only what it is asked
    for), zero-padded where a vocabulary range runs past its rows."""
    if r is None:
        return t[:] if not isinstance(t, torch.Tensor) else t
    dim, a, b = r
    stop = min(b, shape[dim])
    part: torch.Tensor = t[a:stop] if dim == 0 else t[:, a:stop]
    if stop - a < b - a:  # padding rows past the vocabulary (dim 0 only)
        pad = torch.zeros((b - stop, *part.shape[1:]), dtype=part.dtype)
        part = torch.cat([part, pad.to(part.device)])
    return part


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, s: Shard) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``name`` (our names: ``layers.N.q_proj.weight``)."""
    return take(t, tuple(t.shape), shard_range(name, cfg, s))


def embed(ids: torch.Tensor, weight: torch.Tensor, s: Shard, tp: TensorParallel) -> torch.Tensor:
    """Vocabulary-parallel lookup: this rank's rows, zeros elsewhere, summed over ranks."""
    if tp.world == 1:
        return torch.nn.functional.embedding(ids, weight)
    local = ids - s.vocab.start
    outside = (local < 0) | (local >= s.vocab_size)
    x = torch.nn.functional.embedding(local.clamp(0, s.vocab_size - 1), weight)
    x = x.masked_fill(outside[:, None], 0)
    return tp.all_reduce(x)
