"""Incremental detokenization and stop strings, on a byte-level tokenizer where one character can
span several tokens (no downloads)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tiny_models import build

from ferryman.detokenizer import IncrementalDetokenizer
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("detok"), tokenizer=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def deltas(tokenizer: Any, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tokenizer)
    return [d.step(ids[:i], final=i == len(ids)) for i in range(1, len(ids) + 1)]


def test_multibyte_character_is_emitted_once_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("a€b", add_special_tokens=False)
    assert len(ids) == 5  # 'a', three bytes of '€', 'b'
    assert deltas(tokenizer, ids) == ["a", "", "", "€", "b"]


def test_deltas_concatenate_to_the_full_decode(tokenizer: Any) -> None:
    rng = random.Random(0)
    text = "naïve café — 東京 🚀 done"
    real = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(deltas(tokenizer, real)) == text
    for _ in range(300):  # random bytes and specials: invalid UTF-8, cut characters, EOS mid-way
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        assert "".join(deltas(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_cuts_the_text(model_dir: Path) -> None:
    eng = Engine(str(model_dir), block_size=4, num_device_blocks=64, num_host_blocks=0, calibrate=False)
    prompt = [72, 101, 108, 108, 111]
    free = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert len(text) >= 6
    stop = text[3:6]  # three characters, so it spans at least two tokens' deltas
    cut = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.outputs[0].token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < 24
    assert eng.stats()["num_free_device_blocks"] == 64  # every block free again
