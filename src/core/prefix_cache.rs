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
//! The map is keyed by the hash's low 64 bits (half the memory of 128-bit keys, and the map's
//! random accesses are what prefix caching costs); a hit is confirmed against the block's full
//! 128-bit hash, and a key already taken by other content counts as cached elsewhere.
//!
//! Invariant: `hash_to_block[key(h)] == b` implies `block_hash[b] == h`.

use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_128_with_seed;

const NO_HASH: u128 = 0;

/// Hash-to-block map of the device pool plus each block's current hash.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_hash: Vec<u128>,
    hash_to_block: FxHashMap<u64, u32>,
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

/// The map key of a block hash.
#[inline]
fn key(hash: u128) -> u64 {
    hash as u64
}

impl PrefixCache {
    /// An empty cache over a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        let mut hash_to_block = FxHashMap::default();
        hash_to_block.reserve(num_blocks); // never rehashes: a block holds at most one entry
        Self { block_hash: vec![NO_HASH; num_blocks], hash_to_block, scratch: Vec::new() }
    }

    /// The block holding content `hash`, if any.
    #[inline]
    pub fn lookup(&self, hash: u128) -> Option<u32> {
        self.hash_to_block.get(&key(hash)).copied().filter(|&b| self.block_hash[b as usize] == hash)
    }

    /// Whether `block` holds registered content (worth keeping when freed).
    #[inline]
    pub fn is_cached(&self, block: u32) -> bool {
        self.block_hash[block as usize] != NO_HASH
    }

    /// Registers `block` as holding `hash` unless that content is already cached elsewhere.
    #[inline]
    pub fn insert(&mut self, block: u32, hash: u128) {
        if self.block_hash[block as usize] != NO_HASH {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.hash_to_block.entry(key(hash)) {
            e.insert(block);
            self.block_hash[block as usize] = hash;
        }
    }

    /// Forgets what `block` held; called when the pool hands it out again.
    #[inline]
    pub fn evict(&mut self, block: u32) {
        let h = std::mem::replace(&mut self.block_hash[block as usize], NO_HASH);
        if h != NO_HASH {
            self.hash_to_block.remove(&key(h));
        }
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.hash_to_block.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.hash_to_block.is_empty()
    }

    /// Computes missing block hashes of `token_ids` into `hashes` (see `extend_block_hashes`).
    pub fn hash_blocks(&mut self, hashes: &mut Vec<u128>, token_ids: &[i32], block_size: usize) {
        extend_block_hashes(hashes, token_ids, block_size, &mut self.scratch);
    }

    /// Checks map/array agreement (`check_invariants`).
    pub fn check(&self) -> Result<(), String> {
        for (&k, &b) in &self.hash_to_block {
            if key(self.block_hash[b as usize]) != k {
                return Err(format!("prefix cache maps a hash to block {b}, which holds another"));
            }
        }
        let n = self.block_hash.iter().filter(|&&h| h != NO_HASH).count();
        if n != self.hash_to_block.len() {
            return Err(format!("{n} blocks carry a hash but the map has {}", self.hash_to_block.len()));
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
        let mut pc = PrefixCache::new(4);
        pc.insert(1, 77);
        pc.insert(2, 77);
        assert_eq!(pc.lookup(77), Some(1));
        assert!(!pc.is_cached(2));
        pc.evict(1);
        assert_eq!(pc.lookup(77), None);
        pc.check().unwrap();
    }

    #[test]
    fn a_key_shared_by_two_hashes_hits_only_the_registered_one() {
        let (a, b) = (5u128, (9u128 << 64) | 5); // same low 64 bits
        let mut pc = PrefixCache::new(4);
        pc.insert(1, a);
        pc.insert(2, b);
        assert_eq!(pc.lookup(a), Some(1));
        assert_eq!(pc.lookup(b), None); // confirmed against block 1's full hash
        assert!(!pc.is_cached(2));
        pc.evict(1);
        pc.insert(2, b);
        assert_eq!(pc.lookup(b), Some(2));
        pc.check().unwrap();
    }
}
