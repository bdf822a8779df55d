"""The CPU's packed projections (``ferryman.models.cpu_linear``): the padded row counts are few,
close above the real one and stable; a padded projection gives the plain one's rows; oneDNN
builds one primitive per padded row count, not per row count; and an Engine serving prompts of
every length from 1 to 70 only ever has projections built at padded row counts (both read off
oneDNN's verbose log of primitive creation, in a subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import build

from ferryman.models.cpu_linear import can_pack, pack, packed_linear, padded_rows

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="oneDNN is not available"
)


def test_padded_rows_are_few_and_close_above() -> None:
    sizes = [padded_rows(m) for m in range(1, 8193)]
    assert sizes[:15] == list(range(1, 16))  # small row counts run as they are
    for m, p in enumerate(sizes, start=1):
        assert m <= p <= m * 1.125 and padded_rows(p) == p
    assert sizes == sorted(sizes)
    assert len(set(sizes[:2048])) == 72 and len(set(sizes)) == 88
    assert padded_rows(17) == 18 and padded_rows(33) == 36 and padded_rows(1025) == 1152


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_gives_the_plain_rows(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 24, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    packed = pack(w)
    for m in [1, 7, 15, 16, 17, 19, 31, 33, 63, 65, 100, 129, 300]:
        x = torch.randn(m, 24, generator=g)
        got = packed_linear(x, packed, b)
        assert got.shape == (m, 48) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def created_rows(script: str) -> list[int]:
    """The row counts of the inner products oneDNN built (not found in its cache) while
    ``script`` ran with primitive creation logged."""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return [
        int(mb)
        for line in r.stdout.splitlines()
        if ",create:cache_miss," in line and ",inner_product," in line
        for mb in re.findall(r",mb(\d+)ic", line)
    ]


@needs_onednn
def test_onednn_builds_one_primitive_per_padded_row_count() -> None:
    rows = 300
    script = textwrap.dedent(
        f"""
        import torch
        from ferryman.models.cpu_linear import pack, packed_linear
        w = pack(torch.randn(40, 24))
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            for m in list(range(1, {rows} + 1)) * 2:
                packed_linear(torch.randn(m, 24), w, None)
        """
    )
    want = sorted({padded_rows(m) for m in range(1, rows + 1)})
    assert sorted(created_rows(script)) == want  # each built once, the second pass reuses them
    assert len(want) == 50


@needs_onednn
def test_an_engine_builds_projections_at_padded_row_counts_only(tmp_path: Path) -> None:
    model = build("qwen2", tmp_path)  # tied LM head and q/k/v bias: every packed path
    script = textwrap.dedent(
        f"""
        import torch
        from ferryman.engine import Engine
        from ferryman.sampling_params import SamplingParams
        engine = Engine({str(model)!r}, num_device_blocks=256, calibrate=False)
        prompts = [[(7 * i + j) % 90 + 1 for j in range(i)] for i in range(1, 71)]
        params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 10, ignore_eos=True) for i in range(70)]
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            for i in range(0, 70, 10):  # ten prompts at a time, decoding 1 to 10 tokens: 10 to 1 rows
                engine.generate(prompts[i : i + 10], params[i : i + 10])
        """
    )
    created = created_rows(script)
    assert created, "no oneDNN inner product was built: the projections did not run packed"
    assert all(padded_rows(m) == m for m in created), sorted(set(created))
    assert len(set(created)) >= 15  # the steps did have many token counts
