//! Planning one step: `schedule()`, token-count based as in vLLM v1. Every request has tokens
//! known (`num_tokens`) and tokens computed, and a step closes part of the gap in three passes:
//! 1. running requests, in admission order: decodes and unfinished prefill chunks. When one
//!    cannot get the block its next tokens need, victims are preempted (`preemption.rs`) until it
//!    can, or it is itself the victim;
//! 2. if nothing was preempted: swapped requests resume, in precedence order, when their whole
//!    swap-in plus one block to grow fits;
//! 3. if nothing was preempted and nothing is left swapped: waiting requests are admitted, in
//!    precedence order, when all blocks of their known tokens (plus one to grow, for a preempted
//!    one) fit above the watermark. Prefix-cache hits are reused by reference.
//!
//! The passes fill a `StepPlan`; `build_output` (`step.rs`) lays it out as arrays.
//!
//! With `async_scheduling`, a step may be planned while the previous one still runs; its
//! samples are in flight. A running decode then computes the position of its in-flight token,
//! except an unforked `n > 1` parent (it forks when its samples arrive) and a sequence whose
//! in-flight token may be its last. A waiting or swapped request with a sample in flight (it was
//! preempted after that step was planned) is not admitted before its sample arrives.
//!
//! Invariants: the step's tokens stay within `max_num_batched_tokens` and the running sequences
//! within `max_num_seqs`; a step never both swaps out and swaps in.

use std::time::Instant;

use super::{Scheduled, Scheduler, StepPlan};
use crate::arena::ReqIdx;
use crate::error::{CoreError, CoreResult};
use crate::outputs::SchedulerOutput;
use crate::request::{Request, RequestStatus};

impl Scheduler {
    /// Plans one step. Fails if the previous step was not `update()`d.
    pub fn schedule(&mut self) -> CoreResult<SchedulerOutput> {
        if self.pending.len() >= self.cfg.max_steps_in_flight() {
            return Err(CoreError::OutOfOrder(if self.cfg.async_scheduling {
                "schedule() called with two steps awaiting update()"
            } else {
                "schedule() called twice without update() in between"
            }));
        }
        let started = Instant::now();
        let (num_waiting, num_running, num_swapped) = self.queues.lens();
        let mut plan = StepPlan {
            budget: self.cfg.max_num_batched_tokens,
            scheduled: Vec::with_capacity(num_running + num_swapped + num_waiting.min(64)),
            ..StepPlan::default()
        };
        self.schedule_running(&mut plan);
        if plan.preempted.is_empty() {
            self.schedule_swapped(&mut plan);
            if self.queues.next_swapped().is_none() {
                self.schedule_waiting(&mut plan);
            }
        }
        debug_assert!(plan.swap_in.is_empty() || plan.swap_out.is_empty());
        let mut out = self.build_output(plan);
        let ns = started.elapsed().as_nanos() as u64;
        out.stats.schedule_ns = ns;
        self.last_step.schedule_ns = ns;
        self.counters.scheduler_ns += ns;
        self.step += 1;
        Ok(out)
    }

    /// Running requests get their next tokens, preempting others when blocks run out.
    fn schedule_running(&mut self, plan: &mut StepPlan) {
        let mut i = 0;
        while i < self.queues.running().len() && plan.budget > 0 {
            let idx = self.queues.running()[i];
            let r = self.reqs.get(idx);
            let (req_id, num_computed) = (r.req_id, r.num_computed_tokens);
            if r.num_inflight > 0
                && (r.num_pending_forks > 1 || r.num_tokens_scheduled() >= r.max_len().min(self.cfg.max_model_len))
            {
                i += 1; // forks, or may finish, when its sample arrives
                continue;
            }
            let Some(num_new) = self.chunk(r.num_tokens_scheduled() - num_computed, plan.budget) else {
                i += 1;
                continue;
            };
            loop {
                if let Some(cow) = self.kv.allocate_slots(idx, num_computed, num_new) {
                    plan.scheduled.push(Scheduled::new(idx, num_new, cow, self.reqs.get(idx)));
                    plan.budget -= num_new;
                    i += 1;
                    break;
                }
                let v = self.choose_victim();
                let victim = self.queues.running()[v];
                self.preempt(v, req_id, plan);
                if victim == idx {
                    break; // `i` now points at the next request
                }
                if v < i {
                    i -= 1;
                }
            }
        }
    }

    /// Swapped requests come back, in precedence order, while the whole of each fits.
    fn schedule_swapped(&mut self, plan: &mut StepPlan) {
        while let Some(idx) = self.queues.next_swapped() {
            let r = self.reqs.get(idx);
            if plan.budget == 0
                || r.num_inflight > 0
                || self.queues.num_running_seqs() + r.num_pending_forks as usize > self.cfg.max_num_seqs
            {
                break;
            }
            let num_computed = r.num_computed_tokens;
            let keep = r.num_swap_prefix_blocks as usize;
            let (hit, free_hits) = self.kv.match_prefix(&r.block_hashes[..keep]);
            if hit < keep {
                self.queues.pop_swapped();
                self.recompute_lost_prefix(idx);
                continue;
            }
            let Some(num_new) = self.chunk(r.num_tokens() - num_computed, plan.budget) else { break };
            // kept blocks come from the cache; only those now on the free list cost free blocks
            let need = self.cfg.blocks_for(self.continue_len(r)) - keep + free_hits;
            if self.kv.num_free() < need + self.watermark_now() {
                break;
            }
            self.queues.pop_swapped();
            let num_moved = self.kv.host_table(idx).len();
            let r = self.reqs.get_mut(idx);
            r.num_swap_prefix_blocks = 0;
            self.kv.swap_in(idx, &r.block_hashes[..keep], free_hits, &mut plan.swap_in).expect("counted above");
            self.counters.num_blocks_swapped_in += num_moved as u64;
            let cow = self.kv.allocate_slots(idx, num_computed, num_new).expect("counted above");
            debug_assert!(cow.is_none());
            self.make_running(idx);
            plan.scheduled.push(Scheduled::new(idx, num_new, cow, self.reqs.get(idx)));
            plan.budget -= num_new;
        }
    }

    /// A swapped request whose device-kept prefix was evicted cannot be swapped back in: it
    /// drops its host blocks and waits to be recomputed, ahead of new requests.
    fn recompute_lost_prefix(&mut self, idx: ReqIdx) {
        self.counters.num_blocks_swap_dropped += self.kv.free_host(idx) as u64;
        let r = self.reqs.get_mut(idx);
        self.counters.num_tokens_recomputed += r.num_computed_tokens as u64;
        r.num_computed_tokens = 0;
        r.num_cached_blocks = 0;
        r.num_swap_prefix_blocks = 0;
        r.status = RequestStatus::Waiting;
        self.counters.num_swap_prefix_lost += 1;
        self.queues.push_waiting(idx, &self.reqs, self.cfg.policy);
    }

    /// Waiting requests are admitted, in precedence order, while the whole of each fits.
    fn schedule_waiting(&mut self, plan: &mut StepPlan) {
        let bs = self.cfg.block_size;
        while let Some(idx) = self.queues.next_waiting() {
            let r = self.reqs.get_mut(idx);
            if plan.budget == 0
                || r.num_inflight > 0
                || self.queues.num_running_seqs() + r.num_pending_forks as usize > self.cfg.max_num_seqs
            {
                break;
            }
            let num_tokens = r.num_tokens();
            let (hit, free_hits) = if self.cfg.enable_prefix_caching && !r.skip_reading_prefix_cache {
                self.kv.hash_blocks(&mut r.block_hashes, &r.token_ids);
                let max_hit = ((num_tokens - 1) / bs).min(r.block_hashes.len());
                self.kv.match_prefix(&r.block_hashes[..max_hit])
            } else {
                (0, 0)
            };
            let r = self.reqs.get(idx);
            let Some(num_new) = self.chunk(num_tokens - hit * bs, plan.budget) else { break };
            let want = if r.num_preemptions > 0 { self.continue_len(r) } else { num_tokens };
            let need = self.cfg.blocks_for(want) - hit + free_hits;
            if self.kv.num_free() < need + self.watermark_now() {
                break;
            }
            self.queues.pop_waiting();
            let num_fresh = self.cfg.blocks_for(num_tokens) - hit;
            let r = self.reqs.get_mut(idx);
            self.kv.admit(idx, &r.block_hashes[..hit], free_hits, num_fresh).expect("counted above");
            r.num_computed_tokens = hit * bs;
            r.num_cached_blocks = hit;
            // vLLM's: a victim finding its own blocks again, or a request that reads no hits, is
            // not a query (either would make a workload that shares nothing look cached)
            if self.cfg.enable_prefix_caching && !r.skip_reading_prefix_cache && r.num_preemptions == 0 {
                self.counters.prefix_cache_queries += num_tokens as u64;
                self.counters.prefix_cache_hits += (hit * bs) as u64;
            }
            self.make_running(idx);
            plan.scheduled.push(Scheduled::new(idx, num_new, None, self.reqs.get(idx)));
            plan.budget -= num_new;
        }
    }

    /// Tokens to schedule of `remaining` within `budget`; `None` if chunking is off and the
    /// whole does not fit (or nothing fits).
    #[inline]
    fn chunk(&self, remaining: usize, budget: usize) -> Option<usize> {
        if self.cfg.enable_chunked_prefill {
            Some(remaining.min(budget)).filter(|&n| n > 0)
        } else {
            Some(remaining).filter(|&n| n <= budget)
        }
    }

    /// Tokens a resumed request must have room for: all it knows plus one block to grow.
    fn continue_len(&self, r: &Request) -> usize {
        (r.num_tokens() + self.cfg.block_size).min(r.max_len().min(self.cfg.max_model_len)).max(r.num_tokens())
    }

    /// The free-block reserve admission respects; none when nothing runs (so a request as large
    /// as the pool is still admitted).
    fn watermark_now(&self) -> usize {
        if self.queues.running().is_empty() {
            0
        } else {
            self.cfg.watermark_blocks()
        }
    }

    /// Moves a request that was given its blocks into `running`.
    fn make_running(&mut self, idx: ReqIdx) {
        let r = self.reqs.get_mut(idx);
        r.status = RequestStatus::Running;
        self.queues.push_running(idx, r.num_pending_forks as usize);
    }
}
