"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax over the
same prompt: per position the prompt token's logprob and the top N, the first position None;
across prefill chunks, with a prompt the prefix cache holds (such a request must not take the
hits), under recompute preemption and async scheduling; ``max_tokens=0`` outputs nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build

from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

PROMPT = [5, 9, 5, 9, 17, 3, 3, 8, 1, 40, 41, 7, 7, 2, 60, 61, 62, 30]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("plp"))


def reference(model: Path, prompt: list[int]) -> torch.Tensor:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)


def check(got: list[dict[int, float] | None] | None, want: torch.Tensor, prompt: list[int], top: int) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        d = got[pos]
        assert d is not None, pos
        row = want[pos - 1]
        assert d[prompt[pos]] == pytest.approx(float(row[prompt[pos]]), abs=1e-4)
        best = row.topk(top).indices.tolist()
        assert set(best) <= set(d) and len(d) <= top + 1
        for t in best:
            assert d[t] == pytest.approx(float(row[t]), abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_transformers(model: Path, async_scheduling: bool) -> None:
    want = reference(model, PROMPT)
    eng = Engine(
        str(model),
        calibrate=False,
        block_size=4,
        max_num_batched_tokens=8,  # the prompt runs in chunks
        async_scheduling=async_scheduling,
    )
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.generate([PROMPT], plain)  # now the prefix cache holds the prompt's blocks
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs = eng.generate([PROMPT, PROMPT[:7]], sp)
    check(outs[0].prompt_logprobs, want, PROMPT, 2)
    check(outs[1].prompt_logprobs, want, PROMPT[:7], 2)
    # each prompt token's rank in the vocabulary, as transformers' logits order it (vLLM's rank)
    ranks = outs[0].prompt_logprob_ranks
    assert ranks is not None and ranks[0] is None
    assert ranks[1:] == [int((want[p - 1] > want[p - 1, PROMPT[p]]).sum()) + 1 for p in range(1, len(PROMPT))]
    assert outs[0].outputs[0].token_ids == eng.generate([PROMPT], plain)[0].outputs[0].token_ids
    assert eng.generate([PROMPT], plain)[0].prompt_logprobs is None


def test_under_recompute_preemption_and_with_max_tokens_zero(model: Path) -> None:
    want = reference(model, PROMPT)
    eng = Engine(
        str(model),
        calibrate=False,
        block_size=4,
        num_device_blocks=8,
        max_num_batched_tokens=8,
        preemption_mode="recompute",
    )
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    outs = eng.generate([PROMPT, PROMPT[:9], PROMPT[3:12]], sp)
    assert eng.stats()["num_preemptions"] > 0
    check(outs[0].prompt_logprobs, want, PROMPT, 0)
    zero = eng.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    check(zero.prompt_logprobs, want, PROMPT, 1)
    assert zero.outputs[0].token_ids == [] and zero.outputs[0].text == ""
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_logprobs_have_vllm_fields(tmp_path: Path) -> None:
    """Sampled-token and prompt logprobs are vLLM's ``Logprob``: ``.logprob`` (also the float
    itself), ``.rank`` (the top N 1..N in order; the sampled or prompt token 1 + the tokens the
    model found likelier, by transformers' logits) and ``.decoded_token`` (the tokenizer's text
    of that token alone)."""
    import pickle

    from ferryman.outputs import Logprob

    path = build("llama", tmp_path, tokenizer=True)
    eng = Engine(str(path), calibrate=False, block_size=4)
    tok = eng.get_tokenizer()
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = eng.generate(["hello world"], sp)[0]
    prompt, sampled = out.prompt_token_ids, out.outputs[0].token_ids
    want = reference(path, prompt + sampled)
    assert out.outputs[0].logprobs is not None and out.prompt_logprobs is not None
    entries = [(prompt[p], out.prompt_logprobs[p], want[p - 1]) for p in range(1, len(prompt))]
    lps = out.outputs[0].logprobs
    entries += [(t, d, want[len(prompt) - 1 + i]) for i, (t, d) in enumerate(zip(sampled, lps, strict=True))]
    for target, d, row in entries:
        assert d is not None and target in d and len(d) <= 4
        for t, v in d.items():  # the top N and the target: ranks as transformers' logits order them
            assert isinstance(v, Logprob) and v.logprob == float(v) == pytest.approx(float(row[t]), abs=1e-4)
            assert v.rank == int((row > row[t]).sum()) + 1
            assert v.decoded_token == tok.decode([t])
    lp = lps[0][sampled[0]]
    back = pickle.loads(pickle.dumps(lp))  # the server's Ray replicas pickle outputs
    assert (back.logprob, back.rank, back.decoded_token) == (lp.logprob, lp.rank, lp.decoded_token)
    assert repr(lp).startswith("Logprob(logprob=")
    total = sum(d[t] for t, d in zip(sampled, lps, strict=True))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)
