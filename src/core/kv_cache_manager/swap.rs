//! Swapping on `KvCacheManager`: moving a request's blocks to the host pool and back.
//!
//! `swap_out` gives the request a host block for each device block past its first `keep` ones,
//! emits (device, host) pairs for `blocks_to_swap_out`, and drops all its device references (a
//! block shared with a fork stays on the device for it; cached content stays hittable). The
//! `keep` leading blocks are cached blocks that others hold: copying them would only duplicate
//! them on the way back, so they stay on the device and `swap_in` takes them back from the
//! prefix cache by hash, then brings the rest into fresh device blocks. Both are all-or-nothing
//! and return `None` when the target pool is short.
//!
//! Ordering contract with Python: in one step the plans run swap-out, then swap-in, then copy,
//! all before the forward. The scheduler never swaps in during a step that swapped out, so a
//! block freed by one plan is never the target of the other in the same step.

use super::KvCacheManager;
use crate::arena::ReqIdx;

impl KvCacheManager {
    /// Moves the request's device table past its first `keep` blocks to host blocks, appending
    /// (device, host) pairs to `plan`, and drops the whole device table. Returns the device
    /// blocks freed, or `None` (nothing changed) if the host pool is short.
    pub fn swap_out(&mut self, idx: ReqIdx, keep: usize, plan: &mut Vec<[i32; 2]>) -> Option<usize> {
        let s = idx.get();
        debug_assert!(self.host_tables[s].is_empty() && keep <= self.tables[s].len());
        if self.host.num_free() < self.tables[s].len() - keep {
            return None;
        }
        let mut host_table = std::mem::take(&mut self.host_tables[s]);
        for &d in &self.tables[s][keep..] {
            let h = self.host.allocate().expect("counted above") as i32;
            host_table.push(h);
            plan.push([d, h]);
        }
        self.host_tables[s] = host_table;
        Some(self.free(idx))
    }

    /// Takes back the cached blocks of `prefix_hashes` (all must be cached: `match_prefix`
    /// says so first; `num_free_hits` of them are on the free list) and brings the request's host
    /// table back into fresh device blocks after them, appending (host, device) pairs to `plan`.
    /// `None` (nothing changed) if the device pool is short.
    pub fn swap_in(
        &mut self,
        idx: ReqIdx,
        prefix_hashes: &[u128],
        num_free_hits: usize,
        plan: &mut Vec<[i32; 2]>,
    ) -> Option<()> {
        let s = idx.get();
        debug_assert!(self.tables[s].is_empty());
        if self.device.num_free() < self.host_tables[s].len() + num_free_hits {
            return None;
        }
        let host_table = std::mem::take(&mut self.host_tables[s]);
        let mut table = std::mem::take(&mut self.tables[s]);
        for &h in prefix_hashes {
            let b = self.prefix_cache.lookup(&self.device, h).expect("match_prefix saw this hash");
            self.device.touch(b);
            table.push(b as i32);
        }
        for &h in &host_table {
            let d = self.allocate_block().expect("counted above") as i32;
            table.push(d);
            plan.push([h, d]);
            self.host.free(h as u32, false);
        }
        self.tables[s] = table;
        let mut host_table = host_table;
        host_table.clear();
        self.host_tables[s] = host_table;
        Some(())
    }

    /// Drops a swapped request's host blocks (it ended while swapped, or it is recomputed
    /// instead of swapped back in); returns how many.
    pub fn free_host(&mut self, idx: ReqIdx) -> usize {
        let s = idx.get();
        for &h in &self.host_tables[s] {
            self.host.free(h as u32, false);
        }
        let n = self.host_tables[s].len();
        self.host_tables[s].clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::KvCacheManager;
    use crate::arena::ReqIdx;

    const R0: ReqIdx = ReqIdx::new(0);
    const R1: ReqIdx = ReqIdx::new(1);

    #[test]
    fn round_trip_moves_every_block_and_frees_both_sides() {
        let mut kv = KvCacheManager::new(4, 4, 3, false);
        kv.ensure_tables(R1);
        kv.admit(R0, &[], 0, 3).unwrap();
        let mut out = Vec::new();
        assert_eq!(kv.swap_out(R0, 0, &mut out), Some(3));
        assert_eq!(out, vec![[1, 1], [2, 2], [3, 3]]);
        assert_eq!((kv.num_free(), kv.num_free_host()), (4, 0));
        assert!(kv.table(R0).is_empty());
        // another request takes two device blocks meanwhile
        kv.admit(R1, &[], 0, 2).unwrap();
        let mut back = Vec::new();
        assert_eq!(kv.swap_in(R0, &[], 0, &mut back), None); // 2 free < 3 needed
        kv.free(R1);
        assert_eq!(kv.swap_in(R0, &[], 0, &mut back), Some(()));
        assert_eq!(back.len(), 3);
        assert_eq!(back.iter().map(|p| p[0]).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(kv.num_free_host(), 3);
    }

    #[test]
    fn swap_out_is_refused_when_the_host_pool_is_short() {
        let mut kv = KvCacheManager::new(4, 4, 1, false);
        kv.ensure_tables(R0);
        kv.admit(R0, &[], 0, 2).unwrap();
        let mut out = Vec::new();
        assert_eq!(kv.swap_out(R0, 0, &mut out), None);
        assert!(out.is_empty());
        assert_eq!(kv.table(R0).len(), 2);
    }
}
