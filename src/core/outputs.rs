//! What crosses to Python each step: `SchedulerOutput` from `schedule()`, `StepOutputs` from
//! `update()`, and the telemetry records (`PreemptionEvent`, `StepStats`, `Counters`).
//!
//! Every field is a flat `Vec` of the dtype the binding hands to numpy without copying; the
//! binding documents shapes in `_core.pyi`. B = scheduled requests, T = scheduled tokens,
//! S = samples (a request finishing its prompt with `n > 1` samples its last row n times).

use crate::config::PreemptionMode;
use crate::request::FinishReason;

/// `n` default values in a reused allocation: `vec![0; n]` asks the allocator for zeroed memory,
/// which it serves from fresh pages the kernel must fault in and clear (measured: a fifth of
/// `schedule()`'s time); the output arrays are allocated and freed every step.
pub(crate) fn zeroed<T: Default + Clone>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, T::default());
    v
}

/// The plan of one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    /// [B] the caller's id of each row.
    pub req_ids: Vec<i64>,
    /// [B] each scheduled sequence's row of the persistent batch.
    pub rows: Vec<i32>,
    /// [R] rows freed since the previous step: apply before `rows_added`.
    pub rows_removed: Vec<i32>,
    /// [A] rows taken in this step, and the sequence that took each.
    pub rows_added: Vec<i32>,
    pub added_req_ids: Vec<i64>,
    pub added_seq_indices: Vec<i32>,
    /// [N] block-table entries the runner does not hold yet:
    /// `table[table_rows[i], table_cols[i]] = table_blocks[i]` (a taken row gets its whole table).
    pub table_rows: Vec<i32>,
    pub table_cols: Vec<i32>,
    pub table_blocks: Vec<i32>,
    /// [B] fork index of each row (0 unless `n > 1`).
    pub seq_indices: Vec<i32>,
    /// [T] tokens to compute.
    pub input_ids: Vec<i32>,
    /// [B+1] row offsets into the T tokens.
    pub qo_indptr: Vec<i32>,
    /// [B] KV length of each row after this step.
    pub seq_lens: Vec<i32>,
    /// [B+1] each row's first page among the step's pages (FlashInfer's `kv_indptr`; the runner
    /// lays the pages out from its block table).
    pub kv_indptr: Vec<i32>,
    /// [B] tokens in each row's last block (1..=block_size).
    pub kv_last_page_len: Vec<i32>,
    /// [P] (async scheduling) places in `input_ids` whose token is still in flight (laid out
    /// as -1), and each one's index among the previous step's samples, whose sampled id fills it.
    pub inflight_token_indices: Vec<i32>,
    pub inflight_sample_indices: Vec<i32>,
    /// [S] token row whose logits are sampled.
    pub logits_indices: Vec<i64>,
    /// [S] the caller's id of each sample.
    pub sample_req_ids: Vec<i64>,
    /// [S] fork index of each sample.
    pub sample_seq_indices: Vec<i32>,
    /// [S] batch row of each sample's scheduled sequence (its entry of `rows`), and the position
    /// of the token it draws (that row's `seq_lens`): what the sampler reads by sample, so the
    /// runner need not find each sample's row among the B.
    pub sample_rows: Vec<i32>,
    pub sample_positions: Vec<i32>,
    /// [k, 2] flattened (device, host) pairs: copy before the forward.
    pub blocks_to_swap_out: Vec<[i32; 2]>,
    /// [m, 2] flattened (host, device) pairs: copy after the swap-out, before the forward.
    pub blocks_to_swap_in: Vec<[i32; 2]>,
    /// [c, 2] flattened (src, dst) device pairs: copy-on-write, after the swaps.
    pub blocks_to_copy: Vec<[i32; 2]>,
    /// [G] samples constrained by a grammar (indices into the S samples), and [G * W] their
    /// masks: `W = grammar_mask_words` u32 words each, bit `t % 32` of word `t / 32` set when
    /// token `t` is allowed.
    pub grammar_sample_indices: Vec<i32>,
    pub grammar_masks: Vec<u32>,
    pub grammar_mask_words: usize,
    /// Requests preempted in this step (their id, once per preemption).
    pub preempted_req_ids: Vec<i64>,
    /// Requests that finished or were aborted since the previous `schedule()`.
    pub finished_req_ids: Vec<i64>,
    /// Telemetry of this step.
    pub stats: StepStats,
}

impl SchedulerOutput {
    /// Tokens in this step.
    pub fn num_scheduled_tokens(&self) -> usize {
        self.input_ids.len()
    }
    /// Requests waiting after this step was planned.
    pub fn num_waiting(&self) -> usize {
        self.stats.num_waiting
    }
    /// Requests running after this step was planned.
    pub fn num_running(&self) -> usize {
        self.stats.num_running
    }
}

/// Per-step numbers for traces and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Step counter, from 0.
    pub step: u64,
    /// Tokens in this step (T).
    pub num_scheduled_tokens: usize,
    /// Of them, tokens of rows that are still prefilling (more than one token or not sampled).
    pub num_prefill_tokens: usize,
    /// `max_num_batched_tokens - num_scheduled_tokens`.
    pub token_budget_left: usize,
    /// Device blocks free after planning.
    pub num_free_device_blocks: usize,
    /// Host blocks free after planning.
    pub num_free_host_blocks: usize,
    /// Queue sizes after planning.
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    /// Preemptions in this step.
    pub num_preemptions: usize,
    /// Wall time of the `schedule()` call that planned this step, in nanoseconds.
    pub schedule_ns: u64,
}

/// Cumulative counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub num_steps: u64,
    pub num_requests_added: u64,
    pub num_requests_finished: u64,
    pub num_scheduled_tokens: u64,
    pub num_generated_tokens: u64,
    pub num_preemptions_recompute: u64,
    pub num_preemptions_swap: u64,
    /// Swaps wanted but refused for lack of host blocks (done as recompute instead).
    pub num_swap_fallbacks: u64,
    pub num_blocks_swapped_out: u64,
    pub num_blocks_swapped_in: u64,
    pub num_blocks_copied: u64,
    /// Tokens recomputed because of recompute preemptions (estimated at preemption).
    pub num_tokens_recomputed: u64,
    /// Prompt tokens looked up in the prefix cache at admission, and tokens found (a resumed
    /// victim's and a request's that reads no hits not counted).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Preemption events emitted (drained or not).
    pub num_events: u64,
    /// Forks ended by `abort_request` or `finish_request(.., Abort)`.
    pub num_forks_aborted: u64,
    /// Leading blocks swaps left on the device (cached, shared) instead of copying them.
    pub num_blocks_kept_on_swap: u64,
    /// Swapped requests whose device-kept prefix was evicted meanwhile: recomputed instead.
    pub num_swap_prefix_lost: u64,
    /// Host blocks freed without being swapped back in: their request ended while swapped (its
    /// last token was in flight when it was preempted, or it was aborted) or lost its kept
    /// prefix. Blocks swapped out = swapped in + dropped + those swapped requests hold now.
    pub num_blocks_swap_dropped: u64,
    /// Wall time spent inside `schedule()` and `update()`, in nanoseconds.
    pub scheduler_ns: u64,
    /// Grammar masks computed (one per constrained sample row, forks of one prompt share one),
    /// and the time spent computing them (inside `schedule()`), in nanoseconds.
    pub num_grammar_masks: u64,
    pub grammar_mask_ns: u64,
    /// Grammar matchers that failed (an error state, or a token they refused): the sequence
    /// ended with "stop" at that point.
    pub num_grammar_errors: u64,
}

/// The result of `update()`: one row per sample of the step (S), and the whole output of the
/// F sequences that finished in it, so the caller needs no per-token state of its own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutputs {
    /// [S] the caller's id.
    pub req_ids: Vec<i64>,
    /// [S] fork index.
    pub seq_indices: Vec<i32>,
    /// [S] the token appended.
    pub new_token_ids: Vec<i32>,
    /// [S] set when this token finished the sequence.
    pub finish_reasons: Vec<Option<FinishReason>>,
    /// [S] output tokens of the row's sequence, this one included.
    pub num_output_tokens: Vec<u32>,
    /// [S+1] byte offsets into `text`: the text each row may release now (for requests with
    /// text; stop strings cut, text that may begin a stop string held back until it cannot).
    pub text_offsets: Vec<u32>,
    /// The rows' new text, UTF-8, back to back.
    pub text: Vec<u8>,
    /// [F] rows whose sequence finished (not counting aborted ones).
    pub finished_rows: Vec<u32>,
    /// [F+1] offsets into `output_token_ids`: each finished sequence's output tokens.
    pub output_token_offsets: Vec<u32>,
    pub output_token_ids: Vec<i32>,
    /// [F+1] byte offsets into `output_text`: each finished sequence's whole text.
    pub output_text_offsets: Vec<u32>,
    pub output_text: Vec<u8>,
    /// [F] the stop string (its index in the request's `stop`) that finished each finished
    /// sequence, or -1 (an EOS or stop id, a length, a complete grammar).
    pub stop_string_indices: Vec<i32>,
    /// Rows whose token was applied (S less the dropped ones, whose `num_output_tokens` is 0).
    pub num_generated: usize,
}

impl StepOutputs {
    /// Outputs of `n` rows, each to be set once with `set_row`, in order.
    pub fn with_rows(n: usize) -> Self {
        let mut o = Self {
            req_ids: zeroed(n),
            seq_indices: zeroed(n),
            new_token_ids: zeroed(n),
            finish_reasons: zeroed(n),
            num_output_tokens: zeroed(n),
            text_offsets: zeroed(n + 1),
            ..Self::default()
        };
        o.output_token_offsets.push(0);
        o.output_text_offsets.push(0);
        o
    }

    /// Sets row `i`, whose new text (if any) is already at the end of `text`; rows are set in
    /// order (`text_offsets[i + 1]` is the end of the text so far).
    #[inline(always)]
    pub fn set_row(
        &mut self,
        i: usize,
        req_id: u64,
        seq_index: u32,
        token: i32,
        finish: Option<FinishReason>,
        num_output: usize,
    ) {
        self.req_ids[i] = req_id as i64;
        self.seq_indices[i] = seq_index as i32;
        self.new_token_ids[i] = token;
        self.finish_reasons[i] = finish;
        self.num_output_tokens[i] = num_output as u32;
        self.text_offsets[i + 1] = self.text.len() as u32;
    }
}

/// Why a preemption used the mode it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionReason {
    /// The configured fixed mode ("recompute", or "swap" with room on the host).
    Config,
    /// Mode "auto" chose the cheaper restore.
    Cost,
    /// Swap wanted but the host pool is short: fell back to recompute.
    HostFull,
    /// An `n > 1` request whose prompt's samples were in flight, not yet forked: recompute only.
    Fork,
}

impl PreemptionReason {
    /// "config" | "cost" | "host_full" | "fork", as events report it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Cost => "cost",
            Self::HostFull => "host_full",
            Self::Fork => "fork",
        }
    }
}

/// One preemption, as it was decided.
#[derive(Debug, Clone, PartialEq)]
pub struct PreemptionEvent {
    /// Step in which it happened.
    pub step: u64,
    /// The victim.
    pub req_id: u64,
    pub seq_index: u32,
    /// What happens to its KV.
    pub mode: PreemptionMode,
    /// Why this mode.
    pub reason: PreemptionReason,
    /// The request whose growth needed the blocks (may be the victim itself).
    pub for_req_id: u64,
    /// Device blocks this preemption returned to the free list.
    pub num_blocks_freed: usize,
    /// Bytes the swap-out moves (0 for recompute).
    pub bytes_to_move: u64,
    /// Tokens the victim must prefill again (0 for swap), net of surviving prefix blocks.
    pub num_tokens_to_recompute: usize,
    /// Estimated restore costs in seconds under the cost model.
    pub swap_cost_s: f64,
    pub recompute_cost_s: f64,
    /// Token budget left in the step when it happened.
    pub token_budget_left: usize,
    /// Free blocks after it.
    pub num_free_device_blocks: usize,
    pub num_free_host_blocks: usize,
    /// Times this request has been preempted, this one included.
    pub num_preemptions: u32,
}

#[cfg(test)]
mod tests {
    use super::PreemptionReason;

    #[test]
    fn preemption_reasons_cross_as_the_contract_strings() {
        let all =
            [PreemptionReason::Config, PreemptionReason::Cost, PreemptionReason::HostFull, PreemptionReason::Fork];
        assert_eq!(all.map(PreemptionReason::as_str), ["config", "cost", "host_full", "fork"]);
    }
}
