//! `CoreError`: every way a caller can misuse the core.
//!
//! Expected outcomes ("does not fit", "was preempted") are values, never errors; a broken
//! invariant is a bug (`debug_assert!`, or `CoreError::InvariantViolated` from
//! `check_invariants()`). The binding maps each variant to a Python exception in one place.

use thiserror::Error;

/// A caller's mistake, or (`InvariantViolated`) a bug found by `check_invariants()`.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CoreError {
    /// A configuration value is out of range or inconsistent with another.
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// `add_request` with a `req_id` that is still live.
    #[error("request {0} already exists")]
    DuplicateRequest(u64),
    /// A call named a request the scheduler does not hold (never added, or already finished).
    #[error("unknown request {0} (never added, or already finished)")]
    UnknownRequest(u64),
    /// A request parameter is invalid (empty prompt, `max_tokens == 0`, bad token id, ...).
    #[error("invalid request {req_id}: {msg}")]
    InvalidRequest { req_id: u64, msg: String },
    /// Prompt plus `max_tokens` is longer than `max_model_len`.
    #[error(
        "request {req_id}: prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} \
         exceeds max_model_len={max_model_len}"
    )]
    RequestTooLong { req_id: u64, num_prompt_tokens: usize, max_tokens: usize, max_model_len: usize },
    /// The request needs more KV blocks than the whole device pool holds: it could never run.
    #[error(
        "request {req_id}: {num_tokens} tokens need {num_blocks} KV blocks but the device pool has \
         only {num_device_blocks}; it could never fit"
    )]
    RequestTooLarge { req_id: u64, num_tokens: usize, num_blocks: usize, num_device_blocks: usize },
    /// `update()` got a different number of sampled tokens than `schedule()` asked for.
    #[error("update() expected {expected} sampled token ids (one per logits_indices entry), got {got}")]
    BatchSizeMismatch { expected: usize, got: usize },
    /// `schedule()`/`update()` called out of order.
    #[error("{0}")]
    OutOfOrder(&'static str),
    /// `finish_request` with a reason other than "stop", "length" or "abort".
    #[error("invalid finish reason {0:?}: expected \"stop\", \"length\" or \"abort\"")]
    InvalidFinishReason(String),
    /// A tokenizer could not be loaded, or failed to decode (the message says which and why).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// `check_invariants()` found the state broken: a bug in the core.
    #[error("invariant violated: {0}")]
    InvariantViolated(String),
}

/// Result alias used by the core's fallible calls.
pub type CoreResult<T> = Result<T, CoreError>;
