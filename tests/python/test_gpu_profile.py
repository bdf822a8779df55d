"""benchmarks/gpu_profile.py and gpu_overlap.py, which scripts/gpu_check.sh runs on a GPU: the
interval arithmetic and kernel classes, and --smoke dry runs on CPU so that the scripts cannot rot
while no GPU is around."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gp():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_profile

        yield gpu_profile
    finally:
        sys.path.remove(str(BENCH))


def test_busy_time_is_the_union_of_the_intervals(gp) -> None:  # type: ignore[no-untyped-def]
    assert gp.busy_ns([]) == 0
    assert gp.busy_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert gp.busy_ns([(20, 30), (0, 10)]) == 20


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
        ("void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u>", "attention"),
        # FlashInfer's fused elementwise kernels (names seen on an H200)
        ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)", "norm_rope_act"),
        ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &(silu(float))>", "norm_rope_act"),
        ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheHeadParallelismKernel<false>", "norm_rope_act"),
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>", "sampler"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "norm_rope_act"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("void at::native::index_elementwise_kernel<128, 4, ...>", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda>", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "norm_rope_act"),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>", "norm_rope_act"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_classes(gp, name: str, cls: str) -> None:  # type: ignore[no-untyped-def]
    assert gp.classify(name) == cls


def test_summary_of_a_step(gp) -> None:  # type: ignore[no-untyped-def]
    k = [("nvjet_a", 0, 4_000), ("nvjet_a", 10_000, 4_000), ("flashinfer::x", 6_000, 2_000)]
    r = gp.summarise(k, wall_s=20e-6)
    assert (r["busy_ms"], r["span_ms"], r["gaps_ms"], r["kernels"]) == (0.01, 0.014, 0.004, 3)
    assert r["by_class"]["gemm"] == {"us": 8.0, "count": 2}
    assert r["by_class"]["attention"] == {"us": 2.0, "count": 1}
    assert r["top"][0] == {"name": "nvjet_a", "count": 2, "total_us": 8.0}
    assert r["busy_of_step"] == 0.5


def test_gpu_profile_script_dry_runs_on_cpu() -> None:
    args = ["--smoke", "--batches", "1,3", "--context", "24", "--warmup", "2"]
    p = subprocess.run(
        [sys.executable, str(BENCH / "gpu_profile.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(p.stdout)
    assert [(r["batch"], r["mode"]) for r in report["runs"]] == [(1, "eager"), (3, "eager")]
    assert report["graph_kernels_visible"] is None  # no CUDA graphs on CPU
    for r in report["runs"]:
        assert r["kernels"] > 0 and 0 < r["busy_ms"] <= r["span_ms"]
        assert r["by_class"]["gemm"]["count"] > 0 and len(r["top"]) == 15


def test_gpu_overlap_script_dry_runs_on_cpu() -> None:
    """benchmarks/gpu_overlap.py (device idle between decode steps, overlap on and off)."""
    args = ["--smoke", "--batch", "4", "--steps", "3", "--warmup", "1"]
    p = subprocess.run(
        [sys.executable, "gpu_overlap.py", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=BENCH,
    )
    report = json.loads(p.stdout)
    for mode in ("sync", "async"):
        r = report[mode]
        assert 0 < r["busy_ms"] <= r["span_ms"] and 0 <= r["idle_of_span"] < 1 and r["step_ms"] > 0
        host = r["unprofiled"]  # the host's phases, timed without the profiler
        assert host["step_ms"] > 0 and host["forward_ms"] > 0 and {"schedule_ms", "rest_ms"} <= set(host)


def test_gpu_ceilings_script_dry_runs_on_cpu() -> None:
    """benchmarks/gpu_ceilings.py (copy bandwidth, the projections' GEMMs) on tiny shapes."""
    p = subprocess.run(
        [sys.executable, str(BENCH / "gpu_ceilings.py"), "--smoke", "--batches", "1,4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(p.stdout)
    assert report["copy_GBps"] > 0
    rows = report["projections"]
    assert [(r["name"], r["batch"]) for r in rows[:5]] == [
        ("qkv", 1), ("o", 1), ("gate_up", 1), ("down", 1), ("lm_head", 1)
    ]  # fmt: skip
    assert len(rows) == 10 and all(r["us"] > 0 and r["of_copy"] >= 0 for r in rows)
