"""Which attention backend a runner gets, from the ``attention_backend`` knob and the device.

The rule: "torch" is the reference (the CPU path); "flashinfer" needs a CUDA device and
FlashInfer (``pip install ferryman[gpu]``) and is an error without them; "auto" is FlashInfer
when both are there, else torch. FlashInfer is looked for only when the rule can pick it (never on
a CPU device), so the CPU path never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferryman.attention.base import AttentionBackend
from ferryman.attention.flashinfer_backend import FlashInferBackend, flashinfer_available
from ferryman.attention.torch_backend import TorchAttentionBackend
from ferryman.engine_args import ATTENTION_BACKENDS


def backend_name(name: str, device: torch.device) -> str:
    """ "torch" or "flashinfer" for the knob ``name`` on ``device``; ValueError for an unknown
    name, or for "flashinfer" where it cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    use_fi = False
    if name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        use_fi = device.type == "cuda" and flashinfer_available()
        if name == "flashinfer" and not use_fi:
            need = "a CUDA device and FlashInfer (pip install ferryman[gpu])"
            raise ValueError(f"attention_backend='flashinfer' needs {need}")
    return "flashinfer" if use_fi else "torch"


def select_backend(
    name: str,
    device: torch.device,
    kv_layers: Sequence[torch.Tensor],
    *,
    block_size: int,
    scale: float,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend:
    """The backend ``backend_name(name, device)`` picks, over ``kv_layers`` (each layer's
    ``[num_blocks, 2, block_size, Hkv, D]`` cache view)."""
    if backend_name(name, device) == "flashinfer":
        return FlashInferBackend(kv_layers, block_size, scale, num_qo_heads, num_kv_heads, head_dim)
    return TorchAttentionBackend(kv_layers, block_size, scale=scale)
