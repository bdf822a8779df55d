//! Randomized invariant test: random configs and random operations (add, step, abort, finish)
//! with a tiny vocabulary so prefixes are shared, `check_invariants()` after every operation,
//! and a simulated KV store that runs the swap/copy plans and checks, at every step, that each
//! row reads back exactly the KV of its own tokens at every position. Then every request must
//! finish and every block must be free.
//!
//! `FERRYMAN_RANDOM_OPS` sets the number of operations (default 100,000) and
//! `FERRYMAN_RANDOM_SEED` the first seed (default 0). Runs are deterministic for a seed.

use std::collections::{BTreeMap, VecDeque};

use ferryman_core::{
    FinishReason, Policy, PreemptionModeConfig, PreemptionReason, RequestParams, Scheduler, SchedulerConfig,
    SchedulerOutput,
};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo + 1) as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn mix(h: u64, t: u32) -> u64 {
    let mut z = h ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^ (z >> 32)
}

/// What the test knows about one sequence: its tokens and the KV content of each position
/// (a hash of the tokens up to it: KV depends on the whole prefix).
#[derive(Clone)]
struct Seq {
    tokens: Vec<u32>,
    content: Vec<u64>,
    num_prompt: usize,
    params: RequestParams,
}

impl Seq {
    fn push(&mut self, t: u32) {
        let prev = self.content.last().copied().unwrap_or(7);
        self.tokens.push(t);
        self.content.push(mix(prev, t));
    }
}

struct Harness {
    s: Scheduler,
    cfg: SchedulerConfig,
    seqs: BTreeMap<(i64, i32), Seq>,
    device: Vec<u64>,
    host: Vec<u64>,
    /// The runner's view of the persistent batch: each row's sequence and block table, kept
    /// only from the step outputs' changes.
    row_seq: Vec<Option<(i64, i32)>>,
    row_table: Vec<Vec<i32>>,
    next_id: u64,
    ops: usize,
    /// Inputs filled from a sample in flight, and samples dropped (async scheduling).
    num_inflight_inputs: u64,
    num_dropped: u64,
    num_fork_recomputes: u64,
    /// Sampled ids of the planned steps not yet `update()`d, oldest first (two at most with
    /// async scheduling).
    inflight: VecDeque<Vec<i32>>,
}

const VOCAB: u64 = 3;

impl Harness {
    fn new(cfg: SchedulerConfig) -> Self {
        let bs = cfg.block_size;
        Self {
            s: Scheduler::new(cfg.clone()).unwrap(),
            device: vec![0; (cfg.num_device_blocks + 1) * bs],
            host: vec![0; (cfg.num_host_blocks + 1) * bs],
            row_seq: vec![None; cfg.max_num_seqs],
            row_table: vec![vec![-1; cfg.blocks_for(cfg.max_model_len)]; cfg.max_num_seqs],
            cfg,
            seqs: BTreeMap::new(),
            next_id: 0,
            ops: 0,
            inflight: VecDeque::new(),
            num_inflight_inputs: 0,
            num_dropped: 0,
            num_fork_recomputes: 0,
        }
    }

    fn check(&mut self) {
        self.ops += 1;
        if let Err(e) = self.s.check_invariants() {
            panic!("after op {}: {e}", self.ops);
        }
    }

    fn add(&mut self, rng: &mut Rng) {
        let len = rng.range(1, 3 * self.cfg.block_size + 3);
        let prompt: Vec<u32> = (0..len).map(|_| 1 + rng.below(VOCAB) as u32).collect();
        let params = RequestParams {
            max_tokens: rng.range(1, 12),
            priority: rng.below(3) as i32,
            eos_token_ids: if rng.chance(0.3) { vec![1] } else { vec![] },
            stop_token_ids: if rng.chance(0.2) { vec![2] } else { vec![] },
            ignore_eos: rng.chance(0.2),
            n: if rng.chance(0.2) { rng.range(2, 3) as u32 } else { 1 },
            text: None,
            skip_reading_prefix_cache: rng.chance(0.1),
            grammar: None,
        };
        let id = self.next_id;
        self.next_id += 1;
        match self.s.add_request(id, prompt.clone(), params.clone()) {
            Ok(()) => {
                let mut seq = Seq { tokens: vec![], content: vec![], num_prompt: len, params };
                for t in prompt {
                    seq.push(t);
                }
                self.seqs.insert((id as i64, 0), seq);
            }
            Err(_) => {
                // rejected as infeasible: it must really be infeasible
                let total = len + params.max_tokens;
                assert!(
                    total > self.cfg.max_model_len
                        || self.cfg.blocks_for(total) > self.cfg.num_device_blocks
                        || params.n as usize > self.cfg.max_num_seqs
                );
            }
        }
        self.check();
    }

    fn fake_token(req: i64, k: i32, pos: usize) -> u32 {
        (mix(mix(req as u64, k as u32), pos as u32) % (VOCAB + 1)) as u32
    }

    /// Applies the step's batch changes to the runner's view: rows freed, rows taken, table
    /// entries written; every scheduled sequence must then sit in its row.
    fn apply_batch(&mut self, o: &SchedulerOutput) {
        for &r in &o.rows_removed {
            assert!(self.row_seq[r as usize].take().is_some(), "row {r} freed but not held");
        }
        for a in 0..o.rows_added.len() {
            let r = o.rows_added[a] as usize;
            assert!(self.row_seq[r].is_none(), "row {r} taken while held");
            self.row_seq[r] = Some((o.added_req_ids[a], o.added_seq_indices[a]));
            self.row_table[r].fill(-1);
        }
        for i in 0..o.table_rows.len() {
            self.row_table[o.table_rows[i] as usize][o.table_cols[i] as usize] = o.table_blocks[i];
        }
        for b in 0..o.req_ids.len() {
            assert_eq!(self.row_seq[o.rows[b] as usize], Some((o.req_ids[b], o.seq_indices[b])), "row of {b}");
        }
    }

    /// The token and KV content of position `p` of sequence `key`: known, or (async
    /// scheduling) the sample for it still in flight, which the test can tell in advance.
    fn at(&self, key: (i64, i32), p: usize) -> (u32, u64) {
        let seq = &self.seqs[&key];
        if p < seq.tokens.len() {
            return (seq.tokens[p], seq.content[p]);
        }
        assert_eq!(p, seq.tokens.len(), "{key:?} computes past its one token in flight");
        let t = Self::fake_token(key.0, key.1, p);
        (t, mix(seq.content[p - 1], t))
    }

    /// Runs the plans on the simulated KV, writes this step's tokens, and checks every row reads
    /// back its own KV through the runner's view of its block table. `prev`: the sampled ids of
    /// the step still in flight, which in-flight inputs name.
    fn run_forward(&mut self, o: &SchedulerOutput, prev: Option<&[i32]>) {
        let bs = self.cfg.block_size;
        self.apply_batch(o);
        for &[d, h] in &o.blocks_to_swap_out {
            let (d, h) = (d as usize * bs, h as usize * bs);
            self.host[h..h + bs].copy_from_slice(&self.device[d..d + bs]);
        }
        for &[h, d] in &o.blocks_to_swap_in {
            let (d, h) = (d as usize * bs, h as usize * bs);
            self.device[d..d + bs].copy_from_slice(&self.host[h..h + bs]);
        }
        for &[src, dst] in &o.blocks_to_copy {
            let (src, dst) = (src as usize * bs, dst as usize * bs);
            self.device.copy_within(src..src + bs, dst);
        }
        assert!(o.input_ids.len() <= self.cfg.max_num_batched_tokens);
        assert_eq!(*o.qo_indptr.last().unwrap() as usize, o.input_ids.len());
        let mut inputs = o.input_ids.clone();
        assert_eq!(o.inflight_token_indices.len(), o.inflight_sample_indices.len());
        assert!(prev.is_some() || o.inflight_token_indices.is_empty(), "an input names a step not in flight");
        for (&i, &src) in o.inflight_token_indices.iter().zip(&o.inflight_sample_indices) {
            assert_eq!(inputs[i as usize], -1, "an in-flight input is laid out as -1");
            inputs[i as usize] = prev.expect("checked above")[src as usize];
            self.num_inflight_inputs += 1;
        }
        for b in 0..o.req_ids.len() {
            let key = (o.req_ids[b], o.seq_indices[b]);
            let (q0, q1, len) = (o.qo_indptr[b] as usize, o.qo_indptr[b + 1] as usize, o.seq_lens[b] as usize);
            for (i, &input) in inputs.iter().enumerate().take(q1).skip(q0) {
                let p = len - (q1 - i); // the row's tokens end at its new length
                let (t, content) = self.at(key, p);
                assert_eq!(input as u32, t, "wrong input token");
                let table = &self.row_table[o.rows[b] as usize];
                self.device[table[p / bs] as usize * bs + p % bs] = content;
            }
        }
        for b in 0..o.req_ids.len() {
            let key = (o.req_ids[b], o.seq_indices[b]);
            let len = o.seq_lens[b] as usize;
            let table = &self.row_table[o.rows[b] as usize][..len.div_ceil(bs)];
            let held = self.s.block_table(o.req_ids[b] as u64, o.seq_indices[b] as u32).expect("scheduled");
            assert!(table.iter().zip(&held).all(|(&a, &b)| a as u32 == b), "the runner's row table is stale");
            assert_eq!((o.kv_indptr[b + 1] - o.kv_indptr[b]) as usize, table.len());
            assert_eq!(o.kv_last_page_len[b] as usize, len - (table.len() - 1) * bs);
            for p in 0..len {
                let slot = table[p / bs] as usize * bs + p % bs;
                assert_eq!(self.device[slot], self.at(key, p).1, "row {b} reads wrong KV at position {p}");
            }
        }
    }

    /// One step as an engine runs it: plan, run the forward and sample; then (at once, or with
    /// async scheduling after planning the next step) apply the samples.
    fn step(&mut self, rng: &mut Rng) {
        if !self.cfg.async_scheduling {
            self.plan_step();
            // an abort can land between schedule() and update()
            if rng.chance(0.02) {
                if let Some((r, _)) = self.pick(rng) {
                    self.abort(r);
                    self.check();
                }
            }
            self.apply_step();
            return;
        }
        // keep two steps in flight mostly; sometimes let the pipeline drain to one
        if self.inflight.len() < 2 && self.s.has_unfinished_requests() {
            self.plan_step();
        }
        if self.inflight.len() == 2 || (!self.inflight.is_empty() && rng.chance(0.2)) {
            self.apply_step();
        }
    }

    /// `schedule()`, the forward on the simulated KV, and the samples (the token at each sample
    /// row's next position, a function of the sequence and the position).
    fn plan_step(&mut self) {
        let o = self.s.schedule().unwrap();
        self.check();
        self.num_fork_recomputes +=
            self.s.drain_events().iter().filter(|e| e.reason == PreemptionReason::Fork).count() as u64;
        let prev = self.inflight.back().cloned();
        self.run_forward(&o, prev.as_deref());
        let sampled = (0..o.logits_indices.len())
            .map(|i| {
                let b = o.qo_indptr.partition_point(|&q| q as i64 <= o.logits_indices[i]) - 1;
                // the sampler reads a sample's row and position from its own columns
                assert_eq!((o.sample_rows[i], o.sample_positions[i]), (o.rows[b], o.seq_lens[b]), "sample {i}");
                Self::fake_token(o.sample_req_ids[i], o.sample_seq_indices[i], o.seq_lens[b] as usize) as i32
            })
            .collect();
        self.inflight.push_back(sampled);
    }

    /// `update()` of the oldest step in flight; checks every applied token and finish reason.
    fn apply_step(&mut self) {
        let sampled = self.inflight.pop_front().expect("a step is in flight");
        let res = self.s.update(&sampled).unwrap();
        self.check();
        // each row's sequence before this update (a new fork starts as its parent)
        let bases: Vec<Option<Seq>> = (0..res.req_ids.len())
            .map(|i| {
                let (r, k) = (res.req_ids[i], res.seq_indices[i]);
                self.seqs.get(&(r, k)).or_else(|| self.seqs.get(&(r, 0))).cloned()
            })
            .collect();
        for (i, base) in bases.into_iter().enumerate() {
            let key = (res.req_ids[i], res.seq_indices[i]);
            assert_eq!(res.new_token_ids[i], sampled[i], "row {i} is not sample {i}");
            if res.num_output_tokens[i] == 0 {
                assert_eq!(res.finish_reasons[i], None, "a dropped sample finishes nothing");
                self.num_dropped += 1;
                continue; // its sequence ended (or must recompute) while it was in flight
            }
            let mut seq = base.unwrap_or_else(|| panic!("{key:?} got a token but is not live"));
            assert_eq!(
                res.new_token_ids[i] as u32,
                Self::fake_token(key.0, key.1, seq.tokens.len()),
                "{key:?} got the sample of another position"
            );
            seq.push(res.new_token_ids[i] as u32);
            assert_eq!(res.num_output_tokens[i] as usize, seq.tokens.len() - seq.num_prompt);
            let t = *seq.tokens.last().unwrap();
            let p = &seq.params;
            let outputs = seq.tokens.len() - seq.num_prompt;
            let want = if (!p.ignore_eos && p.eos_token_ids.contains(&t)) || p.stop_token_ids.contains(&t) {
                Some(FinishReason::Stop)
            } else if outputs >= p.max_tokens || seq.tokens.len() >= self.cfg.max_model_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            assert_eq!(res.finish_reasons[i], want, "finish of {key:?} after {outputs} outputs");
            if want.is_some() {
                self.seqs.remove(&key);
            } else {
                self.seqs.insert(key, seq);
            }
        }
    }

    /// A live sequence chosen by the test's RNG (deterministic for a seed).
    fn pick(&self, rng: &mut Rng) -> Option<(i64, i32)> {
        let n = self.seqs.len();
        (n > 0).then(|| *self.seqs.keys().nth(rng.below(n as u64) as usize).expect("n > 0"))
    }

    fn abort(&mut self, req: i64) {
        assert!(self.s.abort_request(req as u64));
        self.seqs.retain(|&(r, _), _| r != req);
    }

    fn drain(&mut self, rng: &mut Rng) {
        let mut steps = 0;
        while self.s.has_unfinished_requests() || !self.inflight.is_empty() {
            self.step(rng);
            steps += 1;
            assert!(steps < 20_000, "no progress: a request never finishes");
        }
        let cur = self.s.current();
        assert_eq!(cur.num_free_device_blocks, self.cfg.num_device_blocks, "device blocks leaked");
        assert_eq!(cur.num_free_host_blocks, self.cfg.num_host_blocks, "host blocks leaked");
        let c = *self.s.counters();
        assert_eq!(c.num_events, c.num_preemptions_recompute + c.num_preemptions_swap);
        self.seqs.clear();
    }
}

fn random_config(rng: &mut Rng) -> SchedulerConfig {
    let block_size = [1, 2, 4][rng.below(3) as usize];
    let chunked = rng.chance(0.8);
    let max_model_len = rng.range(8, 40);
    let budget = if chunked { rng.range(2, 48) } else { rng.range(max_model_len, 64) };
    SchedulerConfig {
        block_size,
        num_device_blocks: rng.range(max_model_len.div_ceil(block_size) / 2 + 1, 40),
        num_host_blocks: [0, 4, 16, 64][rng.below(4) as usize],
        max_num_batched_tokens: budget,
        max_num_seqs: rng.range(1, 6),
        max_model_len,
        enable_chunked_prefill: chunked,
        enable_prefix_caching: rng.chance(0.8),
        preemption_mode: [PreemptionModeConfig::Recompute, PreemptionModeConfig::Swap, PreemptionModeConfig::Auto]
            [rng.below(3) as usize],
        policy: if rng.chance(0.5) { Policy::Fcfs } else { Policy::Priority },
        watermark: if rng.chance(0.5) { 0.0 } else { 0.1 },
        bytes_per_block: [1e3, 1e6, 1e9][rng.below(3) as usize],
        host_link_bytes_per_s: 1e9,
        prefill_tokens_per_s: 1e4,
        async_scheduling: rng.chance(0.5),
    }
}

#[test]
fn random_operations_keep_every_invariant() {
    let target: usize = std::env::var("FERRYMAN_RANDOM_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mut total = 0;
    let mut seed: u64 = std::env::var("FERRYMAN_RANDOM_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut preemptions = [0u64; 2];
    let (mut kept_prefix_swaps, mut lost_prefixes, mut swap_dropped) = (0u64, 0u64, 0u64);
    let (mut inflight_inputs, mut dropped, mut fork_recomputes) = (0u64, 0u64, 0u64);
    while total < target {
        let mut rng = Rng(seed);
        eprintln!("seed {seed} (rerun alone with FERRYMAN_RANDOM_SEED={seed})"); // shown on failure
        seed += 1;
        let cfg = random_config(&mut rng);
        let mut h = Harness::new(cfg);
        for _ in 0..rng.range(50, 400) {
            match rng.below(10) {
                0..=2 => h.add(&mut rng),
                3..=8 => h.step(&mut rng),
                _ => {
                    if let Some((r, k)) = h.pick(&mut rng) {
                        if rng.chance(0.5) {
                            h.abort(r);
                        } else {
                            h.s.finish_request(r as u64, FinishReason::Stop, Some(k as u32)).unwrap();
                            h.seqs.remove(&(r, k));
                        }
                        h.check();
                    }
                }
            }
        }
        h.drain(&mut rng);
        let c = h.s.counters();
        preemptions[0] += c.num_preemptions_recompute;
        preemptions[1] += c.num_preemptions_swap;
        kept_prefix_swaps += c.num_blocks_kept_on_swap;
        inflight_inputs += h.num_inflight_inputs;
        dropped += h.num_dropped;
        fork_recomputes += h.num_fork_recomputes;
        lost_prefixes += c.num_swap_prefix_lost;
        swap_dropped += c.num_blocks_swap_dropped;
        total += h.ops;
    }
    println!(
        "{total} operations over {seed} configs; preemptions recompute={} swap={}; blocks kept on \
         the device by swaps={kept_prefix_swaps}, kept prefixes lost={lost_prefixes}, host blocks \
         dropped={swap_dropped}; async: \
         inputs in flight={inflight_inputs}, samples dropped={dropped}, unforked parents \
         recomputed={fork_recomputes}",
        preemptions[0], preemptions[1]
    );
    assert!(preemptions[0] > 0 && preemptions[1] > 0, "the workloads must exercise both modes");
    assert!(kept_prefix_swaps > 0 && lost_prefixes > 0, "and swaps that keep a prefix, kept or lost");
    assert!(swap_dropped > 0, "and swapped requests that end without a swap-in");
    assert!(inflight_inputs > 0 && dropped > 0 && fork_recomputes > 0, "and async steps' corner cases");
}
