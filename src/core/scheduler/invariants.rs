//! `check_invariants()`: verifies the whole state against docs/design.md §5. O(state); for tests and
//! debugging, never on the hot path.

use super::Scheduler;
use crate::error::{CoreError, CoreResult};
use crate::request::RequestStatus;

impl Scheduler {
    /// Checks pools, reference counts, tables, queues and counters; the first violation found is
    /// returned as `CoreError::InvariantViolated`.
    pub fn check_invariants(&self) -> CoreResult<()> {
        self.check_all().map_err(CoreError::InvariantViolated)
    }

    fn check_all(&self) -> Result<(), String> {
        let kv = &self.kv;
        kv.check()?;
        let mut num_live = 0;
        let mut num_rows = 0;
        let mut num_host_held = 0; // host blocks of swapped requests
        self.batch.check()?;
        for (idx, req) in self.reqs.iter() {
            let (table, host_table) = (kv.table(idx), kv.host_table(idx));
            let Some(r) = req else {
                if !table.is_empty() || !host_table.is_empty() {
                    return Err(format!("free request index {} holds blocks", idx.get()));
                }
                continue;
            };
            num_live += 1;
            let id = format!("request {} fork {}", r.req_id, r.seq_index);
            if r.num_computed_tokens > r.num_tokens_scheduled() {
                return Err(format!("{id} computed more tokens than it has"));
            }
            if r.num_inflight as usize > self.pending.len() {
                return Err(format!(
                    "{id} has {} samples in flight in {} pending steps",
                    r.num_inflight,
                    self.pending.len()
                ));
            }
            let queues = self.queues.count(idx);
            match r.status {
                RequestStatus::Waiting => {
                    if queues != (1, 0, 0) || !table.is_empty() || !host_table.is_empty() || r.num_computed_tokens != 0
                    {
                        return Err(format!("{id} is waiting but holds blocks, computed tokens or sits in {queues:?}"));
                    }
                }
                RequestStatus::Running => {
                    if queues != (0, 1, 0) || !host_table.is_empty() {
                        return Err(format!("{id} is running but holds host blocks or sits in {queues:?}"));
                    }
                    if table.len() < self.cfg.blocks_for(r.num_computed_tokens) {
                        return Err(format!("{id}'s table does not cover its computed tokens"));
                    }
                }
                RequestStatus::Swapped => {
                    if queues != (0, 0, 1) || !table.is_empty() {
                        return Err(format!("{id} is swapped but holds device blocks or sits in {queues:?}"));
                    }
                    if host_table.len() + r.num_swap_prefix_blocks as usize
                        != self.cfg.blocks_for(r.num_computed_tokens)
                    {
                        return Err(format!("{id}'s host table does not match its computed tokens"));
                    }
                    num_host_held += host_table.len();
                }
            }
            if let Some(row) = r.row {
                if r.status != RequestStatus::Running || self.batch.holder(row) != Some(idx) {
                    return Err(format!("{id} holds batch row {row} but is not running in it"));
                }
                if self.batch.sent(row) > table.len() {
                    return Err(format!("{id}'s row was sent more blocks than its table has"));
                }
                num_rows += 1;
            }
            if !self.reqs.indices(r.req_id).is_some_and(|v| v.contains(&idx)) {
                return Err(format!("{id} is not indexed by its req_id"));
            }
        }
        if num_rows != self.batch.num_held() {
            return Err(format!("{num_rows} sequences hold batch rows, the batch counts {}", self.batch.num_held()));
        }
        let (num_waiting, num_running, num_swapped) = self.queues.lens();
        if num_live != num_waiting + num_running + num_swapped {
            return Err("a queue holds a request twice or a dead one".into());
        }
        if self.reqs.num_indexed() != num_live {
            return Err("req_id index out of step with the live requests".into());
        }
        let seqs: usize = self.queues.running().iter().map(|&i| self.reqs.get(i).num_pending_forks as usize).sum();
        let counted = self.queues.num_running_seqs();
        if seqs != counted || seqs > self.cfg.max_num_seqs {
            return Err(format!("running forks {seqs} (counted {counted}) vs max_num_seqs"));
        }
        let last = &self.last_step;
        if last.num_scheduled_tokens > self.cfg.max_num_batched_tokens {
            return Err("last step exceeded the token budget".into());
        }
        let c = &self.counters;
        if c.num_preemptions_recompute + c.num_preemptions_swap != c.num_events {
            return Err("preemption counters differ from the events emitted".into());
        }
        if c.num_blocks_swapped_out != c.num_blocks_swapped_in + c.num_blocks_swap_dropped + num_host_held as u64 {
            return Err(format!(
                "blocks swapped out {} != in {} + dropped {} + held on the host {num_host_held}",
                c.num_blocks_swapped_out, c.num_blocks_swapped_in, c.num_blocks_swap_dropped
            ));
        }
        Ok(())
    }
}
