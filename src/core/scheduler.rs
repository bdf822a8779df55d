//! `Scheduler`: one engine's scheduler, composed of parts that each own their state privately:
//! the `RequestArena` (every live request, by `ReqIdx` and `req_id`), the `Queues` (`waiting`,
//! `running`, `swapped`), the `KvCacheManager` (blocks, tables, prefix cache, swap space), and
//! the persistent `Batch` (rows of running sequences).
//! The scheduler itself owns the config, the step counter and the steps awaiting `update()` (one,
//! or two with `async_scheduling`: then step N+1 is planned while step N runs), and the
//! telemetry (events, counters, last step's stats), and the tokenizer that `update()` turns
//! tokens into text with. This file holds the request lifecycle
//! (`add_request`, `abort_request`, `finish_request`) and the accessors; the rest of its impl is
//! in `scheduler/`:
//! - `plan.rs`: `schedule()`, the three passes that plan one step;
//! - `preemption.rs`: victim choice, the restore-cost model, recompute or swap;
//! - `step.rs`: the plan laid out as arrays (`build_output`), and `update()`;
//! - `invariants.rs`: `check_invariants()`.
//!
//! Invariants (checked by `check_invariants`, docs/design.md §5): every live request is in exactly
//! one queue matching its status; running requests hold device blocks only, swapped ones host
//! blocks only, waiting ones none; the running forks never exceed `max_num_seqs`.

mod invariants;
mod plan;
mod preemption;
mod step;

use crate::arena::{ReqIdx, RequestArena};
use crate::batch::Batch;
use crate::block_pool::NULL_BLOCK;
use crate::config::SchedulerConfig;
use crate::error::{CoreError, CoreResult};
use crate::grammar::GrammarCompiler;
use crate::kv_cache_manager::{BlockCopy, KvCacheManager};
use crate::outputs::{Counters, PreemptionEvent, StepStats};
use crate::queues::Queues;
use crate::request::{FinishReason, Request, RequestParams, RequestStatus};
use crate::text::{SeqText, Tokenizer};
use std::collections::VecDeque;
use std::sync::Arc;
use step::PendingStep;

/// A request scheduled in the step being planned.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    req_idx: ReqIdx,
    num_new: usize,
    /// A one-token row's input, read while the request is at hand in the planning pass (so the
    /// layout pass does not wait on the token's cache line); -1 when it is still in flight, and
    /// unused for longer rows.
    input: i32,
    /// Its copy-on-write as [src, dst], or `NO_COPY`: a plain pair, not an `Option`, so the hot
    /// path stores it whole (storing an enum's tag alone and then copying tag and payload as
    /// one word stalled every decode row on a store that cannot be forwarded).
    cow: [u32; 2],
}

/// `Scheduled::cow` of a request that copies nothing (no table holds the null block).
const NO_COPY: [u32; 2] = [NULL_BLOCK, NULL_BLOCK];

impl Scheduled {
    fn new(req_idx: ReqIdx, num_new: usize, cow: Option<BlockCopy>, r: &Request) -> Self {
        let input = if num_new == 1 { r.token_ids.get(r.num_computed_tokens).copied().unwrap_or(-1) } else { -1 };
        Self { req_idx, num_new, input, cow: cow.map_or(NO_COPY, |(src, dst)| [src, dst]) }
    }

    /// The copy-on-write this request runs before the forward, if any.
    fn copy(&self) -> Option<BlockCopy> {
        (self.cow != NO_COPY).then_some((self.cow[0], self.cow[1]))
    }
}

/// What one `schedule()` decided, before it becomes arrays: the token budget left, the requests
/// scheduled, the swap plans and the requests preempted.
#[derive(Debug, Default)]
struct StepPlan {
    budget: usize,
    scheduled: Vec<Scheduled>,
    swap_out: Vec<[i32; 2]>,
    swap_in: Vec<[i32; 2]>,
    preempted: Vec<i64>,
}

/// The scheduler and block manager of one engine.
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    reqs: RequestArena,
    queues: Queues,
    batch: Batch,
    next_arrival: u64,
    step: u64,
    /// Planned steps awaiting `update()`, oldest first.
    pending: VecDeque<PendingStep>,
    finished_req_ids: Vec<i64>,
    events: Vec<PreemptionEvent>,
    counters: Counters,
    last_step: StepStats,
    /// Detokenizes the output of requests that ask for text.
    tokenizer: Option<Tokenizer>,
    /// Compiles requests' grammars against `tokenizer`; built on the first that asks.
    grammars: Option<Arc<GrammarCompiler>>,
    /// Buffers reused step after step: `build_output`'s row records, and the last updated step.
    row_scratch: Vec<step::RowOut>,
    spare_pending: Option<PendingStep>,
}

fn bad_grammar(req_id: u64, e: String) -> CoreError {
    CoreError::InvalidRequest { req_id, msg: format!("structured outputs: {e}") }
}

impl Scheduler {
    /// A scheduler with empty pools; fails on an invalid config.
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let kv =
            KvCacheManager::new(cfg.block_size, cfg.num_device_blocks, cfg.num_host_blocks, cfg.enable_prefix_caching);
        let batch = Batch::new(cfg.max_num_seqs);
        Ok(Self {
            cfg,
            kv,
            reqs: RequestArena::new(),
            queues: Queues::new(),
            batch,
            next_arrival: 0,
            step: 0,
            pending: VecDeque::with_capacity(2),
            finished_req_ids: Vec::new(),
            events: Vec::new(),
            counters: Counters::default(),
            last_step: StepStats::default(),
            tokenizer: None,
            grammars: None,
            row_scratch: Vec::new(),
            spare_pending: None,
        })
    }

    /// Sets the tokenizer that requests with `TextParams` are detokenized with.
    pub fn set_tokenizer(&mut self, tokenizer: Tokenizer) {
        self.tokenizer = Some(tokenizer);
        self.grammars = None;
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
        p.validate().or_else(bad)?;
        if p.n as usize > self.cfg.max_num_seqs {
            return bad(format!("n must be in 1..={} (max_num_seqs), got {}", self.cfg.max_num_seqs, p.n));
        }
        if let Some(&t) = prompt_token_ids.iter().find(|&&t| t > i32::MAX as u32) {
            return bad(format!("token id {t} out of range"));
        }
        if p.text.is_some() && self.tokenizer.is_none() {
            return bad("text output needs a tokenizer, and this scheduler has none".into());
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
        let text = match (&p.text, &self.tokenizer) {
            (Some(t), Some(tok)) => {
                let seq = SeqText::with_options(tok, &t.stop, t.min_tokens, t.include_stop_str_in_output);
                Some(Box::new(seq.after_prompt(tok, &prompt_token_ids)))
            }
            _ => None,
        };
        let grammar = match &p.grammar {
            Some(spec) => {
                let compiled = self.grammar_compiler(&p.eos_token_ids).and_then(|c| c.compile(spec));
                Some(Box::new(compiled.map_err(|e| bad_grammar(req_id, e))?))
            }
            None => None,
        };
        let mut req = Request::new(req_id, self.next_arrival, &prompt_token_ids, p);
        req.text = text;
        req.grammar = grammar;
        self.next_arrival += 1;
        let idx = self.reqs.insert(req);
        self.kv.ensure_tables(idx);
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

    /// The grammar compiler, built on first use from the tokenizer (`eos_ids[0]` is the token
    /// a complete grammar allows; every EOS and stop id of a request is allowed with it).
    fn grammar_compiler(&mut self, eos_ids: &[u32]) -> Result<Arc<GrammarCompiler>, String> {
        if let Some(c) = &self.grammars {
            return Ok(c.clone());
        }
        let tok = self.tokenizer.as_ref().ok_or("structured outputs need a tokenizer, and this scheduler has none")?;
        let eos = *eos_ids.first().ok_or("structured outputs need the model's EOS token id (eos_token_ids)")?;
        let c = Arc::new(GrammarCompiler::new(tok, eos)?);
        self.grammars = Some(c.clone());
        Ok(c)
    }

    /// True while any request is waiting, running or swapped.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.reqs.is_empty()
    }

    /// Ends the request at `idx`: frees its blocks, leaves its queue, forgets it. When the last
    /// fork of a `req_id` ends, the id is reported in the next `finished_req_ids`.
    fn finish(&mut self, idx: ReqIdx, reason: FinishReason) {
        // a pending step may still name the index: it is reused only after the newest is updated
        let (r, last_fork) = self.reqs.remove(idx, self.pending.back().map(PendingStep::step));
        if reason == FinishReason::Abort {
            self.counters.num_forks_aborted += 1;
        }
        if let Some(row) = r.row {
            self.batch.release(row);
        }
        match r.status {
            RequestStatus::Running => _ = self.kv.free(idx),
            RequestStatus::Swapped => self.counters.num_blocks_swap_dropped += self.kv.free_host(idx) as u64,
            RequestStatus::Waiting => {}
        }
        self.queues.remove(idx, r.status, r.num_pending_forks as usize);
        if last_fork {
            self.finished_req_ids.push(r.req_id as i64);
            self.counters.num_requests_finished += 1;
        }
    }

    /// Queue sizes and free blocks now.
    fn gauges(&self, stats: &mut StepStats) {
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

    /// The output token ids so far of the live fork `seq_index` of `req_id` (what the runner's
    /// penalties count when the sequence takes a batch row).
    pub fn output_token_ids(&self, req_id: u64, seq_index: u32) -> Option<&[i32]> {
        let r = self.reqs.get(self.reqs.find_fork(req_id, seq_index)?);
        Some(&r.token_ids[r.num_prompt_tokens..])
    }

    /// The text released so far by the live fork `seq_index` of `req_id` (what its deltas have
    /// carried; empty without detokenization): the output a request failed from outside the
    /// core keeps.
    pub fn output_text(&self, req_id: u64, seq_index: u32) -> Option<&str> {
        let r = self.reqs.get(self.reqs.find_fork(req_id, seq_index)?);
        Some(r.text.as_deref().map_or("", |t| t.released()))
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
