"""The model's elementwise kernels behind one small interface, so a CUDA runner can swap in fused
ones: RMSNorm, the residual add fused with the next RMSNorm, SiLU-and-mul, and RoPE on q and k.

- ``RMSNorm``: the model's norm module (its weight), whose forward is the reference norm.
- ``TorchOps``: the reference, and the CPU path: ``RMSNorm``, ``q * cos + rotate_half(q) * sin``,
  ``silu(gate) * up``, the arithmetic the model always had.
- ``FlashInferOps``: FlashInfer's kernels (CUDA, ``ferryman[gpu]``): ``norm.rmsnorm``,
  ``norm.fused_add_rmsnorm`` (one pass: the residual add, then the norm, both in place),
  ``activation.silu_and_mul`` and ``rope.apply_rope_with_cos_sin_cache_inplace`` over a float32
  cos/sin table of every position below ``max_positions`` (the kernel does not bounds-check a
  position: callers keep them below, as the runner's block table does). Each replaces several
  torch kernels per call site (a profile's "norm / RoPE / activation" line: docs/gpu.md). They
  compute the norm in float32 and round once, where the reference rounds the normalized value
  before the weight multiply: outputs differ by rounding.

``select_ops`` picks FlashInfer's only where they can run, and only after they pass a check
against the reference on the model's own shapes and dtype at start-up; otherwise the reference,
with the reason in ``OpsChoice.note``.

Contract of ``add_rmsnorm(x, residual, norm)``: returns ``(norm(residual + x), residual + x)``;
it may overwrite both arguments (the fused kernel does), so callers pass tensors they no longer
need. ``rope(q, k, state)`` returns the rotated ``q`` and ``k`` (``[n, heads, d]``), possibly the
same tensors rotated in place; ``state`` comes from ``rope_state(positions, dtype)`` once per
forward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """The model's RMSNorm module: its weight, and the reference arithmetic (Hugging Face's order:
    normalized in float32, rounded to the input's dtype, then times the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class TorchOps:
    """The reference: torch ops, the model's arithmetic as it always was."""

    def __init__(self, inv_freq: torch.Tensor, rope_scale: float) -> None:
        self.inv_freq, self.rope_scale = inv_freq, rope_scale

    def rmsnorm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm.forward(x)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = residual + x
        return norm.forward(r), r

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_state(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """cos and sin ``[T, 1, d]`` of ``positions`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = state
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class FlashInferOps:
    """FlashInfer's fused kernels (CUDA only; imported when built)."""

    def __init__(self, inv_freq: torch.Tensor, rope_scale: float, max_positions: int) -> None:
        import flashinfer

        self.fi = flashinfer
        pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = pos[:, None] * inv_freq.float()[None, :]  # [P, d/2]: cos first, then sin
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope_scale

    def rmsnorm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        out: torch.Tensor = self.fi.norm.rmsnorm(x, norm.weight, norm.eps)
        return out

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x.contiguous(), residual.contiguous()  # no-ops on the model's tensors
        self.fi.norm.fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fi.activation.silu_and_mul(gate_up)
        return out

    def rope_state(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions.long()

    def rope(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = q.shape[0], q.shape[-1]
        qf, kf = q.reshape(n, -1), k.reshape(n, -1)  # views of the qkv rows: rotated in place
        self.fi.rope.apply_rope_with_cos_sin_cache_inplace(state, qf, kf, d, self.cos_sin, True)
        return qf.view(q.shape), kf.view(k.shape)


Ops = TorchOps | FlashInferOps


@dataclass
class OpsChoice:
    ops: Ops
    note: str  # why these ops (and, after a failed check, what failed)


@dataclass
class Shapes:
    """What the check runs on: the model's (this rank's) sizes, dtype and device."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    dtype: torch.dtype
    device: torch.device
    max_positions: int


def _outputs(ops: Ops, ref: TorchOps, s: Shapes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each op's output under ``ops`` and under ``ref``, on the same random inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(s.device, s.dtype)

    n, d = 7, s.head_dim
    norm = RMSNorm(s.hidden, 1e-5).requires_grad_(False).to(s.device, s.dtype)
    norm.weight.copy_(1 + 0.1 * rand(s.hidden))
    x, r, gu = rand(n, s.hidden), rand(n, s.hidden), rand(n, 2 * s.intermediate)
    qkv = rand(n, (s.num_heads + 2 * s.num_kv_heads) * d)
    at = [0, 1, 5, 17, 100, s.max_positions // 2, s.max_positions - 1]
    pos = torch.tensor([p % s.max_positions for p in at], device=s.device)  # inside FlashInfer's table

    def rotated(o: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = torch.split(qkv.clone(), [s.num_heads * d, s.num_kv_heads * d, s.num_kv_heads * d], dim=-1)
        return o.rope(q.view(n, -1, d), k.view(n, -1, d), o.rope_state(pos, s.dtype))

    (h1, r1), (h2, r2) = ops.add_rmsnorm(x.clone(), r.clone(), norm), ref.add_rmsnorm(x, r, norm)
    (q1, k1), (q2, k2) = rotated(ops), rotated(ref)
    return {
        "rmsnorm": (ops.rmsnorm(x.clone(), norm), ref.rmsnorm(x, norm)),
        "add_rmsnorm": (h1, h2),
        "add_rmsnorm's residual": (r1, r2),
        "silu_and_mul": (ops.silu_and_mul(gu.clone()), ref.silu_and_mul(gu)),
        "rope q": (q1, q2),
        "rope k": (k1, k2),
    }


def check_ops(ops: Ops, ref: TorchOps, shapes: Shapes, tol: float = 2e-2) -> str | None:
    """None if every op of ``ops`` agrees with ``ref`` on random inputs of ``shapes`` (max |diff|
    / max |reference| below ``tol``), else what differed or raised."""
    try:
        outputs = _outputs(ops, ref, shapes)
    except Exception as e:  # a kernel that cannot run here
        return f"raised {type(e).__name__}: {e}"

    def off(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)

    bad = [f"{name} {off(a, b):.1e}" for name, (a, b) in outputs.items() if not off(a, b) < tol]
    return f"differ from the reference ({', '.join(bad)})" if bad else None


def select_ops(use_flashinfer: bool, inv_freq: torch.Tensor, rope_scale: float, shapes: Shapes) -> OpsChoice:
    """FlashInfer's kernels where ``use_flashinfer`` (the runner's attention is FlashInfer's) and
    they pass ``check_ops``; else the reference, and the note says why."""
    ref = TorchOps(inv_freq, rope_scale)
    if not use_flashinfer:
        return OpsChoice(ref, "torch (the attention backend is torch)")
    try:
        fi = FlashInferOps(inv_freq, rope_scale, shapes.max_positions)
    except Exception as e:
        why: str | None = f"cannot be built: {type(e).__name__}: {e}"
    else:
        why = check_ops(fi, ref, shapes)
        if why is None:
            return OpsChoice(fi, "flashinfer (fused RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE)")
    warnings.warn(f"ferryman: FlashInfer's fused kernels {why}; using torch ops", stacklevel=2)
    return OpsChoice(ref, f"torch (FlashInfer's fused kernels {why})")
