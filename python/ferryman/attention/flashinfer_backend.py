"""FlashInfer paged attention, the GPU path (``pip install ferryman[gpu]``; imported lazily, only
when this backend is built, so the CPU path never touches it).

An ``AttentionBackend`` (``attention/base.py``): ``plan(out)`` once per step, ``forward(layer, q,
k, v)`` per layer. ``plan`` hands FlashInfer the step's arrays as they are: host-side int32
``qo_indptr``, ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len`` (pinned, so planning does
not sync the GPU; FlashInfer reads the indptrs on the host). A step where every row computes one
token uses the decode wrapper (tensor cores, GQA native); any step with a prefill chunk uses the
prefill wrapper with ``causal=True``, whose mask is bottom-right aligned as chunked prefill over
cached context needs. New K/V are written through ``slot_mapping`` (``KvWriter``) into the layer's
view of the block-major cache (FlashInfer accepts the block stride). ``PlanArgs`` and
``run_planned`` are shared with the CUDA-graph decode path (``attention/flashinfer_graphs.py``).

``tests/gpu`` checks it against the torch reference through chunked prefill, decode and swap;
``plan_metadata`` is pure and tested on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ferryman.attention.base import KvWriter, StepInputs

WORKSPACE_BYTES = 256 << 20  # vLLM's size; shared by the two wrappers, which never overlap


@dataclass(slots=True)
class PlanMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1], host
    kv_indptr: torch.Tensor  # int32 [B+1], host
    kv_indices: torch.Tensor  # int32 [pages], host
    kv_last_page_len: torch.Tensor  # int32 [B], host
    decode_only: bool


def plan_metadata(out: StepInputs, pin: bool = False) -> PlanMetadata:
    """FlashInfer's CSR page table for one step, straight from its int32 arrays."""

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


@dataclass(frozen=True, slots=True)
class PlanArgs:
    """What every FlashInfer ``plan()`` call of one model takes besides its page table.

    A wrapper's ``plan()`` writes its metadata into a page-locked buffer of its own and queues a
    copy from it to the device; the next ``plan()`` of that wrapper rewrites the buffer at once.
    With async scheduling nothing else guarantees that the copy has run by then (a step with no
    decode input in flight makes no other copy that waits for the step before), so each plan
    first waits for the event recorded after that wrapper's previous plan: almost always long
    past, so it costs no wait, only an event per plan."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of q and of the KV cache
    scale: float
    device: torch.device | None = None  # the wrappers' (None: stand-ins in a CPU test, no events)
    # the event after each wrapper's last plan (by id; a wrapper lives as long as its backend)
    planned: dict[int, Any] = field(default_factory=dict, compare=False)

    def plan_decode(
        self, wrapper: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor
    ) -> None:
        with self._after_last_plan(wrapper):
            wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, *self._shape(), **self._types())

    def replan_decode(self, fast: Any, kv_indptr: Any, kv_last_page_len: Any) -> None:
        """A CUDA-graph decode wrapper's re-plan (``FastDecodePlan``), its page table staged."""
        with self._after_last_plan(fast.wrapper):
            fast.plan(kv_indptr, kv_last_page_len, self.block_size)

    def plan_prefill(self, wrapper: Any, m: PlanMetadata) -> None:
        """Causal: FlashInfer aligns the mask bottom-right, as chunked prefill over cached context
        needs."""
        page_table = (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len)
        with self._after_last_plan(wrapper):
            wrapper.plan(*page_table, *self._shape(), causal=True, **self._types())

    @contextlib.contextmanager
    def _after_last_plan(self, wrapper: Any) -> Iterator[None]:
        if self.device is None or self.device.type != "cuda":
            yield
            return
        last = self.planned.get(id(wrapper))
        if last is not None:
            last.synchronize()
        yield
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.device))  # where the plan's copy went
        self.planned[id(wrapper)] = done

    def _shape(self) -> tuple[int, int, int, int]:
        return self.num_qo_heads, self.num_kv_heads, self.head_dim, self.block_size

    def _types(self) -> dict[str, Any]:
        return {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.scale}


def run_planned(wrapper: Any, cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The planned wrapper over one layer's cache view, q cast to the cache's dtype and the
    output back to q's; no host sync, so CUDA graphs can capture it."""
    out: torch.Tensor = wrapper.run(q.to(cache.dtype), cache)
    return out.to(q.dtype)


class FlashInferBackend:
    def __init__(
        self,
        kv_layers: Sequence[torch.Tensor],
        block_size: int,
        scale: float,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """``kv_layers``: each layer's ``[num_blocks, 2, block_size, Hkv, D]`` cache view."""
        import flashinfer

        self.layers = list(kv_layers)
        self.device = device = self.layers[0].device
        self.args = PlanArgs(
            num_qo_heads, num_kv_heads, head_dim, block_size, self.layers[0].dtype, scale, device
        )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # graphs share it
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=True
        )
        self._wrapper: Any = self._decode
        self.writer = KvWriter(block_size, device)

    def plan(self, out: StepInputs) -> None:
        m = plan_metadata(out, pin=True)
        slots = torch.from_numpy(out.slot_mapping).pin_memory().to(self.device, non_blocking=True)
        self.writer.map(slots)
        if m.decode_only:
            self.args.plan_decode(self._decode, m.kv_indptr, m.kv_indices, m.kv_last_page_len)
            self._wrapper = self._decode
        else:
            self.args.plan_prefill(self._prefill, m)
            self._wrapper = self._prefill

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.writer.write(self.layers[layer_idx], k, v)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer_idx, k, v)
        return run_planned(self._wrapper, self.layers[layer_idx], q)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # not installed, or installed without a usable CUDA
        return False
    return torch.cuda.is_available()
