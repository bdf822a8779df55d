"""The CPU's packed projections (``ferryman.models.cpu_linear``): the padded row counts are few,
close above the real one and stable; a padded projection gives the plain one's rows; and oneDNN
builds one primitive per padded row count, not per row count (read off its verbose log of
primitive creation, in a subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

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
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    created = [
        int(mb)
        for line in r.stdout.splitlines()
        if ",create:cache_miss," in line and ",inner_product," in line
        for mb in re.findall(r",mb(\d+)ic24oc40,", line)
    ]
    want = sorted({padded_rows(m) for m in range(1, rows + 1)})
    assert sorted(created) == want  # each padded row count built once, the second pass reuses them
    assert len(want) == 50
