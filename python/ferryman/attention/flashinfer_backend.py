"""FlashInfer paged attention, the GPU path (``pip install ferryman[gpu]``; imported lazily, only
when this backend is built, so the CPU path never touches it).

The same protocol as ``TorchAttentionBackend``: ``plan(out)`` once per step, ``forward(layer, q,
k, v)`` per layer. ``plan`` hands FlashInfer the core's arrays as they are: host-side int32
``qo_indptr``, ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len`` (pinned, so planning does
not sync the GPU; FlashInfer reads the indptrs on the host). A step where every row computes one
token uses the decode wrapper (tensor cores, GQA native); any step with a prefill chunk uses the
prefill wrapper with ``causal=True``, whose mask is bottom-right aligned as chunked prefill over
cached context needs. New K/V are written through ``slot_mapping`` into the layer's block view of
the block-major cache (FlashInfer accepts the block stride).

``tests/gpu`` checks it against the torch reference (passed on an H200: relative logit error
3e-3 through chunked prefill, decode and swap). ``plan_metadata`` is pure and tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ferryman._core import SchedulerOutput
from ferryman.worker.kv_cache import KvCache

WORKSPACE_BYTES = 256 << 20  # vLLM's size; shared by the two wrappers, which never overlap


@dataclass(slots=True)
class PlanMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1], host
    kv_indptr: torch.Tensor  # int32 [B+1], host
    kv_indices: torch.Tensor  # int32 [pages], host
    kv_last_page_len: torch.Tensor  # int32 [B], host
    decode_only: bool


def plan_metadata(out: SchedulerOutput, pin: bool = False) -> PlanMetadata:
    """FlashInfer's CSR page table for one step, straight from the core's int32 arrays."""

    def host(a: Any) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory() if pin else t

    qo = host(out.qo_indptr)
    rows = len(out.qo_indptr) - 1
    return PlanMetadata(
        qo_indptr=qo,
        kv_indptr=host(out.kv_indptr),
        kv_indices=host(out.kv_indices),
        kv_last_page_len=host(out.kv_last_page_len),
        decode_only=rows > 0 and out.num_scheduled_tokens == rows,
    )


class FlashInferBackend:
    def __init__(
        self, kv: KvCache, block_size: int, scale: float, num_qo_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        import flashinfer

        self.kv = kv
        self.bs = block_size
        self.scale = scale
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = kv.device_kv.dtype
        device = kv.device_kv.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # graphs share it
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=True
        )
        self._wrapper: Any = self._decode
        self._blk = torch.empty(0, dtype=torch.long, device=device)
        self._off = torch.empty(0, dtype=torch.long, device=device)

    def plan(self, out: SchedulerOutput) -> None:
        m = plan_metadata(out, pin=True)
        device = self.kv.device_kv.device
        slots = torch.from_numpy(out.slot_mapping).pin_memory().to(device, non_blocking=True)
        self._blk, self._off = slots // self.bs, slots % self.bs
        hq, hkv, d = self.heads
        kw = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.scale}
        if m.decode_only:
            self._decode.plan(m.kv_indptr, m.kv_indices, m.kv_last_page_len, hq, hkv, d, self.bs, **kw)
            self._wrapper = self._decode
        else:
            self._prefill.plan(
                m.qo_indptr,
                m.kv_indptr,
                m.kv_indices,
                m.kv_last_page_len,
                hq,
                hkv,
                d,
                self.bs,
                causal=True,
                **kw,
            )
            self._wrapper = self._prefill

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return write_and_attend(self.kv.layer(layer_idx), self._blk, self._off, self._wrapper, q, k, v)


def write_and_attend(
    cache: torch.Tensor,
    blk: torch.Tensor,
    off: torch.Tensor,
    wrapper: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """Writes the step's K/V into one layer's ``[blocks, 2, bs, Hkv, D]`` cache at (block,
    offset), then runs the planned wrapper; no host sync, so CUDA graphs can capture it."""
    cache[blk, 0, off] = k.to(cache.dtype)
    cache[blk, 1, off] = v.to(cache.dtype)
    out: torch.Tensor = wrapper.run(q.to(cache.dtype), cache)
    return out.to(q.dtype)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # not installed, or installed without a usable CUDA
        return False
    return torch.cuda.is_available()
