"""Our Triton kernels on the device: the skinny GEMM against its reference in bfloat16 and
float16 (Triton's interpreter, which the CPU tests use, runs float16 only), and a runner whose
projections run it against one whose projections do not."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from ferryman import RequestParams, Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_gemm_matches_its_reference_on_the_device(dtype: torch.dtype) -> None:
    """Every tile shape in bf16 (the interpreter cannot run tl.dot in it), the last one in fp16
    (which the CPU tests cover): each variant is a compile, and the device's time is short."""
    from ferryman.kernels import skinny_gemm as sg

    torch.manual_seed(0)
    dev = torch.device("cuda")
    for m in (1, 17):  # padded to 16 (and the one-row kernel) and to 32
        cfgs = sg.configs_for(m) if dtype == torch.bfloat16 else sg.configs_for(m)[-1:]
        # K a multiple of every BLOCK_K, and (with a bias) of none
        for n, k, bias in ((1024, 4096, False), (100, 200, True)):
            x = torch.randn(m, k, device=dev).to(dtype)
            w = (torch.randn(n, k, device=dev) * 0.05).to(dtype)
            b = torch.randn(n, device=dev).to(dtype) if bias else None
            want = sg.reference(x, w, b).float()
            tol = 2 * torch.finfo(dtype).eps * want.abs().clamp(min=1.0)
            for cfg in cfgs:
                got = sg.skinny_linear(x, w, b, cfg).float()
                worst = float((got - want).abs().max())
                assert bool(((got - want).abs() <= tol).all()), (m, n, k, bias, cfg, worst)


def test_a_runner_on_the_skinny_gemm_gives_the_logits_of_one_on_cublas(tmp_path: Path) -> None:
    from test_flashinfer import lockstep
    from tiny_models import build

    from ferryman.kernels import skinny_gemm as sg
    from ferryman.model_loader import load_model
    from ferryman.models.llama import Linear
    from ferryman.worker.kv_cache import KvCache
    from ferryman.worker.model_runner import ModelRunner

    dev, dt = torch.device("cuda"), torch.float16
    ckpt = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))
    runners = []
    for _ in range(2):  # a model each: the kernel's choice lives on the model's projections
        model, _ = load_model(ckpt, dt, dev)
        c = model.cfg
        kv = KvCache(c.num_layers, 64, 0, 16, c.num_kv_heads, c.head_dim, dt, dev)
        spec = {"max_num_seqs": 8, "max_model_len": 128, "attention_backend": "flashinfer"}
        runners.append(ModelRunner(model, kv, 16, dev, **spec))
    plain, skinny = runners
    report = skinny.use_skinny_gemm()  # measured: on the tiny model cuBLAS may well win
    assert report and all(g["rows"] for g in report.values()), report
    print("skinny GEMM choice on the tiny model:", report)
    # then the kernel forced on every projection at every graph size, tile shapes taking turns
    projections = [m for m in skinny.model.modules() if isinstance(m, Linear)]
    for i, mod in enumerate(projections):
        cfg, one = sg.CONFIGS[i % len(sg.CONFIGS)], sg.GEMV_CONFIGS[i % len(sg.GEMV_CONFIGS)]
        mod.skinny = {m: functools.partial(sg.skinny_linear, cfg=cfg) for m in (2, 4, 8)}
        mod.skinny[1] = functools.partial(sg.skinny_linear, cfg=one if i % 2 else cfg)
    skinny.capture_graphs()
    for rows, graph_steps in ((5, 19), (1, 38)):  # the size-8 graph, then size 1 (a 1-row head)
        s = Scheduler(SchedulerConfig(block_size=16, num_device_blocks=64, max_num_seqs=8, max_model_len=128))
        for r in range(rows):
            s.add_request(r, [*range(30, 50), r], RequestParams(20, ignore_eos=True))
        (worst,), steps = lockstep([plain, skinny], s)
        print(f"skinny GEMM vs cuBLAS, {rows} rows: worst relative logit error {worst:.2e}, {steps} steps")
        assert skinny.num_graph_steps >= graph_steps
        assert worst < 2e-2
    skinny.use_skinny_gemm(on=False)
    assert all(m.skinny is None for m in projections)
