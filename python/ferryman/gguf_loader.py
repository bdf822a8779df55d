"""Loading a Llama-family model from a GGUF file through the ``gguf`` package.

Every tensor is dequantized to the engine dtype (whatever ``gguf.quants`` supports: F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...). llama.cpp's converter permutes the rows of the q and k
projections of ``llama`` models (it interleaves each head's two rotary halves); that is undone
here so the Hugging Face RoPE convention applies. The config, tokenizer, special tokens and chat
template come from the file's metadata.

RoPE scaling, as llama.cpp applies it: a ``rope_freqs`` tensor (how llama.cpp stores Llama 3.1's
``llama3`` scaling) divides the inverse frequencies; ``{arch}.rope.scaling.type`` ``linear`` and
``yarn`` (with ``factor``, ``original_context_length``, ``yarn_beta_fast`` / ``yarn_beta_slow``, and
``yarn_attn_factor`` or ``attn_factor``, which llama.cpp multiplies YaRN's default cos/sin scale
by) become the matching ``rope_scaling``; other types are refused. (transformers' own GGUF loader
ignores both for these architectures, so it runs a Llama 3.1 GGUF with unscaled RoPE.)

Parsing, dequantizing and converting the tokenizer take seconds (~11 s for SmolLM2 on a 2-core
machine), so what ``convert`` produces is cached by the file's hash (``gguf_cache``).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from ferryman import gguf_cache
from ferryman.models.config import ModelConfig
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.rope import yarn_attention_factor
from ferryman.models.tensor_parallel import TensorParallel

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation for ``n_head`` heads."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(reader: Any) -> dict[str, Any]:
    skip = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    )
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(skip)}


def config_from_gguf(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH)}")
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    hf = {
        "architectures": [_ARCH[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_scaling": rope_scaling_from_gguf(meta, arch),
    }
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        hf.update(sliding_window=int(window), use_sliding_window=True, max_window_layers=0)
    return ModelConfig.from_hf(hf)


def rope_scaling_from_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` of a file's ``{arch}.rope.scaling.*`` keys (or the older
    ``{arch}.rope.scale_linear``); None for unscaled RoPE."""
    key = f"{arch}.rope.scaling."
    kind = meta.get(key + "type")
    factor = meta.get(key + "factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None:  # an old file: only a factor, linear (llama.cpp's type when none is named)
        kind = "linear" if factor is not None and float(factor) != 1.0 else "none"
    if kind == "none":  # named: never scaled, whatever the factor (llama.cpp's rule)
        return None
    if factor is None:
        raise ValueError(f"rope scaling {kind!r} without {key}factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear, yarn are)")
    # llama.cpp's: the original context defaults to the trained one
    orig = meta.get(key + "original_context_length", meta.get(f"{arch}.context_length"))
    if orig is None:
        raise ValueError(f"yarn rope scaling without {key}original_context_length or {arch}.context_length")
    s: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(orig),
    }
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if meta.get(key + theirs) is not None:
            s[ours] = float(meta[key + theirs])
    attn = meta.get(key + "yarn_attn_factor", meta.get(key + "attn_factor"))
    if attn is not None:
        s["attention_factor"] = float(attn) * yarn_attention_factor({}, s["factor"])
    return s


def load_gguf(
    path: str | Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> tuple[LlamaForCausalLM, Any]:
    """Returns the model (eval mode; ``tp``'s rank's slice) and its tokenizer (with the file's
    chat template), from the conversion cache (``gguf_cache``) when it holds this file."""
    path = Path(path)
    cache = gguf_cache.cache_dir(path)
    if gguf_cache.holds(cache):
        try:
            return gguf_cache.load(cache, dtype, device, tp)
        except (OSError, SafetensorError, json.JSONDecodeError, TypeError) as e:  # damaged or stale: rebuilt
            said = f"ferryman: the GGUF conversion cache {cache} cannot be read ({e}); rebuilt"
            warnings.warn(said, stacklevel=2)
            shutil.rmtree(cache, ignore_errors=True)
    cfg, tensors, tokenizer = convert(path)
    gguf_cache.store(cache, cfg, tensors, tokenizer)
    if (cache / "tokenizer").is_dir():  # the same tokenizer object a later, cached load gives
        tokenizer = gguf_cache.cached_tokenizer(cache)
    return LlamaForCausalLM.from_tensors(cfg, tensors, dtype, device, tp), tokenizer


def convert(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """The file's config, its tensors (float32, Hugging Face names and RoPE layout) and its
    tokenizer (None for a file without one): the slow part of loading, which ``load_gguf``
    caches."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = _meta(reader)
    tensors = read_tensors(reader)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else tensors["model.embed_tokens.weight"].shape[0]
    cfg = config_from_gguf(meta, vocab)
    permuted = meta["general.architecture"] == "llama"
    factors = tensors.pop("rope_freqs.weight", None)
    if factors is not None:
        cfg.rope_freq_factors = [float(f) for f in factors.flatten().tolist()]
    if "lm_head.weight" not in tensors:
        cfg.tie_word_embeddings = True
    if permuted:
        for i in range(cfg.num_layers):
            q, k = f"model.layers.{i}.q_proj.weight", f"model.layers.{i}.k_proj.weight"
            tensors[q] = unpermute_rows(tensors[q], cfg.num_heads)
            tensors[k] = unpermute_rows(tensors[k], cfg.num_kv_heads)
    # a file without a tokenizer serves token ids only, as a Hugging Face folder without one
    has_tokenizer = "tokenizer.ggml.model" in reader.fields and tokens is not None
    return cfg, tensors, gguf_tokenizer(path) if has_tokenizer else None


def read_tensors(reader: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a ``GGUFReader``, dequantized to float32 in its logical (row-major) shape,
    under its Hugging Face name."""
    import gguf

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        try:
            raw = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:  # gguf-py reads no such type (F64, integer types, Q8_K, ...)
            raise ValueError(
                f"tensor {t.name} has type {t.tensor_type.name}, which ferryman cannot read"
            ) from None
        w = torch.from_numpy(np.array(raw, dtype=np.float32))
        tensors[_hf_name(t.name)] = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
    return tensors


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")  # blk.N.kind.weight|bias
    if parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return name


def gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of a GGUF file (what it builds from the file's vocabulary)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except BaseException as e:
        # the tokenizers library's own errors about a broken vocabulary or merges: a bare
        # Exception, or a Rust panic (pyo3's PanicException, a BaseException)
        if type(e) is not Exception and type(e).__name__ != "PanicException":
            raise
        raise ValueError(f"its tokenizer cannot be built: {e}") from e
