"""The step-time model of ``ferryman sim``: a roofline of the batch the scheduler planned.

For one step with rows r = 1..B, each computing ``q_r`` new tokens and ending at KV length
``s_r`` (``T = sum q_r`` tokens, ``S`` sampled rows), a model with ``L`` layers, hidden size ``h``,
``H`` query heads and ``H_kv`` KV heads of size ``d``, ``P_l`` parameters per layer, vocabulary
``V``, and ``b`` bytes per element:

    FLOPs   = 2 * L * P_l * T                        (the linear layers)
            + 2 * h * V * S                          (lm_head, only on sampled rows)
            + 4 * L * H * d * sum_r A_r              (QK^T and PV; A_r = sum_{i=1..q_r} (s_r - q_r + i)
                                                      = q_r * s_r - q_r * (q_r - 1) / 2, causal)
    bytes   = b * (L * P_l + h * V)                  (every weight once; the embedding gather is free)
            + kv * sum_r s_r                         (each row reads its context once)
            + kv * T                                 (new K/V written), kv = 2 * L * H_kv * d * b

    step_s  = max(FLOPs / (peak_flops * compute_efficiency),
                  bytes / (hbm_bytes_per_s * bandwidth_efficiency)) + step_overhead_s
    swap_s  = (blocks swapped out + in) * block_bytes / host_link_bytes_per_s   (added, not overlapped)

With tensor parallelism over ``N`` ranks (``tp``), the terms above are one rank's: FLOPs and
weight bytes over ``N``, KV bytes times the share of KV heads a rank holds (``1/N``, or one head
when there are fewer than ``N``), and the ranks' communication is added, not overlapped:

    comm_s  = (2 L + 1) * allreduce(T * h * b)        (after attention and MLP, and the embedding)
            + (N - 1) / N * S * V * b / link_bytes_per_s + link_latency_s   (gathering the
                                                       logits, in the model's dtype)
    allreduce(M) = 2 (N - 1) / N * M / link_bytes_per_s + link_latency_s    (a ring)

A step with nothing scheduled costs only the swap time. Defaults: ``compute_efficiency=0.6``,
``bandwidth_efficiency=0.8``, ``step_overhead_s=1 ms`` (launches, sampling and the host's per-step
work; CUDA graphs bring it down).

Checked against two published measurements (TensorRT-LLM, "Performance of TensorRT-LLM",
docs/source/performance.md of its v0.5-era releases, A100 80GB FP16, static batches of LLaMA 7B):
batch 64 with 128 prompt / 128 output tokens, 3,486 output tokens/s; batch 32 with 128 / 2048,
1,459 output tokens/s. Simulating those runs (the scheduler included) gives 3,675 (+5.4%) and
1,517 (+4.0%) output tokens/s; ``tests/python/test_sim.py`` recomputes both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ferryman._core import SchedulerOutput
from ferryman.sim.presets import LINKS, GpuSpec, Interconnect, ModelShape, tp_split


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    step_s: float
    comm_s: float = 0.0  # tensor-parallel collectives (included in step_s)


class Roofline:
    def __init__(
        self,
        gpu: GpuSpec,
        shape: ModelShape,
        dtype_bytes: int = 2,
        compute_efficiency: float = 0.6,
        bandwidth_efficiency: float = 0.8,
        step_overhead_s: float = 1e-3,
        tp: int = 1,
        link: Interconnect = LINKS["nvlink"],
    ) -> None:
        if not (0 < compute_efficiency <= 1 and 0 < bandwidth_efficiency <= 1):
            raise ValueError("efficiencies must be in (0, 1]")
        self.gpu, self.shape, self.dtype_bytes, self.tp, self.link = gpu, shape, dtype_bytes, tp, link
        kv_share = tp_split(shape, tp)
        L, h, V = shape.num_layers, shape.hidden_size, shape.vocab_size
        self._linear_flops_per_token = 2.0 * L * shape.params_per_layer / tp
        self._head_flops_per_sample = 2.0 * h * V / tp
        self._attn_flops_per_pair = 4.0 * L * shape.num_heads * shape.head_dim / tp
        self.weight_bytes = float(dtype_bytes * (L * shape.params_per_layer + h * V)) / tp
        self.kv_bytes_per_token = float(shape.kv_bytes_per_token(dtype_bytes)) * kv_share
        ring = 2.0 * (tp - 1) / tp / link.bytes_per_s
        self._allreduce_s_per_token = (2 * L + 1) * ring * h * dtype_bytes  # by tokens in the step
        self._allreduce_fixed_s = (2 * L + 2) * link.latency_s if tp > 1 else 0.0  # and the gather
        self._gather_s_per_sample = (tp - 1) / tp * V * dtype_bytes / link.bytes_per_s
        self._flops_per_s = gpu.peak_flops * compute_efficiency
        self._bytes_per_s = gpu.hbm_bytes_per_s * bandwidth_efficiency
        self.step_overhead_s = step_overhead_s

    def cost(self, q: np.ndarray, s: np.ndarray, num_samples: int) -> StepCost:
        """Rows with ``q`` new tokens each ending at KV length ``s`` (int arrays), ``num_samples``
        logits rows."""
        if len(q) == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        q64, s64 = q.astype(np.int64, copy=False), s.astype(np.int64, copy=False)
        t = int(q64.sum())
        kv_len = int(s64.sum())
        # decode rows only (t == rows): each pairs its one query with its whole context
        pairs = kv_len if t == len(q64) else int((q64 * s64).sum()) - int((q64 * (q64 - 1)).sum()) // 2
        flops = (
            self._linear_flops_per_token * t
            + self._head_flops_per_sample * num_samples
            + self._attn_flops_per_pair * pairs
        )
        nbytes = self.weight_bytes + self.kv_bytes_per_token * (kv_len + t)
        return self._step(flops, nbytes, t, num_samples)

    def comm_s(self, tokens: int, num_samples: int) -> float:
        """One rank's collectives in a step of ``tokens`` tokens and ``num_samples`` samples."""
        if self.tp == 1:
            return 0.0
        return (
            self._allreduce_fixed_s
            + self._allreduce_s_per_token * tokens
            + self._gather_s_per_sample * num_samples
        )

    def _step(self, flops: float, nbytes: float, tokens: int, num_samples: int) -> StepCost:
        compute_s, memory_s = flops / self._flops_per_s, nbytes / self._bytes_per_s
        comm = self.comm_s(tokens, num_samples)
        return StepCost(
            flops, nbytes, compute_s, memory_s, max(compute_s, memory_s) + comm + self.step_overhead_s, comm
        )

    def plan_cost(self, plan: SchedulerOutput) -> StepCost:
        s, t = plan.seq_lens, plan.num_scheduled_tokens
        if t == len(s) and t > 0:  # decode rows only (the common step): one token and one sample each
            kv_len = int(s.sum(dtype=np.int64))
            flops = (
                self._linear_flops_per_token + self._head_flops_per_sample
            ) * t + self._attn_flops_per_pair * kv_len
            nbytes = self.weight_bytes + self.kv_bytes_per_token * (kv_len + t)
            return self._step(flops, nbytes, t, t)
        qo = plan.qo_indptr
        return self.cost(qo[1:] - qo[:-1], s, len(plan.logits_indices))

    def prefill_tokens_per_s(self, num_tokens: int, chunk: int = 512) -> float:
        """Prefill rate at a full token budget of ``num_tokens`` made of ``chunk``-token prompts
        (what the Engine's start-up calibration measures on a real device)."""
        rows = max(1, num_tokens // chunk)
        q = np.full(rows, min(chunk, num_tokens))
        return float(q.sum()) / self.cost(q, q, rows).step_s
