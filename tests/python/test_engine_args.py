"""``EngineArgs``: one declaration per knob, validated on construction, the same defaults wherever a
knob is read (the Engine, every CLI command, the simulator, the core's own ``SchedulerConfig``)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ferryman import InvalidRequestError, SchedulerConfig
from ferryman.engine_args import EngineArgs, SchedulerArgs, add_cli_args, from_cli
from ferryman.sim import SimConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 12, "block_size must be a power of two"),
        ("max_num_seqs", 0, r"max_num_seqs must be in \[1, 1048576\]"),
        ("max_num_seqs", 2**40, r"max_num_seqs must be in \[1, 1048576\]"),  # numpy's MemoryError
        ("max_num_batched_tokens", 0, r"max_num_batched_tokens must be in \[1, 2147483646\]"),
        ("max_num_batched_tokens", 2**70, r"max_num_batched_tokens must be in \[1, 2147483646\]"),
        ("max_model_len", 2**31, r"max_model_len must be in \[1, 2147483646\]"),
        ("num_device_blocks", 2**40, r"num_device_blocks must be in \[1, 2147483646\]"),
        ("num_host_blocks", -1, r"num_host_blocks must be in \[0, 2147483646\]"),
        ("kv_cache_memory", 2**70, "kv_cache_memory is too large"),  # an OverflowError in the core
        ("device", "cuda:", "device must be 'auto', 'cpu' or 'cuda"),  # torch's own error, later
        ("device", "cuda:\u0663", "device must be 'auto', 'cpu' or 'cuda"),  # a digit, not ASCII
        ("swap_space", float("inf"), r"swap_space must be a size in GiB in \[0, 1048576\]"),  # a traceback
        ("swap_space", 1e30, "swap_space must be a size in GiB"),
        ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\]"),
        ("preemption_mode", "never", r"preemption_mode must be one of \['recompute', 'swap', 'auto'\]"),
        ("device", "tpu", "device must be 'auto', 'cpu' or 'cuda"),
        ("max_num_seqs", "8", "max_num_seqs must be an integer, got '8'"),
        ("enable_prefix_caching", 1, "enable_prefix_caching must be True or False"),
        ("block_size", None, "block_size must be set"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        EngineArgs(**{field: value})


def test_good_values_pass_and_keep_their_value() -> None:
    a = EngineArgs(block_size=8, device="cuda:1", swap_space=0, gpu_memory_utilization=1.0, num_host_blocks=0)
    assert (a.block_size, a.device, a.swap_space, a.num_host_blocks) == (8, "cuda:1", 0, 0)


def test_the_engine_takes_exactly_engine_args_and_checks_before_loading() -> None:
    from ferryman.engine import Engine

    with pytest.raises(TypeError, match="max_batch"):
        Engine("no/such/model", max_batch=4)
    # the value is refused before the (missing) model is looked at
    with pytest.raises(InvalidRequestError, match=r"max_num_seqs must be in \[1, 1048576\]"):
        Engine("no/such/model", max_num_seqs=0)


def test_the_token_budget_default_follows_the_device_and_chunking() -> None:
    assert EngineArgs().token_budget("cpu", 100_000) == 2048
    assert EngineArgs().token_budget("cuda", 100_000) == 8192
    assert SimConfig().budget(4096) == 8192
    assert EngineArgs(enable_chunked_prefill=False).token_budget("cpu", 100_000) == 100_000
    assert EngineArgs(max_num_batched_tokens=512).token_budget("cuda", 100_000) == 512


def test_the_cores_defaults_are_the_engines_on_a_gpu() -> None:
    """The core's ``SchedulerConfig()`` is what a GPU engine with default knobs plans with."""
    core, args = SchedulerConfig(), SchedulerArgs()
    for name in ("block_size", "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching"):
        assert getattr(core, name) == getattr(args, name), name
    assert (core.preemption_mode, core.policy) == (args.preemption_mode, args.policy)
    assert core.max_num_batched_tokens == args.token_budget("cuda", core.max_model_len)


def test_sim_config_shares_the_scheduler_knobs() -> None:
    shared = {f.name for f in dataclasses.fields(SchedulerArgs)}
    sim = {f.name: f for f in dataclasses.fields(SimConfig)}
    engine = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert shared <= set(sim) and shared <= set(engine)
    for name in shared:  # the same declaration, not a copy
        assert sim[name] is engine[name], name


def test_every_field_is_a_flag_and_no_flags_give_the_defaults() -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p, EngineArgs)
    assert from_cli(EngineArgs, p.parse_args([])) == EngineArgs()
    flags = {a.dest: a.option_strings for a in p._actions if a.dest != "help"}
    assert set(flags) == {f.name for f in dataclasses.fields(EngineArgs)}
    assert flags["enable_prefix_caching"] == ["--no-prefix-caching"]
    assert flags["enforce_eager"] == ["--enforce-eager"]
    assert flags["calibrate"] == ["--no-calibrate"]
    got = from_cli(
        EngineArgs,
        p.parse_args(
            ["--max-num-seqs", "8", "--no-prefix-caching", "--enforce-eager", "--dtype", "bfloat16"]
        ),
    )
    assert got == EngineArgs(
        max_num_seqs=8, enable_prefix_caching=False, enforce_eager=True, dtype="bfloat16"
    )
    with pytest.raises(SystemExit):
        p.parse_args(["--policy", "lifo"])  # choices come from the field
