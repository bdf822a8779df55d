"""The tests' tiny random Llama (``tests/python/tiny_models.py``, byte-level tokenizer), written
into a folder for the benchmarks that run on it (imported as ``tiny`` from a script here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_model(root: Path) -> str:
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests/python/tiny_models.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.build("llama", root, tokenizer=True))
