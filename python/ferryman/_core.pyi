"""Type stubs of the Rust extension ``ferryman._core`` (checked by ``mypy.stubtest``).

Per step exactly two calls cross: ``Scheduler.schedule()`` and ``Scheduler.update()``. B = rows
(scheduled requests), T = scheduled tokens, S = samples (a request finishing its prompt with
``n > 1`` samples its last row n times). Every array is C-contiguous and owned by numpy.
"""

from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "RequestParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepOutputs",
    "TokenBytes",
    "__version__",
    "sample_cpu",
    "sample_random_cpu",
]

__version__: str

class InvalidRequestError(ValueError):
    """A request or argument the core rejects (bad config, unknown/duplicate id, infeasible)."""

class EngineError(RuntimeError):
    """The step protocol was misused (e.g. two schedule() without update()) or a bug was found."""

@final
class SchedulerConfig:
    """The scheduler's knobs (keywords only, vLLM's names); validated on construction.

    A keyword left out (or None) takes the core's default (``SchedulerConfig()`` shows them; the Engine's
    are ``ferryman.EngineArgs``). ``num_device_blocks`` counts usable blocks (the null block 0 is
    extra). ``bytes_per_block``, ``host_link_bytes_per_s`` and ``prefill_tokens_per_s`` are the
    ``auto`` mode's cost model. ``async_scheduling`` lets ``schedule()`` plan step N+1 while
    step N still awaits ``update()``.
    """

    def __new__(
        cls,
        *,
        block_size: int | None = None,
        num_device_blocks: int | None = None,
        num_host_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool | None = None,
        enable_prefix_caching: bool | None = None,
        preemption_mode: str | None = None,
        policy: str | None = None,
        watermark: float | None = None,
        bytes_per_block: float | None = None,
        host_link_bytes_per_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        async_scheduling: bool | None = None,
    ) -> SchedulerConfig: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_device_blocks(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def preemption_mode(self) -> str: ...
    @property
    def policy(self) -> str: ...
    @property
    def watermark(self) -> float: ...
    @property
    def bytes_per_block(self) -> float: ...
    @property
    def host_link_bytes_per_s(self) -> float: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def async_scheduling(self) -> bool: ...

@final
class SchedulerOutput:
    """The plan of one step. Run the plans in the order swap-out, swap-in, copy, then the
    forward; sample rows ``logits_indices``; pass the tokens to ``update()``. Each array becomes a
    numpy array (owning the core's buffer, no copy) when first read, and the same object after."""

    @property
    def req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [B]: request of each row."""
    @property
    def seq_indices(self) -> npt.NDArray[np.int32]:
        """int32 [B]: fork index of each row (0 unless n > 1)."""
    @property
    def input_ids(self) -> npt.NDArray[np.int32]:
        """int32 [T]: tokens to compute."""
    @property
    def qo_indptr(self) -> npt.NDArray[np.int32]:
        """int32 [B+1]: row offsets into the T tokens; qo_indptr[-1] == T."""
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]:
        """int32 [B]: KV length of each row after this step."""
    @property
    def kv_indptr(self) -> npt.NDArray[np.int32]:
        """int32 [B+1]: row offsets into kv_indices (FlashInfer's paged_kv_indptr)."""
    @property
    def kv_last_page_len(self) -> npt.NDArray[np.int32]:
        """int32 [B]: tokens in each row's last block, 1..block_size."""
    @property
    def inflight_token_indices(self) -> npt.NDArray[np.int32]:
        """int32 [P]: with async scheduling, places in input_ids (laid out as -1) whose token is
        the previous step's sample inflight_sample_indices[i], still in flight."""
    @property
    def inflight_sample_indices(self) -> npt.NDArray[np.int32]:
        """int32 [P]: index among the previous step's samples filling inflight_token_indices[i]."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """int64 [S]: token row whose logits each sample uses (a row repeats for n > 1)."""
    @property
    def sample_req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [S]: request of each sample."""
    @property
    def sample_seq_indices(self) -> npt.NDArray[np.int32]:
        """int32 [S]: fork index of each sample."""
    @property
    def sample_rows(self) -> npt.NDArray[np.int32]:
        """int32 [S]: batch row of each sample's scheduled sequence (its entry of ``rows``)."""
    @property
    def sample_positions(self) -> npt.NDArray[np.int32]:
        """int32 [S]: position of the token each sample draws (its row's ``seq_lens``)."""
    @property
    def blocks_to_swap_out(self) -> npt.NDArray[np.int32]:
        """int32 [k, 2]: (device block, host block) pairs to copy device -> host first."""
    @property
    def blocks_to_swap_in(self) -> npt.NDArray[np.int32]:
        """int32 [m, 2]: (host block, device block) pairs to copy host -> device second."""
    @property
    def blocks_to_copy(self) -> npt.NDArray[np.int32]:
        """int32 [c, 2]: (src, dst) device blocks to copy third (copy-on-write)."""
    @property
    def preempted_req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [p]: requests preempted in this step."""
    @property
    def finished_req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [f]: requests finished or aborted since the previous schedule()."""
    @property
    def rows(self) -> npt.NDArray[np.int32]:
        """int32 [B]: each scheduled sequence's row of the persistent batch (kept while it runs)."""
    @property
    def rows_removed(self) -> npt.NDArray[np.int32]:
        """int32 [R]: rows freed since the previous step; apply before rows_added."""
    @property
    def rows_added(self) -> npt.NDArray[np.int32]:
        """int32 [A]: rows taken in this step (their block tables start empty)."""
    @property
    def added_req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [A]: the request that took each added row."""
    @property
    def added_seq_indices(self) -> npt.NDArray[np.int32]:
        """int32 [A]: its fork index."""
    @property
    def table_rows(self) -> npt.NDArray[np.int32]:
        """int32 [N]: with table_cols and table_blocks, the block-table entries the runner does
        not hold yet: ``table[table_rows, table_cols] = table_blocks``."""
    @property
    def table_cols(self) -> npt.NDArray[np.int32]:
        """int32 [N]."""
    @property
    def table_blocks(self) -> npt.NDArray[np.int32]:
        """int32 [N]."""
    @property
    def grammar_sample_indices(self) -> npt.NDArray[np.int32]:
        """int32 [G]: samples constrained by a grammar (indices into the S samples)."""
    @property
    def grammar_masks(self) -> npt.NDArray[np.uint32]:
        """uint32 [G * W], W = grammar_mask_words: each such sample's allowed tokens, bit
        ``t % 32`` of word ``t / 32`` set when token t may be sampled."""
    @property
    def grammar_mask_words(self) -> int:
        """W: u32 words per grammar mask (0 when the step has none)."""
    @property
    def step(self) -> int: ...
    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def token_budget_left(self) -> int: ...
    @property
    def num_free_device_blocks(self) -> int: ...
    @property
    def num_free_host_blocks(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def schedule_ns(self) -> int:
        """Wall time of the schedule() call that planned this step (inside Rust)."""
    @property
    def num_scheduled_seqs(self) -> int:
        """B, without making ``rows``."""
    @property
    def num_blocks_swapped_out(self) -> int:
        """k, without making ``blocks_to_swap_out``."""
    @property
    def num_blocks_swapped_in(self) -> int:
        """m, without making ``blocks_to_swap_in``."""
    @property
    def num_blocks_copied(self) -> int:
        """c, without making ``blocks_to_copy``."""

_FinishReason = Literal["stop", "length", "abort"]

@final
class StepOutputs:
    """What update() did, one entry per sample of the step, in logits_indices order."""

    @property
    def req_ids(self) -> npt.NDArray[np.int64]:
        """int64 [S]."""
    @property
    def seq_indices(self) -> npt.NDArray[np.int32]:
        """int32 [S]."""
    @property
    def new_token_ids(self) -> npt.NDArray[np.int32]:
        """int32 [S]: the token appended."""
    @property
    def finish_reasons(self) -> list[_FinishReason | None]:
        """[S]: None, or why this token finished the sequence."""
    @property
    def num_output_tokens(self) -> npt.NDArray[np.uint32]:
        """uint32 [S]: the row's sequence's output tokens, this one included; 0 marks a dropped
        sample (its sequence was aborted or finished after the step was planned)."""
    @property
    def deltas(self) -> list[str]:
        """[S]: the text each row releases now ("" without detokenization). Stop strings are cut
        and text that may still begin one is held back; a finished row releases the rest."""
    @property
    def finished_rows(self) -> npt.NDArray[np.uint32]:
        """uint32 [F]: the rows whose sequence finished (aborted ones not counted)."""
    @property
    def output_token_offsets(self) -> npt.NDArray[np.uint32]:
        """uint32 [F+1]: each finished sequence's span of output_token_ids."""
    @property
    def output_token_ids(self) -> npt.NDArray[np.int32]:
        """int32: the finished sequences' whole outputs, back to back."""
    @property
    def output_texts(self) -> list[str]:
        """[F]: each finished sequence's whole text."""
    @property
    def stop_string_indices(self) -> npt.NDArray[np.int32]:
        """int32 [F]: the stop string (its index in the request's ``stop``) that finished each
        finished sequence, or -1 (an EOS or stop id, a length, a complete grammar)."""
    @property
    def num_generated(self) -> int:
        """Rows whose token was applied: S less the dropped ones (``num_output_tokens`` 0)."""
    @property
    def num_first_tokens(self) -> int:
        """Rows whose token is their sequence's first output token (``num_output_tokens`` 1)."""
    def __len__(self) -> int: ...

@final
class RequestParams:
    """A request's stop conditions, EOS ids, n, priority and text options: the one record it
    crosses into the core with, validated on construction (InvalidRequestError naming the field).
    ``eos_token_ids`` (the model's EOS ids) finish it with "stop" unless ``ignore_eos``;
    ``stop_token_ids`` always do. ``detokenize`` (needs Scheduler.set_tokenizer) makes update()
    return its text (special tokens add none); ``stop`` strings finish it with "stop", the text
    ending before the first one to appear (after it with ``include_stop_str_in_output``), looked
    for only once more than ``min_tokens`` tokens are out (with detokenize; the sampler holds
    back stop ids until then). ``skip_reading_prefix_cache``: every prompt position
    is computed, never taken from the prefix cache. ``grammar_kind`` ("json", "json_object",
    "regex", "choice" or "lark") with ``grammar`` (the JSON schema text, the regex, a JSON list of
    strings, the Lark grammar): structured output, compiled by add_request (InvalidRequestError
    when it does not compile); each sample then gets a mask (SchedulerOutput.grammar_masks)."""

    def __new__(
        cls,
        max_tokens: int,
        *,
        priority: int = 0,
        eos_token_ids: list[int] | tuple[int, ...] = ...,
        stop_token_ids: list[int] | tuple[int, ...] = ...,
        ignore_eos: bool = False,
        n: int = 1,
        detokenize: bool = False,
        stop: list[str] = ...,
        skip_reading_prefix_cache: bool = False,
        grammar_kind: str | None = None,
        grammar: str = ...,
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> RequestParams: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...
    @property
    def grammar_kind(self) -> str | None: ...
    @property
    def grammar(self) -> str: ...
    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Admission never takes prefix-cache hits for it (prompt logprobs need every position)."""
    @property
    def max_tokens(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def n(self) -> int: ...
    @property
    def detokenize(self) -> bool: ...
    @property
    def stop(self) -> list[str]: ...

@final
class Scheduler:
    """The per-step scheduler and KV block manager."""

    def __new__(cls, config: SchedulerConfig) -> Scheduler: ...
    @property
    def config(self) -> SchedulerConfig: ...
    def set_tokenizer(self, tokenizer_json: str) -> None:
        """Detokenizes requests with ``detokenize=True`` (``tokenizer_json``: a tokenizer.json's
        content, e.g. a fast tokenizer's ``backend_tokenizer.to_str()``)."""
    def add_request(
        self,
        req_id: int,
        prompt_token_ids: list[int] | tuple[int, ...] | npt.NDArray[np.integer],
        params: RequestParams,
    ) -> None:
        """Queues a request; raises InvalidRequestError for a duplicate live id, an empty prompt,
        n above max_num_seqs, text without set_tokenizer, or a request that could never fit
        max_model_len or the device pool."""
    def schedule(self) -> SchedulerOutput: ...
    def update(self, sampled_token_ids: npt.ArrayLike) -> StepOutputs:
        """One int32 token per entry of the oldest pending step's logits_indices, in order."""
    def abort_request(self, req_id: int) -> bool: ...
    def finish_request(self, req_id: int, reason: str, seq_index: int | None = None) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    def drain_events(self) -> list[dict[str, Any]]: ...
    def check_invariants(self) -> None: ...
    def output_token_ids(self, req_id: int, seq_index: int = 0) -> npt.NDArray[np.int32] | None:
        """The output token ids so far of a live sequence, or None."""
    def output_text(self, req_id: int, seq_index: int = 0) -> str | None:
        """The text released so far by a live sequence (its deltas'), or None."""
    def block_table(self, req_id: int, seq_index: int = 0) -> list[int] | None: ...

@final
class TokenBytes:
    """Token id -> the bytes that token adds to the text before UTF-8 decoding (OpenAI's logprob
    ``bytes``): a byte-level token's raw bytes, a ``<0xNN>`` token's one byte, so a character
    split over tokens joins up from theirs; the decoded text for a tokenizer without a per-token
    table and for a special token; empty for an id outside the vocabulary. Immutable: any thread
    may call it."""

    def __new__(cls, tokenizer_json: str) -> TokenBytes: ...
    def __call__(self, token_id: int) -> bytes: ...

def sample_random_cpu(
    logits: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    temperature: npt.NDArray[np.float32],
    top_k: npt.NDArray[np.int64],
    top_p: npt.NDArray[np.float32],
    min_p: npt.NDArray[np.float32],
    seeds: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]:
    """One random token per entry of ``rows``: a sample of ``logits[rows[i]]`` (float32 ``[N, V]``,
    C-contiguous) under the i-th temperature (> 0), top-k (<= 0: off), top-p (>= 1: off), min-p
    (<= 0: off), seed and position. The algorithm and noise of ``ferryman.worker.sampler.
    sample_random`` (the same token but for ties within rounding), run in the core with the GIL
    released. Raises ``InvalidRequestError`` for mismatched lengths, a row out of range, a
    non-contiguous ``logits`` or a temperature that is not > 0."""

def sample_cpu(
    logits: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int32],
    seq_indices: npt.NDArray[np.int32],
    positions: npt.NDArray[np.int32],
    temperature: npt.NDArray[np.float32],
    top_k: npt.NDArray[np.int64],
    top_p: npt.NDArray[np.float32],
    min_p: npt.NDArray[np.float32],
    seed: npt.NDArray[np.int64],
    fork_seed_stride: int,
) -> tuple[npt.NDArray[np.int32], int]:
    """One int32 token per sample of a step, sample i from row i of ``logits`` (float32
    ``[N, V]``, C-contiguous): the argmax (numpy's: the first index of the largest logit), or,
    where its batch row ``rows[i]`` has ``temperature > 0``, a random token as
    ``sample_random_cpu`` draws it under that row's entries of the by-row columns (``[R]`` each),
    the seed ``seed + fork_seed_stride * seq_indices[i]`` and the position ``positions[i]``; -1
    where the row's largest logit is not finite (a NaN or +inf, or all -inf). Returns the ids and
    the number of -1 rows; the GIL is released. Raises ``InvalidRequestError`` for mismatched
    lengths, a row out of range, a non-contiguous ``logits`` or one without columns."""
