"""RoPE frequencies for the Llama family: the plain ones and the scaled variants that
``config.json`` files name in ``rope_scaling`` (or transformers 5's ``rope_parameters``), computed
as transformers computes them, plus llama.cpp's per-frequency divisors (a GGUF's ``rope_freqs``).

``rope_parameters`` returns the inverse frequencies and the factor cos/sin are multiplied by (not 1
only for YaRN). Supported types: ``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``.
``dynamic`` (NTK) rescales only past ``max_position_embeddings``, which is also the longest context
the engine accepts, so within it the frequencies are the plain ones, as in transformers. Any other
type (``longrope``, ...) is refused by ``check_rope_scaling`` with a ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling type of a ``rope_scaling`` dict (its older key ``type`` included)."""
    s = scaling or {}
    return str(s.get("rope_type", s.get("type", "default")))


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """Raises ``ValueError`` naming the type when ferryman cannot compute it."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [k for k in _REQUIRED.get(kind, ()) if (scaling or {}).get(k) is None]
    if missing:  # a KeyError traceback from the model's constructor before
        raise ValueError(f"rope_scaling type {kind!r} needs {', '.join(missing)}")


# the keys each type reads (yarn's and llama3's original context defaults to the config's)
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}


def rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    freq_factors: list[float] | None = None,
) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies ``[head_dim / 2]`` and the cos/sin scale. ``freq_factors``
    (llama.cpp's ``rope_freqs``) divide the frequencies after any scaling."""
    check_rope_scaling(scaling)
    s, kind = scaling or {}, rope_type(scaling)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scale = 1.0
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, s)
    elif kind == "yarn":
        inv, scale = _yarn(head_dim, theta, s, max_position_embeddings)
    if freq_factors is not None:
        inv = inv / torch.tensor(freq_factors, dtype=torch.float64)
    return inv.float(), scale


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: ``attention_factor`` when given, else from ``factor`` (and DeepSeek's
    ``mscale`` / ``mscale_all_dim`` when both are set)."""
    given = s.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies that turn fewer than
    ``beta_slow`` times over the original context are interpolated (divided by ``factor``), those
    turning more than ``beta_fast`` times are kept, with a linear ramp between."""
    old_len = int(s["original_max_position_embeddings"])
    factor = float(s["factor"]) if s.get("factor") is not None else max_pos / old_len
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension turning ``rotations`` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.double()  # the share of the unscaled frequency
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs.double(), 1.0 / (factor * pos_freqs.double())
    return interpolated * (1 - keep) + extrapolated * keep, yarn_attention_factor(s, factor)
