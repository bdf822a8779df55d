"""Reference paged attention in plain torch.

An ``AttentionBackend`` (``attention/base.py``). ``plan()`` runs once per step from the step's
arrays (``StepInputs``); ``forward()`` runs per layer: it writes the step's K/V into the layer's cache
through ``slot_mapping`` (``KvWriter``), then for each request gathers its blocks, keeps the first
``seq_len`` positions and runs scaled dot-product attention in float32 with a bottom-right
aligned causal mask (query j of a request with q_len queries and kv_len keys sees keys
``t <= kv_len - q_len + j``), which is right for chunked prefill over cached context. GQA maps
query head h to KV head h // (Hq / Hkv).

Decode rows (one query each) run batched in groups of up to ``DECODE_GROUP`` rows of similar
length (sorted by block count, so little is padded): each group's block tables are padded with
the null block to its longest (all groups' tables and key masks are built in one vectorized pass,
each group a slice), K and V are gathered separately (one contiguous copy each, no
reshape copies), and a key mask hides the padding (the null block, never written: zeros).

A block is zeroed when a step writes its first position: a freed block keeps what its last
owner wrote, NaN included, and a masked key still multiplies its V by a zero weight (0 x NaN is
NaN). So every position past a row's length in its last block holds zeros, never a previous
owner's values (docs/faults.md). It costs one block per ``block_size`` tokens written; zeroing
the gathered K/V where masked instead made the decode step 1.3-1.6x slower at 128 rows.

Prefill rows run one by one. Gathers use ``index_select`` on dim 0, about 3x faster on CPU than
advanced indexing over the block-strided layer view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ferryman.attention.base import KvWriter, StepInputs

DECODE_GROUP = 8


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor  # [b] rows of q / out
    table: torch.Tensor  # [b, nb] block ids, null-padded
    mask: torch.Tensor  # [b, 1, 1, nb * block_size] keys to attend


class TorchAttentionBackend:
    def __init__(self, kv_layers: Sequence[torch.Tensor], block_size: int, scale: float) -> None:
        """``kv_layers``: each layer's ``[num_blocks, 2, block_size, Hkv, D]`` cache view."""
        self.layers = list(kv_layers)
        self.device = self.layers[0].device
        self.bs = block_size
        self.scale = scale
        self.writer = KvWriter(block_size, self.device)
        self._rows: list[tuple[int, int, torch.Tensor, int]] = []
        self._groups: list[_DecodeGroup] = []
        self._fresh = torch.empty(0, dtype=torch.long)  # blocks whose first position this step writes

    def plan(self, out: StepInputs) -> None:
        device, bs = self.device, self.bs
        slots = out.slot_mapping
        self.writer.map(torch.from_numpy(slots).to(device))
        self._fresh = torch.from_numpy(np.unique(slots[slots % bs == 0] // bs).astype(np.int64)).to(device)
        qo, kvp, lens = out.qo_indptr, out.kv_indptr, out.seq_lens
        qlen, pages = np.diff(qo), np.diff(kvp)
        kvi = torch.from_numpy(out.kv_indices).to(device=device, dtype=torch.long)
        self._rows = [
            (int(qo[i]), int(qo[i + 1]), kvi[kvp[i] : kvp[i + 1]], int(lens[i]))
            for i in np.flatnonzero(qlen > 1)
        ]
        self._groups = []
        decode = np.flatnonzero(qlen == 1)
        if not len(decode):
            return
        # every decode row's table padded with the null block to the longest, sorted by length,
        # built in one pass; each group of DECODE_GROUP rows is then a slice of it
        decode = decode[np.argsort(pages[decode], kind="stable")]
        nb, width = pages[decode], int(pages[decode[-1]])
        col = np.arange(width)
        at = np.minimum(kvp[decode][:, None] + col, max(len(out.kv_indices) - 1, 0))
        table = torch.from_numpy(np.where(col < nb[:, None], out.kv_indices[at], 0)).to(device, torch.long)
        keys = (
            torch.arange(width * bs, device=device)[None, :]
            < torch.from_numpy(lens[decode]).to(device)[:, None]
        )
        tokens = torch.from_numpy(qo[decode]).to(device, torch.long)
        for g in range(0, len(decode), DECODE_GROUP):
            w = int(nb[min(g + DECODE_GROUP, len(decode)) - 1])  # sorted: the group's last row is its longest
            sl = slice(g, g + DECODE_GROUP)
            self._groups.append(
                _DecodeGroup(tokens[sl], table[sl, :w].contiguous(), keys[sl, None, None, : w * bs])
            )

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(self._fresh):  # whatever a previous owner left there, the new owner sees zeros
            self.layers[layer_idx].index_fill_(0, self._fresh, 0)
        self.writer.write(self.layers[layer_idx], k, v)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer_idx, k, v)
        cache = self.layers[layer_idx]
        out = torch.empty_like(q)
        nq, nkv, d = q.shape[1], k.shape[1], q.shape[2]
        keys_all, vals_all = cache[:, 0], cache[:, 1]  # [num_blocks, bs, Hkv, D] views
        for grp in self._groups:
            b = grp.table.shape[0]
            flat = grp.table.view(-1)
            keys = (
                keys_all.index_select(0, flat).float().view(b, -1, nkv, d).transpose(1, 2)
            )  # [b, Hkv, L, D]
            vals = vals_all.index_select(0, flat).float().view(b, -1, nkv, d).transpose(1, 2)
            qd = q.index_select(0, grp.tokens).float()[:, :, None, :]  # [b, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd, keys, vals, attn_mask=grp.mask, scale=self.scale, enable_gqa=nq != nkv
            )
            out.index_copy_(0, grp.tokens, o[:, :, 0, :].to(q.dtype))
        for start, end, blocks, kv_len in self._rows:
            q_len = end - start
            kv = cache.index_select(0, blocks).float()  # [nb, 2, bs, Hkv, D]
            keys = kv[:, 0].reshape(-1, nkv, d)[:kv_len]
            vals = kv[:, 1].reshape(-1, nkv, d)[:kv_len]
            if nq != nkv:
                keys = keys.repeat_interleave(nq // nkv, dim=1)
                vals = vals.repeat_interleave(nq // nkv, dim=1)
            qi = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
            o = F.scaled_dot_product_attention(
                qi, keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask, scale=self.scale
            )
            out[start:end] = o.transpose(0, 1).to(q.dtype)
        return out
