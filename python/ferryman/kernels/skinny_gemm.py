"""``y = x @ w.T (+ bias)`` for a few rows ``x`` ``[M, K]`` (a decode step's, M ≤ 32) against a
weight ``w`` ``[N, K]`` in bf16 or fp16: a Triton kernel that splits only the output features.

Why: a decode step at batch 1 is a chain of GEMVs that should run at the memory bandwidth, and on
the H200 cuBLAS's kernels for the smaller projections did not (o_proj 4096 x 4096 at 0.46 of the
copy bandwidth, qkv at 0.72; docs/gpu.md). Each program here owns ``BLOCK_N`` output features of
every row: it streams its ``[BLOCK_N, K]`` slice of the weight through ``tl.dot`` (rows padded
to ``BLOCK_M``, which costs nothing where memory is the limit) in ``BLOCK_K`` steps, pipelined
``num_stages`` deep, accumulating in float32; so N / BLOCK_N programs cover the device (128 to 384
of them at Llama-3-8B's o, qkv and down), with no split of K and no second pass.

For one row, ``GEMV_CONFIGS`` run ``_gemv_kernel`` instead: no ``tl.dot``, the weight tile times
the row in registers, summed along K once at the end.

``CONFIGS`` (and for one row ``GEMV_CONFIGS``: ``configs_for``) are the tile shapes tried; which
is fastest, and whether any beats cuBLAS, is measured on the device itself
(``worker/gemm_choice.py``), never assumed. ``reference`` is what the kernel must equal up to
float32 summation order: the product in float32, rounded once.

Contract: ``x`` and ``w`` on one device, same dtype (bf16 or fp16), ``w`` contiguous, ``x`` rows
contiguous; ``1 <= M <= MAX_ROWS``; fewer than 2^31 weight elements (int32 offsets). The output
is a new ``[M, N]`` tensor of ``x``'s dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 32  # above it cuBLAS's GEMM tiles are full enough


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    gemv: bool = False  # the one-row kernel (``_gemv_kernel``), for M = 1 only

    @property
    def name(self) -> str:
        kind = "gemv" if self.gemv else "dot"
        return f"{kind}-{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"


# tile shapes tried on the device: narrow ones, so that N / BLOCK_N programs (256 to 384 at
# Llama-3-8B's o and qkv) give each SM a few, and deep pipelines of weight tiles in flight;
# shared memory at most (32 + 16) x 512 x 2 bytes x 4 stages = 192 KiB
CONFIGS = (
    Config(16, 256, 4, 4),
    Config(32, 256, 4, 4),
    Config(16, 512, 4, 4),
    Config(16, 128, 4, 6),
)
# one row: no tl.dot (whose 16-row tiles are 15/16 padding there), the weight tile multiplied in
# registers and summed along K once at the end; BLOCK_N down to 4 for more programs in flight
GEMV_CONFIGS = (
    Config(8, 512, 4, 3, True),
    Config(16, 256, 4, 4, True),
    Config(4, 1024, 4, 3, True),
    Config(16, 512, 8, 3, True),
)


def configs_for(m: int) -> tuple[Config, ...]:
    """The tile shapes worth trying at ``m`` rows."""
    return CONFIGS + GEMV_CONFIGS if m == 1 else CONFIGS


def block_m(m: int) -> int:
    """The rows a program computes: ``m`` padded to 16 or 32 (``tl.dot`` wants at least 16)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny GEMM takes 1 to {MAX_ROWS} rows, not {m}")
    return 16 if m <= 16 else 32


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # a [BLOCK_K, BLOCK_N] view of w.T
    row_ok = rm[:, None] < M
    col_ok = rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        else:
            left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok & (rk[None, :] < left), other=0.0)
            w = tl.load(w_ptrs, mask=col_ok & (rk[:, None] < left), other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=row_ok & col_ok)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    col_ok = rn[:, None] < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptr + k * BLOCK_K + rk)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        else:
            left = K - k * BLOCK_K
            x = tl.load(x_ptr + k * BLOCK_K + rk, mask=rk < left, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok & (rk[None, :] < left), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """``x @ w.T + bias`` by the kernel with tile shape ``cfg`` (the module's contract)."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"skinny GEMM takes bf16 or fp16 alike, not {x.dtype} x {w.dtype}")
    if w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} against w {tuple(w.shape)}, contiguous rows")
    if w.numel() >= 2**31 or x.stride(0) * m >= 2**31:  # the kernel's offsets are int32
        raise ValueError(f"skinny GEMM: w {tuple(w.shape)} has too many elements for int32 offsets")
    bm = block_m(m)  # 1..MAX_ROWS rows
    if cfg.gemv and m != 1:
        raise ValueError(f"the one-row kernel takes 1 row, not {m}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n),)
    b_or_w = bias if bias is not None else w  # not read without HAS_BIAS
    tile = {
        "HAS_BIAS": bias is not None,
        "EVEN_K": k % cfg.block_k == 0,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    if cfg.gemv:
        _gemv_kernel[grid](x, w, b_or_w, y, n, k, w.stride(0), **tile)
    else:
        strides = (x.stride(0), w.stride(0), y.stride(0))
        _skinny_kernel[grid](x, w, b_or_w, y, m, n, k, *strides, BLOCK_M=bm, **tile)
    return y


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``skinny_linear`` computes: the product (and bias) in float32, rounded once."""
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
