//! Preemption: which running request gives up its blocks, and whether its KV is recomputed
//! later or swapped to host memory.
//!
//! Victims. Modes "recompute" and "swap" take the running request of highest precedence key
//! (policy "fcfs": fewest preemptions, then latest arrival; "priority": largest priority value
//! first). Mode "auto" looks at every running request in that same worst policy class (same
//! priority and preemption count) and passes over the policy's victim only for one that frees at
//! least `AUTO_VICTIM_MARGIN` (1.2x) as many device blocks per second of restore cost, so a victim
//! whose blocks are mostly shared with forks (which frees little) is passed over, while near ties
//! (the usual case: blocks freed and restore cost grow together) keep the policy's order.
//!
//! Modes. Restore cost of a victim that has computed `c` tokens, `k` of whose leading blocks
//! survive its preemption because others hold them and they are cached:
//! - swap:      2 x (blocks_for(c) - k) x bytes_per_block / host_link_bytes_per_s (out and back
//!   in; the `k` blocks stay on the device and are taken back from the prefix cache);
//! - recompute: (c - k x block_size) / prefill_tokens_per_s.
//!
//! "auto" takes the cheaper per victim (recompute on a tie); "swap" always swaps. Either falls
//! back to recompute when the host pool cannot take the blocks: a request is never aborted for
//! lack of swap space.
//!
//! Every preemption raises the victim's precedence (`num_preemptions`) for re-admission and
//! emits one `PreemptionEvent`.

use super::{Scheduler, StepPlan};
use crate::arena::ReqIdx;
use crate::config::{PreemptionMode, PreemptionModeConfig};
use crate::outputs::{PreemptionEvent, PreemptionReason};
use crate::queues::precedence;
use crate::request::RequestStatus;

/// How much more blocks-freed-per-second-of-restore-cost another victim must offer before
/// "auto" passes over the policy's own victim.
const AUTO_VICTIM_MARGIN: f64 = 1.2;

/// The estimated restore costs of preempting one request.
#[derive(Debug, Clone, Copy)]
struct RestoreCost {
    /// Leading blocks that survive the preemption (cached, held by others): a swap leaves them
    /// on the device, a recompute hits them in the prefix cache.
    num_blocks_kept: usize,
    /// Blocks holding the other computed tokens (what a swap moves).
    num_blocks_to_move: usize,
    /// Tokens a recompute must prefill again.
    num_tokens_to_recompute: usize,
    /// Seconds to swap out and back in; `None` when the host pool cannot take the blocks.
    swap_s: Option<f64>,
    /// Seconds to prefill again.
    recompute_s: f64,
}

impl RestoreCost {
    /// The mode "auto" picks, and its cost.
    fn cheaper(&self) -> (PreemptionMode, f64) {
        match self.swap_s {
            Some(s) if s < self.recompute_s => (PreemptionMode::Swap, s),
            _ => (PreemptionMode::Recompute, self.recompute_s),
        }
    }
}

impl Scheduler {
    /// Restore costs of preempting the running request `idx` now.
    fn restore_cost(&self, idx: ReqIdx) -> RestoreCost {
        let cfg = &self.cfg;
        let r = self.reqs.get(idx);
        let computed = r.num_computed_tokens;
        let surviving =
            self.kv.num_surviving_prefix_blocks(idx).min(computed / cfg.block_size).min(r.block_hashes.len());
        let num_blocks_to_move = cfg.blocks_for(computed) - surviving;
        let num_tokens_to_recompute = computed - surviving * cfg.block_size;
        let swap_s = (self.kv.num_free_host() >= num_blocks_to_move)
            .then(|| 2.0 * num_blocks_to_move as f64 * cfg.bytes_per_block / cfg.host_link_bytes_per_s);
        RestoreCost {
            num_blocks_kept: surviving,
            num_blocks_to_move,
            num_tokens_to_recompute,
            swap_s,
            recompute_s: num_tokens_to_recompute as f64 / cfg.prefill_tokens_per_s,
        }
    }

    /// Index in `running` of the next victim (never called with `running` empty).
    pub(super) fn choose_victim(&self) -> usize {
        let running = self.queues.running();
        let key = |i: usize| precedence(self.cfg.policy, self.reqs.get(running[i]));
        let worst = (0..running.len()).max_by_key(|&i| key(i)).expect("running is not empty");
        if self.cfg.preemption_mode != PreemptionModeConfig::Auto {
            return worst;
        }
        let (w_prio, w_pre, _) = key(worst);
        let score = |i: usize| {
            let idx = running[i];
            let freed = self.kv.num_exclusive_blocks(idx) as f64;
            freed / (self.restore_cost(idx).cheaper().1 + 1e-9)
        };
        // The policy's victim stays unless another in its class is clearly better: a near tie
        // (most victims free blocks at about the same rate) must not reorder fcfs by noise.
        let mut best = (worst, score(worst));
        for i in 0..running.len() {
            let k = key(i);
            if i == worst || (k.0, k.1) != (w_prio, w_pre) {
                continue;
            }
            let s = score(i);
            if s > best.1 * AUTO_VICTIM_MARGIN {
                best = (i, s);
            }
        }
        best.0
    }

    /// Preempts `running[at]` to make room for `for_req_id`; undoes its part of the step plan.
    pub(super) fn preempt(&mut self, at: usize, for_req_id: u64, plan: &mut StepPlan) {
        let idx = self.queues.running()[at];
        self.queues.remove_running_at(at, self.reqs.get(idx).num_pending_forks as usize);
        // undo its part of this step: the budget comes back; a copy-on-write it planned is dropped
        let mut dropped_cow = None;
        if let Some(pos) = plan.scheduled.iter().position(|s| s.req_idx == idx) {
            let s = plan.scheduled.remove(pos);
            plan.budget += s.num_new;
            dropped_cow = s.copy();
        }
        let cost = self.restore_cost(idx);
        let r = self.reqs.get(idx);
        // an unforked parent whose samples are in flight cannot keep them: it prefills again
        let unforked_inflight = r.num_inflight > 0 && r.num_pending_forks > 1;
        let (mode, reason) = match (self.cfg.preemption_mode, cost.swap_s) {
            _ if unforked_inflight => (PreemptionMode::Recompute, PreemptionReason::Fork),
            (PreemptionModeConfig::Recompute, _) => (PreemptionMode::Recompute, PreemptionReason::Config),
            (PreemptionModeConfig::Swap, Some(_)) => (PreemptionMode::Swap, PreemptionReason::Config),
            (PreemptionModeConfig::Swap, None) => (PreemptionMode::Recompute, PreemptionReason::HostFull),
            (PreemptionModeConfig::Auto, _) => match cost.cheaper().0 {
                PreemptionMode::Swap => (PreemptionMode::Swap, PreemptionReason::Cost),
                // the host pool being short is what made recompute "cheaper"
                PreemptionMode::Recompute if cost.swap_s.is_none() && cost.num_blocks_to_move > 0 => {
                    (PreemptionMode::Recompute, PreemptionReason::HostFull)
                }
                PreemptionMode::Recompute => (PreemptionMode::Recompute, PreemptionReason::Cost),
            },
        };
        let free_before = self.kv.num_free();
        let r = self.reqs.get_mut(idx);
        r.num_preemptions += 1;
        if let Some(row) = r.row.take() {
            self.batch.release(row);
        }
        match mode {
            PreemptionMode::Recompute => {
                self.kv.free(idx);
                r.num_computed_tokens = 0;
                if unforked_inflight {
                    r.num_inflight = 0; // its samples are dropped when they arrive
                }
                r.num_cached_blocks = 0;
                r.status = RequestStatus::Waiting;
                self.counters.num_preemptions_recompute += 1;
                self.counters.num_tokens_recomputed += cost.num_tokens_to_recompute as u64;
                if reason == PreemptionReason::HostFull {
                    self.counters.num_swap_fallbacks += 1;
                }
                self.queues.push_waiting(idx, &self.reqs, self.cfg.policy);
            }
            PreemptionMode::Swap => {
                let keep = cost.num_blocks_kept;
                self.kv.truncate(idx, keep + cost.num_blocks_to_move); // blocks not yet computed
                let first = plan.swap_out.len();
                self.kv.swap_out(idx, keep, &mut plan.swap_out).expect("restore_cost saw host room");
                r.num_swap_prefix_blocks = keep as u32;
                self.counters.num_blocks_kept_on_swap += keep as u64;
                // The dropped copy would have filled its destination only after the swap-out
                // runs; the source still holds that content when the swap-out runs (the
                // step's first operation), so the victim's block is read from there.
                if let Some((src, dst)) = dropped_cow {
                    for pair in &mut plan.swap_out[first..] {
                        if pair[0] == dst as i32 {
                            pair[0] = src as i32;
                        }
                    }
                }
                r.status = RequestStatus::Swapped;
                self.counters.num_preemptions_swap += 1;
                self.counters.num_blocks_swapped_out += cost.num_blocks_to_move as u64;
                self.queues.push_swapped(idx, &self.reqs, self.cfg.policy);
            }
        }
        let r = self.reqs.get(idx);
        plan.preempted.push(r.req_id as i64);
        let swap = mode == PreemptionMode::Swap;
        self.events.push(PreemptionEvent {
            step: self.step,
            req_id: r.req_id,
            seq_index: r.seq_index,
            mode,
            reason,
            for_req_id,
            num_blocks_freed: self.kv.num_free() - free_before,
            bytes_to_move: if swap { (cost.num_blocks_to_move as f64 * self.cfg.bytes_per_block) as u64 } else { 0 },
            num_tokens_to_recompute: if swap { 0 } else { cost.num_tokens_to_recompute },
            swap_cost_s: cost.swap_s.unwrap_or(f64::INFINITY),
            recompute_cost_s: cost.recompute_s,
            token_budget_left: plan.budget,
            num_free_device_blocks: self.kv.num_free(),
            num_free_host_blocks: self.kv.num_free_host(),
            num_preemptions: r.num_preemptions,
        });
        self.counters.num_events += 1;
    }
}
