"""Our Triton kernels against their torch references, run on CPU tensors through Triton's
interpreter (a subprocess with ``TRITON_INTERPRET=1``, which Triton reads at import); and the
choice between cuBLAS and the skinny GEMM, which needs no kernel to test.

The interpreter runs float16 only: it keeps bfloat16 as raw 16-bit integers, and its ``tl.dot``
multiplies those bit patterns (triton-lang/triton#11584, not supported upstream). The same
kernel code in bfloat16 is checked on a GPU (``tests/gpu/test_gpu_kernels.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ferryman.models.llama import Linear
from ferryman.worker import gemm_choice

INTERPRETED = textwrap.dedent(
    """
    import itertools, torch
    from ferryman.kernels import skinny_gemm as sg

    torch.manual_seed(0)
    cases = 0
    # rows padded to 16 and to 32; K a multiple of every BLOCK_K, and of none; N that leaves a
    # partial tile; with and without a bias
    for m, (n, k), bias, dtype in itertools.product(
        (1, 5, 17, 32), ((64, 256), (48, 200)), (False, True), (torch.float16,)
    ):
        x = torch.randn(m, k).to(dtype)
        w = (torch.randn(n, k) * 0.1).to(dtype)
        b = torch.randn(n).to(dtype) if bias else None
        want = sg.reference(x, w, b).float()
        for cfg in sg.configs_for(m):
            got = sg.skinny_linear(x, w, b, cfg).float()
            assert got.shape == (m, n), got.shape
            # float32 sums in another order, rounded once: within two of the dtype's ulps
            tol = 2 * torch.finfo(dtype).eps * want.abs().clamp(min=1.0)
            bad = (got - want).abs() > tol
            assert not bad.any(), (m, n, k, bias, dtype, cfg, (got - want).abs().max())
            cases += 1
    # the one-row kernel uses no tl.dot, so the interpreter runs it in bfloat16 too
    for (n, k), bias in itertools.product(((64, 256), (48, 200)), (False, True)):
        x, w = torch.randn(1, k).bfloat16(), (torch.randn(n, k) * 0.1).bfloat16()
        b = torch.randn(n).bfloat16() if bias else None
        want = sg.reference(x, w, b).float()
        tol = 2 * torch.finfo(torch.bfloat16).eps * want.abs().clamp(min=1.0)
        for cfg in sg.GEMV_CONFIGS:
            got = sg.skinny_linear(x, w, b, cfg).float()
            assert ((got - want).abs() <= tol).all(), (n, k, bias, cfg, (got - want).abs().max())
            cases += 1
    try:
        sg.skinny_linear(torch.randn(2, 64).half(), torch.randn(8, 64).half(), None, sg.GEMV_CONFIGS[0])
    except ValueError:
        pass
    else:
        raise AssertionError("the one-row kernel took two rows")
    # a strided view of rows (every other row of a larger tensor) is a valid input
    x = torch.randn(8, 64).to(torch.float16)[::2]
    w = torch.randn(32, 64).to(torch.float16)
    c = sg.CONFIGS[0]
    assert torch.equal(sg.skinny_linear(x, w, None, c), sg.skinny_linear(x.contiguous(), w, None, c))
    h = torch.float16
    wrong = (  # float32; 33 rows; K mismatched
        (torch.randn(2, 64), torch.randn(8, 64)),
        (torch.randn(33, 64).to(h), torch.randn(8, 64).to(h)),
        (torch.randn(2, 64).to(h), torch.randn(8, 32).to(h)),
    )
    for x, w in wrong:
        try:
            sg.skinny_linear(x, w, None, c)
        except ValueError:
            continue
        raise AssertionError(f"accepted x {x.shape} {x.dtype} against w {w.shape}")
    print("cases", cases)
    """
)


def test_skinny_gemm_matches_its_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "cases 96" in run.stdout


def test_the_kernel_is_chosen_only_where_it_beats_cublas_by_the_margin() -> None:
    assert gemm_choice.choose({"cublas": 10.0, "a": 9.0, "b": 9.5}) == "a"
    assert gemm_choice.choose({"cublas": 10.0, "a": 9.8}) is None  # within 3%: noise
    assert gemm_choice.choose({"cublas": 10.0, "a": 12.0}) is None
    assert gemm_choice.choose({"cublas": 10.0}) is None  # no tile shape compiled or matched


def test_a_linear_runs_its_skinny_launcher_only_at_the_row_counts_it_has() -> None:
    lin = Linear(8, 4, bias=True)
    lin.weight.data, lin.bias.data = torch.randn(4, 8), torch.randn(4)  # type: ignore[union-attr]
    calls: list[int] = []

    def fake(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.full((x.shape[0], w.shape[0]), 7.0)

    lin.skinny = {3: fake}
    assert torch.equal(lin(torch.randn(3, 8)), torch.full((3, 4), 7.0))
    x = torch.randn(5, 8)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    strided = torch.randn(3, 16)[:, ::2]  # rows not contiguous: F.linear
    assert torch.equal(lin(strided), torch.nn.functional.linear(strided, lin.weight, lin.bias))
    assert calls == [3]
    gemm_choice.clear(torch.nn.Sequential(lin))
    assert lin.skinny is None


def test_only_half_precision_cuda_projections_are_grouped() -> None:
    model = torch.nn.Sequential(Linear(8, 4, bias=False), Linear(8, 4, bias=False))
    for m in model:
        m.weight.data = torch.randn(4, 8, dtype=torch.bfloat16)  # on the CPU: not a candidate
    assert gemm_choice.groups(model) == {}
