//! `RequestArena`: the storage of every live request, by `ReqIdx` and by `req_id`.
//!
//! A `ReqIdx` is a request's index in the arena: dense, stable while the request lives, reused
//! after it ends. The KV cache manager indexes its block tables by it too. (It is not a KV
//! *slot*: a slot is a token's flat KV position, block * block_size + offset.)
//!
//! The forks of a parallel-sampling request share one `req_id`; `indices(req_id)` lists them in
//! the order they were made (the parent first).
//!
//! An index removed while steps are pending (between `schedule()` and `update()`) is deferred:
//! a pending step may still name it, so it is reused only after the newest step pending at its
//! removal is updated (`release_deferred(step)`).
//!
//! Invariants: an index is occupied, free or deferred, exactly one of them; `by_id` lists
//! exactly the occupied indices, each under its request's `req_id`, and no empty list.

use rustc_hash::FxHashMap;

use crate::request::Request;

/// The index of a live request in the `RequestArena` (and of its block tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqIdx(u32);

impl ReqIdx {
    /// The index `i`.
    #[inline]
    pub const fn new(i: u32) -> Self {
        Self(i)
    }

    /// As a `usize`, for indexing.
    #[inline]
    pub const fn get(self) -> usize {
        self.0 as usize
    }
}

/// Every live request, found by index or by `req_id`.
#[derive(Debug, Clone, Default)]
pub struct RequestArena {
    reqs: Vec<Option<Request>>,
    free: Vec<ReqIdx>,
    deferred: Vec<(ReqIdx, u64)>,
    by_id: FxHashMap<u64, Vec<ReqIdx>>,
}

impl RequestArena {
    /// An empty arena.
    pub fn new() -> Self {
        Self::default()
    }

    /// True when no request is live.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The indices of the live forks of `req_id`, parent first; `None` if it is not live.
    #[inline]
    pub fn indices(&self, req_id: u64) -> Option<&[ReqIdx]> {
        self.by_id.get(&req_id).map(Vec::as_slice)
    }

    /// The index of the live fork `seq_index` of `req_id`.
    pub fn find_fork(&self, req_id: u64, seq_index: u32) -> Option<ReqIdx> {
        self.indices(req_id)?.iter().copied().find(|&i| self.get(i).seq_index == seq_index)
    }

    /// The live request at `idx`; panics if there is none (a bug).
    #[inline]
    pub fn get(&self, idx: ReqIdx) -> &Request {
        self.reqs[idx.get()].as_ref().expect("index holds a live request")
    }

    /// The live request at `idx`, mutably; panics if there is none (a bug).
    #[inline]
    pub fn get_mut(&mut self, idx: ReqIdx) -> &mut Request {
        self.reqs[idx.get()].as_mut().expect("index holds a live request")
    }

    /// The request at `idx` if it is still live (a pending step may name one that ended).
    #[inline]
    pub fn try_get(&self, idx: ReqIdx) -> Option<&Request> {
        self.reqs[idx.get()].as_ref()
    }

    /// The request at `idx`, mutably, if it is still live.
    #[inline]
    pub fn try_get_mut(&mut self, idx: ReqIdx) -> Option<&mut Request> {
        self.reqs[idx.get()].as_mut()
    }

    /// Stores a request with a new `req_id`.
    pub fn insert(&mut self, req: Request) -> ReqIdx {
        let req_id = req.req_id;
        let idx = self.store(req);
        let before = self.by_id.insert(req_id, vec![idx]);
        debug_assert!(before.is_none(), "req_id {req_id} is already live");
        idx
    }

    /// Stores one more fork of a live `req_id`.
    pub fn insert_fork(&mut self, req: Request) -> ReqIdx {
        let req_id = req.req_id;
        let idx = self.store(req);
        self.by_id.get_mut(&req_id).expect("a fork's request is live").push(idx);
        idx
    }

    /// Puts `req` at a free index (or a new one) and returns it; `by_id` is the caller's.
    fn store(&mut self, req: Request) -> ReqIdx {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.reqs.push(None);
                ReqIdx((self.reqs.len() - 1) as u32)
            }
        };
        self.reqs[idx.get()] = Some(req);
        idx
    }

    /// Removes the request at `idx`; also returns whether it was the last fork of its `req_id`.
    /// With `defer = Some(step)`, the index is reused only after `release_deferred(step)`.
    pub fn remove(&mut self, idx: ReqIdx, defer: Option<u64>) -> (Request, bool) {
        let r = self.reqs[idx.get()].take().expect("index holds a live request");
        let forks = self.by_id.get_mut(&r.req_id).expect("live request is indexed");
        forks.retain(|&i| i != idx);
        let last = forks.is_empty();
        if last {
            self.by_id.remove(&r.req_id);
        }
        match defer {
            Some(step) => self.deferred.push((idx, step)),
            None => self.free.push(idx),
        }
        (r, last)
    }

    /// Makes the indices deferred until step `step` (or earlier) reusable: call after its
    /// `update()`.
    pub fn release_deferred(&mut self, step: u64) {
        let free = &mut self.free;
        self.deferred.retain(|&(idx, s)| {
            let keep = s > step;
            if !keep {
                free.push(idx);
            }
            keep
        });
    }

    /// Every index ever handed out, with its request if it is live (`check_invariants`).
    pub fn iter(&self) -> impl Iterator<Item = (ReqIdx, Option<&Request>)> {
        self.reqs.iter().enumerate().map(|(i, r)| (ReqIdx(i as u32), r.as_ref()))
    }

    /// Indices listed under some `req_id` (`check_invariants`: equals the live requests).
    pub fn num_indexed(&self) -> usize {
        self.by_id.values().map(Vec::len).sum()
    }
}
