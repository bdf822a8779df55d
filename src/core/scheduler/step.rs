//! The two halves of a step that touch every scheduled request: turning a `StepPlan` into the
//! flat arrays of `SchedulerOutput` (`build_output`), and applying the sampled tokens
//! (`update`): advancing `num_computed_tokens`, registering newly full blocks in the prefix
//! cache, forking `n > 1` requests, appending tokens and checking stop conditions.
//!
//! Between the two, the `PendingStep` (owned here) remembers the scheduled requests and the
//! sample rows, by `ReqIdx`; a request finished meanwhile keeps its index until `update()`.
//!
//! Hot path: one pass over the scheduled requests each way; block tables are copied into
//! `kv_indices` with one slice extend per request.

use super::{Scheduled, Scheduler, StepPlan};
use crate::arena::ReqIdx;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::blocks_for;
use crate::outputs::{SchedulerOutput, StepOutputs, StepStats};
use crate::request::{FinishReason, Request, RequestStatus};

/// A sample row between `schedule()` and `update()`.
#[derive(Debug, Clone, Copy)]
struct Sample {
    req_idx: ReqIdx,
    req_id: u64,
    seq_index: u32,
}

/// The step awaiting `update()`.
#[derive(Debug, Clone)]
pub(super) struct PendingStep {
    scheduled: Vec<Scheduled>,
    samples: Vec<Sample>,
}

impl Scheduler {
    /// Lays out the plan as FlashInfer-ready arrays and remembers it for `update()`.
    pub(super) fn build_output(&mut self, plan: StepPlan) -> SchedulerOutput {
        let bs = self.cfg.block_size;
        let (shift, mask) = (bs.trailing_zeros(), bs - 1); // a position's block and offset
        let b = plan.scheduled.len();
        let t = self.cfg.max_num_batched_tokens - plan.budget;
        let mut o = SchedulerOutput {
            req_ids: Vec::with_capacity(b),
            seq_indices: Vec::with_capacity(b),
            input_ids: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            qo_indptr: Vec::with_capacity(b + 1),
            seq_lens: Vec::with_capacity(b),
            kv_indptr: Vec::with_capacity(b + 1),
            kv_indices: Vec::with_capacity(plan.scheduled.iter().map(|s| self.kv.table(s.req_idx).len()).sum()),
            kv_last_page_len: Vec::with_capacity(b),
            slot_mapping: Vec::with_capacity(t),
            logits_indices: Vec::with_capacity(b),
            sample_req_ids: Vec::with_capacity(b),
            sample_seq_indices: Vec::with_capacity(b),
            ..SchedulerOutput::default()
        };
        let mut samples = Vec::with_capacity(b);
        o.qo_indptr.push(0);
        o.kv_indptr.push(0);
        let mut num_prefill_tokens = 0;
        for s in &plan.scheduled {
            let r = self.reqs.get(s.req_idx);
            let table = self.kv.table(s.req_idx);
            let (start, end) = (r.num_computed_tokens, r.num_computed_tokens + s.num_new);
            o.req_ids.push(r.req_id as i64);
            o.seq_indices.push(r.seq_index as i32);
            if s.num_new == 1 {
                o.input_ids.push(r.token_ids[start]);
            } else {
                o.input_ids.extend_from_slice(&r.token_ids[start..end]);
            }
            append_range(&mut o.positions, &self.iota, start as i64, s.num_new);
            let mut pos = start;
            while pos < end {
                let (blk, off) = (pos >> shift, pos & mask);
                let run = (bs - off).min(end - pos);
                append_range(&mut o.slot_mapping, &self.iota, table[blk] as i64 * bs as i64 + off as i64, run);
                pos += run;
            }
            o.qo_indptr.push(o.input_ids.len() as i32);
            o.seq_lens.push(end as i32);
            let num_blocks = blocks_for(end, bs);
            o.kv_indices.extend_from_slice(&table[..num_blocks]);
            o.kv_indptr.push(o.kv_indices.len() as i32);
            o.kv_last_page_len.push((end - (num_blocks - 1) * bs) as i32);
            if let Some((src, dst)) = s.cow {
                o.blocks_to_copy.push([src as i32, dst as i32]);
            }
            if end == r.num_tokens() {
                let n = r.num_pending_forks;
                for k in 0..n {
                    let seq_index = if n > 1 { k } else { r.seq_index };
                    o.logits_indices.push(o.input_ids.len() as i64 - 1);
                    o.sample_req_ids.push(r.req_id as i64);
                    o.sample_seq_indices.push(seq_index as i32);
                    samples.push(Sample { req_idx: s.req_idx, req_id: r.req_id, seq_index });
                }
                if s.num_new > 1 {
                    num_prefill_tokens += s.num_new;
                }
            } else {
                num_prefill_tokens += s.num_new;
            }
        }
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
        self.pending = Some(PendingStep { scheduled: plan.scheduled, samples });
        o
    }

    /// Applies one sampled token per sample row of the last `schedule()`, in its order.
    pub fn update(&mut self, sampled_token_ids: &[i32]) -> CoreResult<StepOutputs> {
        let started = std::time::Instant::now();
        let pending =
            self.pending.take().ok_or(CoreError::OutOfOrder("update() called without a schedule() before it"))?;
        if sampled_token_ids.len() != pending.samples.len() {
            let (expected, got) = (pending.samples.len(), sampled_token_ids.len());
            self.pending = Some(pending);
            return Err(CoreError::BatchSizeMismatch { expected, got });
        }
        if let Some(i) = sampled_token_ids.iter().position(|&t| t < 0) {
            let req_id = pending.samples[i].req_id;
            self.pending = Some(pending);
            return Err(CoreError::InvalidRequest {
                req_id,
                msg: format!("sampled token id {} < 0", sampled_token_ids[i]),
            });
        }
        for s in &pending.scheduled {
            self.advance(s.req_idx, s.num_new);
        }
        let n = pending.samples.len();
        let mut out = StepOutputs {
            req_ids: Vec::with_capacity(n),
            seq_indices: Vec::with_capacity(n),
            new_token_ids: Vec::with_capacity(n),
            finish_reasons: Vec::with_capacity(n),
        };
        let mut i = 0;
        while i < n {
            let Sample { req_idx: idx, req_id, seq_index } = pending.samples[i];
            let alive = self.reqs.try_get(idx).is_some_and(|r| r.status == RequestStatus::Running);
            let token = sampled_token_ids[i];
            out.req_ids.push(req_id as i64);
            out.new_token_ids.push(token);
            if !alive {
                out.seq_indices.push(seq_index as i32);
                out.finish_reasons.push(Some(FinishReason::Abort));
                i += 1;
            } else if self.reqs.get(idx).num_pending_forks == 1 {
                out.seq_indices.push(seq_index as i32);
                out.finish_reasons.push(self.append(idx, token as u32));
                i += 1;
            } else {
                out.req_ids.pop();
                out.new_token_ids.pop();
                for (k, target) in self.fork(idx).into_iter().enumerate() {
                    let token = sampled_token_ids[i];
                    out.req_ids.push(req_id as i64);
                    out.seq_indices.push(k as i32);
                    out.new_token_ids.push(token);
                    out.finish_reasons.push(self.append(target, token as u32));
                    i += 1;
                }
            }
        }
        self.reqs.release_deferred();
        self.counters.scheduler_ns += started.elapsed().as_nanos() as u64;
        Ok(out)
    }

    /// The forward computed `num_new` more tokens of request `idx`: count them and cache full
    /// blocks.
    fn advance(&mut self, idx: ReqIdx, num_new: usize) {
        let Some(r) = self.reqs.try_get_mut(idx).filter(|r| r.status == RequestStatus::Running) else {
            return; // aborted or finished after schedule()
        };
        r.num_computed_tokens += num_new;
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let num_full = r.num_computed_tokens >> self.cfg.block_size.trailing_zeros();
        if num_full > r.num_cached_blocks {
            let known = &r.token_ids[..num_full * self.cfg.block_size];
            self.kv.hash_blocks(&mut r.block_hashes, known);
            self.kv.cache_blocks(idx, &r.block_hashes, r.num_cached_blocks, num_full);
            r.num_cached_blocks = num_full;
        }
    }

    /// Appends `token` to request `idx`; finishes it when a stop condition holds.
    fn append(&mut self, idx: ReqIdx, token: u32) -> Option<FinishReason> {
        let max_model_len = self.cfg.max_model_len;
        let r = self.reqs.get_mut(idx);
        let finish = r.append_token(token, max_model_len);
        self.counters.num_generated_tokens += 1;
        if let Some(reason) = finish {
            self.finish(idx, reason);
        }
        finish
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
            let child = Request { seq_index: k, ..template.clone() };
            let idx = self.reqs.insert_fork(child);
            self.kv.ensure_tables(idx);
            self.kv.fork(parent, idx);
            self.queues.push_fork(idx);
            forks.push(idx);
        }
        forks
    }
}

/// Appends `start, start + 1, .., start + n - 1` as a copy of `iota` (0, 1, 2, ..) plus a
/// vectorized add, the cheapest safe way to fill a run.
#[inline]
fn append_range(dst: &mut Vec<i64>, iota: &[i64], start: i64, n: usize) {
    if n == 1 {
        dst.push(start); // a decode: no copy call for one element
        return;
    }
    let at = dst.len();
    if start >= 0 && (start as usize) + n <= iota.len() {
        dst.extend_from_slice(&iota[start as usize..start as usize + n]);
    } else {
        dst.extend_from_slice(&iota[..n]);
        for x in &mut dst[at..] {
            *x += start;
        }
    }
}
