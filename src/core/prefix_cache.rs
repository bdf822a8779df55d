//! Prefix cache: full device blocks keyed by a hash of (parent block's hash, the block's tokens).
//!
//! A block is registered once all its tokens are computed (in `update`, after the forward wrote
//! its KV), so a hit never reads KV that is not there yet. A freed block keeps its hash and stays
//! in the cache until the pool hands it out again (`evict`), which is what lets a finished or
//! recompute-preempted request's prefix be hit again.
//!
//! Hashes are 128-bit xxh3, chained through the parent, so two blocks with the same tokens after
//! different prefixes differ; a false hit needs a 128-bit collision. When two requests compute
//! the same block at once, the first registered keeps the entry; the other block stays private.
//!
//! Each block's current hash lives in the device `BlockPool`'s record of it, beside its count
//! and free-list links. The map is a table of block ids alone (4 bytes a block), placed by the
//! hash's low 64 bits and told apart by the block's full hash in the pool: at ~10^5 blocks it
//! fits in a core's L2 cache, where a map holding the keys did not (its random accesses were most
//! of what prefix caching cost). Removing a block compares ids, so it reads no other block.
//!
//! Invariants: the table holds each block with a hash (`pool.hash(b) != NO_HASH`) once, placed
//! by that hash, and no other block; no two blocks hold the same hash.

use hashbrown::hash_table::{Entry, HashTable};
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::block_pool::{BlockPool, NO_HASH};

/// The device pool's registered blocks, found by content hash.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    blocks: HashTable<u32>,
    scratch: Vec<u8>,
}

/// Hashes of the full blocks of `token_ids` not yet in `hashes`, appended in block order.
///
/// Each block hashes the bytes of its parent's hash (little-endian) followed by its tokens'.
/// The common block sizes hash from a stack buffer of their exact length, which lets xxh3 pick
/// its path at compile time (about twice as fast per block as a buffer sized at run time).
pub fn extend_block_hashes(hashes: &mut Vec<u128>, token_ids: &[i32], block_size: usize, scratch: &mut Vec<u8>) {
    match block_size {
        8 => chain::<48>(hashes, token_ids, &mut [0; 48]),
        16 => chain::<80>(hashes, token_ids, &mut [0; 80]),
        32 => chain::<144>(hashes, token_ids, &mut [0; 144]),
        64 => chain::<272>(hashes, token_ids, &mut [0; 272]),
        _ => {
            scratch.resize(16 + 4 * block_size, 0);
            chain::<0>(hashes, token_ids, scratch)
        }
    }
}

/// `extend_block_hashes` over `buf`, which holds one parent hash and one block of tokens; `N`
/// is its length when known at compile time (else 0).
#[inline(always)]
fn chain<const N: usize>(hashes: &mut Vec<u128>, token_ids: &[i32], buf: &mut [u8]) {
    let len = if N > 0 { N } else { buf.len() };
    let block_size = (len - 16) / 4;
    let num_full = token_ids.len() / block_size;
    hashes.reserve(num_full.saturating_sub(hashes.len()));
    while hashes.len() < num_full {
        let i = hashes.len();
        let parent = if i == 0 { NO_HASH } else { hashes[i - 1] };
        let (head, tail) = buf[..len].split_at_mut(16);
        head.copy_from_slice(&parent.to_le_bytes());
        for (c, t) in tail.chunks_exact_mut(4).zip(&token_ids[i * block_size..(i + 1) * block_size]) {
            c.copy_from_slice(&t.to_le_bytes());
        }
        let h = xxh3_128_with_seed(&buf[..len], 0x6665_7272_796d_616e); // "ferryman"
        hashes.push(if h == NO_HASH { 1 } else { h });
    }
}

/// Where the table places a block hash.
#[inline]
fn key(hash: u128) -> u64 {
    hash as u64
}

impl PrefixCache {
    /// An empty cache over a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        // never grows: a block holds at most one entry
        Self { blocks: HashTable::with_capacity(num_blocks), scratch: Vec::new() }
    }

    /// The block of `pool` holding content `hash`, if any.
    #[inline]
    pub fn lookup(&self, pool: &BlockPool, hash: u128) -> Option<u32> {
        self.blocks.find(key(hash), |&b| pool.hash(b) == hash).copied()
    }

    /// Registers `block` as holding `hash` unless that content is already cached elsewhere.
    #[inline]
    pub fn insert(&mut self, pool: &mut BlockPool, block: u32, hash: u128) {
        if pool.is_cached(block) {
            return;
        }
        let at = |b: &u32| key(pool.hash(*b));
        if let Entry::Vacant(e) = self.blocks.entry(key(hash), |&b| pool.hash(b) == hash, at) {
            e.insert(block);
            pool.set_hash(block, hash);
        }
    }

    /// Forgets what `block` held; called when the pool hands it out again.
    #[inline]
    pub fn evict(&mut self, pool: &mut BlockPool, block: u32) {
        let h = pool.hash(block);
        if h != NO_HASH {
            pool.set_hash(block, NO_HASH);
            if let Ok(e) = self.blocks.find_entry(key(h), |&b| b == block) {
                e.remove();
            }
        }
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Computes missing block hashes of `token_ids` into `hashes` (see `extend_block_hashes`).
    pub fn hash_blocks(&mut self, hashes: &mut Vec<u128>, token_ids: &[i32], block_size: usize) {
        extend_block_hashes(hashes, token_ids, block_size, &mut self.scratch);
    }

    /// Checks that the table and `pool`'s hashes agree (`check_invariants`).
    pub fn check(&self, pool: &BlockPool) -> Result<(), String> {
        let mut seen = vec![false; pool.num_blocks()];
        for &b in &self.blocks {
            if std::mem::replace(&mut seen[b as usize], true) {
                return Err(format!("prefix cache lists block {b} twice"));
            }
            let h = pool.hash(b);
            if h == NO_HASH || self.blocks.find(key(h), |&x| x == b).is_none() {
                return Err(format!("prefix cache lists block {b}, which holds no registered content"));
            }
            if self.lookup(pool, h) != Some(b) {
                return Err(format!("prefix cache holds block {b}'s content twice"));
            }
        }
        let n = (0..pool.num_blocks() as u32).filter(|&b| pool.hash(b) != NO_HASH).count();
        if n != self.blocks.len() {
            return Err(format!("{n} blocks carry a hash but the prefix cache lists {}", self.blocks.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_through_the_parent() {
        let mut s = Vec::new();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        extend_block_hashes(&mut a, &[1, 2, 3, 4, 5], 2, &mut s);
        extend_block_hashes(&mut b, &[9, 9, 3, 4], 2, &mut s);
        assert_eq!(a.len(), 2); // the partial block [5] is not hashed
        assert_ne!(a[1], b[1]); // same tokens [3, 4], different parent
        let mut c = vec![a[0]];
        extend_block_hashes(&mut c, &[1, 2, 3, 4], 2, &mut s);
        assert_eq!(c, a);
    }

    #[test]
    fn the_stack_buffer_paths_hash_as_the_general_one() {
        let tokens: Vec<i32> = (0..300).map(|t| t * 7919 % 151_936).collect();
        for bs in [8, 16, 32, 64] {
            let (mut fast, mut general, mut s) = (Vec::new(), Vec::new(), Vec::new());
            extend_block_hashes(&mut fast, &tokens, bs, &mut s);
            s.resize(16 + 4 * bs, 0);
            chain::<0>(&mut general, &tokens, &mut s);
            assert_eq!(fast.len(), 300 / bs);
            assert_eq!(fast, general, "block size {bs}");
        }
    }

    #[test]
    fn first_registration_wins_and_evict_forgets() {
        let (mut pc, mut pool) = (PrefixCache::new(4), BlockPool::new(3));
        pc.insert(&mut pool, 1, 77);
        pc.insert(&mut pool, 2, 77);
        assert_eq!(pc.lookup(&pool, 77), Some(1));
        assert!(!pool.is_cached(2));
        pc.evict(&mut pool, 1);
        assert_eq!(pc.lookup(&pool, 77), None);
        pc.check(&pool).unwrap();
    }

    #[test]
    fn two_hashes_in_one_place_are_told_apart() {
        let (a, b) = (5u128, (9u128 << 64) | 5); // same low 64 bits: the same place in the table
        let (mut pc, mut pool) = (PrefixCache::new(4), BlockPool::new(3));
        pc.insert(&mut pool, 1, a);
        assert_eq!(pc.lookup(&pool, b), None); // told apart by block 1's full hash
        pc.insert(&mut pool, 2, b);
        assert_eq!((pc.lookup(&pool, a), pc.lookup(&pool, b)), (Some(1), Some(2)));
        pc.check(&pool).unwrap();
        pc.evict(&mut pool, 1); // removes block 1's entry, not block 2's
        assert_eq!((pc.lookup(&pool, a), pc.lookup(&pool, b)), (None, Some(2)));
        pc.check(&pool).unwrap();
    }

    #[test]
    fn check_finds_a_map_entry_whose_block_holds_other_content() {
        let (mut pc, mut pool) = (PrefixCache::new(4), BlockPool::new(3));
        pc.insert(&mut pool, 1, 77);
        pool.set_hash(1, (0x7f << 57) | 77); // placed elsewhere (another tag in the table)
        assert_eq!(pc.check(&pool).unwrap_err(), "prefix cache lists block 1, which holds no registered content");
        pool.set_hash(1, 77);
        pool.set_hash(2, 77);
        assert_eq!(pc.check(&pool).unwrap_err(), "2 blocks carry a hash but the prefix cache lists 1");
        // block 1 listed twice instead of blocks 1 and 2: each entry alone looks right
        pc.blocks.insert_unique(key(77), 1, |&b| key(pool.hash(b)));
        assert_eq!(pc.check(&pool).unwrap_err(), "prefix cache lists block 1 twice");
    }
}
