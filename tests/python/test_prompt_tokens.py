"""A text prompt's special tokens, as vLLM and transformers encode it: a plain prompt gets the
tokenizer's own (a BOS where its post-processor adds one: Llama-2 / Llama-3 / Mistral style),
a rendered chat does not (its template writes the BOS). Checked on a tiny Llama with a
SentencePiece-style tokenizer that adds a BOS, against transformers: the prompt ids and the greedy
output, offline (``generate``, ``chat``) and through the server (completions, chat, ``/tokenize``,
and ``add_special_tokens`` both ways)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from test_tokenizer import LLAMA2_TEMPLATE
from tiny_models import build, sentencepiece_tokenizer

from ferryman import Engine, SamplingParams
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHAT = [{"role": "user", "content": "hello the world"}]


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    tok = sentencepiece_tokenizer(add_bos_token=True)
    tok.chat_template = LLAMA2_TEMPLATE
    path = build("llama", tmp_path_factory.mktemp("bos"), vocab_size=len(tok))
    tok.save_pretrained(str(path))
    return path, tok


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return [int(t) for t in out[0, len(ids) :]]


@pytest.fixture(scope="module")
def engine(bos_model: tuple[Path, Any]) -> Engine:
    return Engine(str(bos_model[0]), block_size=4, num_device_blocks=64, calibrate=False)


def test_a_text_prompt_gets_the_bos_and_the_output_of_transformers(
    bos_model: tuple[Path, Any], engine: Engine
) -> None:
    path, tok = bos_model
    want = tok("hello the world").input_ids
    assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    out = engine.generate("hello the world", GREEDY)[0]
    assert out.prompt_token_ids == want
    assert out.outputs[0].token_ids == hf_greedy(path, want, 8)
    # token ids are taken as given, with no BOS added
    assert engine.generate([want[1:]], GREEDY)[0].prompt_token_ids == want[1:]


def test_a_chat_has_its_templates_bos_only(bos_model: tuple[Path, Any], engine: Engine) -> None:
    path, tok = bos_model
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    out = engine.chat(CHAT, GREEDY)[0]
    assert out.prompt_token_ids == want
    assert out.prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.outputs[0].token_ids == hf_greedy(path, want, 8)


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(build_app(AsyncEngine(engine), "bos")) as c:
        yield c


def test_the_server_counts_the_same_tokens(bos_model: tuple[Path, Any], client: TestClient) -> None:
    _, tok = bos_model
    text = "hello the world"
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with_bos = client.post("/v1/completions", json=body).json()
    without = client.post("/v1/completions", json=body | {"add_special_tokens": False}).json()
    assert with_bos["usage"]["prompt_tokens"] == len(tok(text).input_ids)
    assert without["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids)
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    count = client.post("/tokenize", json={"prompt": text}).json()["count"]
    assert count == with_bos["usage"]["prompt_tokens"]

    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=chat).json()
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert plain["usage"]["prompt_tokens"] == len(want)
    assert client.post("/tokenize", json={"messages": CHAT}).json()["count"] == len(want)
    doubled = client.post("/v1/chat/completions", json=chat | {"add_special_tokens": True}).json()
    assert doubled["usage"]["prompt_tokens"] == len(want) + 1  # asked for: the tokenizer's BOS too
    tokenized = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert tokenized["count"] == len(want) + 1


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(client: TestClient) -> None:
    prompt = [(7 * i) % 200 + 3 for i in range(30)]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["usage"]
    again = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # every full block but the one holding the last prompt token (it is computed for its logits)
    assert again["prompt_tokens"] == 30 and again["prompt_tokens_details"] == {"cached_tokens": 28}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 28}
    chat = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "n": 2}
    client.post("/v1/chat/completions", json=chat)
    usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_text_no_context_can_hold_is_refused_before_it_is_tokenized(tmp_path: Path) -> None:
    """A prompt longer than any max_model_len tokens spell (every token at most its longest
    vocabulary entry) is refused untokenized: a 50 MB one took the server's tokenizer thread 85 s
    and 8 GB. truncate_prompt_tokens keeps its tail, so such a prompt still runs with it."""
    from ferryman._core import InvalidRequestError
    from ferryman.tokenizer import max_prompt_chars

    eng = Engine(str(build("llama", tmp_path, tokenizer=True)), max_model_len=64, calibrate=False)
    limit = max_prompt_chars(eng.tokenizer, 64)
    longest = max(map(len, eng.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)))
    assert limit == 64 * longest * 4
    with pytest.raises(InvalidRequestError, match=rf"prompt of {limit + 1} characters, .* max_model_len=64$"):
        eng.add_request("huge", "a" * (limit + 1), GREEDY)
    with pytest.raises(InvalidRequestError, match=r"prompt of \d+ tokens plus"):  # counted as tokens
        eng.add_request("long", "a" * limit, GREEDY)
    cut = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=16)
    out = eng.generate(["ab" * limit], cut)[0]
    assert len(out.prompt_token_ids) == 16 and len(out.outputs[0].token_ids) == 4
    chat = eng.chat([{"role": "user", "content": "ab" * limit}], cut)[0]  # and so does a chat
    assert len(chat.prompt_token_ids) == 16 and len(chat.outputs[0].token_ids) == 4


def test_the_character_bound_holds_only_where_no_step_deletes_text(bos_model: tuple[Path, Any]) -> None:
    """A Llama-2-style SentencePiece tokenizer (unknown characters fused, but as bytes) is bounded;
    one that drops whitespace in a pre-tokenizer is not: a short prompt could hold any number of
    characters there."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers

    from ferryman.tokenizer import max_prompt_chars

    assert max_prompt_chars(bos_model[1], 8) < 1 << 20
    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert max_prompt_chars(SimpleNamespace(backend_tokenizer=words), 8) == 1 << 62
    assert len(words.encode("a" + " " * 10_000 + "a").ids) == 2
