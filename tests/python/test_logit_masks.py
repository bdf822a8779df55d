"""Masks that leave a request nothing to sample (``worker/logit_masks.py``): refused when the
request is queued where its fields alone say so; else the request fails alone, as its own doing
(``engine_faults.NO_TOKEN``, a 400 from the server), never as the model's fault. Under a grammar
the masks hold too: its fallback (when ``min_tokens`` holds back its end) keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build

from ferryman._core import InvalidRequestError
from ferryman.engine import Engine
from ferryman.engine_faults import NO_TOKEN
from ferryman.sampling_params import SamplingParams, StructuredOutputsParams

G: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6}
PROMPT = [72, 105, 72, 105]


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(str(build("llama", tmp_path_factory.mktemp("masks"), tokenizer=True)), calibrate=False)


def ids(eng: Engine, text: str) -> list[int]:
    return eng.tokenizer.encode(text, add_special_tokens=False)


def test_masks_that_leave_nothing_are_refused_when_queued(eng: Engine) -> None:
    b, c = ids(eng, "bc")
    eos = eng.eos_token_ids[0]
    for p, why in (
        (SamplingParams(**G, allowed_token_ids=[b], bad_words=["b"]), "all are one-token bad words"),
        (SamplingParams(**G, allowed_token_ids=[eos], min_tokens=2), "min_tokens holds back"),
        (SamplingParams(**G, allowed_token_ids=[b, c], stop_token_ids=[b, c], min_tokens=1), "stop ids"),
    ):
        with pytest.raises(InvalidRequestError, match=f"allowed_token_ids leave no token to sample: .*{why}"):
            eng.add_request("x", PROMPT, p)
    assert not eng.has_unfinished_requests()
    ok = SamplingParams(**G, allowed_token_ids=[eos], min_tokens=2, ignore_eos=True)  # EOS is no stop
    assert eng.generate([PROMPT], ok)[0].outputs[0].token_ids == [eos] * 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_finds_nothing_fails_the_request_alone(tmp_path: Path, async_scheduling: bool) -> None:
    eng = Engine(
        str(build("llama", tmp_path, tokenizer=True)), calibrate=False, async_scheduling=async_scheduling
    )
    b, c = ids(eng, "bc")
    stuck = SamplingParams(**G, allowed_token_ids=[b, c], bad_words=["bb", "bc", "cb", "cc"])
    plain = SamplingParams(**G, ignore_eos=True)
    alone = eng.generate([PROMPT], plain)[0].outputs[0].token_ids
    outs = eng.generate([PROMPT, PROMPT], [stuck, plain])
    assert outs[0].error == NO_TOKEN and len(outs[0].outputs[0].token_ids) <= 1
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    assert eng.stats()["num_free_device_blocks"] == eng.stats()["num_device_blocks"]


def test_a_failed_request_keeps_what_it_produced_in_every_output_kind(eng: Engine) -> None:
    """ "c" is sampled, then the grammar wants "d", which allowed_token_ids forbid: the request
    fails after one token. "final_only" (what generate() asks for) answered no tokens at all,
    where "cumulative" and the deltas had "c"."""
    [c] = ids(eng, "c")
    kw: dict[str, Any] = {
        "allowed_token_ids": [c],
        "structured_outputs": StructuredOutputsParams(regex="(cd)+g"),
    }
    got = {}
    for kind in ("cumulative", "delta", "final_only"):
        eng.add_request(kind, PROMPT, SamplingParams(**G, **kw, output_kind=kind, logprobs=1))
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step().outputs
        assert outs[-1].finished and outs[-1].error == NO_TOKEN
        seqs = [o.outputs[0] for o in outs] if kind == "delta" else [outs[-1].outputs[0]]
        toks = [t for o in seqs for t in o.token_ids]
        lps = [lp[t] for o in seqs for lp, t in zip(o.logprobs or [], o.token_ids, strict=True)]
        got[kind] = (toks, "".join(o.text for o in seqs), seqs[-1].finish_reason, len(lps))
    assert got["cumulative"] == got["delta"] == got["final_only"] == ([c], "c", "error", 1)
    out = eng.generate([PROMPT], SamplingParams(**G, **kw))[0]
    assert (out.error, out.outputs[0].token_ids, out.outputs[0].text) == (NO_TOKEN, [c], "c")


def test_a_grammar_keeps_the_masks(eng: Engine) -> None:
    """The grammar's fallback (min_tokens holding back its end) used to be the raw logits, which
    dropped allowed_token_ids and bad_words: "ab" came out with "b" barred."""
    a, b, c = ids(eng, "abc")
    choice = StructuredOutputsParams(choice=["ab", "ac"])
    for extra, want in (
        ({"bad_words": ["b"]}, [a, c]),
        ({"allowed_token_ids": [a, c, *eng.eos_token_ids]}, [a, c]),
        ({"bad_words": ["ab"], "min_tokens": 6}, [a, c]),
    ):
        out = eng.generate([PROMPT], SamplingParams(**G, structured_outputs=choice, **extra))[0]
        assert out.error is None and out.outputs[0].token_ids[:2] == want, extra
    only_b = SamplingParams(**G, structured_outputs=StructuredOutputsParams(choice=["ab"]), bad_words=["b"])
    out = eng.generate([PROMPT], only_b)[0]
    assert out.error == NO_TOKEN and b not in out.outputs[0].token_ids


def test_masks_never_hide_logits_that_are_not_finite(tmp_path: Path) -> None:
    """A mask writing -inf over a NaN logit of a token it forbids hid the fault: the request
    answered 200 where one without the mask failed. -inf is added now (as a grammar's is)."""
    from safetensors.torch import load_file, save_file

    from ferryman.engine_faults import NON_FINITE

    path = build("llama", tmp_path, tokenizer=True)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][200] = float("nan")  # token 200's logit is NaN for every request
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    eng = Engine(str(path), calibrate=False)
    a, b = ids(eng, "ab")
    for extra in (
        {},
        {"allowed_token_ids": [a, b]},
        {"min_tokens": 3, "stop_token_ids": [200]},
        {"allowed_token_ids": [a, b], "structured_outputs": StructuredOutputsParams(regex="[ab]+")},
    ):
        out = eng.generate([PROMPT], SamplingParams(**G, **extra))[0]
        assert out.error == NON_FINITE and out.outputs[0].token_ids == [], extra  # at its first step
