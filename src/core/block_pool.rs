//! `BlockPool`: the blocks of one KV pool (device or host), their `ref_cnt`, and the free list.
//!
//! Blocks live in flat arrays indexed by `block_id`; the free list is doubly linked through
//! those arrays by index, so allocate, free and "take this free block off the list" (a prefix
//! cache hit on a free block) are all O(1). Block 0 is `NULL_BLOCK`: it is never on the free
//! list and never handed out.
//!
//! Free-list order is eviction order: `allocate` pops the head. A freed block that still holds
//! reusable content (a prefix-cache hash) goes to the tail, so it is evicted last; a freed block
//! with nothing worth keeping goes to the head, so it is reused first.
//!
//! Invariants: a block is on the free list iff `ref_cnt == 0` and it is not `NULL_BLOCK`;
//! `num_free` equals the list's length.

/// The reserved block id; pads tables and is never allocated.
pub const NULL_BLOCK: u32 = 0;
const NIL: u32 = u32::MAX;

/// One pool of `num_blocks` blocks (block 0 included).
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
}

impl BlockPool {
    /// A pool with `num_usable` allocatable blocks plus the null block; all free, in id order.
    pub fn new(num_usable: usize) -> Self {
        let n = num_usable + 1;
        let mut pool =
            Self { ref_cnt: vec![0; n], prev: vec![NIL; n], next: vec![NIL; n], head: NIL, tail: NIL, num_free: 0 };
        pool.ref_cnt[NULL_BLOCK as usize] = 1; // pinned forever
        for b in 1..n as u32 {
            pool.push_back(b);
        }
        pool
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks on the free list (cached-but-unreferenced blocks included).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// The reference count of `block`.
    #[inline]
    pub fn ref_cnt(&self, block: u32) -> u32 {
        self.ref_cnt[block as usize]
    }

    /// Takes the head of the free list and gives it `ref_cnt = 1`; `None` when none is free.
    /// The caller must forget whatever the block held before (its prefix hash).
    #[inline]
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        self.ref_cnt[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to `block`; if it was free (a prefix-cache hit), takes it off the list.
    #[inline]
    pub fn touch(&mut self, block: u32) {
        debug_assert_ne!(block, NULL_BLOCK);
        if self.ref_cnt[block as usize] == 0 {
            self.unlink(block);
        }
        self.ref_cnt[block as usize] += 1;
    }

    /// Drops one reference. Returns true when the block became free; it then goes to the tail
    /// (`keep` = its content is worth keeping) or to the head (reused first).
    #[inline]
    pub fn free(&mut self, block: u32, keep: bool) -> bool {
        debug_assert_ne!(block, NULL_BLOCK);
        let rc = &mut self.ref_cnt[block as usize];
        debug_assert!(*rc > 0, "double free of block {block}");
        *rc -= 1;
        if *rc > 0 {
            return false;
        }
        if keep {
            self.push_back(block);
        } else {
            self.push_front(block);
        }
        true
    }

    /// The free list from head (next to be evicted) to tail.
    pub fn free_list(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NIL && out.len() <= self.num_blocks() {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.num_free += 1;
    }

    /// Checks the free list against the reference counts (`check_invariants`).
    pub fn check(&self, name: &str) -> Result<(), String> {
        if self.ref_cnt[NULL_BLOCK as usize] != 1 {
            return Err(format!("{name}: null block ref_cnt changed"));
        }
        let list = self.free_list();
        if list.len() != self.num_free {
            return Err(format!("{name}: free list has {} blocks, num_free = {}", list.len(), self.num_free));
        }
        let mut on_list = vec![false; self.num_blocks()];
        for &b in &list {
            if b == NULL_BLOCK || on_list[b as usize] {
                return Err(format!("{name}: block {b} on the free list twice or null"));
            }
            on_list[b as usize] = true;
        }
        for (b, (&listed, &rc)) in on_list.iter().zip(&self.ref_cnt).enumerate().skip(1) {
            if listed != (rc == 0) {
                return Err(format!("{name}: block {b} ref_cnt {rc} but on free list = {listed}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_in_id_order_and_never_the_null_block() {
        let mut p = BlockPool::new(3);
        assert_eq!(p.num_free(), 3);
        assert_eq!((p.allocate(), p.allocate(), p.allocate(), p.allocate()), (Some(1), Some(2), Some(3), None));
        assert_eq!(p.num_free(), 0);
        p.check("t").unwrap();
    }

    #[test]
    fn kept_blocks_go_to_the_tail_others_to_the_head() {
        let mut p = BlockPool::new(4);
        let bs: Vec<u32> = (0..4).map(|_| p.allocate().unwrap()).collect();
        assert!(p.free(bs[0], true));
        assert!(p.free(bs[1], true));
        assert!(p.free(bs[2], false));
        assert_eq!(p.free_list(), vec![3, 1, 2]);
        assert_eq!(p.allocate(), Some(3));
        p.check("t").unwrap();
    }

    #[test]
    fn touch_takes_a_free_block_off_the_list_and_shares_a_used_one() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap();
        p.free(a, true);
        assert_eq!(p.free_list(), vec![2, 3, 1]);
        p.touch(1); // prefix hit on a free cached block
        assert_eq!(p.free_list(), vec![2, 3]);
        p.touch(1); // shared
        assert_eq!(p.ref_cnt(1), 2);
        assert!(!p.free(1, true));
        assert!(p.free(1, true));
        assert_eq!(p.free_list(), vec![2, 3, 1]);
        p.check("t").unwrap();
    }
}
