//! `Batch`: the persistent batch (vLLM v1's InputBatch idea). A running sequence takes a row in
//! `[0, max_num_seqs)` the first time it is scheduled and keeps it until it stops running
//! (finished, aborted or preempted). The runner keeps per-row state in tensors indexed by row —
//! the block table `[max_num_seqs, max_blocks_per_seq]` above all — so a step tells it only what
//! changed: the rows freed, the rows taken, and the block-table entries written since it last
//! heard, instead of every row's whole table.
//!
//! Invariants: a row is free or held, never both; a sequence holds at most one row (its
//! `Request::row`) and holds it only while running; `sent[row]` counts the leading entries of the
//! holder's block table that the runner has, and they equal the table's (checked by the
//! scheduler's `check_invariants`). Free rows are handed out lowest first, so the held rows stay
//! packed towards 0.

use crate::arena::ReqIdx;

/// Rows of the persistent batch and what the runner has been told about them.
#[derive(Debug, Clone)]
pub struct Batch {
    holder: Vec<Option<ReqIdx>>,
    /// Free rows, highest first, so `pop()` gives the lowest.
    free: Vec<u32>,
    /// Per row: leading block-table entries the runner holds.
    sent: Vec<usize>,
    /// Rows freed since the last `take_removed()`.
    removed: Vec<i32>,
}

impl Batch {
    /// `max_num_seqs` free rows.
    pub fn new(max_num_seqs: usize) -> Self {
        Self {
            holder: vec![None; max_num_seqs],
            free: (0..max_num_seqs as u32).rev().collect(),
            sent: vec![0; max_num_seqs],
            removed: Vec::new(),
        }
    }

    /// Gives the lowest free row to `idx`; the runner holds none of its table yet.
    pub fn take(&mut self, idx: ReqIdx) -> u32 {
        let row = self.free.pop().expect("running sequences never exceed max_num_seqs");
        self.holder[row as usize] = Some(idx);
        self.sent[row as usize] = 0;
        row
    }

    /// Frees `row` (its holder stopped running).
    pub fn release(&mut self, row: u32) {
        debug_assert!(self.holder[row as usize].is_some(), "row {row} released twice");
        self.holder[row as usize] = None;
        let at = self.free.partition_point(|&r| r > row);
        self.free.insert(at, row);
        self.removed.push(row as i32);
    }

    /// Leading block-table entries of `row` the runner holds.
    #[inline]
    pub fn sent(&self, row: u32) -> usize {
        self.sent[row as usize]
    }

    /// The runner now holds `n` leading entries of `row`'s table.
    #[inline]
    pub fn set_sent(&mut self, row: u32, n: usize) {
        self.sent[row as usize] = n;
    }

    /// The rows freed since the last call, in order.
    pub fn take_removed(&mut self) -> Vec<i32> {
        std::mem::take(&mut self.removed)
    }

    /// The sequence holding `row`, if any.
    pub fn holder(&self, row: u32) -> Option<ReqIdx> {
        self.holder[row as usize]
    }

    /// Rows held now.
    pub fn num_held(&self) -> usize {
        self.holder.len() - self.free.len()
    }

    /// Free list and holders agree: every row is free or held, exactly once.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.holder.len()];
        for &r in &self.free {
            if self.holder[r as usize].is_some() || std::mem::replace(&mut seen[r as usize], true) {
                return Err(format!("batch row {r} is free and held, or free twice"));
            }
        }
        if self.free.windows(2).any(|w| w[0] <= w[1]) {
            return Err("batch free rows out of order".into());
        }
        if seen.iter().zip(&self.holder).any(|(&f, h)| !f && h.is_none()) {
            return Err("a batch row is neither free nor held".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_taken_lowest_first_and_reported_when_freed() {
        let mut b = Batch::new(4);
        let (r0, r1, r2) = (b.take(ReqIdx::new(7)), b.take(ReqIdx::new(8)), b.take(ReqIdx::new(9)));
        assert_eq!((r0, r1, r2), (0, 1, 2));
        b.set_sent(1, 3);
        b.release(1);
        b.release(0);
        assert_eq!(b.take_removed(), vec![1, 0]);
        assert!(b.take_removed().is_empty());
        assert_eq!(b.take(ReqIdx::new(10)), 0);
        let r = b.take(ReqIdx::new(11));
        assert_eq!((r, b.sent(r)), (1, 0), "a retaken row starts with nothing sent");
        assert_eq!(b.num_held(), 3);
        assert_eq!(b.holder(2), Some(ReqIdx::new(9)));
        b.check().unwrap();
    }
}
