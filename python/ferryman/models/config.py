"""What ferryman reads from a Hugging Face ``config.json`` (``ModelConfig``): the shapes of the
Llama family, RoPE settings (checked against what ``models.rope`` computes) and the
sliding-window size a config would need, which the loader weighs against ``max_model_len``.
A GGUF file's metadata is turned into the same fields (``gguf_loader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferryman.models.rope import check_rope_scaling, rope_type

_ARCH_OF_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}


@dataclass(slots=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` this implementation uses."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    rope_freq_factors: list[float] | None = None  # llama.cpp's rope_freqs (GGUF): divide inv_freq
    sliding_window: int | None = None  # the attention window of some layer, None when all are full

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        # no architectures: transformers goes by model_type (a qwen3 config read as Llama lost
        # its q/k norms without a word)
        archs = d.get("architectures") or [_ARCH_OF_TYPE.get(d.get("model_type") or "llama", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            named = repr(arch) if arch != "?" else f"of model_type {d.get('model_type')!r}"
            raise ValueError(
                f"unsupported architecture {named}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # what the model below does not compute is refused, never dropped (other tokens than
        # transformers'): another activation than SiLU, MLP biases, an o_proj bias
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (SiLU only)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        if d.get("attention_bias") and arch != "Qwen2ForCausalLM":
            raise ValueError(f"attention_bias (q/k/v/o biases) is not supported for {arch}")
        heads = int(d["num_attention_heads"])
        # transformers': a legacy rope_scaling replaces rope_parameters (theta too, then from the top
        # level or 10000); llama3's and yarn's original context is a top-level one first, then
        # the dict's, then the config's
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        scaling = rope if rope_type(rope) != "default" else None
        if scaling is not None and rope_type(scaling) in ("llama3", "yarn"):
            orig = d.get("original_max_position_embeddings")
            scaling = {"original_max_position_embeddings": d.get("max_position_embeddings", 4096), **scaling}
            if orig is not None:
                scaling["original_max_position_embeddings"] = orig
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        check_rope_scaling(scaling)
        partial = (scaling or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if scaling is not None and float(partial) != 1.0:  # transformers' scaled RoPE reads it
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE on every dimension)")
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v always carry biases (transformers' Qwen2 ignores the key)
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(d, arch),
        )


def _sliding_window(d: dict[str, Any], arch: str) -> int | None:
    """The window of a config whose layers (some of them) use sliding-window attention: Mistral's
    ``sliding_window``; Qwen2/3's only with ``use_sliding_window`` and layers from
    ``max_window_layers`` on (or ``layer_types`` naming one), as transformers decides."""
    window = d.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = d.get("sliding_window", 4096)  # their configs' default when absent (null: none)
        if not d.get("use_sliding_window", False) or window is None:
            return None
        types = d.get("layer_types")
        if types is not None:
            return int(window) if "sliding_attention" in types else None
        return int(window) if int(d.get("max_window_layers", 28)) < int(d["num_hidden_layers"]) else None
    return None if window is None else int(window)
