"""The torch paged-attention backend, driven by the real scheduler through chunked prefill and
decode steps of two interleaved requests, against one dense causal attention per sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import dense_causal

from ferryman import RequestParams, Scheduler, SchedulerConfig
from ferryman.attention.torch_backend import DECODE_GROUP, TorchAttentionBackend
from ferryman.worker.block_table import BlockTable

MANY = {r: (3 + 3 * r, 24) for r in range(13)}  # 13 decode rows at once: two length-sorted groups


@pytest.mark.parametrize("lens", [{0: (23, 4), 1: (9, 5)}, MANY], ids=["two", "thirteen"])
def test_chunked_prefill_and_decode_match_dense_causal_attention(lens: dict[int, tuple[int, int]]) -> None:
    """``lens``: request -> (prompt tokens, new tokens)."""
    torch.manual_seed(0)
    hq, hkv, d, bs, layers = 4, 2, 8, 4, 2
    seqs = {
        r: [
            (torch.randn(p + n, hq, d), torch.randn(p + n, hkv, d), torch.randn(p + n, hkv, d))
            for _ in range(layers)
        ]
        for r, (p, n) in lens.items()
    }
    s = Scheduler(
        SchedulerConfig(block_size=bs, num_device_blocks=160, max_num_batched_tokens=16, max_model_len=80)
    )
    for r, (p, n) in lens.items():
        s.add_request(
            r, [100 * r + t for t in range(1, p + 1)], RequestParams(n, ignore_eos=True)
        )  # no shared prefix
    kv = torch.zeros(161, layers, 2, bs, hkv, d)  # block-major, as KvCache lays it out
    backend = TorchAttentionBackend([kv[:, i] for i in range(layers)], bs, scale=d**-0.5)
    got = {r: [torch.full((p + n, hq, d), float("nan")) for _ in range(layers)] for r, (p, n) in lens.items()}
    chunked, most_decodes = False, 0
    tables = BlockTable(16, 20, bs)
    while s.has_unfinished_requests():
        out = s.schedule()
        step = tables.step(out)
        backend.plan(step)
        most_decodes = max(most_decodes, int(np.sum(np.diff(out.qo_indptr) == 1)))
        rows = np.repeat(out.req_ids, np.diff(out.qo_indptr))
        chunked |= bool(np.any(out.seq_lens > np.diff(out.qo_indptr)) and out.num_prefill_tokens > 0)
        for layer in range(layers):
            q = torch.stack([seqs[int(r)][layer][0][p] for r, p in zip(rows, step.positions, strict=True)])
            k = torch.stack([seqs[int(r)][layer][1][p] for r, p in zip(rows, step.positions, strict=True)])
            v = torch.stack([seqs[int(r)][layer][2][p] for r, p in zip(rows, step.positions, strict=True)])
            o = backend.forward(layer, q, k, v)
            for i, (r, p) in enumerate(zip(rows, step.positions, strict=True)):
                got[int(r)][layer][p] = o[i]
        s.update(np.ones(len(out.logits_indices), dtype=np.int32))
    assert chunked, "the 16-token budget must split a prompt across steps over cached context"
    if len(lens) > DECODE_GROUP:
        assert most_decodes > DECODE_GROUP, "some step must batch decodes in more than one group"
    for r, (p, n) in lens.items():
        for layer in range(layers):
            q, k, v = seqs[r][layer]
            # the last sampled token is never computed; compare every computed position
            m = p + n - 1
            want = dense_causal(q[:m], k[:m], v[:m])
            torch.testing.assert_close(got[r][layer][:m], want, rtol=1e-5, atol=1e-5)


def test_kv_writer_writes_each_slot_at_its_block_and_offset() -> None:
    """The one K/V write every backend and the CUDA-graph path use: slot s of the step lands at
    block s // block_size, offset s % block_size of the layer's view, cast to the cache's dtype,
    and nothing else in the pool changes."""
    from ferryman.attention.base import KvWriter
    from ferryman.worker.kv_cache import KvCache

    bs, hkv, d = 4, 2, 3
    kv = KvCache(3, 6, 0, bs, hkv, d, torch.float16, torch.device("cpu"))
    writer = KvWriter(bs, torch.device("cpu"))
    slots = [5, 4 * 3 + 3, 4 * 6]  # (1, 1), (3, 3), (6, 0)
    writer.map(torch.tensor(slots))
    assert writer.blk.tolist() == [1, 3, 6] and writer.off.tolist() == [1, 3, 0]
    k = torch.arange(3 * hkv * d, dtype=torch.float32).view(3, hkv, d) + 0.25
    v = -k
    writer.write(kv.layers()[2], k, v)
    assert kv.device_kv.dtype == torch.float16
    for i, (blk, off) in enumerate([(1, 1), (3, 3), (6, 0)]):
        assert torch.equal(kv.device_kv[blk, 2, 0, off], k[i].half())
        assert torch.equal(kv.device_kv[blk, 2, 1, off], v[i].half())
    assert kv.device_kv.count_nonzero() == 2 * k.count_nonzero()  # nothing else was written


@pytest.mark.parametrize("rows", [1, 3])
def test_kv_writer_writes_k_and_v_of_one_qkv_buffer_in_one_go(rows: int) -> None:
    """K and V as the model hands them over (views of its qkv rows, V right after K) take the
    one-launch write; a copy of either takes the two-launch one; both land the same."""
    from ferryman.attention.base import KvWriter, _side_by_side
    from ferryman.worker.kv_cache import KvCache

    bs, hq, hkv, d = 4, 4, 2, 3
    qkv = torch.randn(rows + 2, (hq + 2 * hkv) * d)[:rows]  # rows of a larger buffer
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(rows, hkv, d), v.view(rows, hkv, d)
    both = _side_by_side(k, v)
    assert both is not None and torch.equal(both[:, 0], k) and torch.equal(both[:, 1], v)
    assert _side_by_side(k.clone(), v) is None and _side_by_side(v, k) is None
    assert _side_by_side(q.view(rows, hq, d)[:, :hkv], k) is None  # not adjacent
    slots = torch.tensor([5, 14, 21][:rows])
    pools = []
    for kk, vv in [(k, v), (k.clone(), v.clone())]:
        kv = KvCache(2, 6, 0, bs, hkv, d, torch.float16, torch.device("cpu"))
        writer = KvWriter(bs, torch.device("cpu"))
        writer.map(slots)
        writer.write(kv.layers()[1], kk, vv)
        pools.append(kv.device_kv)
    assert torch.equal(pools[0], pools[1])
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(pools[0][s // bs, 1, 0, s % bs], k[i].half())
        assert torch.equal(pools[0][s // bs, 1, 1, s % bs], v[i].half())
    assert pools[0].count_nonzero() == 2 * k.count_nonzero()


@pytest.mark.parametrize("seed", range(4))
def test_staged_swaps_move_what_copying_each_run_moves(seed: int) -> None:
    """The staging path (device blocks gathered into halves of a buffer of 6 blocks, copied by host runs;
    scattered back on swap-in) against plain run copies, on random plans: scattered device
    blocks with host blocks in runs or scattered, swap-out then swap-in in one step."""
    from ferryman.worker.kv_cache import KvCache, host_runs

    rng = np.random.default_rng(seed)
    pools = [KvCache(2, 40, 30, 2, 1, 4, torch.float32, torch.device("cpu"), staging=s) for s in (None, 6)]
    start = torch.randn_like(pools[0].device_kv)
    for kv in pools:
        kv.device_kv.copy_(start)
        kv.host_kv.fill_(0.0)
    for _ in range(3):
        n = int(rng.integers(1, 12))
        dev = rng.permutation(np.arange(1, 41))[: 2 * n].astype(np.int32)
        if rng.random() < 0.5:
            base = int(rng.integers(1, 30 - n + 2))
            host = np.arange(base, base + n, dtype=np.int32)
        else:
            host = rng.permutation(np.arange(1, 31))[:n].astype(np.int32)
        out = np.stack([dev[:n], host], 1)
        back = np.stack([host[::-1], dev[n:]], 1)  # swapped back in elsewhere
        for kv in pools:
            kv.run_plans(out, np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32))
            kv.run_plans(np.zeros((0, 2), np.int32), back, np.zeros((0, 2), np.int32))
        assert host_runs(host) >= 1
    assert torch.equal(pools[0].device_kv, pools[1].device_kv)
    assert torch.equal(pools[0].host_kv, pools[1].host_kv)
    assert pools[0].num_staged_swaps == 0 and pools[1].num_staged_swaps > 0


def test_a_plan_is_staged_only_where_that_saves_host_copies() -> None:
    from ferryman.worker.kv_cache import KvCache

    kv = KvCache(1, 20, 20, 2, 1, 4, torch.float32, torch.device("cpu"), staging=8)
    none = np.zeros((0, 2), np.int32)
    kv.run_plans(np.array([[3, 1], [4, 2], [5, 3]], np.int32), none, none)  # one run already
    assert kv.num_staged_swaps == 0
    kv.run_plans(np.array([[9, 4], [2, 5], [7, 6], [11, 7]], np.int32), none, none)  # 4 runs -> 1
    assert kv.num_staged_swaps == 1
    kv.run_plans(np.array([[12, 9], [14, 11], [16, 13]], np.int32), none, none)  # scattered both
    assert kv.num_staged_swaps == 1


def test_contiguous_runs_group_block_pairs() -> None:
    from ferryman.worker.kv_cache import contiguous_runs

    pairs = np.array([[7, 3], [5, 1], [6, 2], [9, 4], [10, 9], [11, 10]], dtype=np.int32)
    assert contiguous_runs(pairs).tolist() == [[5, 1, 3], [9, 4, 1], [10, 9, 2]]
    assert contiguous_runs(np.zeros((0, 2), dtype=np.int32)).shape == (0, 3)


def test_run_grouped_swaps_move_exactly_the_planned_blocks() -> None:
    from ferryman.worker.kv_cache import KvCache

    kv = KvCache(3, 12, 10, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.device_kv.copy_(torch.randn_like(kv.device_kv))
    before = kv.device_kv.clone()
    out = np.array([[2, 1], [3, 2], [4, 3], [9, 7], [6, 5]], dtype=np.int32)
    kv.run_plans(out, np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32))
    for d, h in out.tolist():
        assert torch.equal(kv.host_kv[h], before[d])
    back = np.array([[1, 10], [2, 11], [3, 12], [7, 1], [5, 8]], dtype=np.int32)
    kv.run_plans(np.zeros((0, 2), np.int32), back, np.array([[9, 4]], dtype=np.int32))
    for (_, d), src in zip(back.tolist(), [2, 3, 4, 9, 6], strict=True):
        assert torch.equal(kv.device_kv[d], before[src])
    assert torch.equal(kv.device_kv[4], before[9])  # the copy ran after the swap-in
    assert torch.equal(kv.layers()[1][10], before[2, 1])  # a layer view sees the same memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_device_pool_starts_zeroed_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    """The CPU pool is an anonymous memory map (zero pages until written): it reads zeros, and
    a write stays after the map's Python object is gone from the constructor."""
    import gc

    from ferryman.worker.kv_cache import KvCache

    kv = KvCache(3, 12, 0, 4, 2, 8, dtype, torch.device("cpu"))
    assert kv.device_kv.shape == (13, 3, 2, 4, 2, 8) and kv.device_kv.dtype == dtype
    assert not kv.device_kv.any()
    gc.collect()
    kv.layers()[2][5] = 1.5
    assert float(kv.device_kv.float().sum()) == 1.5 * 2 * 4 * 2 * 8
    assert torch.equal(kv.device_kv[5, 2], torch.full((2, 4, 2, 8), 1.5, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_pool_is_locked_at_its_own_size_until_its_last_view_is_freed(dtype: torch.dtype) -> None:
    """``page_locked`` registers exactly the pool's bytes (not the power of two PyTorch's pinned
    allocator rounds to) and unregisters the same address once, when no tensor over it is left.
    The CUDA runtime is replaced by a recorder here; tests/gpu runs the real one."""
    import gc

    from ferryman.worker.transfer import page_locked

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int, int]] = []

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            self.calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            self.calls.append(("unregister", ptr, 0))
            return 0

    rt = Recorder()
    shape = (1 + 1000, 3, 2, 16, 2, 8)  # 4.1 MB in float32: a power of two would be 8.4 MB
    pool = page_locked(shape, dtype, rt)
    nbytes = pool.numel() * pool.element_size()
    assert pool.shape == shape and pool.dtype == dtype and rt.calls == [("register", pool.data_ptr(), nbytes)]
    view = pool[7]
    view.fill_(2)
    del pool
    gc.collect()
    assert len(rt.calls) == 1, "unregistered while a view still uses the memory"
    assert float(view.float().sum()) == 2 * view.numel()
    del view
    gc.collect()
    assert rt.calls[1:] == [("unregister", rt.calls[0][1], 0)]

    class Refuses(Recorder):
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            return 2  # cudaErrorMemoryAllocation

    with pytest.raises(RuntimeError, match=r"page-locking .* failed: cudaError 2"):
        page_locked(shape, dtype, Refuses())


def test_a_swap_out_overlaps_the_forward_only_when_the_step_writes_none_of_its_blocks() -> None:
    from ferryman.worker.kv_cache import swap_out_blocks_rewritten

    none = np.zeros((0, 2), np.int32)
    out = np.array([[5, 1], [6, 2]], dtype=np.int32)
    bs = 4
    assert not swap_out_blocks_rewritten(none, np.array([0, 1]), none, bs)  # nothing swapped out
    assert not swap_out_blocks_rewritten(out, np.array([4 * 7 + 2, 4 * 9]), none, bs)  # blocks 7, 9
    assert swap_out_blocks_rewritten(out, np.array([4 * 7, 4 * 6 + 3]), none, bs)  # block 6 reused
    assert swap_out_blocks_rewritten(out, np.array([4 * 7]), np.array([[7, 5]], np.int32), bs)  # CoW into 5
    assert not swap_out_blocks_rewritten(out, np.array([4 * 7]), np.array([[5, 8]], np.int32), bs)  # reads 5
    assert swap_out_blocks_rewritten(out, None, none, bs)  # unknown writes: wait


def test_block_table_derivations_by_flat_index_match_2d_indexing() -> None:
    """``BlockTable.step`` gathers slots and page lists by flat index into its table; the same
    arrays by plain 2-D indexing, step by step, through chunked prefill, decode and recompute
    preemption (rows freed and taken again)."""
    rng = np.random.default_rng(5)
    bs = 4
    s = Scheduler(
        SchedulerConfig(
            block_size=bs, num_device_blocks=24, max_num_batched_tokens=24, max_num_seqs=6,
            max_model_len=64, preemption_mode="recompute",
        )
    )  # fmt: skip
    for r in range(10):
        prompt = rng.integers(1, 500, int(rng.integers(3, 30))).tolist()
        s.add_request(r, prompt, RequestParams(int(rng.integers(2, 12)), ignore_eos=True))
    tables, steps = BlockTable(2, 2, bs), 0  # grows to what the scheduler sends
    while s.has_unfinished_requests():
        out = s.schedule()
        got = tables.step(out)
        t, qo, kvp, rows = tables.table, out.qo_indptr, out.kv_indptr, out.rows
        tok = np.repeat(np.arange(len(rows)), np.diff(qo))
        pos = out.seq_lens[tok].astype(np.int64) - (qo[tok + 1] - np.arange(len(tok)))
        page = np.repeat(np.arange(len(rows)), np.diff(kvp))
        assert got.positions.tolist() == pos.tolist()
        slots = t[rows[tok], pos // bs].astype(np.int64) * bs + pos % bs
        assert got.slot_mapping.tolist() == slots.tolist()
        assert got.kv_indices.tolist() == t[rows[page], np.arange(int(kvp[-1])) - kvp[page]].tolist()
        s.update(np.ones(len(out.logits_indices), dtype=np.int32))
        steps += 1
    assert s.stats()["num_preemptions"] > 0 and steps > 10


def test_flashinfer_plan_metadata_from_the_core_arrays() -> None:
    """The host-side part of the GPU backend: int32 CSR arrays FlashInfer takes, untouched, and
    the decode/prefill wrapper choice (FlashInfer itself needs a GPU; tests/gpu runs it)."""
    from ferryman.attention.flashinfer_backend import plan_metadata

    s = Scheduler(
        SchedulerConfig(block_size=4, num_device_blocks=32, max_num_batched_tokens=16, max_model_len=64)
    )
    s.add_request(1, list(range(1, 11)), RequestParams(3, ignore_eos=True))
    s.add_request(2, list(range(20, 26)), RequestParams(3, ignore_eos=True))
    tables = BlockTable(4, 16, 4)
    out = s.schedule()
    m = plan_metadata(tables.step(out))
    assert not m.decode_only
    assert all(t.dtype == torch.int32 for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len))
    assert m.qo_indptr.tolist() == [0, 10, 16] and m.kv_indptr.tolist() == [0, 3, 5]
    assert m.kv_last_page_len.tolist() == [2, 2]
    # kv length per row = page_size * (pages - 1) + last_page_len = seq_lens
    pages = np.diff(m.kv_indptr.numpy())
    assert (4 * (pages - 1) + m.kv_last_page_len.numpy()).tolist() == out.seq_lens.tolist()
    assert m.kv_indices.tolist() == [1, 2, 3, 4, 5]  # each row's blocks, from the runner's table
    s.update(np.ones(len(out.logits_indices), dtype=np.int32))
    out = s.schedule()
    m = plan_metadata(tables.step(out))
    assert m.decode_only and m.qo_indptr.tolist() == [0, 1, 2]
    s.update(np.ones(len(out.logits_indices), dtype=np.int32))


def test_cuda_graph_sizes_and_the_size_a_batch_runs_on() -> None:
    from ferryman.attention.flashinfer_graphs import capture_sizes, graph_size

    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1000)[-1] == 256 and capture_sizes(0) == []
    sizes = capture_sizes(40)
    assert [graph_size(sizes, b) for b in (1, 3, 8, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]
    assert graph_size(sizes, 41) is None and graph_size(sizes, 0) is None


def test_graph_padding_keeps_the_step_and_pads_on_the_null_block() -> None:
    """The host side of a CUDA-graph replay, as the graphs read it from the staged buffer: the
    real rows unchanged, and every dummy row one token on page 0 (the null block, which no
    request owns), writing slot 0."""
    from ferryman.attention.flashinfer_graphs import StepStaging

    bs = 4
    s = Scheduler(
        SchedulerConfig(block_size=bs, num_device_blocks=32, max_num_batched_tokens=64, max_model_len=64)
    )
    for r, n in enumerate((9, 4, 13)):
        s.add_request(r, list(range(100 * r + 1, 100 * r + 1 + n)), RequestParams(4, ignore_eos=True))
    tables, st = BlockTable(4, 16, bs), StepStaging(16, 16, torch.device("cpu"))
    out = s.schedule()
    with pytest.raises(ValueError, match="decode-only"):
        st.stage(tables.step(out), 8)
    s.update(np.ones(len(out.logits_indices), dtype=np.int32))
    out = tables.step(s.schedule())
    st.stage(out, 8)
    buf, inputs = st.device_buf, st.inputs(8)
    ids, pos, slots = (inputs[i].tolist() for i in range(3))
    assert ids[:3] == out.input_ids.tolist() and ids[3:] == [0] * 5
    assert pos[:3] == out.positions.tolist()
    assert slots[:3] == out.slot_mapping.tolist() and slots[3:] == [0] * 5
    indptr = st.kv_indptr(buf, 8).numpy()
    assert indptr.tolist() == [*out.kv_indptr.tolist(), *(out.kv_indptr[-1] + np.arange(1, 6))]
    assert st.kv_indices(buf)[: indptr[-1]].tolist() == [*out.kv_indices.tolist(), 0, 0, 0, 0, 0]
    last = st.kv_last_page_len(buf, 8).numpy()
    kv_len = bs * (np.diff(indptr) - 1) + last
    assert kv_len.tolist() == [*out.seq_lens.tolist(), 1, 1, 1, 1, 1]
    assert 0 not in out.kv_indices.tolist()  # so the dummies share no block with a request
    with pytest.raises(ValueError, match="do not fit"):
        st.stage(out, 2)
    s.update(np.ones(3, dtype=np.int32))


def test_step_staging_packs_each_step_into_its_sizes_views() -> None:
    """One copy carries a graph step: after ``stage``, the device buffer's views of that size hold
    exactly the step, padded (ids, positions and slots as int64; the page table as int32), over
    whatever a larger earlier step left there, and the host buffers rotate."""
    from types import SimpleNamespace

    from ferryman.attention.flashinfer_graphs import StepStaging

    st = StepStaging(8, 3, torch.device("cpu"))
    rng = np.random.default_rng(0)
    hosts = []
    for rows, size in ((8, 8), (3, 4), (5, 8), (2, 2), (0, 1)):
        pages = rng.integers(1, 4, rows)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        step = SimpleNamespace(
            input_ids=rng.integers(0, 1 << 40, rows),  # past int32, so the int64 rows are checked
            positions=rng.integers(0, 48, rows),
            slot_mapping=rng.integers(0, 1 << 33, rows),
            kv_indptr=indptr,
            kv_indices=rng.integers(1, 100, int(indptr[-1])).astype(np.int32),
            kv_last_page_len=rng.integers(1, 17, rows).astype(np.int32),
        )
        hosts.append(st.stage(step, size).data_ptr())
        buf, pad = st.device_buf, size - rows
        inputs = st.inputs(size)
        assert inputs.dtype == torch.int64 and inputs.shape == (3, size)
        assert inputs[0].tolist() == [*step.input_ids.tolist(), *[0] * pad]
        assert inputs[1].tolist() == [*step.positions.tolist(), *[0] * pad]
        assert inputs[2].tolist() == [*step.slot_mapping.tolist(), *[0] * pad]
        top = int(indptr[-1])
        assert st.kv_indptr(buf, size).tolist() == [*indptr.tolist(), *(top + np.arange(1, pad + 1)).tolist()]
        assert st.kv_last_page_len(buf, size).tolist() == [*step.kv_last_page_len.tolist(), *[1] * pad]
        assert st.kv_indices(buf)[: top + pad].tolist() == [*step.kv_indices.tolist(), *[0] * pad]
    assert len(set(hosts[: StepStaging.RING])) == StepStaging.RING and hosts[StepStaging.RING] == hosts[0]


def test_graph_attention_writes_kv_where_the_static_slots_say_at_each_call() -> None:
    """A captured graph replays with new contents in the same slot buffer, so (block, offset)
    must come from the buffer inside the forward, at every call. The wrapper here only hands back
    q: what is checked is the K/V write that precedes it."""
    from ferryman.attention.flashinfer_backend import PlanArgs
    from ferryman.attention.flashinfer_graphs import StepStaging, _GraphAttention
    from ferryman.worker.kv_cache import KvCache

    class Identity:
        def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            return q

    kv = KvCache(2, 4, 0, 4, 1, 2, torch.float32, torch.device("cpu"))
    staging = StepStaging(1, 4, torch.device("cpu"))  # a size-1 graph's ids, positions, slots
    attn = _GraphAttention(kv.layers(), Identity(), staging, 1, PlanArgs(1, 1, 2, 4, torch.float32, 1.0))
    inputs = attn.inputs
    q = torch.zeros(1, 1, 2)
    for slot, value in ((5, 1.0), (14, 2.0)):  # block 1, offset 1; then block 3, offset 2
        inputs[2, 0] = slot
        k, v = torch.full((1, 1, 2), value), torch.full((1, 1, 2), -value)
        for layer in range(2):
            assert torch.equal(attn.forward(layer, q, k, v), q)
            assert torch.equal(kv.layers()[layer][slot // 4, 0, slot % 4], k[0])
            assert torch.equal(kv.layers()[layer][slot // 4, 1, slot % 4], v[0])
    assert kv.layers()[0][1, 0, 1, 0, 0] == 1.0  # the first write stayed where it went
    assert kv.device_kv.count_nonzero() == 2 * 2 * 2 * 2  # 2 steps x 2 layers x K,V x D


def test_cpu_runner_picks_torch_and_flashinfer_needs_a_gpu(tmp_path: Path) -> None:
    import sys

    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams

    path = str(build("llama", tmp_path))
    eng = Engine(path, block_size=4, num_device_blocks=8, num_host_blocks=0, calibrate=False)
    assert eng.runner.attention_backend == "torch"
    assert eng.runner.graphs is None  # CUDA graphs belong to the FlashInfer path only
    with pytest.raises(ValueError, match="FlashInfer"):
        eng.runner.capture_graphs(logits_in_graph=True)
    eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
    assert eng.stats()["num_cuda_graph_steps"] == 0
    assert "flashinfer" not in sys.modules  # the CPU path never imports it
    with pytest.raises(ValueError, match=r"ferryman\[gpu\]"):
        Engine(path, block_size=4, num_device_blocks=8, calibrate=False, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(path, block_size=4, num_device_blocks=8, calibrate=False, attention_backend="triton")


def test_selector_gives_torch_on_cpu_and_refuses_flashinfer_there() -> None:
    import sys

    from ferryman.attention.selector import backend_name, select_backend
    from ferryman.worker.kv_cache import KvCache

    cpu = torch.device("cpu")
    kv = KvCache(2, 4, 0, 4, 1, 2, torch.float32, cpu)
    shape = {"block_size": 4, "scale": 0.5, "num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 2}
    assert [backend_name(n, cpu) for n in ("auto", "torch")] == ["torch", "torch"]
    backend = select_backend("auto", cpu, kv.layers(), **shape)
    assert isinstance(backend, TorchAttentionBackend) and (backend.bs, backend.scale) == (4, 0.5)
    assert [t.data_ptr() for t in backend.layers] == [kv.device_kv[:, i].data_ptr() for i in range(2)]
    need = (
        r"^attention_backend='flashinfer' needs a CUDA device and FlashInfer \(pip install ferryman\[gpu\]\)$"
    )
    with pytest.raises(ValueError, match=need):
        select_backend("flashinfer", cpu, kv.layers(), **shape)
    with pytest.raises(
        ValueError,
        match=r"^attention_backend must be one of \('auto', 'torch', 'flashinfer'\), got 'triton'$",
    ):
        backend_name("triton", cpu)
    assert "flashinfer" not in sys.modules  # on a CPU device the rule never looks for it


def run_benchmark(script: str, *args: str) -> dict[str, Any]:
    """The JSON a script of benchmarks/ prints, run as its own process."""
    import json
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    cmd = [sys.executable, str(path), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(p.stdout)


def test_gpu_benchmark_script_dry_runs_on_cpu() -> None:
    """benchmarks/gpu_bench.py is what scripts/gpu_check.sh runs on a GPU; its --smoke mode runs
    every code path on CPU with a tiny model, so the script cannot rot while no GPU is around."""
    report = run_benchmark("gpu_bench.py", "--smoke", "--batches", "1,3", "--context", "24", "--steps", "2")
    assert [d["batch"] for d in report["decode"]] == [1, 3]
    assert all(d["decode_tokens_per_s"] > 0 and d["prefill_tokens_per_s"] > 0 for d in report["decode"])
    assert [s["block_size"] for s in report["swap"]] == [16, 64]
    # the whole Engine.step() (load_format="dummy") beside the runner alone, at each batch
    assert all(d["engine_step_ms"] > 0 and d["engine_step_over_runner"] > 0 for d in report["decode"])


def test_block_table_benchmark_runs() -> None:
    """benchmarks/block_table.py on a small batch: every request decodes in every timed step."""
    report = run_benchmark("block_table.py", "--rows", "6", "--context", "40", "--steps", "5")
    assert report["rows"] == 6 and report["step_us"] > 0
    assert report["pages_last_step"] == 6 * -(-(40 + 5 + 1) // 16)  # 3 pages a row: 40 + 6 tokens


@pytest.mark.parametrize(
    ("places", "src"),
    [([2, 3, 4], [1, 2, 3]), ([0, 2], [3, 1]), ([1, 2], [4, 0]), ([5], [0])],
)
def test_inflight_inputs_land_at_their_places(places: list[int], src: list[int]) -> None:
    """Async scheduling: a step's inputs that the previous step is still sampling are written
    from that step's ids on the device, as a slice copy where both sides run consecutively (a
    decode batch that kept its order) and by index otherwise; both give the same ids."""
    from types import SimpleNamespace

    from ferryman.attention.base import put_inflight
    from ferryman.worker.model_runner import ModelRunner

    runner = SimpleNamespace(device=torch.device("cpu"))
    out = SimpleNamespace(
        inflight_token_indices=np.array(places, np.int32), inflight_sample_indices=np.array(src, np.int32)
    )
    prev = torch.tensor([70, 71, 72, 73, 74], dtype=torch.int32)
    fill = ModelRunner._inflight_inputs(runner, out, prev)  # type: ignore[arg-type]
    assert fill is not None
    assert isinstance(fill[0], slice) == (
        places == list(range(places[0], places[0] + len(places)))
        and src == list(range(src[0], src[0] + len(src)))
    )
    ids = torch.arange(6, dtype=torch.int64)
    put_inflight(ids, fill)
    want = list(range(6))
    for p, s in zip(places, src, strict=True):
        want[p] = 70 + s
    assert ids.tolist() == want
    empty = SimpleNamespace(
        inflight_token_indices=np.zeros(0, np.int32), inflight_sample_indices=np.zeros(0, np.int32)
    )
    assert ModelRunner._inflight_inputs(runner, empty, None) is None  # type: ignore[arg-type]
