"""GPU and model-shape presets for ``ferryman sim`` (override any field; shapes also load from a
Hugging Face ``config.json``).

GPU figures are the vendors' datasheet peaks: dense bf16 tensor FLOP/s (no sparsity), HBM
bandwidth and memory. ``host_link_bytes_per_s`` is what a pinned copy-engine transfer reaches in
practice, not the bus's nominal rate: about 57 GB/s was measured on H100 over PCIe Gen5 x16
(nvbandwidth), of 64 GB/s nominal; we take 55 GB/s for Gen5 cards and 25 GB/s for Gen4 x16 ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ferryman.engine_args import type_problem


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def params_per_layer(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o; k, v
        return attn + 3 * h * self.intermediate_size  # gate, up, down

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * self.params_per_layer + emb * (1 if self.tie_word_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


GB = 1e9
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM 80GB", 989e12, 3.35e12, 55 * GB, 80 * GB),
    "h200": GpuSpec("H200 SXM 141GB", 989e12, 4.8e12, 55 * GB, 141 * GB),
    "a100": GpuSpec("A100 SXM 80GB", 312e12, 2.039e12, 25 * GB, 80 * GB),
    "l4": GpuSpec("L4 24GB", 121e12, 300 * GB, 25 * GB, 24 * GB),
}


@dataclass(frozen=True, slots=True)
class Interconnect:
    """How tensor-parallel ranks talk: an all-reduce's bus bandwidth per GPU (NCCL's "busbw"
    figure) and a fixed latency per collective. Assumed from published NCCL figures, not
    measured here: NVLink 4 moves 450 GB/s per direction, all-reduces reach ~80% of it; PCIe Gen5
    x16 moves 64 GB/s per direction, through host bridges all-reduces reach ~40 GB/s."""

    name: str
    bytes_per_s: float
    latency_s: float


LINKS: dict[str, Interconnect] = {
    "nvlink": Interconnect("NVLink 4 (H100/H200 SXM)", 360 * GB, 10e-6),
    "pcie": Interconnect("PCIe Gen5 x16", 40 * GB, 25e-6),
}


def tp_split(shape: ModelShape, tp: int) -> float:
    """The share of the KV heads one of ``tp`` ranks holds (one head each when there are fewer
    heads than ranks: replicated); ``ValueError`` when the model does not split that way (the
    rule of ``ferryman.models.tensor_parallel``)."""
    nq, nkv, inter = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    if tp < 1 or nq % tp or inter % tp or (nkv % tp and tp % nkv):
        raise ValueError(
            f"tensor_parallel_size={tp} must divide {shape.name}'s {nq} heads and intermediate size "
            f"{inter}, and divide or be a multiple of its {nkv} KV heads"
        )
    return max(nkv // tp, 1) / nkv


MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "mistral-7b": ModelShape("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32000),
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    # used to check the roofline against published static-batch measurements (see cost.py)
    "llama-2-7b": ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
}


def _override(obj: Any, overrides: dict[str, Any]) -> Any:
    known = {f.name for f in fields(obj)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown field(s) {bad} for {type(obj).__name__}; known: {sorted(known)}")
    for k, v in overrides.items():  # a value of the field's type (a TypeError deep in the model before)
        problem = type_problem(type(getattr(obj, k)), v)
        if problem:
            raise ValueError(f"{type(obj).__name__}.{k} {problem}, got {v!r}")
    # sizes and rates are positive (a zero one divides the cost model by zero)
    sizes = {k: v for k, v in overrides.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    zero = next((k for k, v in sizes.items() if not v > 0), None)
    if zero is not None:
        raise ValueError(f"{type(obj).__name__}.{zero} must be > 0, got {overrides[zero]}")
    return replace(obj, **overrides)


def gpu(name: str, **overrides: Any) -> GpuSpec:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; presets: {sorted(GPUS)}")
    spec: GpuSpec = _override(GPUS[key], overrides)
    return spec


def model_shape(name: str, **overrides: Any) -> ModelShape:
    """A preset by name, or the shape in a Hugging Face ``config.json`` (a file or its folder)."""
    key = name.lower()
    if key in MODEL_SHAPES:
        shape: ModelShape = _override(MODEL_SHAPES[key], overrides)
        return shape
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model shape {name!r}: not a preset ({sorted(MODEL_SHAPES)}) nor a config.json"
        )
    try:
        cfg = json.loads(path.read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        shape = ModelShape(
            name=str(cfg.get("_name_or_path") or path.parent.name),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or (hidden // heads if heads > 0 else 0)),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a traceback before
        what = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path} is not a model's config.json: {what}") from None
    small = next(
        (f.name for f in fields(shape) if type(getattr(shape, f.name)) is int and getattr(shape, f.name) < 1),
        None,
    )
    if small is not None:
        raise ValueError(f"{path}: ModelShape.{small} must be > 0, got {getattr(shape, small)}")
    result: ModelShape = _override(shape, overrides)
    return result
