"""Reference paged attention in plain torch.

``plan()`` runs once per step from the scheduler's arrays; ``forward()`` runs per layer: it
writes the step's K/V into the cache through ``slot_mapping`` (block = slot // block_size,
offset = slot % block_size), then for each request gathers its blocks, keeps the first
``seq_len`` positions and runs scaled dot-product attention in float32 with a bottom-right
aligned causal mask (query j of a request with q_len queries and kv_len keys sees keys
``t <= kv_len - q_len + j``), which is right for chunked prefill over cached context. GQA maps
query head h to KV head h // (Hq / Hkv).

Decode rows (one query each) run as one batched call: their block tables are padded with the
null block to the longest, and a key mask hides the padding. Prefill rows run one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferryman._core import SchedulerOutput


class TorchAttentionBackend:
    def __init__(self, kv_caches: torch.Tensor, block_size: int, scale: float) -> None:
        """``kv_caches``: block-major ``[num_blocks, layers, 2, block_size, Hkv, D]`` (per layer,
        FlashInfer's NHD with a block stride)."""
        self.kv = kv_caches
        self.bs = block_size
        self.scale = scale
        self._rows: list[tuple[int, int, torch.Tensor, int]] = []
        self._blk = torch.empty(0, dtype=torch.long)
        self._off = torch.empty(0, dtype=torch.long)
        self._decode_tokens = torch.empty(0, dtype=torch.long)
        self._decode_table = torch.empty((0, 0), dtype=torch.long)
        self._decode_mask = torch.empty((0, 1, 1, 0), dtype=torch.bool)

    def plan(self, out: SchedulerOutput) -> None:
        device = self.kv.device
        slots = torch.from_numpy(out.slot_mapping).to(device)
        self._blk = slots // self.bs
        self._off = slots % self.bs
        qo, kvp = out.qo_indptr.tolist(), out.kv_indptr.tolist()
        lens = out.seq_lens.tolist()
        kvi = torch.from_numpy(out.kv_indices).to(device=device, dtype=torch.long)
        decode = [i for i in range(len(lens)) if qo[i + 1] - qo[i] == 1]
        self._rows = [
            (qo[i], qo[i + 1], kvi[kvp[i] : kvp[i + 1]], lens[i])
            for i in range(len(lens))
            if qo[i + 1] - qo[i] > 1
        ]
        self._decode_tokens = torch.tensor([qo[i] for i in decode], dtype=torch.long, device=device)
        if decode:
            nb = max(kvp[i + 1] - kvp[i] for i in decode)
            table = torch.zeros((len(decode), nb), dtype=torch.long, device=device)  # pad: null block
            for row, i in enumerate(decode):
                table[row, : kvp[i + 1] - kvp[i]] = kvi[kvp[i] : kvp[i + 1]]
            kv_lens = torch.tensor([lens[i] for i in decode], device=device)
            self._decode_table = table
            self._decode_mask = (torch.arange(nb * self.bs, device=device)[None, :] < kv_lens[:, None])[
                :, None, None, :
            ]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv[:, layer_idx]
        cache[self._blk, 0, self._off] = k.to(cache.dtype)
        cache[self._blk, 1, self._off] = v.to(cache.dtype)
        out = torch.empty_like(q)
        nq, nkv, d = q.shape[1], k.shape[1], q.shape[2]
        if len(self._decode_tokens):
            kv = cache[self._decode_table].float()  # [B, nb, 2, bs, Hkv, D]
            b = kv.shape[0]
            keys = kv[:, :, 0].reshape(b, -1, nkv, d).transpose(1, 2)  # [B, Hkv, L, D]
            vals = kv[:, :, 1].reshape(b, -1, nkv, d).transpose(1, 2)
            qd = q[self._decode_tokens].float()[:, :, None, :]  # [B, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd, keys, vals, attn_mask=self._decode_mask, scale=self.scale, enable_gqa=nq != nkv
            )
            out[self._decode_tokens] = o[:, :, 0, :].to(q.dtype)
        for start, end, blocks, kv_len in self._rows:
            q_len = end - start
            kv = cache[blocks].float()  # [nb, 2, bs, Hkv, D]
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
