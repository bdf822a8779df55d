"""Every engine setting, declared once: name, type, default, help and validation.

``SchedulerArgs`` holds the knobs of the scheduler and the KV pools, which ``ferryman sim`` shares
(``SimConfig`` extends it); ``EngineArgs`` adds what only a real engine has (the model, device,
attention backend, seeds, calibration). ``Engine(**kwargs)`` builds an ``EngineArgs``; the CLI's
engine flags are generated from the fields (``add_cli_args`` / ``from_cli``); the server is built
from an ``EngineArgs``. A ``None`` default means "derived", and the help says from what.

Invariant: an ``EngineArgs`` that exists is valid field by field (``__post_init__`` checks each
value and raises ``InvalidRequestError``, a ``ValueError``, naming the field). Relations that
need the model (``max_model_len`` against the model's context) are checked when the engine
builds its ``SchedulerConfig``. This module imports no torch, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ferryman._core import InvalidRequestError, SchedulerConfig

DEFAULT_MODEL = "smollm2"
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # attention/selector.py holds the rule
LOAD_FORMATS = ("auto", "dummy")  # model_loader.load_model

_Check = Callable[[Any], str | None]  # None when the value is fine, else what is wrong


def knob(
    default: Any, help: str, *, choices: Iterable[str] | None = None, check: _Check | None = None
) -> Any:
    """A dataclass field carrying its help text, its allowed values and a validator."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "check": check}
    return field(default=default, metadata=meta)


def at_least(lo: float) -> _Check:  # and below 2**63 (past it the core's conversion overflowed)
    return lambda v: (None if v < 1 << 63 else "is too large") if v >= lo else f"must be >= {lo}"


def in_range(lo: int, hi: int = (1 << 31) - 2) -> _Check:  # counts and ids cross as int32
    return lambda v: None if lo <= v <= hi else f"must be in [{lo}, {hi}]"


def _gib(v: float) -> str | None:
    """A host memory size in GiB: finite, up to a PiB (inf and 1e30 overflowed the block count)."""
    return None if 0 <= v <= 1 << 20 else "must be a size in GiB in [0, 1048576]"


def in_unit_interval(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def power_of_two(v: int) -> str | None:  # up to 4096
    return None if 0 < v <= 4096 and v & (v - 1) == 0 else "must be a power of two up to 4096"


def _device_name(v: str) -> str | None:
    head, _, index = v.partition(":")
    ok = v in ("auto", "cpu") or (head == "cuda" and (v == "cuda" or (index.isascii() and index.isdigit())))
    return None if ok else "must be 'auto', 'cpu' or 'cuda[:N]'"


@dataclass(kw_only=True)
class SchedulerArgs:
    """The scheduler's and the KV pools' knobs (vLLM's names)."""

    block_size: int = knob(16, "tokens per KV block", check=power_of_two)
    max_num_batched_tokens: int | None = knob(
        None,
        "token budget of one step (default: 8192 on CUDA and in the simulator, 2048 on CPU; "
        "without chunked prefill at least max_model_len)",
        check=in_range(1),
    )
    max_num_seqs: int = knob(256, "most sequences running at once", check=in_range(1, 1 << 20))
    max_model_len: int | None = knob(
        None, "longest prompt + output of a request (default: the model's context)", check=in_range(1)
    )
    num_device_blocks: int | None = knob(
        None,
        "device KV blocks (default: profiled to gpu_memory_utilization on CUDA, kv_cache_memory on CPU)",
        check=in_range(1),
    )
    num_host_blocks: int | None = knob(None, "host KV blocks (default: from swap_space)", check=in_range(0))
    swap_space: float = knob(4.0, "host memory for swapped KV, GiB", check=_gib)
    gpu_memory_utilization: float = knob(
        0.9, "share of the GPU's memory for weights, activations and KV", check=in_unit_interval
    )
    preemption_mode: str = knob(
        "auto",
        "what happens to a preempted request's KV: recomputed later, swapped to host, or chosen per "
        "victim by estimated cost",
        choices=("recompute", "swap", "auto"),
    )
    policy: str = knob(
        "fcfs", "admission and victim order: arrival, or the request's priority", choices=("fcfs", "priority")
    )
    enable_prefix_caching: bool = knob(True, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = knob(True, "split long prompts across steps, beside decodes")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name), type(self))

    def token_budget(self, device_type: str, max_model_len: int) -> int:
        """``max_num_batched_tokens``, or its default for this device and context."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = 8192 if device_type == "cuda" else 2048
        return budget if self.enable_chunked_prefill else max(budget, max_model_len)

    def scheduler_config(
        self,
        *,
        num_device_blocks: int,
        num_host_blocks: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        async_scheduling: bool = False,
        **cost_model: float,
    ) -> SchedulerConfig:
        """The core's config: these knobs plus the resolved sizes and the cost model's rates."""
        return SchedulerConfig(
            block_size=self.block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            preemption_mode=self.preemption_mode,
            policy=self.policy,
            async_scheduling=async_scheduling,
            **cost_model,
        )


@dataclass(kw_only=True)
class EngineArgs(SchedulerArgs):
    """Every knob of ``Engine``: the scheduler's plus the model, device and runner's."""

    model: str = knob(DEFAULT_MODEL, "'smollm2' (the embedded default), a .gguf file or a Hugging Face dir")
    dtype: str = knob(
        "auto",
        "weights and KV dtype ('auto': bfloat16 on CUDA, float32 on CPU; vLLM's 'half', 'float' too)",
        choices=("auto", "float32", "float16", "bfloat16", "half", "float"),
    )
    device: str = knob("auto", "'auto' (CUDA when there is one), 'cpu' or 'cuda[:N]'", check=_device_name)
    kv_cache_memory: int = knob(512 << 20, "device KV bytes when not profiled (CPU)", check=at_least(1))
    attention_backend: str = knob(
        "auto",
        "paged attention: torch (the reference, CPU), flashinfer (CUDA), auto (flashinfer when available)",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = knob(False, "never replay CUDA graphs for decode steps (FlashInfer on CUDA)")
    async_scheduling: bool | None = knob(
        None,
        "overlap: plan and run step N+1 while step N's tokens become text and outputs (default: on "
        "with CUDA; off on CPU, where the forward dwarfs the host work and it measured no gain)",
    )
    seed: int = knob(0, "engine seed: sampling seeds of requests that bring none")
    max_logprobs: int = knob(
        20, "most logprobs (and prompt logprobs) a request may ask for per token", check=at_least(0)
    )
    tensor_parallel_size: int = knob(
        1,
        "ranks one model is split over (tensor parallelism: gloo on CPU, NCCL on CUDA, not yet run)",
        check=at_least(1),
    )
    distributed_executor_backend: str = knob(
        "mp",
        "how tensor-parallel ranks 1..N-1 start: spawned processes (mp) or Ray actors in a placement "
        "group (ray; needs ray)",
        choices=("mp", "ray"),
    )
    calibrate: bool = knob(True, "measure the host link and prefill rate at start-up for the cost model")
    load_format: str = knob(
        "auto",
        "'auto': the checkpoint's weights; 'dummy': random weights of the model's shape from its "
        "config.json alone (benchmarks without the weights, as vLLM's)",
        choices=LOAD_FORMATS,
    )
    # vLLM's names for what a script passes it, served or refused here by name
    tokenizer: str | None = knob(None, "the tokenizer's folder, Hub id or .gguf, if not the model's")
    revision: str | None = knob(None, "the Hub revision (branch, tag or commit) of a Hub id model")
    download_dir: str | None = knob(None, "where Hub downloads go (default: the Hugging Face cache)")
    trust_remote_code: bool = knob(False, "accepted, changes nothing: ferryman runs no checkpoint code")
    quantization: str | None = knob(
        None, "None, or 'gguf' for a .gguf model (dequantized to dtype on load)", choices=("gguf",)
    )
    kv_cache_dtype: str = knob("auto", "'auto': the KV cache takes the model's dtype", choices=("auto",))
    generation_config: str = knob(
        "auto", "sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none) or a folder"
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates every annotation: once per class


def value_type(cls: type, f: dataclasses.Field[Any]) -> tuple[type, bool]:
    """The field's value type, and whether it may be None."""
    hint = _hints(cls)[f.name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def type_problem(kind: Any, v: Any) -> str | None:
    """Why ``v`` cannot be a value of type ``kind`` (bool, int, float or str; a number is never a
    bool, an int is a float), or None."""
    if kind is bool:
        return None if isinstance(v, bool) else "must be True or False"
    if kind is int:
        return None if isinstance(v, int) and not isinstance(v, bool) else "must be an integer"
    if kind is float:
        return None if isinstance(v, int | float) and not isinstance(v, bool) else "must be a number"
    if kind is str:
        return None if isinstance(v, str) else "must be a string"
    return None


def _validate(f: dataclasses.Field[Any], v: Any, cls: type) -> None:
    kind, optional = value_type(cls, f)
    bad = ("must be set" if not optional else None) if v is None else type_problem(kind, v)
    if bad is None and v is not None:
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            bad = f"must be one of {list(choices)}"
        elif f.metadata.get("check"):
            bad = f.metadata["check"](v)
    if bad:
        raise InvalidRequestError(f"{f.name} {bad}, got {v!r}")


# -- the command line ------------------------------------------------------------------------------

A = TypeVar("A", bound=SchedulerArgs)


def _flag(f: dataclasses.Field[Any]) -> str:
    name = f.name.replace("_", "-")
    if f.default is True:  # a switch that is on by default is turned off
        return "--no-" + name.removeprefix("enable-")
    return "--" + name


def add_cli_args(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type[SchedulerArgs] = EngineArgs,
    *,
    only: Iterable[str] | None = None,
    help_overrides: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of ``cls`` (or of the names in ``only``), ``cls``'s own fields first, with the
    field's default and help: ``--max-num-seqs``, and ``--no-prefix-caching`` for a switch on by
    default. ``help_overrides`` replaces a field's help where a command gives it another meaning."""
    keep = set(only) if only is not None else None
    own = inspect.get_annotations(cls)
    ordered = sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)  # cls's own first
    for f in ordered:
        if keep is not None and f.name not in keep:
            continue
        text = (help_overrides or {}).get(f.name, f.metadata["help"])
        if value_type(cls, f)[0] is bool and f.default is None:  # on, off, or the knob's own rule
            flag, on_off = "--" + f.name.replace("_", "-"), argparse.BooleanOptionalAction
            p.add_argument(flag, dest=f.name, action=on_off, default=None, help=text)
            continue
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            text += " (on by default; this flag turns it off)" if f.default else ""
            p.add_argument(_flag(f), dest=f.name, action=action, default=f.default, help=text)
            continue
        kind, _ = value_type(cls, f)
        shown = "" if f.default is None else f" (default: {f.default})"
        p.add_argument(
            _flag(f),
            dest=f.name,
            type=kind,
            default=f.default,
            choices=f.metadata["choices"],
            help=text + shown,
        )


def from_cli(cls: type[A], a: argparse.Namespace) -> A:
    """The dataclass from parsed flags: each of its fields the parser has."""
    return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)})
