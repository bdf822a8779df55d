"""What a model's files say beyond its weights, checked against transformers on tiny random
checkpoints: RoPE scaling from ``config.json`` (linear, dynamic, llama3, YaRN) and from a GGUF
(llama.cpp's ``rope_freqs`` tensor, ``rope.scaling.*`` keys) at positions past the original
context; sliding windows and a ``max_model_len`` past the model's context refused;
``generation_config.json`` as the default sampling; a Hugging Face Hub id read from the hub cache;
``load_format="dummy"``: random weights of the config's shape."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build, dense_causal

from ferryman._core import InvalidRequestError
from ferryman.engine import Engine
from ferryman.model_loader import ModelLoadError, load_model
from ferryman.sampling_params import SamplingParams

CPU = torch.device("cpu")
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class _DenseCausal:
    """One sequence's plain causal attention, the oracle for a bare forward."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_causal(q, k, v)


def ours(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), _DenseCausal()))  # type: ignore[no-any-return]


def theirs(path: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()  # type: ignore[no-any-return]


def long_ids(vocab: int, n: int = 240) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))


SCALINGS = [
    ("llama", LLAMA3),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("llama", {"rope_type": "dynamic", "factor": 4.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    (
        "llama",
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.3,
        },
    ),
    (
        "qwen3",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
    ),
]


@pytest.mark.parametrize(
    ("kind", "scaling"), SCALINGS, ids=lambda v: v if isinstance(v, str) else v["rope_type"]
)
def test_rope_scaling_matches_transformers_past_the_original_context(
    tmp_path: Path, kind: str, scaling: dict[str, Any]
) -> None:
    """Logits of 240 tokens (the tiny models' original context is 32 or 64; dynamic NTK rescales
    only past max_position_embeddings=256, the longest context accepted) equal transformers'; the
    same weights with plain RoPE differ, so the scaling is what is compared."""
    path = build(kind, tmp_path, rope_scaling=dict(scaling))  # type: ignore[arg-type]
    model, _ = load_model(path, torch.float32, CPU)
    assert not any(p.requires_grad for p in model.parameters())  # no autograd (CUDA graph captures)
    ids = long_ids(model.cfg.vocab_size)
    want, got = theirs(path, ids), ours(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if scaling["rope_type"] != "dynamic":
        plain = json.loads((path / "config.json").read_text())
        plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        (path / "config.json").write_text(json.dumps(plain))
        unscaled, _ = load_model(path, torch.float32, CPU)
        assert (ours(unscaled, ids) - want).abs().max() > 1e-2


def test_an_unsupported_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    path = build("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope_scaling type 'longrope' is not supported"):
        load_model(path, torch.float32, CPU)


def patch_config(path: Path, **fields: Any) -> None:
    """Sets (or, with None, deletes) top-level fields of a folder's config.json."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in fields.items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias is not supported"),
        ({"attention_bias": True}, "attention_bias .* is not supported for LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling type 'linear' needs factor"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5 is not supported",
        ),
        ({"vocab_size": None, "architectures": None, "model_type": "gpt2"}, "of model_type 'gpt2'"),
        ({"vocab_size": "x"}, "a config ferryman cannot load"),
    ],
)
def test_what_the_model_does_not_compute_is_refused_not_dropped(
    tmp_path: Path, fields: dict[str, Any], said: str
) -> None:
    """Each loaded before, and gave other tokens than transformers (or a raw traceback)."""
    path = build("llama", tmp_path)
    patch_config(path, **fields)
    with pytest.raises(ModelLoadError, match=said):
        load_model(path, torch.float32, CPU)


def test_checkpoint_tensors_without_a_place_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = build("llama", tmp_path)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.ones(weights["model.norm.weight"].shape)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"tensors this model does not use, e\.g\. \['layers\.0\.o_proj\.bias'\]"
    ):
        load_model(path, torch.float32, CPU)
    del weights["model.layers.0.self_attn.o_proj.bias"], weights["model.norm.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors, e\.g\. \['norm\.weight'\]"):
        load_model(path, torch.float32, CPU)


def test_checkpoints_transformers_keeps_apart_load_as_it_does(tmp_path: Path) -> None:
    """A config that ties the embeddings over the checkpoint's own, different lm_head (the
    lm_head is kept), and a Qwen2 config saying ``attention_bias: false`` (its q/k/v carry biases
    all the same): ferryman tied over the first and refused the second."""
    tied = build("llama", tmp_path / "tied")
    patch_config(tied, tie_word_embeddings=True)
    qwen = build("qwen2", tmp_path / "qwen")
    patch_config(qwen, attention_bias=False)
    for path in (tied, qwen):
        with pytest.warns() if path == tied else contextlib.nullcontext():
            model, _ = load_model(path, torch.float32, CPU)
        ids = long_ids(model.cfg.vocab_size, 24)
        torch.testing.assert_close(ours(model, ids), theirs(path, ids), rtol=1e-4, atol=1e-4)


def test_gguf_file_edges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name ending in ".GGUF" is a GGUF; a damaged conversion cache is rebuilt (it failed on
    every load); merges that do not fit the vocabulary are a ModelLoadError (a bare Exception or
    a Rust panic from the tokenizers library before)."""
    from ferryman.gguf_cache import cache_dir

    monkeypatch.setenv("FERRYMAN_CACHE_DIR", str(tmp_path / "cache"))
    hf = build("llama", tmp_path / "llama")
    up = tmp_path / "UP.GGUF"
    write_llama_gguf(hf, up, merges=[])
    model, _ = load_model(up, torch.float32, CPU)
    (cache_dir(up) / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.warns(UserWarning, match="cannot be read"):
        again, _ = load_model(up, torch.float32, CPU)
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)
    load_model(up, torch.float32, CPU)  # rebuilt: read back without a warning (pytest's -W error)
    for merges in (["t t1"], ["t1 t2"]):  # a token not in the vocabulary; a merge it panics on
        bad = tmp_path / f"bad{len(merges[0])}.gguf"
        write_llama_gguf(hf, bad, merges=merges)
        with pytest.raises(ModelLoadError, match="its tokenizer cannot be built"):
            load_model(bad, torch.float32, CPU)


def test_gguf_rope_keys_and_tensor_types_as_llama_cpp_reads_them() -> None:
    """A scaling type named "none" scales nothing whatever the factor (a factor alone is an old
    file's linear); yarn's original context defaults to the trained one; a tensor type gguf-py
    cannot read is named (a bare NotImplementedError before, not a ModelLoadError)."""
    from types import SimpleNamespace

    import gguf
    import numpy as np

    from ferryman.gguf_loader import read_tensors, rope_scaling_from_gguf

    k = "llama.rope.scaling."
    assert rope_scaling_from_gguf({k + "type": "none", k + "factor": 4.0}, "llama") is None
    assert rope_scaling_from_gguf({k + "factor": 4.0}, "llama") == {"rope_type": "linear", "factor": 4.0}
    yarn = rope_scaling_from_gguf(
        {k + "type": "yarn", k + "factor": 4.0, "llama.context_length": 64}, "llama"
    )
    assert yarn is not None and yarn["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="original_context_length"):
        rope_scaling_from_gguf({k + "type": "yarn", k + "factor": 4.0}, "llama")
    f64 = SimpleNamespace(
        name="blk.0.ffn_norm.weight",
        data=np.ones(4),
        tensor_type=gguf.GGMLQuantizationType.F64,
        shape=np.array([4]),
    )
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_norm\.weight has type F64"):
        read_tensors(SimpleNamespace(tensors=[f64]))


def test_a_config_without_architectures_goes_by_model_type_and_yarn_by_its_default_context(
    tmp_path: Path,
) -> None:
    """transformers' rules: a qwen3 config without ``architectures`` is Qwen3 (read as Llama it
    lost its q/k norms); YaRN without ``original_max_position_embeddings`` takes the config's
    context (a KeyError before)."""
    qwen3 = build("qwen3", tmp_path / "q")
    patch_config(qwen3, architectures=None)
    llama = build("llama", tmp_path / "l", rope_scaling={"rope_type": "yarn", "factor": 4.0})  # type: ignore[arg-type]
    cfg = json.loads((llama / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            cfg[key].pop("original_max_position_embeddings", None)
    (llama / "config.json").write_text(json.dumps(cfg))
    for path in (qwen3, llama):
        model, _ = load_model(path, torch.float32, CPU)
        ids = long_ids(model.cfg.vocab_size, 64)
        torch.testing.assert_close(ours(model, ids), theirs(path, ids), rtol=1e-4, atol=1e-4)


def test_rope_and_window_keys_are_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """A top-level ``original_max_position_embeddings`` wins over the rope dict's (Phi-3's way);
    a legacy ``rope_scaling`` replaces ``rope_parameters``, theta included; Qwen2/3 without
    ``max_window_layers`` or ``sliding_window`` take their configs' defaults (28, 4096)."""
    import transformers as tf

    from ferryman.models.config import ModelConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    top = build("llama", tmp_path / "top", rope_scaling=yarn)  # type: ignore[arg-type]
    patch_config(top, original_max_position_embeddings=32)
    both = build("llama", tmp_path / "both")
    cfg = json.loads((both / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg |= {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    (both / "config.json").write_text(json.dumps(cfg))
    for path in (top, both):
        model, _ = load_model(path, torch.float32, CPU)
        ids = long_ids(model.cfg.vocab_size)
        torch.testing.assert_close(ours(model, ids), theirs(path, ids), rtol=1e-4, atol=1e-4)
    base = json.loads((build("qwen2", tmp_path / "q") / "config.json").read_text())
    base = {k: v for k, v in base.items() if k not in ("max_window_layers", "layer_types", "sliding_window")}
    for layers, window in ((30, 32), (30, "absent"), (30, None), (2, 32)):  # None: written as null
        d = base | {"num_hidden_layers": layers, "use_sliding_window": True}
        d |= {} if window == "absent" else {"sliding_window": window}
        hf = tf.Qwen2Config(**d)
        slides = "sliding_attention" in (hf.layer_types or [])
        assert ModelConfig.from_hf(d).sliding_window == (hf.sliding_window if slides else None), d


GGUF_TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def write_llama_gguf(
    hf_path: Path, out: Path, scaling: dict[str, Any] | None = None, merges: list[str] | None = None
) -> None:
    """The tiny HF Llama as an F32 GGUF the way llama.cpp's converter writes one: q/k rows
    permuted, and a Llama 3.1 scaling as per-frequency divisors in ``rope_freqs.weight``
    (``scaling``: other scalings as ``rope.scaling.*`` keys instead); ``merges``: a byte-level
    BPE tokenizer with these merges."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from test_gguf import llama_cpp_permute

    cfg = json.loads((hf_path / "config.json").read_text())
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim, rope = hidden // heads, cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    if merges is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_types([1] * cfg["vocab_size"])
        w.add_token_scores([0.0] * cfg["vocab_size"])
        w.add_token_merges(merges)
    for key, value in (scaling or {}).items():
        w.add_key_value(f"llama.rope.scaling.{key}", value, _gguf_type(value))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm"}
    names["post_attention_layernorm"] = "ffn_norm"
    for name, t in load_file(str(hf_path / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            part = ".".join(rest[:-1])
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                t = llama_cpp_permute(t, heads if part.endswith("q_proj") else kv_heads)
            gname = f"blk.{i}.{names[part]}.{rest[-1]}"
        else:
            gname = GGUF_TOP_LEVEL.get(name, "output.weight")
        w.add_tensor(gname, t.float().numpy())
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(llama_cpp_rope_factors(rope, head_dim), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_type(value: Any) -> Any:
    from gguf import GGUFValueType as V

    return V.STRING if isinstance(value, str) else V.UINT32 if isinstance(value, int) else V.FLOAT32


def llama_cpp_rope_factors(rope: dict[str, Any], head_dim: int) -> list[float]:
    """What llama.cpp's converter stores for a ``llama3`` scaling: per frequency, the number its
    frequency is divided by (1 for short wavelengths, ``factor`` for long ones, a blend between)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


@pytest.mark.parametrize(
    "scaling",
    [
        LLAMA3,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0},
    ],
    ids=lambda s: s["rope_type"],
)
def test_gguf_rope_scaling_matches_transformers_on_the_source_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scaling: dict[str, Any]
) -> None:
    """A Llama 3.1-style GGUF (``rope_freqs``) and GGUFs with ``rope.scaling.*`` keys load with
    the source model's RoPE: logits and an engine's greedy tokens as transformers' on the HF
    checkpoint the GGUF was written from. The files hold no tokenizer: they load without one."""
    from ferryman import gguf_cache

    monkeypatch.setenv("FERRYMAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "store", lambda *_: None)
    path = build("llama", tmp_path, rope_scaling=dict(scaling))  # type: ignore[arg-type]
    keys = None
    if scaling["rope_type"] == "linear":
        keys = {"type": "linear", "factor": 2.0}
    elif scaling["rope_type"] == "yarn":
        keys = {"type": "yarn", "factor": 4.0, "original_context_length": 32, "yarn_beta_fast": 16.0}
    write_llama_gguf(path, tmp_path / "m.gguf", keys)
    model, tokenizer = load_model(tmp_path / "m.gguf", torch.float32, CPU)
    assert tokenizer is None
    assert (model.cfg.rope_freq_factors is not None) == (scaling["rope_type"] == "llama3")
    ids = long_ids(model.cfg.vocab_size)
    torch.testing.assert_close(ours(model, ids), theirs(path, ids), rtol=1e-4, atol=1e-4)
    prompt = ids[:200].tolist()
    eng = Engine(str(tmp_path / "m.gguf"), num_device_blocks=64, calibrate=False)
    got = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    direct = Engine(str(path), num_device_blocks=64, calibrate=False)
    assert got == direct.generate([prompt], GREEDY)[0].outputs[0].token_ids


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path: Path) -> None:
    """Mistral's ``sliding_window`` and Qwen2's ``use_sliding_window`` are refused naming the
    field unless max_model_len fits in the window; a window no layer uses is no window."""
    mistral = build("llama", tmp_path)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    (mistral / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"sliding_window=64.*max_model_len must be <= 64 \(it is 256\)"):
        Engine(str(mistral), num_device_blocks=16, calibrate=False)
    assert Engine(str(mistral), num_device_blocks=16, max_model_len=64, calibrate=False).max_model_len == 64
    qwen = build("qwen2", tmp_path, use_sliding_window=True, sliding_window=128, max_window_layers=1)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="use_sliding_window with sliding_window=128"):
        Engine(str(qwen), num_device_blocks=16, max_model_len=200, calibrate=False)
    Engine(str(qwen), num_device_blocks=16, max_model_len=128, calibrate=False)
    unused = build("qwen3", tmp_path, use_sliding_window=False, sliding_window=64)  # type: ignore[arg-type]
    assert Engine(str(unused), num_device_blocks=16, calibrate=False).max_model_len == 256


def test_max_model_len_past_the_models_context_is_refused(tmp_path: Path) -> None:
    path = build("llama", tmp_path, rope_scaling=dict(LLAMA3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_model_len \(257\).*max_position_embeddings=256"):
        Engine(str(path), num_device_blocks=16, max_model_len=257, calibrate=False)
    assert Engine(str(path), num_device_blocks=16, max_model_len=256, calibrate=False).max_model_len == 256


def test_generation_config_gives_the_default_sampling_params(tmp_path: Path) -> None:
    path = build("llama", tmp_path)
    plain = Engine(str(path), num_device_blocks=32, calibrate=False)
    assert plain.default_sampling_params() == SamplingParams()  # transformers' own file sets none
    given = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    (path / "generation_config.json").write_text(
        json.dumps({**given, "max_new_tokens": 5, "do_sample": True})
    )
    eng = Engine(str(path), num_device_blocks=32, calibrate=False)
    assert eng.generation_defaults == {**given, "max_tokens": 5}
    assert eng.default_sampling_params() == SamplingParams(**given, max_tokens=None)  # capped at 5
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    got = [o.outputs[0].token_ids for o in eng.generate(prompts)]
    assert [len(g) for g in got] == [5, 5]
    want = eng.generate(prompts, SamplingParams(**given, max_tokens=5))
    big = Engine(str(path), num_device_blocks=64, calibrate=False, max_model_len=8)
    assert [len(o.outputs[0].token_ids) for o in big.generate(prompts)] == [4, 5]  # the room left wins
    assert got == [o.outputs[0].token_ids for o in want]
    # vLLM's knob: 'vllm' reads none, a folder its own file, a folder that is not one is refused
    kw: dict[str, Any] = {"num_device_blocks": 32, "calibrate": False}
    assert Engine(str(path), **kw, generation_config="vllm").generation_defaults == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    elsewhere = Engine(str(path), **kw, generation_config=str(other))
    assert elsewhere.generation_defaults == {"top_k": 3}
    with pytest.raises(ModelLoadError, match="generation_config 'nowhere': expected 'auto', 'vllm' or a "):
        Engine(str(path), **kw, generation_config="nowhere")


def test_a_hub_id_loads_from_the_hub_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``org/name`` resolves through huggingface_hub's cache layout with HF_HUB_OFFLINE=1 and
    generates what the folder itself does; an id neither cached nor downloadable is refused."""
    folder = build("llama", tmp_path, tokenizer=True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no relative path tiny-org/... exists here
    hub = Engine("tiny-org/tiny-llama", num_device_blocks=32, calibrate=False)
    local = Engine(str(folder), num_device_blocks=32, calibrate=False)
    prompts = ["hello there", "abc"]
    got = [o.outputs[0] for o in hub.generate(prompts, GREEDY)]
    want = [o.outputs[0] for o in local.generate(prompts, GREEDY)]
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    with pytest.raises(ModelLoadError, match=r"tiny-org/missing.*not in the hub cache.*HF_HUB_OFFLINE"):
        Engine("tiny-org/missing", num_device_blocks=32, calibrate=False)


def test_the_server_fills_unset_fields_from_generation_config() -> None:
    """As vLLM's server: the model's defaults for what a request leaves unset, never over what
    it sets (``max_tokens`` set through either chat field counts as set)."""
    from ferryman.server.protocol import ChatCompletionRequest, CompletionRequest

    d = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 9}
    p = CompletionRequest.model_validate({"prompt": "x", "temperature": 1.0}).sampling_params(d)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 0.8, 7, 1.2, 9)
    msgs = [{"role": "user", "content": "hi"}]
    p = ChatCompletionRequest.model_validate({"messages": msgs, "max_completion_tokens": 3}).sampling_params(
        d
    )
    assert (p.temperature, p.max_tokens) == (0.3, 3)
    p = ChatCompletionRequest.model_validate({"messages": msgs}).sampling_params(d)
    assert p.max_tokens is None  # open: the engine caps it with the model's 9 and max_model_len
    p = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 50}).sampling_params(d)
    assert p.max_tokens == 50  # a length the request sets is never capped by the defaults
    p = ChatCompletionRequest.model_validate({"messages": msgs}).sampling_params(None)
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, None)


def test_dummy_load_format_serves_random_weights_of_the_configs_shape(tmp_path: Path) -> None:
    """``load_format="dummy"`` (vLLM's): the shape from config.json alone, no weights read."""
    real = build("qwen3", tmp_path / "real", tokenizer=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in real.iterdir():  # everything but the weights
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(bare, torch.float32, CPU)
    model, tok = load_model(bare, torch.float32, CPU, load_format="dummy")
    want, _ = load_model(real, torch.float32, CPU)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in want.named_parameters()}
    assert tok is not None  # the folder's tokenizer still loads
    assert float(model.layers[0].input_layernorm.weight.min()) == 1.0
    w = model.layers[0].qkv_proj.weight.detach()
    assert 0.015 < float(w.std()) < 0.025 and not torch.equal(w, want.layers[0].qkv_proj.weight)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = dataclasses.replace(GREEDY, ignore_eos=True)
    outs = [
        [
            o.outputs[0].token_ids
            for o in Engine(str(bare), load_format="dummy", calibrate=False).generate(prompts, sp)
        ]
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0])  # seeded: the same weights each time


def test_dummy_load_format_fetches_no_weights_from_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id with ``load_format="dummy"`` asks huggingface_hub for the config and tokenizer
    only (a download of the weights would be gigabytes for nothing); ``auto`` asks for them."""
    import huggingface_hub

    folder = build("llama", tmp_path / "src", tokenizer=True)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    asked: list[list[str]] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str], **kwargs: object) -> str:
        asked.append(allow_patterns)  # where the network would be: it hands back the files asked
        return str(bare if "*.safetensors" not in allow_patterns else folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)  # no relative path tiny-org/... exists here
    sp = dataclasses.replace(GREEDY, ignore_eos=True)
    out = Engine("tiny-org/tiny-llama", load_format="dummy", calibrate=False).generate([[5, 6, 7]], sp)
    assert len(out[0].outputs[0].token_ids) == 8
    assert asked and all("*.safetensors" not in a and "*.json" in a for a in asked)
    Engine("tiny-org/tiny-llama", num_device_blocks=32, calibrate=False)
    assert "*.safetensors" in asked[-1]


def test_dummy_load_format_needs_a_config_and_one_rank(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path, torch.float32, CPU, load_format="dummy")
    with pytest.raises(InvalidRequestError, match="load_format"):
        Engine(str(tmp_path), load_format="dumb")
    with pytest.raises(InvalidRequestError, match="one rank"):
        Engine(str(tmp_path), load_format="dummy", tensor_parallel_size=2)
