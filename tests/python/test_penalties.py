"""Penalties, logit bias and min_tokens (issue: OpenAI API completeness, item 1) against a plain
reference: a loop that runs the transformers model on the whole sequence each step, applies
vLLM's rules to the last logits and takes the argmax. Also: the same tokens with every request in
one batch, under forced preemption (recompute and swap rebuild a sequence's counts when it takes
a row again), with async scheduling, for n = 2 forks and for seeded sampling; and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tiny_models import build

from ferryman._core import InvalidRequestError
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams
from ferryman.worker.logit_masks import bad_words_token_ids

PROMPTS = [[5, 9, 5, 9, 5], [17, 3, 3, 3, 8, 1], [40, 41], [7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("penalties"))


def reference(
    model: Path, prompt: list[int], p: SamplingParams, stop_ids: list[int], bad: list[list[int]] = ()
) -> list[int]:
    """Greedy tokens with vLLM's rules, one full forward per token (float32 transformers);
    ``bad``: the bad words' token ids."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    seq = list(prompt)
    out: list[int] = []
    assert p.max_tokens is not None
    while len(out) < p.max_tokens:
        with torch.no_grad():
            lg = hf(torch.tensor([seq])).logits[0, -1].clone()
        if p.allowed_token_ids is not None:
            keep = lg[p.allowed_token_ids].clone()
            lg[:] = float("-inf")
            lg[p.allowed_token_ids] = keep
        for w in bad:
            if len(w) == 1 or out[len(out) - len(w) + 1 :] == w[:-1]:
                lg[w[-1]] = float("-inf")
        if len(out) < p.min_tokens:
            lg[stop_ids] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            lg[t] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=lg.numel())
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=lg.numel()) > 0)
        rp = p.repetition_penalty
        lg = torch.where(seen, torch.where(lg > 0, lg / rp, lg * rp), lg)
        lg = lg - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        t = int(lg.argmax())
        out.append(t)
        seq.append(t)
        if t in stop_ids:
            break
    return out


def params(model: Path) -> list[SamplingParams]:
    g: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    first = Engine(str(model), calibrate=False).generate([PROMPTS[3]], SamplingParams(**g))[0]
    stop = first.outputs[0].token_ids[0]  # the first token it would say: min_tokens holds it back
    return [
        SamplingParams(**g, repetition_penalty=1.6),
        SamplingParams(**g, frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(**g, logit_bias={11: 4.0, 12: -100.0}, repetition_penalty=0.8),
        SamplingParams(**g, min_tokens=4, stop_token_ids=[stop], presence_penalty=-0.5),
    ]


def tokens(eng: Engine, ps: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, ps)]


def test_penalties_bias_and_min_tokens_match_the_reference_loop(model: Path) -> None:
    ps = params(model)
    want = [reference(model, pr, p, p.stop_token_ids) for pr, p in zip(PROMPTS, ps, strict=True)]
    assert tokens(Engine(str(model), calibrate=False), ps) == want  # all four in one batch
    plain = tokens(
        Engine(str(model), calibrate=False),
        [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4,
    )
    assert plain != want  # the adjustments changed something
    assert len(want[3]) >= 4 and ps[3].stop_token_ids[0] not in want[3][:4]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_overlap_keep_the_counts(model: Path, mode: str, async_scheduling: bool) -> None:
    ps = params(model)
    want = tokens(Engine(str(model), calibrate=False, block_size=4), ps)
    tight = Engine(
        str(model),
        calibrate=False,
        block_size=4,
        num_device_blocks=8,
        num_host_blocks=16,
        max_num_batched_tokens=8,
        preemption_mode=mode,
        async_scheduling=async_scheduling,
    )
    assert tokens(tight, ps) == want
    assert tight.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_with_penalties_does_not_depend_on_the_batch(
    model: Path, async_scheduling: bool
) -> None:
    sp = SamplingParams(
        temperature=0.9,
        seed=3,
        max_tokens=10,
        ignore_eos=True,
        n=2,
        frequency_penalty=1.0,
        logit_bias={4: 2.0},
    )
    kw: dict[str, Any] = {"calibrate": False, "block_size": 4, "async_scheduling": async_scheduling}
    alone = Engine(str(model), **kw).generate([PROMPTS[0]], sp)[0]
    others = [SamplingParams(temperature=0.7, seed=9, max_tokens=10, repetition_penalty=1.3)] * 3
    batch = Engine(str(model), **kw, num_device_blocks=10, num_host_blocks=16).generate(
        PROMPTS, [sp, *others]
    )[0]
    assert [o.token_ids for o in batch.outputs] == [o.token_ids for o in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # two forks, two draws


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_bad_values_are_refused(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_min_tokens_with_stop_ids_outside_the_vocabulary(model: Path) -> None:
    """Found by the API fuzzer: such an id made the step index past the logits and fail."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=3, stop_token_ids=[421, 5])
    out = Engine(str(model), calibrate=False).generate([PROMPTS[0]], sp)[0]
    assert out.error is None and len(out.outputs[0].token_ids) >= 3


def test_a_bias_outside_the_vocabulary_is_refused(model: Path) -> None:
    eng = Engine(str(model), calibrate=False)
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 96 out of range"):
        eng.add_request("a", [1, 2], SamplingParams(logit_bias={96: 1.0}))
    eng.add_request("a", [1, 2], SamplingParams(max_tokens=2))  # the id was not taken
    assert len(eng.generate([[3]], SamplingParams(max_tokens=2))) == 1


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """A word as written, and after a space when that spells it with as many tokens and another
    first one (a word inside the text); a longer spelling after a space is not added."""
    vocab = {"hello": [5], " hello": [9], "new york": [1, 2], " new york": [3, 2], "cat": [7], " cat": [7]}
    vocab |= {"big cat": [7, 8], " big cat": [4, 7, 8]}
    words = ["  hello", "new york", "cat", "big cat"]
    got = bad_words_token_ids(words, lambda text, add_special_tokens: vocab[text], 10)
    assert got == [[5], [9], [1, 2], [3, 2], [7], [7, 8]]
    with pytest.raises(InvalidRequestError, match="bad_words: token id 9 out of range"):
        bad_words_token_ids(words, lambda text, add_special_tokens: vocab[text], 9)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids must be non-empty"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be non-empty"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids must be token ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words must be a list of words"),
        ({"bad_words": [3]}, "bad_words must be a list of words"),
        ({"bad_words": 3}, "bad_words must be a list of words"),
        ({"bad_words": "word"}, "bad_words must be a list of words"),
    ],
)
def test_bad_masks_are_refused(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_allowed_token_ids_and_bad_words_match_the_reference_loop(tmp_path: Path) -> None:
    """Only the allowed ids are sampled; a two-token bad word never appears (its second token is
    barred after its first, in the output), a one-token one never at all; the same under
    forced preemption with async scheduling asked for (such requests run without overlap)."""
    model = build("llama", tmp_path, tokenizer=True)
    eng = Engine(str(model), calibrate=False, block_size=4)
    letters = eng.tokenizer.encode("abcdefgh", add_special_tokens=False)
    g: dict[str, Any] = {
        "temperature": 0.0,
        "max_tokens": 12,
        "ignore_eos": True,
        "allowed_token_ids": letters,
    }
    prompt = [72, 105, 72, 105]
    first = eng.generate([prompt], SamplingParams(**g))[0].outputs[0]
    assert set(first.token_ids) <= set(letters)
    assert first.token_ids == reference(model, prompt, SamplingParams(**g), [])
    word, single = first.text[:2], first.text[5]
    p = SamplingParams(**g, bad_words=[word, single])
    bad = [eng.tokenizer.encode(w, add_special_tokens=False) for w in (word, single)]
    want = reference(model, prompt, p, [], bad)
    assert want != first.token_ids and set(want) <= set(letters)
    out = eng.generate([prompt], p)[0].outputs[0]
    assert out.token_ids == want and word not in out.text and single not in out.text
    with pytest.raises(InvalidRequestError, match="allowed_token_ids: token id 259 out of range"):
        eng.add_request("x", prompt, SamplingParams(allowed_token_ids=[1, 259]))
    tight = Engine(
        str(model),
        calibrate=False,
        block_size=4,
        num_device_blocks=9,
        max_num_batched_tokens=8,
        async_scheduling=True,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = tight.generate([prompt] * 4, [p, plain, p, plain])
    assert [o.outputs[0].token_ids for o in outs[::2]] == [want, want]
    assert tight.stats()["num_preemptions"] > 0


def test_the_server_takes_the_fields(tmp_path: Path) -> None:
    from test_server import Server

    model = build("llama", tmp_path, tokenizer=True)
    s = Server(model, "--block-size", "4", log=tmp_path / "log")
    try:
        body = {"prompt": [72, 105, 72, 105], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        offline = Engine(str(model), calibrate=False, block_size=4)
        for extra, sp in [
            (
                {"frequency_penalty": 1.2, "presence_penalty": 0.4},
                {"frequency_penalty": 1.2, "presence_penalty": 0.4},
            ),
            ({"logit_bias": {"65": 100}}, {"logit_bias": {65: 100.0}}),
            ({"repetition_penalty": 1.5, "min_tokens": 3}, {"repetition_penalty": 1.5, "min_tokens": 3}),
            ({"allowed_token_ids": [65, 66, 67]}, {"allowed_token_ids": [65, 66, 67]}),
            (
                {"allowed_token_ids": [65, 66], "bad_words": ["b"]},
                {"allowed_token_ids": [65, 66], "bad_words": ["b"]},
            ),
        ]:
            r = httpx.post(s.url + "/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            want = offline.generate(
                [body["prompt"]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **sp)
            )
            assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        assert r.json()["choices"][0]["text"] != ""
        r = httpx.post(s.url + "/v1/completions", json={**body, "logit_bias": {"65": 100}})
        assert r.json()["choices"][0]["text"] == offline.tokenizer.decode([65]) * 8  # only token 65
        r = httpx.post(
            s.url + "/v1/completions", json={**body, "allowed_token_ids": [65, 66], "bad_words": ["b"]}
        )
        assert r.json()["choices"][0]["text"] == "c" * 8  # token 65 is "b", 66 "c"
        # masks that leave nothing are the client's doing: refused up front, or the request fails
        # with a 400 once a step finds nothing (two-token words barring the second token)
        r = httpx.post(
            s.url + "/v1/completions", json={**body, "allowed_token_ids": [65], "bad_words": ["b"]}
        )
        assert r.status_code == 400 and "all are one-token bad words" in r.json()["error"]["message"], r.text
        stuck = {**body, "allowed_token_ids": [65, 66], "bad_words": ["bb", "bc", "cb", "cc"]}
        r = httpx.post(s.url + "/v1/completions", json=stuck)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "no token is left to sample" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={**stuck, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "invalid_request_error" in events[-2] and events[-1] == "data: [DONE]", events
        for bad in ({"logit_bias": {"x": 1}}, {"frequency_penalty": 3}, {"logit_bias": {"999": 1}}):
            r = httpx.post(s.url + "/v1/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    finally:
        s.stop()
