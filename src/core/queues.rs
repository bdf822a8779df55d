//! `Queues`: the `waiting`, `running` and `swapped` queues of live requests (by `ReqIdx`), and
//! how many sequences run.
//!
//! Precedence (lower is first): policy "fcfs" orders by (-num_preemptions, arrival); "priority"
//! by (priority, -num_preemptions, arrival). `waiting` and `swapped` are kept in this order, a
//! request going after every one that ranks at or before it; `running` is in admission order.
//! Victims of preemption come from the other end of precedence.
//!
//! Invariants: a live request is in exactly one queue, the one its status names;
//! `num_running_seqs` is the sum over `running` of `num_pending_forks` (an unforked parent
//! counts as its `n`).

use std::collections::VecDeque;

use crate::arena::{ReqIdx, RequestArena};
use crate::config::Policy;
use crate::request::{Request, RequestStatus};

/// Precedence key of `r` under `policy`: lower goes first (admission), higher is preempted first.
#[inline]
pub fn precedence(policy: Policy, r: &Request) -> (i64, i64, u64) {
    let prio = match policy {
        Policy::Fcfs => 0,
        Policy::Priority => r.priority as i64,
    };
    (prio, -(r.num_preemptions as i64), r.arrival)
}

/// Inserts `idx` into `queue` after every request that ranks at or before it.
fn insert_by_precedence(queue: &mut VecDeque<ReqIdx>, idx: ReqIdx, reqs: &RequestArena, policy: Policy) {
    let key = precedence(policy, reqs.get(idx));
    let at = queue.partition_point(|&i| precedence(policy, reqs.get(i)) <= key);
    queue.insert(at, idx);
}

/// The three queues of one scheduler.
#[derive(Debug, Clone, Default)]
pub struct Queues {
    waiting: VecDeque<ReqIdx>,
    running: Vec<ReqIdx>,
    swapped: VecDeque<ReqIdx>,
    /// Running forks, counting an unforked parent as its `n`.
    num_running_seqs: usize,
}

impl Queues {
    /// Empty queues.
    pub fn new() -> Self {
        Self::default()
    }

    /// The running requests, in admission order.
    #[inline]
    pub fn running(&self) -> &[ReqIdx] {
        &self.running
    }

    /// Running sequences (an unforked parent counts as its `n`).
    #[inline]
    pub fn num_running_seqs(&self) -> usize {
        self.num_running_seqs
    }

    /// Sizes of `waiting`, `running`, `swapped`.
    #[inline]
    pub fn lens(&self) -> (usize, usize, usize) {
        (self.waiting.len(), self.running.len(), self.swapped.len())
    }

    /// The waiting request of highest precedence.
    #[inline]
    pub fn next_waiting(&self) -> Option<ReqIdx> {
        self.waiting.front().copied()
    }

    /// The swapped request of highest precedence.
    #[inline]
    pub fn next_swapped(&self) -> Option<ReqIdx> {
        self.swapped.front().copied()
    }

    /// Takes `next_waiting()` off the queue.
    pub fn pop_waiting(&mut self) {
        self.waiting.pop_front();
    }

    /// Takes `next_swapped()` off the queue.
    pub fn pop_swapped(&mut self) {
        self.swapped.pop_front();
    }

    /// Queues `idx` as waiting, in precedence order.
    pub fn push_waiting(&mut self, idx: ReqIdx, reqs: &RequestArena, policy: Policy) {
        insert_by_precedence(&mut self.waiting, idx, reqs, policy);
    }

    /// Queues `idx` as swapped, in precedence order.
    pub fn push_swapped(&mut self, idx: ReqIdx, reqs: &RequestArena, policy: Policy) {
        insert_by_precedence(&mut self.swapped, idx, reqs, policy);
    }

    /// Appends `idx` to `running`; it runs `num_seqs` sequences (its `num_pending_forks`).
    pub fn push_running(&mut self, idx: ReqIdx, num_seqs: usize) {
        self.num_running_seqs += num_seqs;
        self.running.push(idx);
    }

    /// Appends a new fork to `running`; its parent already counted it.
    pub fn push_fork(&mut self, idx: ReqIdx) {
        self.running.push(idx);
    }

    /// Removes `running[at]`, which ran `num_seqs` sequences, and returns it.
    pub fn remove_running_at(&mut self, at: usize, num_seqs: usize) -> ReqIdx {
        self.num_running_seqs -= num_seqs;
        self.running.remove(at)
    }

    /// Removes `idx` from the queue its `status` names (`num_seqs`: as for `push_running`).
    pub fn remove(&mut self, idx: ReqIdx, status: RequestStatus, num_seqs: usize) {
        match status {
            RequestStatus::Running => {
                let at = self.running.iter().position(|&i| i == idx).expect("running request is queued");
                self.remove_running_at(at, num_seqs);
            }
            RequestStatus::Swapped => self.swapped.retain(|&i| i != idx),
            RequestStatus::Waiting => self.waiting.retain(|&i| i != idx),
        }
    }

    /// How many times `idx` sits in `waiting`, `running`, `swapped` (`check_invariants`).
    pub fn count(&self, idx: ReqIdx) -> (usize, usize, usize) {
        (
            self.waiting.iter().filter(|&&i| i == idx).count(),
            self.running.iter().filter(|&&i| i == idx).count(),
            self.swapped.iter().filter(|&&i| i == idx).count(),
        )
    }
}
