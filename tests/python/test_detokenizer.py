"""Detokenization and stop strings in the core's ``update()``, checked against transformers'
``decode`` on a byte-level BPE tokenizer (GPT-2 / Qwen style) and a SentencePiece-style one with
byte fallback (Llama-2 style), where one character can span several tokens (no downloads)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_models import build, sentencepiece_tokenizer

from ferryman._core import InvalidRequestError, RequestParams, Scheduler, SchedulerConfig, TokenBytes
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("detok"), tokenizer=True)


@pytest.fixture(scope="module")
def byte_level(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece() -> Any:
    return sentencepiece_tokenizer(clean_up_tokenization_spaces=False)


def feed(
    tokenizer: Any, ids: list[int], params: RequestParams, prompt: list[int] | None = None
) -> tuple[list[str], Any]:
    """Feeds ``ids`` one per step to a request of a bare scheduler (its prompt: ``prompt``, by
    default token 1, a special token of the SentencePiece tokenizer) until it finishes: its
    deltas, and the step outputs it finished in."""
    s = Scheduler(SchedulerConfig(block_size=16, num_device_blocks=64, max_num_seqs=4, max_model_len=1024))
    s.set_tokenizer(tokenizer.backend_tokenizer.to_str())
    s.add_request(0, prompt or [1], params)
    deltas = []
    for t in ids:
        s.schedule()
        res = s.update(np.array([t], np.int32))
        deltas.append(res.deltas[0])
        if res.finish_reasons[0] is not None:
            assert res.finished_rows.tolist() == [0]
            return deltas, res
    raise AssertionError("the request did not finish")


def run(
    tokenizer: Any, ids: list[int], stop: list[str] | None = None, prompt: list[int] | None = None
) -> tuple[list[str], str, str, list[int]]:
    """``feed`` at ``max_tokens`` = ``len(ids)``, EOS ignored: its deltas, final text, finish
    reason and output tokens."""
    params = RequestParams(len(ids), ignore_eos=True, detokenize=True, stop=stop or [])
    deltas, res = feed(tokenizer, ids, params, prompt)
    return deltas, res.output_texts[0], res.finish_reasons[0], res.output_token_ids.tolist()


def reference(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[str, int]:
    """transformers' text of ``ids`` cut at the first stop string to appear as tokens arrive
    (a character still incomplete does not count), and the tokens it took."""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], i
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def test_multibyte_character_is_emitted_once_complete(byte_level: Any) -> None:
    ids = byte_level.encode("a€b", add_special_tokens=False)
    assert len(ids) == 5  # 'a', three bytes of '€', 'b'
    assert run(byte_level, ids)[0] == ["a", "", "", "€", "b"]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_deltas_concatenate_to_transformers_decode(kind: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(kind)
    rng = random.Random(0)
    text = "naïve café — 東京 🚀 the hello world"
    real = tok.encode(text, add_special_tokens=False)
    deltas, final, reason, out_ids = run(tok, real)
    assert "".join(deltas) == final == tok.decode(real, skip_special_tokens=True)
    assert (reason, out_ids) == ("length", real)
    for _ in range(200):  # random ids: invalid UTF-8, cut characters, specials mid-way
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        want = tok.decode(ids, skip_special_tokens=True)
        if kind == "sentencepiece" and "\ufffd" in want:
            # a run of <0xNN> byte tokens that is not valid UTF-8 decodes to one U+FFFD per byte
            # of the whole run, valid characters in it included; streamed text cannot take back
            # a character it released, so such runs may differ in U+FFFDs (docs/design.md)
            continue
        deltas, final, _, _ = run(tok, ids)
        assert "".join(deltas) == final == want, ids


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_an_output_is_what_it_adds_to_its_prompts_text(kind: str, request: pytest.FixtureRequest) -> None:
    """vLLM's text of an output: decode(prompt + output) less decode(prompt). A SentencePiece
    decoder strips the first space of the whole text, which is the prompt's: the first output
    token keeps its own ("▁the" after "hello" is " the", not "the")."""
    tok = request.getfixturevalue(kind)
    rng = random.Random(2)
    cases = [("hello", " the the"), ("東", " hello"), ("a", "b c")]
    cases += [
        ("".join(rng.choice("ab lé東") for _ in range(5)), " the " + rng.choice("ab")) for _ in range(30)
    ]
    for prompt_text, out_text in cases:
        prompt, out = (
            tok.encode(prompt_text, add_special_tokens=False),
            tok.encode(out_text, add_special_tokens=False),
        )
        head = tok.decode(prompt, skip_special_tokens=True)
        joint = tok.decode(prompt + out, skip_special_tokens=True)
        assert joint.startswith(head)
        deltas, final, _, _ = run(tok, out, prompt=prompt)
        assert "".join(deltas) == final == joint[len(head) :], (prompt_text, out_text)
    if kind == "sentencepiece":  # a stop string that starts with the space matches the first token
        the = tok.convert_tokens_to_ids("▁the")
        assert run(tok, [the, the], [" the"], prompt)[1:] == ("", "stop", [the])


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_stop_strings_cut_where_transformers_text_first_shows_one(
    kind: str, request: pytest.FixtureRequest
) -> None:
    tok = request.getfixturevalue(kind)
    rng = random.Random(1)
    text = "the hello world, hello é東 the end"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in (["llo w"], ["東 t", "d,"], ["é東"], ["o"], ["end", "the e"], ["absent"]):
        deltas, final, reason, out_ids = run(tok, ids, stop)
        want, n = reference(tok, ids, stop)
        assert final == want and "".join(deltas) == final, stop
        assert out_ids == ids[:n]
        assert reason == ("stop" if n < len(ids) or any(s in tok.decode(ids) for s in stop) else "length")
    alphabet = "ab lé東🚀"
    for _ in range(100):  # a stream never releases text a later stop string cuts
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(2, 16)))
        ids = tok.encode(text, add_special_tokens=False)
        at = rng.randrange(len(text) - 1)
        stop = [text[at : at + rng.randrange(1, 4)], "".join(rng.choice(alphabet) for _ in range(2))]
        deltas, final, _, out_ids = run(tok, ids, stop)
        assert "".join(deltas) == final == reference(tok, ids, stop)[0], (ids, stop)


def test_stop_strings_need_text(byte_level: Any) -> None:
    s = Scheduler(SchedulerConfig(block_size=16, num_device_blocks=8, max_model_len=64))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        s.add_request(0, [1], RequestParams(4, detokenize=True))
    with pytest.raises(InvalidRequestError, match="detokenize"):
        s.add_request(0, [1], RequestParams(4, stop=["x"]))
    s.set_tokenizer(byte_level.backend_tokenizer.to_str())
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request(0, [1], RequestParams(4, detokenize=True, stop=[""]))


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_a_stop_tokens_text_is_output_only_with_include_stop_str_in_output(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """vLLM's rule: the text of the token that stopped the sequence (a stop id or an EOS that
    is not a special token, such as a newline) is left out unless include_stop_str_in_output;
    kept, it is still searched for stop strings."""
    tok = request.getfixturevalue(kind)
    ids = tok.encode("ab\ncd", add_special_tokens=False)
    nl = tok.encode("\n", add_special_tokens=False)[-1]
    assert nl in ids and tok.decode([nl]).endswith("\n")
    upto = ids[: ids.index(nl) + 1]
    want = tok.decode(upto, skip_special_tokens=True)

    def text(**kw: Any) -> tuple[str, str, list[str]]:
        deltas, res = feed(tok, ids, RequestParams(len(ids), detokenize=True, **kw))
        assert res.output_token_ids.tolist() == upto and "".join(deltas) == res.output_texts[0]
        return res.output_texts[0], res.finish_reasons[0], res.stop_string_indices.tolist()

    for how in ({"stop_token_ids": [nl]}, {"eos_token_ids": [nl]}):
        assert text(**how) == (want.removesuffix("\n"), "stop", [-1])
        assert text(**how, include_stop_str_in_output=True) == (want, "stop", [-1])
    # the kept text completes a stop string: the sequence stops on it (its index reported)
    got = text(stop_token_ids=[nl], stop=["b\n"], include_stop_str_in_output=True)
    assert got == (want, "stop", [0])


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


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_streamed_outputs_add_up_to_the_final_one(model_dir: Path, kind: str) -> None:
    eng = Engine(str(model_dir), block_size=4, num_device_blocks=64, num_host_blocks=0, calibrate=False)
    p = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=20, ignore_eos=True, stop=["e"])
    want = eng.generate(["Hello"], p)[0]
    eng.add_request("r", "Hello", dataclasses.replace(p, output_kind=kind))
    texts, toks, reasons = ["", ""], [[], []], [None, None]
    while eng.has_unfinished_requests():
        for ro in eng.step().outputs:
            for o in ro.outputs:
                if kind == "delta":
                    texts[o.index] += o.text
                    toks[o.index] += o.token_ids
                else:
                    texts[o.index], toks[o.index] = o.text, list(o.token_ids)
                reasons[o.index] = o.finish_reason
    assert texts == [o.text for o in want.outputs]
    assert toks == [o.token_ids for o in want.outputs]
    assert reasons == [o.finish_reason for o in want.outputs]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_bytes_join_into_the_text(kind: str, request: pytest.FixtureRequest) -> None:
    """``TokenBytes`` (OpenAI's logprob ``bytes``): a character split over byte tokens joins up
    from their bytes, where each one's decoded text alone is "�"."""
    tok = request.getfixturevalue(kind)
    token_bytes = TokenBytes(tok.backend_tokenizer.to_str())
    for text in ["héllo €", "日本語 ok", "a\nb", "😀!"]:
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(token_bytes(t) for t in ids)
        assert joined.decode() in (text, " " + text)  # SentencePiece's "▁": the word's space
    split = tok.encode("😀", add_special_tokens=False)  # the case it is for: each alone is "�"
    assert sum("\ufffd" in tok.decode([t]) for t in split) >= 2
    special = tok.convert_tokens_to_ids(tok.eos_token)
    assert token_bytes(special) == tok.eos_token.encode()  # a special token: its text
    assert token_bytes(10**6) == b""  # not in the vocabulary
