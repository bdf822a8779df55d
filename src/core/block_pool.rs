//! `BlockPool`: the blocks of one KV pool (device or host), their `ref_cnt`, the free list, and
//! the prefix hash of the content each holds.
//!
//! Blocks live in one flat array of 32-byte records indexed by `block_id`; the free list is
//! doubly linked through them by index, so allocate, free and "take this free block off the
//! list" (a prefix cache hit on a free block) are all O(1). A block's count, links and hash share
//! one record, so allocating, freeing or registering a block touches one cache line of it (in a
//! pool of ~10^5 blocks these lines are rarely in the CPU's caches; with four arrays each
//! operation missed up to four times). Block 0 is `NULL_BLOCK`: it is never on the free list and
//! never handed out.
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
/// The hash of a block holding no registered content.
pub const NO_HASH: u128 = 0;

/// What the pool keeps of one block.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Node {
    /// Prefix hash of its registered content, or `NO_HASH` (set by the prefix cache).
    hash: u128,
    ref_cnt: u32,
    prev: u32,
    next: u32,
}

const _: () = assert!(std::mem::size_of::<Node>() == 32); // two per cache line, never straddling

/// One pool of `num_blocks` blocks (block 0 included).
#[derive(Debug, Clone)]
pub struct BlockPool {
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
    num_free: usize,
}

impl BlockPool {
    /// A pool with `num_usable` allocatable blocks plus the null block; all free, in id order.
    pub fn new(num_usable: usize) -> Self {
        let n = num_usable + 1;
        let node = Node { hash: NO_HASH, ref_cnt: 0, prev: NIL, next: NIL };
        let mut pool = Self { nodes: vec![node; n], head: NIL, tail: NIL, num_free: 0 };
        pool.nodes[NULL_BLOCK as usize].ref_cnt = 1; // pinned forever
        for b in 1..n as u32 {
            pool.push_back(b);
        }
        pool
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.nodes.len()
    }

    /// Blocks on the free list (cached-but-unreferenced blocks included).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// The reference count of `block`.
    #[inline]
    pub fn ref_cnt(&self, block: u32) -> u32 {
        self.nodes[block as usize].ref_cnt
    }

    /// The prefix hash of the content `block` holds, or `NO_HASH`.
    #[inline]
    pub fn hash(&self, block: u32) -> u128 {
        self.nodes[block as usize].hash
    }

    /// Whether `block` holds registered content (worth keeping when freed).
    #[inline]
    pub fn is_cached(&self, block: u32) -> bool {
        self.nodes[block as usize].hash != NO_HASH
    }

    /// Records that `block` holds the content `hash` (`NO_HASH`: nothing registered).
    #[inline]
    pub fn set_hash(&mut self, block: u32, hash: u128) {
        self.nodes[block as usize].hash = hash;
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
        self.nodes[b as usize].ref_cnt = 1;
        Some(b)
    }

    /// Adds a reference to `block`; if it was free (a prefix-cache hit), takes it off the list.
    #[inline]
    pub fn touch(&mut self, block: u32) {
        debug_assert_ne!(block, NULL_BLOCK);
        if self.nodes[block as usize].ref_cnt == 0 {
            self.unlink(block);
        }
        self.nodes[block as usize].ref_cnt += 1;
    }

    /// Drops one reference. Returns true when the block became free; it then goes to the tail
    /// (`keep` = its content is worth keeping) or to the head (reused first).
    #[inline]
    pub fn free(&mut self, block: u32, keep: bool) -> bool {
        debug_assert_ne!(block, NULL_BLOCK);
        let rc = &mut self.nodes[block as usize].ref_cnt;
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
            b = self.nodes[b as usize].next;
        }
        out
    }

    fn unlink(&mut self, b: u32) {
        let node = &mut self.nodes[b as usize];
        let (p, n) = (node.prev, node.next);
        (node.prev, node.next) = (NIL, NIL);
        if p == NIL {
            self.head = n;
        } else {
            self.nodes[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.nodes[n as usize].prev = p;
        }
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        let node = &mut self.nodes[b as usize];
        (node.prev, node.next) = (self.tail, NIL);
        if self.tail == NIL {
            self.head = b;
        } else {
            self.nodes[self.tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        let node = &mut self.nodes[b as usize];
        (node.prev, node.next) = (NIL, self.head);
        if self.head == NIL {
            self.tail = b;
        } else {
            self.nodes[self.head as usize].prev = b;
        }
        self.head = b;
        self.num_free += 1;
    }

    /// Checks the free list against the reference counts (`check_invariants`).
    pub fn check(&self, name: &str) -> Result<(), String> {
        if self.nodes[NULL_BLOCK as usize].ref_cnt != 1 {
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
        for (b, (&listed, node)) in on_list.iter().zip(&self.nodes).enumerate().skip(1) {
            let rc = node.ref_cnt;
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
