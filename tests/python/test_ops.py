"""The model's elementwise kernels (``models/ops.py``) on CPU: the start-up check accepts the
reference and names an op that differs or raises; FlashInfer's kernels fall back to the reference
where they cannot run; and the model honours the in-place contract FlashInfer's kernels need (it
never reads a tensor it handed to ``add_rmsnorm`` or ``rope`` again), checked by running it with
torch ops that overwrite their inputs as the fused kernels do. The FlashInfer kernels themselves
are checked against the reference in ``tests/gpu``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import build

from ferryman.engine import Engine
from ferryman.models.ops import RMSNorm, Shapes, TorchOps, check_ops, select_ops
from ferryman.sampling_params import SamplingParams

SHAPES = Shapes(64, 4, 2, 16, 128, torch.float32, torch.device("cpu"), 256)


def reference() -> TorchOps:
    return TorchOps(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)


class InPlaceOps(TorchOps):
    """The reference's arithmetic, writing its results over its inputs as FlashInfer's
    ``fused_add_rmsnorm`` and ``apply_rope_with_cos_sin_cache_inplace`` do."""

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual.add_(x)
        x.copy_(norm(residual))
        return x, residual

    def rope(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rq, rk = super().rope(q, k, state)
        q.copy_(rq)
        k.copy_(rk)
        return q, k


class GeluOps(TorchOps):
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate) * up


class RaisingOps(TorchOps):
    def rope(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("no kernel image for this device")


def test_the_check_accepts_the_reference_and_names_what_differs_or_raises() -> None:
    ref = reference()
    assert check_ops(reference(), ref, SHAPES) is None
    assert check_ops(InPlaceOps(ref.inv_freq, 1.0), ref, SHAPES) is None
    differs = check_ops(GeluOps(ref.inv_freq, 1.0), ref, SHAPES)
    assert differs is not None and differs.startswith("differ from the reference (silu_and_mul ")
    # cos and sin doubled: every rotated value doubles, |2y - y| / |y| = 1
    assert (
        check_ops(TorchOps(ref.inv_freq, 2.0), ref, SHAPES)
        == "differ from the reference (rope q 1.0e+00, rope k 1.0e+00)"
    )
    assert (
        check_ops(RaisingOps(ref.inv_freq, 1.0), ref, SHAPES)
        == "raised RuntimeError: no kernel image for this device"
    )


def test_without_flashinfer_attention_the_reference_runs() -> None:
    choice = select_ops(False, reference().inv_freq, 1.0, SHAPES)
    assert isinstance(choice.ops, TorchOps) and choice.note == "torch (the attention backend is torch)"


def test_flashinfer_kernels_that_cannot_run_fall_back_to_the_reference_with_a_warning() -> None:
    # on CPU FlashInfer is either missing (cannot be built) or has no CPU kernels (raises)
    with pytest.warns(UserWarning, match="FlashInfer's fused kernels"):
        choice = select_ops(True, reference().inv_freq, 1.0, SHAPES)
    assert type(choice.ops) is TorchOps
    assert choice.note.startswith("torch (FlashInfer's fused kernels ")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_model_gives_the_same_tokens_with_kernels_that_overwrite_their_inputs(
    kind: str, tmp_path: Path
) -> None:
    path = str(build(kind, tmp_path, tokenizer=True))
    kw: dict[str, Any] = {"block_size": 4, "num_device_blocks": 14, "num_host_blocks": 16, "calibrate": False}
    prompts = [f"sea {i}" for i in range(5)]  # 2 blocks each, 5 at the end: the pool swaps
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = Engine(path, preemption_mode="swap", **kw)
    assert plain.runner.ops_note == "torch (the attention backend is torch)"
    in_place = Engine(path, preemption_mode="swap", **kw)
    in_place.runner.ops = InPlaceOps(in_place.runner.model.inv_freq, in_place.runner.model.rope_scale)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in in_place.generate(prompts, sp)]
    assert got == want
    assert in_place.stats()["num_preemptions_swap"] > 0
