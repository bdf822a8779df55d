//! `Scheduler`: the per-step policy. Owns every request, the `waiting`, `running` and `swapped`
//! queues, the token budget, and the `KvCacheManager`.
//!
//! One step (`schedule()`), token-count based as in vLLM v1 — every request has tokens known
//! (`num_tokens`) and tokens computed, and a step closes part of the gap:
//! 1. running requests, in admission order: decodes and unfinished prefill chunks. When one
//!    cannot get the block its next tokens need, victims are preempted (`preemption.rs`) until it
//!    can, or it is itself the victim;
//! 2. if nothing was preempted: swapped requests resume, in precedence order, when their whole
//!    swap-in plus one block to grow fits;
//! 3. if nothing was preempted and nothing is left swapped: waiting requests are admitted, in
//!    precedence order, when all blocks of their known tokens (plus one to grow, for a preempted
//!    one) fit above the watermark. Prefix-cache hits are reused by reference.
//!
//! Then `update()` (`step.rs`) takes one sampled token per sample row.
//!
//! Precedence ("fcfs" or "priority") orders the waiting and swapped queues (`queues.rs`);
//! victims come from the other end.
//!
//! Invariants (checked by `check_invariants`, DESIGN.md §6): every live request is in exactly
//! one queue matching its status; running requests hold device blocks only, swapped ones host
//! blocks only, waiting ones none; the running forks never exceed `max_num_seqs`.

use std::time::Instant;

use crate::arena::{ReqIdx, RequestArena};
use crate::config::SchedulerConfig;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::{BlockCopy, KvCacheManager};
use crate::outputs::{PreemptionEvent, SchedulerOutput, StepStats};
use crate::queues::Queues;
use crate::request::{FinishReason, Request, RequestStatus, StopParams};

/// Sampling-independent parameters of a new request.
#[derive(Debug, Clone, Default)]
pub struct RequestParams {
    /// Output tokens at most (>= 1).
    pub max_tokens: usize,
    /// Lower is more important (policy "priority").
    pub priority: i32,
    /// Stop on this token unless `ignore_eos`.
    pub eos_token_id: Option<u32>,
    /// Stop on any of these.
    pub stop_token_ids: Vec<u32>,
    /// Ignore `eos_token_id`.
    pub ignore_eos: bool,
    /// Parallel samples (>= 1).
    pub n: u32,
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
    /// Tokens looked up in the prefix cache at admission, and tokens found.
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
    /// Wall time spent inside `schedule()` and `update()`, in nanoseconds.
    pub scheduler_ns: u64,
}

/// A request scheduled in the step being planned.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scheduled {
    pub req_idx: ReqIdx,
    pub num_new: usize,
    pub cow: Option<BlockCopy>,
}

/// What one `schedule()` decided, before it becomes arrays.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub budget: usize,
    pub scheduled: Vec<Scheduled>,
    pub swap_out: Vec<[i32; 2]>,
    pub swap_in: Vec<[i32; 2]>,
    pub preempted: Vec<i64>,
}

/// A sample row between `schedule()` and `update()`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub req_idx: ReqIdx,
    pub req_id: u64,
    pub seq_index: u32,
}

/// The step awaiting `update()`.
#[derive(Debug, Clone)]
pub(crate) struct PendingStep {
    pub scheduled: Vec<Scheduled>,
    pub samples: Vec<Sample>,
}

/// The scheduler and block manager of one engine.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub(crate) cfg: SchedulerConfig,
    pub(crate) kv: KvCacheManager,
    pub(crate) reqs: RequestArena,
    pub(crate) queues: Queues,
    next_arrival: u64,
    pub(crate) step: u64,
    pub(crate) pending: Option<PendingStep>,
    pub(crate) finished_req_ids: Vec<i64>,
    pub(crate) events: Vec<PreemptionEvent>,
    pub(crate) counters: Counters,
    pub(crate) last_step: StepStats,
    /// 0, 1, .., max(max_model_len, block_size): positions and slot runs are copied from it.
    pub(crate) iota: Vec<i64>,
}

impl Scheduler {
    /// A scheduler with empty pools; fails on an invalid config.
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let kv =
            KvCacheManager::new(cfg.block_size, cfg.num_device_blocks, cfg.num_host_blocks, cfg.enable_prefix_caching);
        let iota = (0..=cfg.max_model_len.max(cfg.block_size) as i64).collect();
        Ok(Self {
            cfg,
            kv,
            reqs: RequestArena::new(),
            queues: Queues::new(),
            next_arrival: 0,
            step: 0,
            pending: None,
            finished_req_ids: Vec::new(),
            events: Vec::new(),
            counters: Counters::default(),
            last_step: StepStats::default(),
            iota,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request. Rejects (and changes nothing) a duplicate live id, an empty prompt, bad
    /// parameters, or a request that could never fit `max_model_len` or the device pool.
    pub fn add_request(&mut self, req_id: u64, prompt_token_ids: Vec<u32>, p: RequestParams) -> CoreResult<()> {
        let bad = |msg: String| Err(CoreError::InvalidRequest { req_id, msg });
        if self.reqs.indices(req_id).is_some() {
            return Err(CoreError::DuplicateRequest(req_id));
        }
        if prompt_token_ids.is_empty() {
            return bad("prompt_token_ids is empty".into());
        }
        if p.max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if p.n == 0 || p.n as usize > self.cfg.max_num_seqs {
            return bad(format!("n must be in 1..={} (max_num_seqs), got {}", self.cfg.max_num_seqs, p.n));
        }
        if let Some(&t) = prompt_token_ids.iter().find(|&&t| t > i32::MAX as u32) {
            return bad(format!("token id {t} out of range"));
        }
        let num_prompt_tokens = prompt_token_ids.len();
        let total = num_prompt_tokens.saturating_add(p.max_tokens);
        if total > self.cfg.max_model_len {
            return Err(CoreError::RequestTooLong {
                req_id,
                num_prompt_tokens,
                max_tokens: p.max_tokens,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let num_blocks = self.cfg.blocks_for(total);
        if num_blocks > self.cfg.num_device_blocks {
            return Err(CoreError::RequestTooLarge {
                req_id,
                num_tokens: total,
                num_blocks,
                num_device_blocks: self.cfg.num_device_blocks,
            });
        }
        // room for every token the request can have, so appending never reallocates
        let mut token_ids: Vec<i32> = Vec::with_capacity(total);
        token_ids.extend(prompt_token_ids.iter().map(|&t| t as i32));
        let req = Request {
            req_id,
            seq_index: 0,
            arrival: self.next_arrival,
            priority: p.priority,
            token_ids,
            num_prompt_tokens,
            num_computed_tokens: 0,
            stop: StopParams {
                max_tokens: p.max_tokens,
                eos_token_id: p.eos_token_id,
                stop_token_ids: p.stop_token_ids,
                ignore_eos: p.ignore_eos,
            },
            num_pending_forks: p.n,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            block_hashes: Vec::new(),
            num_swap_prefix_blocks: 0,
            num_cached_blocks: 0,
        };
        self.next_arrival += 1;
        let idx = self.insert_request(req, false);
        self.queues.push_waiting(idx, &self.reqs, self.cfg.policy);
        self.counters.num_requests_added += 1;
        Ok(())
    }

    /// Aborts every fork of `req_id`, freeing its blocks now. False if it is not live.
    pub fn abort_request(&mut self, req_id: u64) -> bool {
        let Some(forks) = self.reqs.indices(req_id).map(<[ReqIdx]>::to_vec) else {
            return false;
        };
        for idx in forks {
            self.finish(idx, FinishReason::Abort);
        }
        true
    }

    /// Finishes a request (all forks, or fork `seq_index`) for a reason found outside the core,
    /// e.g. a stop string found by Python after detokenizing.
    pub fn finish_request(&mut self, req_id: u64, reason: FinishReason, seq_index: Option<u32>) -> CoreResult<()> {
        let forks = self.reqs.indices(req_id).ok_or(CoreError::UnknownRequest(req_id))?;
        let targets: Vec<ReqIdx> = match seq_index {
            None => forks.to_vec(),
            Some(k) => vec![self.reqs.find_fork(req_id, k).ok_or_else(|| CoreError::InvalidRequest {
                req_id,
                msg: format!("no live sequence with seq_index {k}"),
            })?],
        };
        for idx in targets {
            self.finish(idx, reason);
        }
        Ok(())
    }

    /// True while any request is waiting, running or swapped.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.reqs.is_empty()
    }

    /// Plans one step. Fails if the previous step was not `update()`d.
    pub fn schedule(&mut self) -> CoreResult<SchedulerOutput> {
        if self.pending.is_some() {
            return Err(CoreError::OutOfOrder("schedule() called twice without update() in between"));
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
            let Some(num_new) = self.chunk(r.num_tokens() - num_computed, plan.budget) else {
                i += 1;
                continue;
            };
            loop {
                if let Some(cow) = self.kv.allocate_slots(idx, num_computed, num_new) {
                    plan.scheduled.push(Scheduled { req_idx: idx, num_new, cow });
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
            if plan.budget == 0 || self.queues.num_running_seqs() + r.num_pending_forks as usize > self.cfg.max_num_seqs
            {
                break;
            }
            let num_computed = r.num_computed_tokens;
            let keep = r.num_swap_prefix_blocks;
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
            plan.scheduled.push(Scheduled { req_idx: idx, num_new, cow });
            plan.budget -= num_new;
        }
    }

    /// A swapped request whose device-kept prefix was evicted cannot be swapped back in: it
    /// drops its host blocks and waits to be recomputed, ahead of new requests.
    fn recompute_lost_prefix(&mut self, idx: ReqIdx) {
        self.kv.free_host(idx);
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
            if plan.budget == 0 || self.queues.num_running_seqs() + r.num_pending_forks as usize > self.cfg.max_num_seqs
            {
                break;
            }
            let num_tokens = r.num_tokens();
            let (hit, free_hits) = if self.cfg.enable_prefix_caching {
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
            if self.cfg.enable_prefix_caching {
                self.counters.prefix_cache_queries += num_tokens as u64;
                self.counters.prefix_cache_hits += (hit * bs) as u64;
            }
            self.make_running(idx);
            plan.scheduled.push(Scheduled { req_idx: idx, num_new, cow: None });
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

    pub(crate) fn make_running(&mut self, idx: ReqIdx) {
        let r = self.reqs.get_mut(idx);
        r.status = RequestStatus::Running;
        self.queues.push_running(idx, r.num_pending_forks as usize);
    }

    /// Stores a request (`fork`: one more fork of a live `req_id`) and makes room for its
    /// block tables.
    pub(crate) fn insert_request(&mut self, req: Request, fork: bool) -> ReqIdx {
        let idx = self.reqs.insert(req, fork);
        self.kv.ensure_tables(idx);
        idx
    }

    /// Ends the request at `idx`: frees its blocks, leaves its queue, forgets it. When the last
    /// fork of a `req_id` ends, the id is reported in the next `finished_req_ids`.
    pub(crate) fn finish(&mut self, idx: ReqIdx, reason: FinishReason) {
        // the pending step may still name the index: it is reused only after update()
        let (r, last_fork) = self.reqs.remove(idx, self.pending.is_some());
        if reason == FinishReason::Abort {
            self.counters.num_forks_aborted += 1;
        }
        match r.status {
            RequestStatus::Running => {
                self.kv.free(idx);
            }
            RequestStatus::Swapped => self.kv.free_host(idx),
            RequestStatus::Waiting => {}
        }
        self.queues.remove(idx, r.status, r.num_pending_forks as usize);
        if last_fork {
            self.finished_req_ids.push(r.req_id as i64);
            self.counters.num_requests_finished += 1;
        }
    }

    /// Queue sizes and free blocks now.
    pub(crate) fn gauges(&self, stats: &mut StepStats) {
        stats.num_free_device_blocks = self.kv.num_free();
        stats.num_free_host_blocks = self.kv.num_free_host();
        (stats.num_waiting, stats.num_running, stats.num_swapped) = self.queues.lens();
    }

    /// Takes the preemption events emitted since the last call.
    pub fn drain_events(&mut self) -> Vec<PreemptionEvent> {
        std::mem::take(&mut self.events)
    }

    /// Cumulative counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The stats of the last planned step.
    pub fn last_step(&self) -> &StepStats {
        &self.last_step
    }

    /// Current queue sizes and free blocks.
    pub fn current(&self) -> StepStats {
        let mut s = StepStats { step: self.step, ..StepStats::default() };
        self.gauges(&mut s);
        s
    }

    /// Blocks cached in the prefix cache (free or in use).
    pub fn num_cached_blocks(&self) -> usize {
        self.kv.num_cached_blocks()
    }

    /// The device block table of the live fork `seq_index` of `req_id` (tests, debugging).
    pub fn block_table(&self, req_id: u64, seq_index: u32) -> Option<Vec<u32>> {
        let idx = self.reqs.find_fork(req_id, seq_index)?;
        Some(self.kv.table(idx).iter().map(|&b| b as u32).collect())
    }

    /// Status of the live fork `seq_index` of `req_id` (tests, debugging).
    pub fn request_status(&self, req_id: u64, seq_index: u32) -> Option<RequestStatus> {
        self.reqs.find_fork(req_id, seq_index).map(|i| self.reqs.get(i).status)
    }

    /// The free list of the device pool, head (evicted next) first (tests, debugging).
    pub fn device_free_list(&self) -> Vec<u32> {
        self.kv.device_free_list()
    }
}
