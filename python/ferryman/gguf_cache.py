"""The GGUF conversion cache: what ``gguf_loader.convert`` produces for a file, kept under
``$FERRYMAN_CACHE_DIR`` (default ``~/.cache/ferryman``) ``/gguf/<key>``, the key being the sha256
of ``CONVERSION_VERSION`` and the file's bytes (a changed file, or a conversion that changed, is
converted again). A folder holds:

- ``model.safetensors``: the float32 tensors, each layer's q/k/v and gate/up stacked as the model
  holds them (``stack_projections``), so a cached load is memory-mapped tensors taken as the
  parameters, with nothing concatenated or copied (packing for the CPU copies them later);
- ``config.json``: the ``ModelConfig``;
- ``tokenizer/``: the tokenizer as transformers saved it, read back without transformers where
  that gives what transformers gives (``tokenizer.load_saved``); absent for a file without one.

A folder is written whole or not at all (a temp folder renamed last) and never changed after, so
the tensors a model maps stay valid; one that cannot be written is skipped with a warning.

Hashing the file (~0.25 s for SmolLM2's GGUF on a 2-core machine) is remembered too: ``gguf/keys/``
maps the file's identity (real path, device, inode, size, mtime and ctime in ns) to its key, so an
unchanged file is not read again. Writing to a file changes its ctime, which only a change of the
system clock can set back; but file times come from a clock that ticks every few milliseconds, so
a file rewritten at the same size within one tick of its last write would keep its identity. So
only a file whose ctime is ``SETTLED_S`` (2 s) old is remembered: a changed file is hashed again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ferryman.models.config import ModelConfig
from ferryman.models.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from ferryman.models.tensor_parallel import TensorParallel
from ferryman.tokenizer import load_saved

CONVERSION_VERSION = b"ferryman-gguf-3"  # bump when what gguf_loader.convert or store writes changes
_KEY = re.compile(r"[0-9a-f]{64}")
SETTLED_S = 2  # a file whose ctime is younger is hashed every time (see the module docstring)


def cache_root() -> Path:
    return Path(os.environ.get("FERRYMAN_CACHE_DIR") or Path.home() / ".cache" / "ferryman") / "gguf"


def content_key(path: Path) -> str:
    """sha256 of ``CONVERSION_VERSION`` and the file's bytes (reads the whole file)."""
    h = hashlib.sha256(CONVERSION_VERSION)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def cache_dir(path: Path) -> Path:
    """Where the conversion of the GGUF file ``path`` is cached (see the module docstring)."""
    st = path.stat()
    identity = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    memo = cache_root() / "keys" / hashlib.sha256(CONVERSION_VERSION + identity.encode()).hexdigest()
    try:
        key = memo.read_text().strip()
    except OSError:  # not remembered (or unreadable): hash the file
        key = ""
    if not _KEY.fullmatch(key):
        now = time.time_ns()  # before hashing: a rewrite while it hashes must not count as settled
        key = content_key(path)
        if now - st.st_ctime_ns < SETTLED_S * 1_000_000_000:
            return cache_root() / key  # written just now: may change again within a clock tick
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".tmp-{os.getpid()}-{memo.name}")
            tmp.write_text(key)
            tmp.replace(memo)
        except OSError:  # a cache that cannot be written: store() says so
            pass
    return cache_root() / key


def holds(cache: Path) -> bool:
    return (cache / "config.json").is_file()


def load(
    cache: Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> tuple[LlamaForCausalLM, Any]:
    """The cached model (eval mode; ``tp``'s rank's slice) and tokenizer (None if none)."""
    from safetensors.torch import load_file

    cfg = ModelConfig(**json.loads((cache / "config.json").read_text()))
    tensors = load_file(cache / "model.safetensors")
    if tp is not None and tp.world > 1:  # ranks slice each part of a stacked tensor
        tensors = split_projections(tensors, cfg)
    return LlamaForCausalLM.from_tensors(cfg, tensors, dtype, device, tp), cached_tokenizer(cache)


def cached_tokenizer(cache: Path) -> Any:
    """The cached conversion's tokenizer: a ``ChatTokenizer`` where it reproduces transformers'
    (``tokenizer.load_saved``), or None where the conversion stored none."""
    folder = cache / "tokenizer"
    return load_saved(folder) if folder.is_dir() else None


def store(cache: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Any) -> None:
    """Writes the conversion into ``cache`` whole or not at all (a temp folder renamed last)."""
    from safetensors.torch import save_file

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        save_file(stack_projections(tensors), tmp / "model.safetensors")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        try:
            tmp.rename(cache)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        warnings.warn(f"ferryman: cannot cache the GGUF conversion in {cache}: {e}", stacklevel=2)


def stack_projections(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors (contiguous) with each layer's q/k/v and gate/up weights and biases stacked
    into one tensor under the name the model holds it by (``model.layers.N.qkv_proj.weight``
    from a GGUF's names)."""
    out = {k: v.contiguous() for k, v in tensors.items()}
    for key in list(out):
        *prefix, name, kind = key.split(".")
        for fused, parts in FUSED_PROJECTIONS.items():
            names = [".".join([*prefix, p, kind]) for p in parts]
            if name == parts[0] and all(n in out for n in names):
                out[".".join([*prefix, fused, kind])] = torch.cat([out.pop(n) for n in names])
    return out


def split_projections(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``stack_projections`` undone, as views: each stacked tensor back into its parts."""
    d = cfg.head_dim
    sizes = {
        "qkv_proj": [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        *prefix, name, kind = key.split(".")
        if name not in FUSED_PROJECTIONS:
            out[key] = t
            continue
        for part, piece in zip(FUSED_PROJECTIONS[name], torch.split(t, sizes[name]), strict=True):
            out[".".join([*prefix, part, kind])] = piece
    return out
