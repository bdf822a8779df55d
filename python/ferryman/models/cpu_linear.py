"""oneDNN-packed float32 projections on the CPU, run at a bounded set of row counts.

``pack(weight)`` moves a weight to oneDNN's packed layout (the one PyTorch's own CPU inference
path uses after freezing); ``packed_linear(x, packed, bias)`` runs a projection on it. For the
small row counts of decode steps MKL's plain sgemm streams the weights at a quarter of the memory
bandwidth, the packed kernels at about twice that (``benchmarks/cpu_linear.py``).

oneDNN builds a primitive (JIT-compiled kernels) for every distinct (rows, in, out) shape and
keeps it, both in its own primitive cache and in ideep's, about 0.65 MiB each
(``benchmarks/cpu_linear.py --cache``), up to 1,024 entries per cache before it evicts and
rebuilds. A step's token count (and its number of sampled rows) can be anything up to the token
budget, so a server that ran on them as they come would hold ever more primitives. Instead
``packed_linear`` runs at ``padded_rows(m)`` rows: ``m`` itself below 16, then the next multiple
of ``2 ** (floor(log2(m)) - 3)`` (eight sizes per doubling, at most 12.5% more rows). That is 72
row counts up to 2,048 (88 up to 8,192) per weight shape, and the caches stop growing once those
have run. ``x`` with any other row count is copied with zero rows added; ``LlamaForCausalLM``
pads its flat batch once per forward instead, so its layers' projections need no copy.

Invariants: rows are independent in a projection, so the zero rows change nothing in the real
rows' values beyond what any other row count would (the kernel oneDNN picks for a shape may sum
in another order); the output has exactly ``x``'s rows, a contiguous leading slice of the padded
result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 16  # oneDNN picks the packed layout for this many rows; measured best for 1..2048
EXACT_BELOW = 16  # row counts under this run as they are
STEPS_PER_OCTAVE_LOG2 = 3  # 2**3 = 8 padded sizes per doubling of the row count above that


def padded_rows(m: int) -> int:
    """The row count a projection of ``m`` rows runs at (``m`` itself below ``EXACT_BELOW``)."""
    if m < EXACT_BELOW:
        return m
    step = 1 << (m.bit_length() - 1 - STEPS_PER_OCTAVE_LOG2)
    return -(-m // step) * step


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's packed layout (a new tensor; ``weight`` is untouched)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)  # type: ignore[no-any-return]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[m, in]``, run at ``padded_rows(m)`` rows."""
    m = x.shape[0]
    pad = padded_rows(m) - m
    if pad == 0:
        return _run(x, packed, bias)
    return _run(F.pad(x, (0, 0, 0, pad)), packed, bias)[:m]


def _run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]
