"""What a script written for vLLM's offline ``LLM`` does on ``Engine`` (from a migration trial):
prompt dicts, ``chat`` over one or many conversations with vLLM's keywords, a ``max_tokens`` past
``max_model_len`` cut to the room left, ``truncate_prompt_tokens=-1`` fitting the prompt,
``seed=-1`` as no seed, a dict of structured outputs, vLLM's text flags at their defaults, an EOS
that is also a stop token id reported with no stop reason, vLLM's dtype names, and vLLM's engine
keywords (``trust_remote_code``, ``tokenizer``, ``quantization``, ``kv_cache_dtype``,
``revision``, ``download_dir``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_models import CHAT_TEMPLATE, build

from ferryman import Engine, InvalidRequestError, SamplingParams
from ferryman.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("vllm"), tokenizer=True)


@pytest.fixture(scope="module")
def engine(path: Path) -> Engine:
    return Engine(str(path), block_size=4, num_device_blocks=128, max_model_len=48, calibrate=False)


def test_prompt_dicts_are_unwrapped(engine: Engine) -> None:
    ids = engine.tokenizer.encode("hello there", add_special_tokens=False)
    want = [o.outputs[0].token_ids for o in engine.generate(["hello there", ids], GREEDY)]
    outs = engine.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].prompt == "hello there" and outs[1].prompt is None
    assert engine.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids == want[1]
    with pytest.raises(InvalidRequestError, match=r"multi_modal_data"):
        engine.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="needs 'prompt'"):
        engine.generate([{}], GREEDY)
    assert not engine.has_unfinished_requests()


def test_chat_takes_vllms_arguments(engine: Engine) -> None:
    tok = engine.tokenizer
    one = engine.chat(HI, GREEDY)
    assert isinstance(one, list) and len(one) == 1
    assert one[0].prompt == tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    other = [{"role": "user", "content": "hello"}]
    both = engine.chat([HI, other], GREEDY)
    assert [o.outputs[0].token_ids for o in both] == [
        one[0].outputs[0].token_ids,
        engine.chat(other, GREEDY)[0].outputs[0].token_ids,
    ]
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    joined = [{"role": "user", "content": "h\ni"}]  # parts a newline apart, as vLLM joins them
    assert engine.chat(parts, GREEDY)[0].prompt_token_ids == engine.chat(joined, GREEDY)[0].prompt_token_ids
    assert engine.chat(parts, GREEDY)[0].prompt_token_ids != one[0].prompt_token_ids
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    # the last assistant message left open: the prompt ends with its text
    opened = [*HI, {"role": "assistant", "content": "Sure, "}]
    out = engine.chat(opened, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt is not None and out.prompt.endswith("Sure, ")
    assert CHAT_TEMPLATE  # the template renders no generation prompt when asked not to
    bare = engine.chat(HI, GREEDY, add_generation_prompt=False)[0]
    assert bare.prompt == tok.apply_chat_template(HI, add_generation_prompt=False, tokenize=False)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
        engine.chat(opened, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="2 conversations but 3"):
        engine.chat([HI, other], [GREEDY] * 3)


TRIMMING_TEMPLATE = (  # Llama 3's way: every message's content trimmed
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
)


@pytest.mark.parametrize("template", ["own", "trimming"])
def test_continue_final_message_cuts_where_transformers_does(
    engine: Engine, path: Path, template: str
) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(path)
    own = engine.tokenizer.chat_template
    if template == "trimming":
        engine.tokenizer.chat_template = hf.chat_template = TRIMMING_TEMPLATE
    try:
        # the final text also ends an earlier message, whole or trimmed; trailing spaces; empty
        for final in ["The answer is ", "The answer is", "  x  ", ""]:
            msgs = [
                {"role": "user", "content": "Finish: The answer is 42"},
                {"role": "assistant", "content": final},
            ]
            want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
            text, _ = engine.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
            assert text == want, final
    finally:
        engine.tokenizer.chat_template = own


def test_max_tokens_past_max_model_len_is_cut_to_the_room_left(engine: Engine) -> None:
    ids = list(range(3, 43))  # 40 of max_model_len 48
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    # -1 keeps as many of the prompt's last tokens as leave room for max_tokens
    long = list(range(3, 103))
    fit = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=-1, ignore_eos=True)
    out = engine.generate([long], fit)[0]
    assert out.prompt_token_ids == long[-42:] and len(out.outputs[0].token_ids) == 6
    # a max_tokens that leaves no prompt keeps max_model_len - 1 tokens and one output token
    out = engine.generate([long], dataclasses.replace(fit, max_tokens=100))[0]
    assert out.prompt_token_ids == long[-47:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # a prompt that leaves no room
        engine.generate([long], GREEDY)


def test_vllms_sentinels_and_shapes_of_sampling_params() -> None:
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert p.structured_outputs is not None and p.structured_outputs.spec() == ("choice", '["yes", "no"]')
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"colour": "red"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]
    SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=True, detokenize=True)
    for flag in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
        with pytest.raises(ValueError, match=f"{flag}=False is not supported"):
            SamplingParams(**{flag: False})


def test_unseeded_samples_differ_and_a_structured_dict_is_served(engine: Engine) -> None:
    free = SamplingParams(temperature=1.0, seed=-1, max_tokens=8, ignore_eos=True)
    assert len({tuple(engine.generate(["hi"] * 4, free)[i].outputs[0].token_ids) for i in range(4)}) > 1
    picked = engine.generate(
        "hi", SamplingParams(temperature=1.0, structured_outputs={"choice": ["ab", "ba"]})
    )
    assert picked[0].outputs[0].text in ("ab", "ba")


def test_an_eos_in_stop_token_ids_has_no_stop_reason(engine: Engine) -> None:
    eos = engine.eos_token_ids[0]
    bias = {eos: 100.0}  # the EOS is sampled first
    out = engine.generate(
        "hi", SamplingParams(temperature=0.0, max_tokens=4, logit_bias=bias, stop_token_ids=[eos])
    )
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason is None
    other = (eos + 1) % 259
    out = engine.generate(
        "hi", SamplingParams(temperature=0.0, max_tokens=4, logit_bias={other: 100.0}, stop_token_ids=[other])
    )
    assert out[0].outputs[0].stop_reason == other


def test_vllms_dtype_names() -> None:
    import torch

    from ferryman.engine_setup import resolve_dtype

    EngineArgs(dtype="half")
    EngineArgs(dtype="float")
    assert resolve_dtype("half", torch.device("cpu")) == torch.float16
    assert resolve_dtype("float", torch.device("cpu")) == torch.float32


def test_vllms_accessor_names(engine: Engine) -> None:
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.get_default_sampling_params() == engine.default_sampling_params()
    p = SamplingParams(stop=["x"], logit_bias={3: 1.0}, seed=4)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    assert q.logit_bias is not None
    q.logit_bias[5] = 2.0
    assert p.stop == ["x"] and p.logit_bias == {3: 1.0}
    so = SamplingParams(stop_token_ids=[1], structured_outputs={"json": {"type": "object"}})
    c = so.clone()
    for f in dataclasses.fields(SamplingParams):  # no list, dict or record is shared
        v = getattr(so, f.name)
        if isinstance(v, list | dict) or dataclasses.is_dataclass(v):
            assert getattr(c, f.name) == v and getattr(c, f.name) is not v, f.name


def test_add_request_keeps_its_own_params(engine: Engine) -> None:
    """vLLM's engine clones the params: a caller may change or reuse theirs once a request is
    queued (a request whose ``n`` was changed under it never finished, and its id stayed taken)."""
    sp = SamplingParams(temperature=0, max_tokens=4, n=2, ignore_eos=True, output_kind="final_only")
    engine.add_request("shared-a", [5, 9, 3], sp)
    sp.n, sp.max_tokens = 1, 2
    engine.add_request("shared-b", [7, 7, 7], sp)
    assert engine.get_num_unfinished_requests() == 2  # vLLM's count: requests, not sequences
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert sorted(done) == ["shared-a", "shared-b"]
    assert [len(c.token_ids) for c in done["shared-a"].outputs] == [4, 4]
    assert [len(c.token_ids) for c in done["shared-b"].outputs] == [2]
    assert engine.get_num_unfinished_requests() == 0
    # a request whose last output another caller's generate() holds for it still counts
    engine.add_request("held", [5, 9, 3], dataclasses.replace(sp, n=1, max_tokens=2))
    engine.generate([[7, 7, 7]], dataclasses.replace(sp, n=1, max_tokens=8))
    assert engine.get_num_unfinished_requests() == 1
    while engine.get_num_unfinished_requests():
        done.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert "held" in done and not engine.has_unfinished_requests()


def test_vllms_engine_keywords_are_served_or_refused_by_name(path: Path, tmp_path: Path) -> None:
    """``trust_remote_code`` is accepted (it changes nothing); ``tokenizer=`` loads another
    folder's tokenizer (here for a model folder that has none, which then serves text as the model
    with its own does); ``quantization`` and ``kv_cache_dtype`` take only what ferryman does and
    refuse the rest naming the knob; ``revision`` and ``download_dir`` reach the Hub lookup."""
    import re
    import shutil

    kw = {"block_size": 4, "num_device_blocks": 64, "max_model_len": 48, "calibrate": False}
    own = Engine(str(path), trust_remote_code=True, kv_cache_dtype="auto", quantization=None, **kw)
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for f in path.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)
    assert Engine(str(bare), **kw).tokenizer is None
    other = Engine(str(bare), tokenizer=str(path), **kw)
    assert other.tokenizer is not None
    want = own.generate(["hello there"], GREEDY)[0].outputs[0]
    got = other.generate(["hello there"], GREEDY)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text) and want.text
    with pytest.raises(ValueError, match=r"tokenizer .*no tokenizer there"):
        Engine(str(path), tokenizer=str(bare), **kw)
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        EngineArgs(quantization="awq")
    with pytest.raises(InvalidRequestError, match=r"quantization=.gguf. needs a \.gguf model"):
        Engine(str(path), quantization="gguf", **kw)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp8")
    # a Hub id that no cache holds, offline: the error names the revision and the download dir
    cache = tmp_path / "hub-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ValueError, match=f"at revision 'v2'.*{re.escape(str(cache))}"):
            Engine("nobody/no-such-model", revision="v2", download_dir=str(cache), **kw)


def test_chat_renders_the_developer_role_as_the_server_does(engine: Engine) -> None:
    """Offline ``chat`` maps OpenAI's developer role to system where the template does not name
    it, as the server's chat endpoint does: both give the same prompt."""
    from ferryman.server.chat_prompt import ChatPrompt

    dev = [{"role": "developer", "content": "be brief"}, *HI]
    sys_ = [{"role": "system", "content": "be brief"}, *HI]
    out = engine.chat(dev, GREEDY)[0]
    assert out.prompt == engine.chat(sys_, GREEDY)[0].prompt
    assert out.prompt == ChatPrompt.model_validate({"messages": dev}).render(engine.tokenizer)


def test_chat_hands_earlier_tool_calls_arguments_as_objects(path: Path, tmp_path: Path) -> None:
    """vLLM's rule (``LLM.chat`` and its server): an earlier tool call's ``arguments``, OpenAI's
    JSON text, reach the template as an object, so a template writing them with ``tojson`` (as
    Qwen2.5's does) gets the object's JSON, not a quoted string (the server's rule already)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "m"
    shutil.copytree(path, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    eng = Engine(str(model), block_size=4, num_device_blocks=64, calibrate=False)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "ok", "tool_calls": []},  # empty: dropped, as vLLM does
    ]
    text, ids = eng.render_chat(msgs)
    assert '<call>{"city": "Paris"}</call>' in text
    parsed = json.loads(json.dumps(msgs))
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(parsed, add_generation_prompt=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
