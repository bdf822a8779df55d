"""The GPU path against the torch reference (CUDA + FlashInfer only; skipped elsewhere, so CI
never runs it). ``scripts/gpu_check.sh`` runs these on a GPU machine."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ferryman import RequestParams, Scheduler, SchedulerConfig
from ferryman.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

# The greedy tests run in float16: in bfloat16 (8 mantissa bits) the tiny random model's top two
# logits are often closer than the rounding that a different batch shape (another GEMM kernel,
# another reduction order) brings, so greedy ids flip without any bug (seen on an H200, where CPU
# bfloat16 also differs from float32 by the sixth token). The lockstep tests below compare logits
# step by step instead, which a real bug fails by far more than rounding.
GREEDY_DTYPE = "float16"


def lockstep(runners: list, sched: Scheduler) -> tuple[list[float], int]:
    """Run every runner on the same scheduler outputs, the first one's greedy tokens driving the
    scheduler; the worst max |logits - first's| / max |first's logits| of each other runner, and
    the number of steps."""
    worst, steps = [0.0] * (len(runners) - 1), 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        logits = [r.execute(out) for r in runners]
        ref = logits[0]
        if ref.numel():
            scale = float(ref.abs().max())
            for i, other in enumerate(logits[1:]):
                worst[i] = max(worst[i], float((other - ref).abs().max()) / scale)
        sched.update(ref.argmax(-1).to(torch.int32).cpu().numpy())
        steps += 1
    return worst, steps


def tiny_runners(tmp_path: Path, num_blocks: int, num_host: int, *specs: dict) -> list:
    """One float16 tiny Llama (head_dim 64) on the GPU, and a runner with its own KV per spec."""
    from tiny_models import build

    from ferryman.model_loader import load_model
    from ferryman.worker.kv_cache import KvCache
    from ferryman.worker.model_runner import ModelRunner

    dev, dt = torch.device("cuda"), torch.float16
    model, _ = load_model(str(build("llama", tmp_path, hidden_size=256, intermediate_size=512)), dt, dev)
    c = model.cfg
    runners = []
    for spec in specs:
        kv = KvCache(c.num_layers, num_blocks, num_host, 16, c.num_kv_heads, c.head_dim, dt, dev)
        runners.append(ModelRunner(model, kv, 16, dev, max_num_seqs=16, max_model_len=128, **spec))
    return runners


def test_flashinfer_engine_logits_match_torch_reference_under_swap(tmp_path: Path) -> None:
    torch_r, fi_r = tiny_runners(
        tmp_path,
        6,
        32,
        {"attention_backend": "torch"},
        {"attention_backend": "flashinfer", "enforce_eager": True},
    )
    s = Scheduler(
        SchedulerConfig(
            block_size=16,
            num_device_blocks=6,
            num_host_blocks=32,
            max_num_batched_tokens=40,
            max_num_seqs=16,
            max_model_len=128,
            preemption_mode="swap",
        )
    )
    for r in range(6):
        s.add_request(r, [*range(20, 44), r, r + 1], RequestParams(24, ignore_eos=True))
    (worst,), steps = lockstep([torch_r, fi_r], s)
    print(f"flashinfer vs torch reference: worst relative logit error {worst:.2e} over {steps} steps")
    assert s.stats()["num_preemptions_swap"] > 0
    assert worst < 2e-2


def test_cuda_graph_logits_match_eager(tmp_path: Path) -> None:
    eager, graphs, head = tiny_runners(
        tmp_path,
        64,
        0,
        {"attention_backend": "flashinfer", "enforce_eager": True},
        {"attention_backend": "flashinfer"},
        {"attention_backend": "flashinfer"},
    )
    head.capture_graphs(logits_in_graph=True)  # the LM head inside the graphs
    assert eager.graphs is None and graphs.graphs.sizes == [1, 2, 4, 8, 16]
    assert head.graphs.logits_in_graph and not graphs.graphs.logits_in_graph
    s = Scheduler(SchedulerConfig(block_size=16, num_device_blocks=64, max_num_seqs=16, max_model_len=128))
    for r in range(5):  # 5 rows replay the size-8 graph, 3 of them padding
        s.add_request(r, [*range(30, 50), r], RequestParams(20, ignore_eos=True))
    (worst, worst_head), steps = lockstep([eager, graphs, head], s)
    print(f"graphs vs eager: worst relative logit error {worst:.2e} over {steps} steps")
    print(f"graphs with the LM head vs eager: {worst_head:.2e}")
    assert graphs.num_graph_steps >= 19 and head.num_graph_steps >= 19
    import flashinfer

    from ferryman.attention.flashinfer_plan import VERSIONS

    if flashinfer.__version__.split("+")[0] in VERSIONS:  # elsewhere every plan is FlashInfer's own
        assert graphs.graphs.num_fast_plans >= 18  # every plan after a size's first (FastDecodePlan)
    assert worst < 2e-2 and worst_head < 2e-2


@pytest.mark.parametrize(("heads", "head_dim"), [((8, 2), 128), ((9, 3), 64)])
def test_fast_decode_plan_runs_what_flashinfers_own_plan_runs(heads: tuple[int, int], head_dim: int) -> None:
    """Two CUDA-graph decode wrappers over one cache, one planned by FlashInfer's ``plan()`` each
    step, the other by ``FastDecodePlan`` after its first: the same output, bit for bit, over
    batches from one page per row to 200 (which change how FlashInfer splits the KV)."""
    import flashinfer

    from ferryman.attention.flashinfer_backend import PlanArgs
    from ferryman.attention.flashinfer_plan import FastDecodePlan

    dev, dt, bs, size = torch.device("cuda"), torch.bfloat16, 16, 32
    (hq, hkv), d = heads, head_dim
    rng, blocks = np.random.default_rng(0), size * 200 + 1
    torch.manual_seed(0)
    cache = torch.randn(blocks, 2, bs, hkv, d, device=dev, dtype=dt)
    q = torch.randn(size, hq, d, device=dev, dtype=dt)

    def graph_wrapper() -> object:
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device=dev),
            kv_layout="NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(blocks, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=dev),
        )

    own, fast_w = graph_wrapper(), graph_wrapper()
    fast = FastDecodePlan(fast_w, size, hq, hkv, d)
    args = PlanArgs(hq, hkv, d, bs, dt, d**-0.5, dev)
    for trial, most in enumerate((1, 3, 40, 200, 2, 120)):
        pages = rng.integers(1, most + 1, size)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = rng.permutation(np.arange(1, blocks))[: indptr[-1]].astype(np.int32)
        last = rng.integers(1, bs + 1, size).astype(np.int32)
        host = [torch.from_numpy(a).pin_memory() for a in (indptr, indices, last)]
        args.plan_decode(own, host[0], host[1].to(dev), host[2])
        if trial == 0:
            assert not fast.usable()  # not planned yet
            args.plan_decode(fast_w, host[0], host[1].to(dev), host[2])
            continue
        assert fast.usable()
        fast_w._paged_kv_indptr_buf.copy_(host[0])
        fast_w._paged_kv_indices_buf[: len(indices)].copy_(host[1])
        fast_w._paged_kv_last_page_len_buf.copy_(host[2])
        args.replan_decode(fast, indptr, last)
        want, got = own.run(q, cache), fast_w.run(q, cache)
        assert torch.equal(got, want), f"trial {trial}: up to {most} pages per row"


def test_flashinfer_backend_matches_the_torch_reference() -> None:
    from ferryman.attention.flashinfer_backend import FlashInferBackend
    from ferryman.worker.block_table import BlockTable
    from ferryman.worker.kv_cache import KvCache

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, bs, layers = 8, 2, 128, 16, 2
    lens = {0: (300, 5), 1: (70, 9), 2: (17, 12)}
    s = Scheduler(
        SchedulerConfig(block_size=bs, num_device_blocks=64, max_num_batched_tokens=128, max_model_len=512)
    )
    for r, (p, n) in lens.items():
        s.add_request(r, [1000 * r + t for t in range(1, p + 1)], RequestParams(n, ignore_eos=True))
    kv_fi = KvCache(layers, 64, 0, bs, hkv, d, dt, dev)
    kv_ref = KvCache(layers, 64, 0, bs, hkv, d, dt, dev)
    fi = FlashInferBackend(kv_fi.layers(), bs, d**-0.5, hq, hkv, d)
    ref = TorchAttentionBackend(kv_ref.layers(), bs, d**-0.5)
    steps, tables = 0, BlockTable(4, 32, bs)
    while s.has_unfinished_requests():
        out = s.schedule()
        step = tables.step(out)
        fi.plan(step)
        ref.plan(step)
        t = out.num_scheduled_tokens
        for layer in range(layers):
            q = torch.randn(t, hq, d, device=dev, dtype=dt)
            k = torch.randn(t, hkv, d, device=dev, dtype=dt)
            v = torch.randn(t, hkv, d, device=dev, dtype=dt)
            a, b = fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        s.update(np.ones(len(out.logits_indices), dtype=np.int32))
        steps += 1
    assert steps > 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [((8, 2), 128), ((4, 4), 64)])
def test_flashinfer_fused_ops_match_the_torch_reference(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int
) -> None:
    """FlashInfer's norm, residual add + norm, SiLU-and-mul and RoPE (``models/ops.py``) against
    the torch ops, on strided q/k views of a qkv buffer as the model hands them over."""
    from ferryman.models.ops import FlashInferOps, Shapes, TorchOps, check_ops

    dev = torch.device("cuda")
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    shapes = Shapes(1024, heads[0], heads[1], head_dim, 2048, dtype, dev, 4096)
    assert check_ops(FlashInferOps(inv_freq, 1.0, 4096), TorchOps(inv_freq, 1.0), shapes) is None
    # YaRN's cos/sin factor goes into FlashInfer's table
    assert check_ops(FlashInferOps(inv_freq, 1.2, 4096), TorchOps(inv_freq, 1.2), shapes) is None


def test_a_flashinfer_runner_runs_the_fused_ops(tmp_path: Path) -> None:
    from ferryman.models.ops import FlashInferOps

    (fi_r,) = tiny_runners(tmp_path, 16, 0, {"attention_backend": "flashinfer"})
    assert isinstance(fi_r.ops, FlashInferOps), fi_r.ops_note
    assert fi_r.ops_note.startswith("flashinfer")
    # its RoPE table covers max_model_len (128) and the runner refuses positions past it
    assert fi_r.ops.cos_sin.shape[0] == fi_r.position_limit == 128


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_forced_preemption_gives_identical_greedy_output_on_gpu(tmp_path: Path, mode: str) -> None:
    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams

    path = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))  # head_dim 64
    prompts = [[*range(20, 44), i, i + 1] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = {"device": "cuda", "dtype": GREEDY_DTYPE, "attention_backend": "flashinfer", "calibrate": False}
    free = Engine(path, block_size=16, num_device_blocks=64, num_host_blocks=0, **kw).generate(
        prompts, params
    )
    tight = Engine(path, block_size=16, num_device_blocks=6, num_host_blocks=32, preemption_mode=mode, **kw)
    got = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in free]
    st = tight.stats()
    assert st["num_preemptions"] > 0
    assert st["num_free_device_blocks"] == 6


def test_cuda_graphs_replay_decode_with_the_eager_output(tmp_path: Path) -> None:
    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams

    path = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))
    prompts = [[*range(30, 50), i] for i in range(5)]  # 5 rows run on the size-8 graph
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = {
        "device": "cuda",
        "dtype": GREEDY_DTYPE,
        "attention_backend": "flashinfer",
        "calibrate": False,
        "block_size": 16,
        "num_device_blocks": 64,
        "num_host_blocks": 0,
        "max_num_seqs": 16,
    }
    eager = Engine(path, enforce_eager=True, **kw)
    graphs = Engine(path, **kw)
    assert eager.runner.graphs is None and graphs.runner.graphs.sizes == [1, 2, 4, 8, 16]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    assert graphs.stats()["num_cuda_graph_steps"] >= 19  # every decode step after the prefill
    assert eager.stats()["num_cuda_graph_steps"] == 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overlap_on_and_off_give_identical_output_on_gpu(tmp_path: Path, mode: str, sampling: str) -> None:
    """Async scheduling on CUDA (step N+1 queued on the device while the host applies step N,
    in-flight inputs filled on the device, ids back through pinned memory and an event; decode
    replays CUDA graphs) against the synchronous engine, under forced preemption: greedy, and
    seeded sampling with every filter, penalties and a logit bias (the sampler's indices reach
    the device without a wait)."""
    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams

    path = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))
    prompts = [[*range(20, 44), i, i + 1] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params: SamplingParams | list[SamplingParams] = greedy
    if sampling == "seeded":
        params = [
            SamplingParams(
                temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=i, max_tokens=24, ignore_eos=True,
                presence_penalty=0.5, repetition_penalty=1.1, logit_bias={30 + i: 2.0},
            )
            for i in range(6)
        ]  # fmt: skip
    kw = {
        "device": "cuda",
        "dtype": GREEDY_DTYPE,
        "attention_backend": "flashinfer",
        "calibrate": False,
        "block_size": 16,
        "num_device_blocks": 8,
        "num_host_blocks": 32,
        "preemption_mode": mode,
        "max_num_seqs": 8,
    }
    sync = Engine(path, async_scheduling=False, **kw)
    overlap = Engine(path, async_scheduling=True, **kw)
    want = [o.outputs[0].token_ids for o in sync.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in overlap.generate(prompts, params)]
    assert got == want
    st = overlap.stats()
    assert st["num_preemptions"] > 0 and st["num_cuda_graph_steps"] > 0
    assert st["num_free_device_blocks"] == 8 and st["num_free_host_blocks"] == 32


def test_to_device_copies_without_waiting_for_the_stream() -> None:
    """A copy queued behind a long kernel returns at once and lands with the right values (a
    pageable copy would wait for the kernel first)."""
    from ferryman.worker.transfer import to_device

    cuda = torch.device("cuda")
    to_device(np.zeros(8, dtype=np.int64), cuda)  # the first page-locked allocation itself syncs
    torch.cuda.synchronize()
    queued = torch.cuda.Event()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time
    queued.record()
    t = to_device(np.arange(10, dtype=np.int64)[::2], cuda)  # strided on purpose
    assert not queued.query(), "the copy waited for the kernel queued before it"
    assert t.dtype == torch.int64 and t.cpu().tolist() == [0, 2, 4, 6, 8]


def test_the_host_pool_is_page_locked_at_its_own_size() -> None:
    """The host KV pool is locked memory that copies run from asynchronously, without PyTorch's
    pinned allocator (which would round its 4.002 GiB up to 8)."""
    import gc

    from ferryman.worker.kv_cache import KvCache

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    kv = KvCache(2, 8, 1000, 16, 2, 64, torch.bfloat16, torch.device("cuda"))
    assert kv.host_kv.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    kv.device_kv[3] = 1.0
    kv.run_plans(np.array([[3, 500]], dtype=np.int32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32))
    torch.cuda.synchronize()
    assert bool((kv.host_kv[500] == 1.0).all())
    del kv
    gc.collect()  # unregisters: a second pool of the same size registers again
    KvCache(2, 8, 1000, 16, 2, 64, torch.bfloat16, torch.device("cuda"))


def test_kv_pool_is_sized_from_gpu_memory_utilization(tmp_path: Path) -> None:
    """No ``num_device_blocks``: ``profile_kv_blocks`` gives KV what is left of the utilization
    share after weights and a full-budget forward; the pool stays inside that share and serves."""
    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams
    from ferryman.worker.kv_cache import KvCache

    path = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))
    util = 0.05
    eng = Engine(
        path, device="cuda", dtype=GREEDY_DTYPE, attention_backend="flashinfer", calibrate=False,
        num_host_blocks=0, gpu_memory_utilization=util, enforce_eager=True,
    )  # fmt: skip
    c = eng.model.cfg
    blocks = eng.scheduler.config.num_device_blocks
    per_block = KvCache.bytes_per_block(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.float16)
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"profiled pool: {blocks} blocks, {blocks * per_block / 2**30:.2f} GiB of {total / 2**30:.0f} GiB")
    assert blocks > 1000 and blocks * per_block <= util * total
    out = eng.generate([[*range(20, 40)]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_flashinfer_masked_kv_positions_contribute_nothing_whatever_they_hold(
    tmp_path: Path, enforce_eager: bool
) -> None:
    """Every KV block (device and host) filled with NaN before the run: positions past a row's
    length in its last page, and pages of padded CUDA-graph rows, must not leak into any output."""
    from tiny_models import build

    from ferryman.engine import Engine
    from ferryman.sampling_params import SamplingParams

    path = str(build("llama", tmp_path, hidden_size=256, intermediate_size=512))
    prompts = [[*range(20, 27 + 3 * i)] for i in range(5)]  # lengths not multiples of the page
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = {
        "device": "cuda",
        "dtype": GREEDY_DTYPE,
        "attention_backend": "flashinfer",
        "calibrate": False,
        "block_size": 16,
        "num_device_blocks": 16,
        "num_host_blocks": 16,
        "enforce_eager": enforce_eager,
    }
    want = [o.outputs[0].token_ids for o in Engine(path, **kw).generate(prompts, params)]
    eng = Engine(path, **kw)
    eng.kv.device_kv[1:].fill_(float("nan"))  # every block a request can own (0 is the null block)
    eng.kv.host_kv.fill_(float("nan"))
    outs = eng.generate(prompts, params)
    assert [o.error for o in outs] == [None] * len(prompts)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_sampler_flags_non_finite_rows_and_takes_the_first_largest(temperature: float) -> None:
    """On CUDA, greedy is the row's maximum with argmax's index (the first largest, here in rows
    of ties), and ``ok`` is False exactly for rows with a NaN or +inf, or all -inf, read off that
    maximum; a single -inf among finite logits samples normally."""
    from ferryman.sampling_params import SamplingParams
    from ferryman.worker.sampling_table import SamplingTable

    vocab, n, dev = 64, 6, torch.device("cuda")
    table = SamplingTable(n, dev, vocab)
    for i in range(n):
        table.set(i, SamplingParams(temperature=temperature, max_tokens=4), seed=i)
    ids = np.arange(n, dtype=np.int64)

    class Plan:  # what ``args`` reads of a planned step
        added_req_ids = sample_req_ids = ids
        rows_added = ids.astype(np.int32)

    args = table.args(Plan())
    table.write_rows(args)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, 5] = float("-inf")
    logits[5, :] = 1.0
    logits[5, [9, 20, 41]] = 2.0  # ties: the first, 9
    rows = ids.astype(np.int32)
    tokens, ok, _ = table.sample(logits.to(dev), rows, np.zeros(n, np.int32), np.full(n, 9, np.int32), args)
    assert ok is not None and ok.tolist() == [True, False, False, False, True, True]
    assert int(tokens[4]) != 5
    if temperature == 0.0:
        assert tokens[[0, 4, 5]].tolist() == [*logits[[0, 4]].argmax(dim=-1).tolist(), 9]


def test_cuda_top_k_by_selection_samples_what_the_sort_does() -> None:
    """On CUDA, top-k without top-p selects the k-th largest with ``topk`` (no sort of the
    vocabulary); the sorted path's tokens, on a 49,152-token vocabulary with ties at the k-th."""
    from ferryman.worker.sampler import Filters, sample_random

    dev, rows, vocab = torch.device("cuda"), 64, 49_152
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    logits[::5] = (logits[::5] * 2).round() / 2
    top_k = torch.tensor([[-1, 1, 5, 50, 0, 1000][i % 6] for i in range(rows)], dtype=torch.int64)
    args = [
        logits,
        torch.tensor([0.3 + (i % 5) * 0.4 for i in range(rows)]),
        top_k,
        torch.ones(rows),
        torch.tensor([[0.0, 0.1][i % 2] for i in range(rows)]),
        torch.arange(rows, dtype=torch.int64) * 7 + 1,
        torch.arange(rows, dtype=torch.int64) + 3,
    ]
    args = [a.to(dev) for a in args]
    want = sample_random(*args, Filters(True, False, True)).tolist()
    assert sample_random(*args, Filters(True, False, True, top_k_max=1000)).tolist() == want
