//! The two halves of a step that touch every scheduled request: turning a `StepPlan` into the
//! flat arrays of `SchedulerOutput` (`build_output`), and applying the sampled tokens
//! (`update`): advancing `num_computed_tokens`, registering newly full blocks in the prefix
//! cache, forking `n > 1` requests, appending tokens, detokenizing them and checking stop
//! conditions (token ids, lengths, stop strings).
//!
//! `build_output` advances each scheduled request's `num_computed_tokens` at once (the KV is
//! written by the time any later step reads it: steps run in order), and counts its samples in
//! flight. Between the two halves, the `PendingStep` (owned here) remembers the scheduled
//! requests, the end of what each computes, and the sample rows, by `ReqIdx`; a request finished
//! meanwhile keeps its index until the step is updated. `update()` applies the oldest pending
//! step; blocks enter the prefix cache only then, once their KV is written and their tokens known.
//!
//! A decode input whose token is still in flight (async scheduling) is laid out as -1, with its
//! place in `inflight_token_indices` and its sample's index in the previous step in
//! `inflight_sample_indices`: the runner fills it from that step's sampled ids on the device.
//!
//! A sample of a sequence with a grammar gets its mask of allowed tokens here, from the matcher's
//! state after every token applied so far: the caller applies a step before planning the next
//! while such a sequence runs (a sample in flight would make the mask stale; checked in debug
//! builds). `update()` advances the matcher with the sampled token; a complete grammar finishes
//! the sequence with "stop" (its last token's text included), and so does a matcher error
//! (counted in `num_grammar_errors`).
//!
//! A sample of a sequence no longer live when it is applied (aborted, or finished by the step
//! before: a stop found one step late) is dropped: its row has `num_output_tokens == 0` and no
//! finish reason.
//!
//! Hot path: one pass over the scheduled requests each way, O(1) per row plus the tokens of
//! prompt chunks and the block-table entries the runner does not hold yet (a taken row's whole
//! table, else a block now and then): the runner keeps each row's table (`batch.rs`) and derives
//! positions, slots and page lists from it.

use super::{Scheduler, StepPlan, NO_COPY};
use crate::arena::ReqIdx;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::blocks_for;
use crate::outputs::{SchedulerOutput, StepOutputs, StepStats};
use crate::request::{FinishReason, Request, RequestStatus};
use crate::text::Push;

/// A sample row between `schedule()` and `update()`.
#[derive(Debug, Clone, Copy)]
struct Sample {
    req_id: u64,
    req_idx: ReqIdx,
    seq_index: u32,
    /// Its token row in the step (`logits_indices`).
    logits_index: u32,
    /// Its sequence's batch row, and the position of the token it draws.
    row: u32,
    position: u32,
}

/// One scheduled row's entries of the per-row output arrays, gathered in `build_output`'s pass
/// over the requests.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RowOut {
    req_id: i64,
    row: i32,
    seq_index: i32,
    seq_len: i32,
    /// Ends of the row's tokens and pages in the step (`qo_indptr[i + 1]`, `kv_indptr[i + 1]`).
    qo_end: i32,
    kv_end: i32,
    last_page_len: i32,
}

/// A step awaiting `update()`; once updated its buffers serve the next step's.
#[derive(Debug, Clone, Default)]
pub(super) struct PendingStep {
    /// Its number (`StepStats::step`).
    step: u64,
    /// Scheduled requests whose step may complete a block to cache, and the end of the
    /// positions each computes (every scheduled request when its step ends a block past those
    /// it has cached; prefix caching only).
    computed: Vec<(ReqIdx, usize)>,
    samples: Vec<Sample>,
}

impl PendingStep {
    /// Its step number.
    pub(super) fn step(&self) -> u64 {
        self.step
    }
}

impl Scheduler {
    /// Lays out the plan as arrays (rows, their counts and the batch's changes) and remembers it
    /// for `update()`.
    pub(super) fn build_output(&mut self, plan: StepPlan) -> SchedulerOutput {
        let bs = self.cfg.block_size;
        let shift = bs.trailing_zeros(); // a position's block
        let t = self.cfg.max_num_batched_tokens - plan.budget;
        let mut o = SchedulerOutput { input_ids: Vec::with_capacity(t), ..SchedulerOutput::default() };
        // one pass over the requests fills a row record and the samples; the columns are then
        // copied out of them in loops of their own (no bounds or capacity check per element)
        let mut rows = std::mem::take(&mut self.row_scratch);
        rows.clear();
        rows.reserve(plan.scheduled.len());
        let PendingStep { mut computed, mut samples, .. } = self.spare_pending.take().unwrap_or_default();
        computed.clear();
        samples.clear();
        let mut num_pages = 0;
        let mut num_prefill_tokens = 0;
        for s in &plan.scheduled {
            let r = self.reqs.get_mut(s.req_idx);
            let (start, end) = (r.num_computed_tokens, r.num_computed_tokens + s.num_new);
            let num_blocks = blocks_for(end, bs);
            let row = match r.row {
                Some(row) => row,
                None => {
                    let row = self.batch.take(s.req_idx);
                    r.row = Some(row);
                    o.rows_added.push(row as i32);
                    o.added_req_ids.push(r.req_id as i64);
                    o.added_seq_indices.push(r.seq_index as i32);
                    row
                }
            };
            // a copy-on-write replaced the entry of the block this step writes first
            let sent = if s.cow != NO_COPY { self.batch.sent(row).min(start >> shift) } else { self.batch.sent(row) };
            if sent < num_blocks {
                o.table_rows.resize(o.table_rows.len() + num_blocks - sent, row as i32);
                o.table_cols.extend(sent as i32..num_blocks as i32);
                o.table_blocks.extend_from_slice(&self.kv.table(s.req_idx)[sent..num_blocks]);
                self.batch.set_sent(row, num_blocks);
            }
            if s.num_new == 1 {
                if s.input < 0 {
                    // the token sampled for this position is still in flight
                    o.inflight_token_indices.push(o.input_ids.len() as i32);
                    o.inflight_sample_indices.push(r.last_sample as i32);
                }
                o.input_ids.push(s.input);
            } else {
                o.input_ids.extend_from_slice(&r.token_ids[start..end]);
            }
            num_pages += num_blocks;
            rows.push(RowOut {
                req_id: r.req_id as i64,
                row: row as i32,
                seq_index: r.seq_index as i32,
                seq_len: end as i32,
                qo_end: o.input_ids.len() as i32,
                kv_end: num_pages as i32,
                last_page_len: (end - (num_blocks - 1) * bs) as i32,
            });
            if let Some((src, dst)) = s.copy() {
                o.blocks_to_copy.push([src as i32, dst as i32]);
            }
            // only a step that completes a block beyond those cached can cache one
            if self.cfg.enable_prefix_caching && end >> shift > r.num_cached_blocks {
                computed.push((s.req_idx, end));
            }
            if end == r.num_tokens_scheduled() {
                let n = r.num_pending_forks;
                let first = samples.len() as u32;
                if let Some(g) = r.grammar.as_deref_mut() {
                    debug_assert_eq!(r.num_inflight, 0, "a grammar's mask needs every earlier sample applied");
                    let started = std::time::Instant::now();
                    let words = self.grammars.as_ref().map_or(0, |c| c.mask_words());
                    let stops = r.stop.stop_ids.iter().copied();
                    let at = o.grammar_masks.len();
                    o.grammar_masks.resize(at + words, 0);
                    if g.fill_mask(&mut o.grammar_masks[at..], stops).is_err() {
                        self.counters.num_grammar_errors += 1;
                    }
                    for k in 0..n {
                        if k > 0 {
                            o.grammar_masks.extend_from_within(at..at + words); // forks share the mask
                        }
                        o.grammar_sample_indices.push((first + k) as i32);
                    }
                    o.grammar_mask_words = words;
                    self.counters.num_grammar_masks += 1;
                    self.counters.grammar_mask_ns += started.elapsed().as_nanos() as u64;
                }
                let logits_index = o.input_ids.len() as u32 - 1;
                let (req_idx, req_id, position) = (s.req_idx, r.req_id, end as u32);
                if n == 1 {
                    let seq_index = r.seq_index;
                    samples.push(Sample { req_id, req_idx, seq_index, logits_index, row, position });
                } else {
                    for seq_index in 0..n {
                        samples.push(Sample { req_id, req_idx, seq_index, logits_index, row, position });
                    }
                }
                r.num_inflight += 1;
                r.last_sample = first;
                if s.num_new > 1 {
                    num_prefill_tokens += s.num_new;
                }
            } else {
                num_prefill_tokens += s.num_new;
            }
            r.num_computed_tokens = end;
        }
        o.req_ids = rows.iter().map(|x| x.req_id).collect();
        o.rows = rows.iter().map(|x| x.row).collect();
        o.seq_indices = rows.iter().map(|x| x.seq_index).collect();
        o.qo_indptr = std::iter::once(0).chain(rows.iter().map(|x| x.qo_end)).collect();
        o.seq_lens = rows.iter().map(|x| x.seq_len).collect();
        o.kv_indptr = std::iter::once(0).chain(rows.iter().map(|x| x.kv_end)).collect();
        o.kv_last_page_len = rows.iter().map(|x| x.last_page_len).collect();
        o.logits_indices = samples.iter().map(|x| i64::from(x.logits_index)).collect();
        o.sample_req_ids = samples.iter().map(|x| x.req_id as i64).collect();
        o.sample_seq_indices = samples.iter().map(|x| x.seq_index as i32).collect();
        o.sample_rows = samples.iter().map(|x| x.row as i32).collect();
        o.sample_positions = samples.iter().map(|x| x.position as i32).collect();
        self.row_scratch = rows;
        o.rows_removed = self.batch.take_removed();
        o.blocks_to_swap_out = plan.swap_out;
        o.blocks_to_swap_in = plan.swap_in;
        o.preempted_req_ids = plan.preempted;
        o.finished_req_ids = std::mem::take(&mut self.finished_req_ids);
        let mut stats = StepStats {
            step: self.step,
            num_scheduled_tokens: o.input_ids.len(),
            num_prefill_tokens,
            token_budget_left: plan.budget,
            num_preemptions: o.preempted_req_ids.len(),
            ..StepStats::default()
        };
        self.gauges(&mut stats);
        o.stats = stats;
        self.last_step = stats;
        self.counters.num_steps += 1;
        self.counters.num_scheduled_tokens += o.input_ids.len() as u64;
        self.counters.num_blocks_copied += o.blocks_to_copy.len() as u64;
        self.pending.push_back(PendingStep { step: self.step, computed, samples });
        o
    }

    /// Applies one sampled token per sample row of the oldest pending step, in its order.
    pub fn update(&mut self, sampled_token_ids: &[i32]) -> CoreResult<StepOutputs> {
        let started = std::time::Instant::now();
        let pending =
            self.pending.front().ok_or(CoreError::OutOfOrder("update() called without a schedule() before it"))?;
        if sampled_token_ids.len() != pending.samples.len() {
            let (expected, got) = (pending.samples.len(), sampled_token_ids.len());
            return Err(CoreError::BatchSizeMismatch { expected, got });
        }
        if let Some(i) = sampled_token_ids.iter().position(|&t| t < 0) {
            return Err(CoreError::InvalidRequest {
                req_id: pending.samples[i].req_id,
                msg: format!("sampled token id {} < 0", sampled_token_ids[i]),
            });
        }
        let pending = self.pending.pop_front().expect("checked above");
        for &(idx, end) in &pending.computed {
            self.cache_computed(idx, end);
        }
        let n = pending.samples.len();
        let mut out = StepOutputs::with_rows(n);
        let max_model_len = self.cfg.max_model_len;
        let mut num_dropped = 0;
        let mut i = 0;
        while i < n {
            let idx = pending.samples[i].req_idx;
            let Some(r) = self.reqs.try_get_mut(idx).filter(|r| r.num_inflight > 0) else {
                // not live, or preempted and recomputing its samples: drop (every fork's)
                while i < n && pending.samples[i].req_idx == idx {
                    let Sample { req_id, seq_index, .. } = pending.samples[i];
                    out.set_row(i, req_id, seq_index, sampled_token_ids[i], None, 0);
                    num_dropped += 1;
                    i += 1;
                }
                continue;
            };
            r.num_inflight -= 1;
            let token = sampled_token_ids[i] as u32;
            if r.num_pending_forks == 1 {
                // most rows: a token without text or a grammar that does not finish the sequence
                // settles here (a request has text only if the scheduler has a tokenizer)
                let finish = r.append_token(token, max_model_len);
                if finish.is_none() && r.grammar.is_none() && r.text.is_none() {
                    out.set_row(i, r.req_id, r.seq_index, token as i32, None, r.num_output_tokens());
                } else {
                    self.append_rest(idx, i, token, finish, &mut out);
                }
                i += 1;
            } else {
                for target in self.fork(idx) {
                    let token = sampled_token_ids[i] as u32; // each fork its own sample
                    let finish = self.reqs.get_mut(target).append_token(token, max_model_len);
                    self.append_rest(target, i, token, finish, &mut out);
                    i += 1;
                }
            }
        }
        out.num_generated = n - num_dropped;
        self.counters.num_generated_tokens += out.num_generated as u64;
        self.reqs.release_deferred(pending.step);
        self.spare_pending = Some(pending);
        self.counters.scheduler_ns += started.elapsed().as_nanos() as u64;
        Ok(out)
    }

    /// A step computed request `idx` up to position `end`: cache its full blocks whose tokens
    /// are known.
    fn cache_computed(&mut self, idx: ReqIdx, end: usize) {
        let Some(r) = self.reqs.try_get_mut(idx).filter(|r| r.status == RequestStatus::Running) else {
            return; // aborted, finished or preempted after schedule()
        };
        let known = end.min(r.num_tokens()).min(r.num_computed_tokens);
        let num_full = known >> self.cfg.block_size.trailing_zeros();
        if num_full > r.num_cached_blocks {
            let known = &r.token_ids[..num_full * self.cfg.block_size];
            self.kv.hash_blocks(&mut r.block_hashes, known);
            self.kv.cache_blocks(idx, &r.block_hashes, r.num_cached_blocks, num_full);
            r.num_cached_blocks = num_full;
        }
    }

    /// A token just appended to request `idx` (`finish`: what its stop conditions said), as row
    /// `i` of `out`, past the common case: the grammar, the text and stop strings, finishing (and
    /// then its whole output in `out`).
    #[inline(never)]
    fn append_rest(
        &mut self,
        idx: ReqIdx,
        i: usize,
        token: u32,
        mut finish: Option<FinishReason>,
        out: &mut StepOutputs,
    ) {
        let r = self.reqs.get_mut(idx);
        let stop_token = finish == Some(FinishReason::Stop);
        let mut stop_string = -1;
        if let Some(g) = r.grammar.as_deref_mut().filter(|_| !stop_token) {
            // a complete grammar ends the sequence; so does a token it refuses (a bug or a
            // sampler that ignored the mask), counted
            let done = g.consume(token).unwrap_or_else(|_| {
                self.counters.num_grammar_errors += 1;
                true
            });
            if done && finish.is_none() {
                finish = Some(FinishReason::Stop);
            }
        }
        if let (Some(text), Some(tok)) = (r.text.as_deref_mut(), self.tokenizer.as_ref()) {
            // a stop token's own text is part of the output only with include_stop_str_in_output
            // (vLLM's rule; stop strings are still looked for in it); a token the tokenizer
            // cannot decode adds no text
            let pushed = if stop_token && !text.includes_stop() { Ok(Push::Continue) } else { text.push(tok, token) };
            if let Ok(Push::Stop(k)) = pushed {
                (finish, stop_string) = (Some(FinishReason::Stop), k as i32);
            }
            if finish.is_some() {
                if let Push::Stop(k) = text.finish() {
                    (finish, stop_string) = (Some(FinishReason::Stop), k as i32);
                }
            }
            text.take_delta(&mut out.text);
        }
        out.set_row(i, r.req_id, r.seq_index, token as i32, finish, r.num_output_tokens());
        if let Some(reason) = finish {
            out.finished_rows.push(i as u32);
            out.output_token_ids.extend_from_slice(&r.token_ids[r.num_prompt_tokens..]);
            out.output_token_offsets.push(out.output_token_ids.len() as u32);
            out.output_text.extend_from_slice(r.text.as_ref().map_or(&b""[..], |t| t.released().as_bytes()));
            out.output_text_offsets.push(out.output_text.len() as u32);
            out.stop_string_indices.push(stop_string);
            self.finish(idx, reason);
        }
    }

    /// Forks an unforked parent whose prompt just completed into its `n` sequences; returns
    /// their indices in `seq_index` order (the parent first).
    fn fork(&mut self, parent: ReqIdx) -> Vec<ReqIdx> {
        let p = self.reqs.get_mut(parent);
        let n = std::mem::replace(&mut p.num_pending_forks, 1);
        let template: Request = p.clone();
        let mut forks = Vec::with_capacity(n as usize);
        forks.push(parent);
        for k in 1..n {
            let child = Request { seq_index: k, row: None, ..template.clone() };
            let idx = self.reqs.insert_fork(child);
            self.kv.ensure_tables(idx);
            self.kv.fork(parent, idx);
            self.queues.push_fork(idx);
            forks.push(idx);
        }
        forks
    }
}
