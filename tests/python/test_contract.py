"""The binding's contract: names, defaults, dtypes, shapes and errors of ferryman._core."""

from __future__ import annotations

import numpy as np
import pytest

import ferryman
from ferryman import EngineError, InvalidRequestError, RequestParams, Scheduler, SchedulerConfig

INT32_FIELDS = [
    "seq_indices",
    "input_ids",
    "qo_indptr",
    "seq_lens",
    "kv_indptr",
    "kv_last_page_len",
    "sample_seq_indices",
    "sample_rows",
    "sample_positions",
    "rows",
    "rows_removed",
    "rows_added",
    "added_seq_indices",
    "table_rows",
    "table_cols",
    "inflight_token_indices",
    "inflight_sample_indices",
    "table_blocks",
]
INT64_FIELDS = ["req_ids", "logits_indices", "sample_req_ids", "added_req_ids"]
PAIR_FIELDS = ["blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"]


def test_config_defaults_are_the_contracts() -> None:
    c = SchedulerConfig()
    assert (c.block_size, c.num_device_blocks, c.num_host_blocks) == (16, 4096, 0)
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len) == (8192, 256, 8192)
    assert c.enable_chunked_prefill and c.enable_prefix_caching
    assert (c.preemption_mode, c.policy, c.watermark) == ("auto", "fcfs", 0.01)
    assert "SchedulerConfig(block_size=16" in repr(c)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 24}, "power of two"),
        ({"num_device_blocks": 0}, "num_device_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 2**40}, "max_num_seqs must be at most 1048576"),  # aborted on memory
        ({"max_model_len": 2**40}, r"max_model_len must be in 1\.\.=2147483646"),
        ({"num_device_blocks": 2**31}, r"num_device_blocks must be in 1\.\.=2147483646"),  # said ">= 1"
        ({"max_num_batched_tokens": 2**40}, r"max_num_batched_tokens must be in 1\.\.=2147483646"),
        ({"preemption_mode": "evict"}, "preemption_mode"),
        ({"policy": "lifo"}, "policy"),
        ({"watermark": 1.5}, "watermark"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 64}, "chunked"),
    ],
)
def test_bad_config_raises_a_value_error_naming_the_field(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle) as e:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(e.value, ValueError)


def make(**kw: object) -> Scheduler:
    base: dict[str, object] = {"block_size": 4, "num_device_blocks": 16, "max_model_len": 64}
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def test_every_output_array_has_its_dtype_and_shape() -> None:
    s = make(num_host_blocks=4)
    s.add_request(3, [1, 2, 3, 4, 5, 6], RequestParams(4, n=2))
    s.add_request(4, np.array([9, 9, 9], dtype=np.int32), RequestParams(2))
    out = s.schedule()
    for name in INT32_FIELDS:
        a = getattr(out, name)
        assert a.dtype == np.int32 and a.ndim == 1 and a.flags.c_contiguous, name
    for name in [*INT64_FIELDS, "preempted_req_ids", "finished_req_ids"]:
        a = getattr(out, name)
        assert a.dtype == np.int64 and a.ndim == 1, name
    for name in PAIR_FIELDS:
        a = getattr(out, name)
        assert a.dtype == np.int32 and a.shape == (0, 2), name
    b, t = len(out.req_ids), len(out.input_ids)
    assert (b, t) == (2, 9)
    assert out.qo_indptr.shape == (b + 1,) and out.qo_indptr[-1] == t
    assert out.kv_indptr.shape == (b + 1,) and out.rows.tolist() == out.rows_added.tolist() == [0, 1]
    assert out.table_rows.tolist() == [0, 0, 1] and out.table_cols.tolist() == [0, 1, 0]
    assert out.kv_indptr[-1] == len(out.table_blocks)  # a new row gets its whole table
    assert list(out.logits_indices) == [5, 5, 8]  # the n=2 request samples its last row twice
    assert list(out.sample_req_ids) == [3, 3, 4] and list(out.sample_seq_indices) == [0, 1, 0]
    # each sample's row and the position it draws, as the runner would find them
    b_of = np.searchsorted(out.qo_indptr, out.logits_indices, side="right") - 1
    assert out.sample_rows.tolist() == out.rows[b_of].tolist() == [0, 0, 1]
    assert out.sample_positions.tolist() == out.seq_lens[b_of].tolist() == [6, 6, 3]
    assert out.num_scheduled_tokens == 9 and out.step == 0
    assert (out.num_scheduled_seqs, out.num_blocks_swapped_out, out.num_blocks_swapped_in) == (2, 0, 0)
    res = s.update(np.array([7, 8, 9], dtype=np.int32))
    assert len(res) == res.num_generated == res.num_first_tokens == 3  # every row's first token
    assert res.new_token_ids.dtype == np.int32 and list(res.new_token_ids) == [7, 8, 9]
    assert res.req_ids.dtype == np.int64 and list(res.seq_indices) == [0, 1, 0]
    assert res.finish_reasons == [None, None, None]
    out = s.schedule()  # the two forks copy-on-write into the shared partial block
    assert out.blocks_to_copy.shape == (1, 2) and out.num_blocks_copied == 1
    assert s.update([1, 2, 3]).num_first_tokens == 0  # a list is accepted too
    k = len(s.schedule().sample_req_ids)
    ids = np.zeros(2 * k, dtype=np.int32)
    ids[1::2] = np.arange(4, 4 + k)
    res = s.update(ids[1::2])  # and a strided view
    assert list(res.new_token_ids) == list(range(4, 4 + k))


def test_output_arrays_are_wrapped_once_and_outlive_their_output() -> None:
    """Arrays become numpy objects when first read: a second read gives the same object, and an
    array read before its output (or result) is dropped keeps its data."""
    s = Scheduler(SchedulerConfig(block_size=4, num_device_blocks=16, max_model_len=64))
    s.add_request(7, list(range(1, 11)), RequestParams(3))
    out = s.schedule()
    arrays = {name: getattr(out, name) for name in [*INT32_FIELDS, *INT64_FIELDS, *PAIR_FIELDS]}
    assert all(getattr(out, name) is a for name, a in arrays.items())
    del out
    assert arrays["table_blocks"].tolist() == [1, 2, 3] and arrays["input_ids"].tolist() == list(range(1, 11))
    res = s.update(np.array([42], dtype=np.int32))
    tokens, reasons = res.new_token_ids, res.finish_reasons
    assert res.new_token_ids is tokens and res.finish_reasons is reasons
    del res
    assert tokens.tolist() == [42] and reasons == [None]


def test_update_takes_other_integer_dtypes() -> None:
    s = make()
    s.add_request(1, [1, 2], RequestParams(1))
    s.schedule()
    res = s.update(np.array([5], dtype=np.int64))
    assert res.finish_reasons == ["length"]
    assert not s.has_unfinished_requests()
    assert list(s.schedule().finished_req_ids) == [1]


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s: s.add_request(1, [], RequestParams(4)), "empty"),
        (lambda s: s.add_request(-1, [1], RequestParams(4)), "req_id"),
        (lambda s: s.add_request(1, [1], RequestParams(0)), "max_tokens"),
        (lambda s: s.add_request(1, [1], RequestParams(4, n=0)), "n must be"),
        (lambda s: s.add_request(1, [-5], RequestParams(4)), "token id"),
        (lambda s: s.add_request(1, [1] * 60, RequestParams(10)), "max_model_len"),
        (lambda s: s.add_request(1, [1] * 60, RequestParams(4)), "could never fit"),
        (lambda s: s.add_request(1, [1], RequestParams(4, eos_token_ids=[-1])), "token id"),
        (lambda s: s.finish_request(77, "stop"), "unknown request 77"),
        (lambda s: s.finish_request(5, "done"), "finish reason"),
    ],
)
def test_bad_calls_raise_invalid_request_error(call, needle: str) -> None:  # type: ignore[no-untyped-def]
    s = make(num_device_blocks=8)
    s.add_request(5, [1, 2, 3], RequestParams(2))
    with pytest.raises(InvalidRequestError, match=needle):
        call(s)
    s.check_invariants()


def test_request_params_are_one_record_validated_once() -> None:
    p = RequestParams(
        8, priority=2, eos_token_ids=[5, 6], stop_token_ids=[9], n=2, detokenize=True, stop=["!"]
    )
    assert (p.max_tokens, p.priority, p.eos_token_ids, p.stop_token_ids) == (8, 2, [5, 6], [9])
    assert (p.ignore_eos, p.n, p.detokenize, p.stop) == (False, 2, True, ["!"])
    assert repr(p).startswith("RequestParams(max_tokens=8, priority=2, eos_token_ids=[5, 6]")
    for kwargs, needle in [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 4, "n": 0}, "n must be >= 1, got 0"),
        ({"max_tokens": 4, "stop_token_ids": [2**31]}, "stop_token_ids: token id"),
        ({"max_tokens": 4, "detokenize": True, "stop": [""]}, "empty"),
        ({"max_tokens": 4, "grammar_kind": "bogus"}, 'unknown structured output kind "bogus"'),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            RequestParams(**kwargs)  # type: ignore[arg-type]
    s = make()
    s.add_request(1, [1, 2], RequestParams(4, eos_token_ids=[7, 8]))
    s.add_request(2, [3, 4], RequestParams(4, eos_token_ids=[7, 8], ignore_eos=True))
    s.schedule()
    res = s.update(np.array([8, 8], dtype=np.int32))  # any of the model's EOS ids stops, unless ignored
    assert res.finish_reasons == ["stop", None]


def test_duplicate_ids_and_protocol_misuse() -> None:
    s = make()
    s.add_request(1, [1, 2, 3], RequestParams(2))
    with pytest.raises(InvalidRequestError, match="already exists"):
        s.add_request(1, [4], RequestParams(2))
    with pytest.raises(EngineError, match="without a schedule"):
        s.update([])
    out = s.schedule()
    with pytest.raises(EngineError, match="twice"):
        s.schedule()
    with pytest.raises(InvalidRequestError, match="expected 1 sampled token ids"):
        s.update(np.zeros(3, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="must be integers"):
        s.update(np.array([7.9]))  # refused, not truncated
    with pytest.raises(InvalidRequestError, match="2147483653 out of range"):
        s.update(np.array([2**31 + 5], np.int64))  # refused, not wrapped
    with pytest.raises(InvalidRequestError, match="must be integers"):
        s.update([0.5])  # a list's floats too
    with pytest.raises(InvalidRequestError, match="out of range"):
        s.update([2**70])  # an integer numpy cannot hold
    for bad in (2**70, 2**63, -1):  # out of range: refused by name, not an OverflowError
        with pytest.raises(InvalidRequestError, match=r"req_id must be an integer in \[0, 2\*\*63\)"):
            s.add_request(bad, [4], RequestParams(2))
        with pytest.raises(InvalidRequestError, match="req_id must be"):
            s.abort_request(bad)
    with pytest.raises(InvalidRequestError, match="seq_index must be an integer"):
        s.output_token_ids(1, -1)
    with pytest.raises(TypeError):
        s.add_request("1", [4], RequestParams(2))
    with pytest.raises(InvalidRequestError, match="num_device_blocks must be >= 0, got -1"):
        SchedulerConfig(num_device_blocks=-1)
    s.update(np.zeros(len(out.logits_indices), dtype=np.int32))  # the step is still pending
    assert s.abort_request(1) and not s.abort_request(1)
    assert ferryman.__version__


def test_async_scheduling_plans_a_step_while_one_is_in_flight() -> None:
    """With async_scheduling a second schedule() may come before the first update(): a decode
    whose token is still in flight is laid out as -1 and names that step's sample; a stop found
    one step late drops the extra sample; a third schedule() is refused."""
    s = make(async_scheduling=True)
    assert s.config.async_scheduling and "async_scheduling=True" in repr(s.config)
    s.add_request(1, [1, 2, 3], RequestParams(5, stop_token_ids=[8]))
    s.add_request(2, [4, 5], RequestParams(5))
    first = s.schedule()
    assert list(first.sample_req_ids) == [1, 2] and len(first.inflight_token_indices) == 0
    second = s.schedule()  # both decode the token sampled in `first`, still in flight
    assert second.input_ids.tolist() == [-1, -1]
    assert second.inflight_token_indices.dtype == np.int32
    assert second.inflight_token_indices.tolist() == [0, 1]
    assert second.inflight_sample_indices.tolist() == [0, 1]
    with pytest.raises(EngineError, match="two steps"):
        s.schedule()
    res = s.update(np.array([8, 6], dtype=np.int32))  # request 1 stops on its first token
    assert res.finish_reasons == ["stop", None] and res.num_output_tokens.tolist() == [1, 1]
    third = s.schedule()
    assert third.finished_req_ids.tolist() == [1] and third.req_ids.tolist() == [2]
    res = s.update(np.array([5, 5], dtype=np.int32))  # request 1's sample is dropped
    assert res.num_output_tokens.tolist() == [0, 2] and res.finish_reasons == [None, None]
    s.update(np.array([7], dtype=np.int32))
    s.check_invariants()
    assert s.abort_request(2) and not s.has_unfinished_requests()


def test_events_and_stats_report_a_preemption() -> None:
    s = make(block_size=2, num_device_blocks=4, preemption_mode="swap", num_host_blocks=8, watermark=0.0)
    s.add_request(1, [1, 2, 3], RequestParams(4, ignore_eos=True))
    s.add_request(2, [4, 5, 6], RequestParams(4, ignore_eos=True))
    preempted, moved = [], [0, 0]
    while s.has_unfinished_requests():
        out = s.schedule()
        preempted += list(out.preempted_req_ids)
        moved[0] += out.num_blocks_swapped_out
        moved[1] += out.num_blocks_swapped_in
        assert (out.num_blocks_swapped_out, out.num_blocks_swapped_in) == (
            len(out.blocks_to_swap_out),
            len(out.blocks_to_swap_in),
        )
        s.update(np.ones(len(out.logits_indices), dtype=np.int32))
    assert moved == [2, 2]
    events = s.drain_events()
    assert preempted == [2] and len(events) == 1
    e = events[0]
    assert (e["req_id"], e["mode"], e["reason"], e["for_req_id"]) == (2, "swap", "config", 1)
    assert set(e) >= {
        "step",
        "num_blocks_freed",
        "bytes_to_move",
        "num_tokens_to_recompute",
        "token_budget_left",
        "num_free_device_blocks",
        "num_free_host_blocks",
        "num_preemptions",
    }
    st = s.stats()
    assert st["num_preemptions_swap"] == 1 and st["num_preemptions"] == 1
    assert st["num_blocks_swapped_out"] == st["num_blocks_swapped_in"] == 2
    assert st["num_free_device_blocks"] == 4 and st["num_free_host_blocks"] == 8
    assert s.drain_events() == []


def test_num_generated_leaves_out_dropped_samples() -> None:
    s = make()
    s.add_request(1, [1, 2, 3], RequestParams(4))
    s.add_request(2, [4, 5, 6], RequestParams(4))
    out = s.schedule()
    assert s.abort_request(2)  # after its sample was planned: update() drops it
    res = s.update(np.ones(len(out.logits_indices), dtype=np.int32))
    assert (len(res), res.num_generated, res.num_first_tokens) == (2, 1, 1)  # a dropped row is no first
    assert res.num_output_tokens.tolist() == [1, 0]


def test_the_binding_refuses_what_aborted_or_answered_nonsense() -> None:
    """A grammar's EOS id past the tokenizer sized every mask by it (2**31 - 1 aborted the
    process); sampling from no columns gave token 0; ``TokenBytes`` of a negative id overflowed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ferryman._core import TokenBytes, sample_random_cpu

    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    s = make()
    s.set_tokenizer(tok.to_str())
    eos = RequestParams(3, eos_token_ids=[2**31 - 1], grammar_kind="regex", grammar="a+")
    with pytest.raises(InvalidRequestError, match=r"EOS token id 2147483647 is not in the tokenizer's 256"):
        s.add_request(0, [1], eos)
    s.add_request(1, [1], RequestParams(3, eos_token_ids=[255], grammar_kind="regex", grammar="a+"))
    assert s.schedule().grammar_masks.shape == (8,)  # one mask of 256 tokens: the refused one left no trace
    one = [np.ones(2, np.float32), np.zeros(2, np.int64), np.ones(2, np.float32), np.zeros(2, np.float32)]
    with pytest.raises(InvalidRequestError, match="no columns"):
        sample_random_cpu(np.zeros((2, 0), np.float32), np.arange(2), *one, np.arange(2), np.arange(2))
    table = TokenBytes(tok.to_str())
    assert table(-1) == table(2**40) == b"" and table(tok.token_to_id("a")) == b"a"
