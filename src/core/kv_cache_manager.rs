//! `KvCacheManager`: turns token counts into blocks. Owns the device and host `BlockPool`s, the
//! prefix cache, and every request's block table (indexed by the request's `ReqIdx`).
//!
//! Check/commit pairs: the scheduler asks `num_new_blocks` / `num_free`, then commits with
//! `admit` or `allocate_slots`, which return `None` when the blocks are not there (a value, not
//! an error). Swapping lives in `kv_cache_manager/swap.rs` on the same type.
//!
//! Tables hold block ids as i32, the dtype they cross the boundary in, so building
//! `kv_indices` is a plain copy.
//!
//! Invariants: every block in a device table has `ref_cnt` equal to the number of tables that
//! hold it; a table never holds `NULL_BLOCK`; a request holds a device table or a host table,
//! not both.

mod swap;

use crate::arena::ReqIdx;
use crate::block_pool::{BlockPool, NULL_BLOCK};
use crate::prefix_cache::PrefixCache;

/// The block bookkeeping of one scheduler.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    block_size: usize,
    /// log2(block_size): block arithmetic is shifts and masks on the hot path.
    block_shift: u32,
    device: BlockPool,
    host: BlockPool,
    prefix_cache: PrefixCache,
    enable_prefix_caching: bool,
    tables: Vec<Vec<i32>>,
    host_tables: Vec<Vec<i32>>,
    /// Requests whose device table may share a partly filled block (set by `fork`, cleared when
    /// the table is dropped): only they can need a copy-on-write, so others skip the check.
    forked: Vec<bool>,
}

/// A copy-on-write the step must run before the forward: (src, dst) device blocks.
pub type BlockCopy = (u32, u32);

/// Blocks needed to hold `num_tokens` tokens: the one place this is computed. `block_size` is a
/// power of two (`SchedulerConfig::validate`), so this is an add and a shift.
#[inline]
pub fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    debug_assert!(block_size.is_power_of_two());
    (num_tokens + block_size - 1) >> block_size.trailing_zeros()
}

impl KvCacheManager {
    /// Pools of `num_device_blocks` and `num_host_blocks` usable blocks.
    pub fn new(block_size: usize, num_device_blocks: usize, num_host_blocks: usize, prefix: bool) -> Self {
        debug_assert!(block_size.is_power_of_two());
        Self {
            block_size,
            block_shift: block_size.trailing_zeros(),
            device: BlockPool::new(num_device_blocks),
            host: BlockPool::new(num_host_blocks),
            prefix_cache: PrefixCache::new(num_device_blocks + 1),
            enable_prefix_caching: prefix,
            tables: Vec::new(),
            host_tables: Vec::new(),
            forked: Vec::new(),
        }
    }

    /// Makes room for the tables of request `idx`.
    pub fn ensure_tables(&mut self, idx: ReqIdx) {
        let n = idx.get() + 1;
        if self.tables.len() < n {
            self.tables.resize_with(n, Vec::new);
            self.host_tables.resize_with(n, Vec::new);
            self.forked.resize(n, false);
        }
    }

    /// The device block table of `idx`.
    #[inline]
    pub fn table(&self, idx: ReqIdx) -> &[i32] {
        &self.tables[idx.get()]
    }

    /// The host block table of `idx` (non-empty only while swapped).
    #[inline]
    pub fn host_table(&self, idx: ReqIdx) -> &[i32] {
        &self.host_tables[idx.get()]
    }

    /// Free device blocks (evictable cached blocks included).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.device.num_free()
    }

    /// Free host blocks.
    #[inline]
    pub fn num_free_host(&self) -> usize {
        self.host.num_free()
    }

    /// Blocks registered in the prefix cache (free or in use).
    pub fn num_cached_blocks(&self) -> usize {
        self.prefix_cache.len()
    }

    /// The device pool's free list, head (evicted next) first (tests, debugging).
    pub fn device_free_list(&self) -> Vec<u32> {
        self.device.free_list()
    }

    /// Appends to `hashes` the prefix hashes of the full blocks of `token_ids` it lacks.
    #[inline]
    pub fn hash_blocks(&mut self, hashes: &mut Vec<u128>, token_ids: &[i32]) {
        self.prefix_cache.hash_blocks(hashes, token_ids, self.block_size);
    }

    /// Leading blocks of `hashes` found in the prefix cache, and how many of them are currently
    /// free (a hit on a free block takes it off the free list).
    pub fn match_prefix(&self, hashes: &[u128]) -> (usize, usize) {
        let mut num_free_hits = 0;
        for (i, &h) in hashes.iter().enumerate() {
            match self.prefix_cache.lookup(&self.device, h) {
                Some(b) => num_free_hits += usize::from(self.device.ref_cnt(b) == 0),
                None => return (i, num_free_hits),
            }
        }
        (hashes.len(), num_free_hits)
    }

    /// Gives a request without blocks the cached blocks of `hit_hashes` plus `num_new` fresh blocks.
    /// `None` (nothing changed) if the pool cannot supply them.
    pub fn admit(&mut self, idx: ReqIdx, hit_hashes: &[u128], num_free_hits: usize, num_new: usize) -> Option<()> {
        debug_assert!(self.tables[idx.get()].is_empty() && self.host_tables[idx.get()].is_empty());
        if self.device.num_free() < num_new + num_free_hits {
            return None;
        }
        let mut table = std::mem::take(&mut self.tables[idx.get()]);
        table.reserve(hit_hashes.len() + num_new);
        for &h in hit_hashes {
            let b = self.prefix_cache.lookup(&self.device, h).expect("match_prefix saw this hash");
            self.device.touch(b);
            table.push(b as i32);
        }
        for _ in 0..num_new {
            table.push(self.allocate_block().expect("counted above") as i32);
        }
        self.tables[idx.get()] = table;
        Some(())
    }

    /// Blocks `allocate_slots(idx, num_computed, num_new)` would take: new blocks past the
    /// table's end, plus one if the first token lands in a shared block (copy-on-write).
    #[inline]
    pub fn num_new_blocks(&self, idx: ReqIdx, num_computed: usize, num_new: usize) -> usize {
        self.blocks_needed(idx, num_computed, num_new).2
    }

    /// (blocks the table must reach, index of the block to copy on write, new blocks needed).
    #[inline]
    fn blocks_needed(&self, idx: ReqIdx, num_computed: usize, num_new: usize) -> (usize, Option<usize>, usize) {
        let want = blocks_for(num_computed + num_new, self.block_size);
        let cow_idx = self.cow_index(idx, num_computed);
        let need = want.saturating_sub(self.tables[idx.get()].len()) + usize::from(cow_idx.is_some());
        (want, cow_idx, need)
    }

    /// The index of the shared, partly filled block the next token would be written into.
    #[inline]
    fn cow_index(&self, idx: ReqIdx, num_computed: usize) -> Option<usize> {
        if !self.forked[idx.get()] || num_computed & (self.block_size - 1) == 0 {
            return None;
        }
        let i = num_computed >> self.block_shift;
        self.tables[idx.get()].get(i).filter(|&&b| self.device.ref_cnt(b as u32) > 1).map(|_| i)
    }

    /// Makes the table cover `num_computed + num_new` tokens, copying a shared partly filled
    /// block first. Returns the copy to run, if any; `None` when the pool is short (no change).
    #[inline]
    pub fn allocate_slots(&mut self, idx: ReqIdx, num_computed: usize, num_new: usize) -> Option<Option<BlockCopy>> {
        let s = idx.get();
        if !self.forked[s] && blocks_for(num_computed + num_new, self.block_size) <= self.tables[s].len() {
            return Some(None); // most decodes: an unshared table whose last block has room
        }
        self.grow_slots(idx, num_computed, num_new)
    }

    /// `allocate_slots` past its common case: new blocks, or a forked table.
    #[inline(never)]
    fn grow_slots(&mut self, idx: ReqIdx, num_computed: usize, num_new: usize) -> Option<Option<BlockCopy>> {
        let s = idx.get();
        let (want, cow_idx, need) = self.blocks_needed(idx, num_computed, num_new);
        if need == 0 {
            return Some(None); // most decodes: the last block has room
        }
        if need > self.device.num_free() {
            return None;
        }
        let mut cow = None;
        if let Some(idx) = cow_idx {
            let src = self.tables[s][idx] as u32;
            let dst = self.allocate_block().expect("counted above");
            self.device.free(src, true); // still held by the other forks
            self.tables[s][idx] = dst as i32;
            cow = Some((src, dst));
        }
        while self.tables[s].len() < want {
            let b = self.allocate_block().expect("counted above");
            self.tables[s].push(b as i32);
        }
        Some(cow)
    }

    /// Takes a block off the free list, forgetting the content it cached.
    #[inline]
    fn allocate_block(&mut self) -> Option<u32> {
        let b = self.device.allocate()?;
        if self.enable_prefix_caching {
            self.prefix_cache.evict(&mut self.device, b);
        }
        Some(b)
    }

    /// Drops the request's device references, last block first, so that a prefix is evicted from
    /// its tail. Cached blocks keep their content for later hits. Returns the blocks freed.
    pub fn free(&mut self, idx: ReqIdx) -> usize {
        self.forked[idx.get()] = false;
        let table = std::mem::take(&mut self.tables[idx.get()]);
        let mut freed = 0;
        for &b in table.iter().rev() {
            let b = b as u32;
            freed += usize::from(self.device.free(b, self.device.is_cached(b)));
        }
        let mut table = table;
        table.clear();
        self.tables[idx.get()] = table; // keep the allocation for the next occupant
        freed
    }

    /// Frees device blocks of the request beyond the first `keep` (no content worth keeping).
    pub fn truncate(&mut self, idx: ReqIdx, keep: usize) {
        while self.tables[idx.get()].len() > keep {
            let b = self.tables[idx.get()].pop().expect("len > keep") as u32;
            self.device.free(b, self.device.is_cached(b));
        }
    }

    /// Gives `child` the same blocks as `parent` (one more reference each).
    pub fn fork(&mut self, parent: ReqIdx, child: ReqIdx) {
        debug_assert!(self.tables[child.get()].is_empty());
        let mut t = std::mem::take(&mut self.tables[child.get()]);
        t.extend_from_slice(&self.tables[parent.get()]);
        for &b in &t {
            self.device.touch(b as u32);
        }
        self.tables[child.get()] = t;
        self.forked[parent.get()] = true;
        self.forked[child.get()] = true;
    }

    /// Registers the request's blocks `from..to` under `hashes[from..to]` in the prefix cache.
    pub fn cache_blocks(&mut self, idx: ReqIdx, hashes: &[u128], from: usize, to: usize) {
        let table = &self.tables[idx.get()];
        for i in from..to {
            self.prefix_cache.insert(&mut self.device, table[i] as u32, hashes[i]);
        }
    }

    /// Blocks of the request that only it holds: what preempting it really frees.
    pub fn num_exclusive_blocks(&self, idx: ReqIdx) -> usize {
        self.tables[idx.get()].iter().filter(|&&b| self.device.ref_cnt(b as u32) == 1).count()
    }

    /// Leading blocks of the request that others also hold and that are cached: they survive its
    /// preemption, so its re-prefill will hit them.
    pub fn num_surviving_prefix_blocks(&self, idx: ReqIdx) -> usize {
        self.tables[idx.get()]
            .iter()
            .take_while(|&&b| self.device.ref_cnt(b as u32) > 1 && self.device.is_cached(b as u32))
            .count()
    }

    /// Checks both pools and the prefix cache; that each block's `ref_cnt` equals the number of
    /// tables holding it and free + used + null = total, per pool; that no table holds
    /// `NULL_BLOCK`; and that a table sharing an uncached block is marked forked
    /// (`check_invariants`).
    pub fn check(&self) -> Result<(), String> {
        self.device.check("device pool")?;
        self.host.check("host pool")?;
        if self.enable_prefix_caching {
            self.prefix_cache.check(&self.device)?;
        }
        check_ref_counts("device", &self.device, &self.tables)?;
        check_ref_counts("host", &self.host, &self.host_tables)?;
        for (i, table) in self.tables.iter().enumerate() {
            // sharing outside the prefix cache comes only from forks, which must be marked so
            // that a write into a shared block copies it first
            let shared_uncached =
                table.iter().any(|&b| self.device.ref_cnt(b as u32) > 1 && !self.device.is_cached(b as u32));
            if shared_uncached && !self.forked[i] {
                return Err(format!("request index {i} shares an uncached block but is not marked forked"));
            }
        }
        Ok(())
    }
}

/// Each block's `ref_cnt` in `pool` equals the number of `tables` holding it; none holds the
/// null block; free + used + null = total.
fn check_ref_counts(name: &str, pool: &BlockPool, tables: &[Vec<i32>]) -> Result<(), String> {
    let mut refs = vec![0u32; pool.num_blocks()];
    for (i, table) in tables.iter().enumerate() {
        for &b in table {
            if b as u32 == NULL_BLOCK {
                return Err(format!("request index {i} holds the {name} null block"));
            }
            refs[b as usize] += 1;
        }
    }
    for (b, &n) in refs.iter().enumerate().skip(1) {
        if pool.ref_cnt(b as u32) != n {
            return Err(format!("{name} block {b}: ref_cnt {} but {n} tables hold it", pool.ref_cnt(b as u32)));
        }
    }
    let used = refs.iter().skip(1).filter(|&&n| n > 0).count();
    if used + pool.num_free() + 1 != pool.num_blocks() {
        return Err(format!("{name}: free + used + null != total"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: ReqIdx = ReqIdx::new(0);
    const R1: ReqIdx = ReqIdx::new(1);

    #[test]
    fn cow_copies_a_shared_partial_block_once() {
        let mut kv = KvCacheManager::new(4, 8, 0, true);
        kv.ensure_tables(R1);
        kv.admit(R0, &[], 0, 2).unwrap(); // 6 prompt tokens -> blocks [1, 2]
        kv.fork(R0, R1);
        assert_eq!(kv.table(R1), &[1, 2]);
        assert_eq!(kv.device.ref_cnt(2), 2);
        // fork 1 writes position 6, inside shared block 2
        assert_eq!(kv.num_new_blocks(R1, 6, 1), 1);
        assert_eq!(kv.allocate_slots(R1, 6, 1), Some(Some((2, 3))));
        assert_eq!(kv.table(R1), &[1, 3]);
        // fork 0 now holds block 2 alone: no copy
        assert_eq!(kv.allocate_slots(R0, 6, 1), Some(None));
        assert_eq!(kv.device.ref_cnt(2), 1);
        assert_eq!(kv.device.ref_cnt(1), 2);
    }

    #[test]
    fn allocate_slots_is_all_or_nothing() {
        let mut kv = KvCacheManager::new(4, 3, 0, false);
        kv.ensure_tables(R0);
        kv.admit(R0, &[], 0, 1).unwrap();
        assert_eq!(kv.allocate_slots(R0, 0, 16), None); // needs 4 blocks, pool has 3
        assert_eq!(kv.table(R0), &[1]);
        assert_eq!(kv.allocate_slots(R0, 0, 12), Some(None));
        assert_eq!(kv.table(R0), &[1, 2, 3]);
        assert_eq!(kv.free(R0), 3);
        assert_eq!(kv.device.free_list(), vec![1, 2, 3]); // uncached blocks go to the head
    }

    #[test]
    fn check_finds_references_the_tables_do_not_account_for() {
        let mut kv = KvCacheManager::new(4, 4, 0, true);
        kv.ensure_tables(R1);
        kv.admit(R0, &[], 0, 2).unwrap();
        kv.check().unwrap();
        kv.tables[1].push(1); // a second table holds block 1 without a reference
        assert_eq!(kv.check().unwrap_err(), "device block 1: ref_cnt 1 but 2 tables hold it");
        kv.device.touch(1); // counted now, but shared, uncached, by tables not marked forked
        assert!(kv.check().unwrap_err().ends_with("not marked forked"));
    }
}
