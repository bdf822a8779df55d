//! Random sampling on the CPU: one token per row of float32 logits, each row with its own
//! temperature, top-k, top-p, min-p, seed and position. The algorithm is the Python sampler's
//! (`ferryman/worker/sampler.py`, torch ops, which serves CUDA and is the reference in tests):
//! 1. the logits divided by the temperature;
//! 2. top-k (k > 0): the tokens whose scaled logit is at least the k-th largest (ties kept);
//! 3. top-p (p < 1): of those, by descending logit, a token is dropped when the probability mass
//!    before it (softmax over the top-k survivors) already exceeds p;
//! 4. the survivors' probabilities (their softmax); min-p (> 0) zeroes those below
//!    min_p × the largest;
//! 5. an exponential race: the winner maximizes p / E with E = -ln(u), u a counter-based hash of
//!    (seed, position, token id) (`uniform`), so a row's sample depends on its own seed and
//!    position only, never on the batch.
//!
//! Dtypes follow the Python sampler (float32 probabilities, float64 race, the top-p prefix sums
//! accumulated in float64 as torch does on the CPU), so both pick the same token except where two
//! candidates tie to within rounding, or the mass before a token lies within float64 rounding
//! of a float32 boundary (a block of surely kept tokens has its mass summed in its own order).
//!
//! What makes it cheap:
//! - top-k by selection (O(V)) of the k-th largest, not a sort of the vocabulary: from 2,048
//!   tokens on, over the tokens above a pivot read off a strided sample of the row (`pivot`);
//!   below that, for a k too large to gain from a pivot, or where the sample misjudged, over
//!   every token's sort key, which leaves the candidates first (no pass to filter them out);
//! - top-p after a top-k of at most 128 candidates: one sort of them (at that size cheaper than
//!   selecting); otherwise without sorting most of what it keeps: no probability exceeds the
//!   largest, so a first block of tokens is surely kept and is selected, not sorted, and so on
//!   for a few blocks while the bound stays large (a flat row); then growing prefixes are
//!   selected and sorted until the cut falls in one (a peaked row sorts tens of tokens;
//!   `cut_sorted_prefixes`);
//! - exponentials in a loop the compiler vectorizes (`exp_nonpositive`);
//! - a race that never takes the logarithm of a token that cannot win (since -ln(u) ≥ 1 - u, a
//!   token whose p / (1 - u) is below the best race value so far is out, exactly), tests that on
//!   a bound of p with no division (exactly only for what passes), hashes every token it offers
//!   without a data-dependent branch before the hash (a mispredicted one cost more than the
//!   hash), and skips the tokens min-p rules out;
//! - sums of weights in eight running float64 sums (`sum_weights`), not one chain of additions.
//!
//! A row with NaN logits returns some token without panicking; the caller fails such a row
//! (its largest logit is not finite), and which token is not specified.
//!
//! `sample_step` is a whole step's samples: every row's argmax and finiteness check from
//! `greedy.rs`, then the rows with parameters drawn here.

use crate::greedy::{argmax_rows, row_max};

mod keys;
mod top_k;
mod top_p;

#[cfg(test)]
use keys::{exp_nonpositive, logit_of, EXP_MIN};
use keys::{exp_shifted, id_of, key, rank};
use top_p::{cut_sorted_prefixes, keep_top_p, least_kept};

/// Sampling parameters of one row; `top_k <= 0` and `top_p >= 1` are off, `min_p <= 0` is off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowParams {
    pub temperature: f32,
    pub top_k: i64,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: i64,
    pub position: i64,
}

const M35: u64 = (1 << 35) - 1;
const M52: u64 = (1 << 52) - 1;
/// The clamp of `uniform`: u stays in [U_MIN, 1 - U_MIN].
const U_MIN: f64 = 1e-12;

/// Uniform (0, 1) noise of `token` for (`seed`, `position`): three xor-shift-multiply rounds of
/// a linear mix in wrapping 64-bit arithmetic, 52 bits of the result, clamped to
/// [1e-12, 1 - 1e-12]. The same bits as the Python sampler's `_uniform`.
#[inline]
pub fn uniform(seed: i64, position: i64, token: i64) -> f64 {
    let mut x = (seed as u64)
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add((position as u64).wrapping_mul(1_442_695_040_888_963_407))
        .wrapping_add(token as u64);
    for _ in 0..3 {
        x ^= (x >> 29) & M35;
        x = x.wrapping_mul(2_685_821_657_736_338_717);
    }
    let u = ((x >> 11) & M52) as f64 / (1u64 << 52) as f64;
    u.clamp(U_MIN, 1.0 - U_MIN)
}

/// The least vocabulary whose top-k, or top-p alone, first runs on the tokens above a sampled
/// pivot (below it, selecting over the whole row measured faster: at 259 the pivot's extra
/// passes cost more than they saved).
const PIVOT_MIN_VOCAB: usize = 2048;

/// The most top-k candidates whose top-p cut sorts them all (`cut_sorted_top_p`).
const SORT_ALL_MAX: usize = 128;

/// Reusable buffers: sampling many rows allocates once.
#[derive(Debug, Default, Clone)]
pub struct RowSampler {
    /// The row's scaled logits.
    lg: Vec<f32>,
    /// The survivors' token ids: after top-k in id order (the pivot's path) or in the order of
    /// the selection (`top_k` says which); sorted by descending logit for a top-p over at most
    /// `SORT_ALL_MAX`; after a larger top-p in the order of its cut (blocks by descending logit,
    /// each unordered, the last sorted).
    cand: Vec<u32>,
    /// Selection buffer of sort keys: every token's, or those above a pivot (top-p alone), or
    /// every candidate's.
    keys: Vec<u64>,
    /// Top-k's selection buffer: every token's `rank`, or the passing tokens' (`top_k_below`);
    /// `pivot`'s strided sample.
    ranks: Vec<u32>,
    /// Unnormalized probabilities exp(x - max): by token for the race over the whole vocabulary;
    /// by candidate, aligned with `cand`, once a filter has chosen the candidates.
    weights: Vec<f32>,
    /// Scratch: the candidates' logits; top-p alone, the weights by token.
    scratch: Vec<f32>,
    /// Scratch for the kept candidates' ids while `cand` is reordered.
    kept: Vec<u32>,
}

impl RowSampler {
    /// One token of the row `logits` under `p` (`p.temperature > 0`).
    pub fn sample(&mut self, logits: &[f32], p: &RowParams) -> u32 {
        let vocab = logits.len();
        if vocab == 0 {
            return 0;
        }
        self.lg.clear();
        self.lg.extend(logits.iter().map(|&x| x / p.temperature + 0.0)); // -0 + 0 is +0 (`rank`)
        let top_k = usize::try_from(p.top_k).ok().filter(|&k| k > 0 && k < vocab);
        let top_p = p.top_p < 1.0;
        if top_k.is_none() && !top_p {
            return self.race_all(p);
        }
        match top_k {
            Some(k) => {
                let keyed = self.top_k(k);
                if !top_p {
                    self.candidate_weights();
                } else if self.cand.len() <= SORT_ALL_MAX {
                    self.sort_candidates(keyed);
                    self.candidate_weights();
                    self.cut_sorted_top_p(p.top_p);
                } else {
                    if keyed {
                        self.candidates_by_id(); // `cut_top_p` breaks ties by candidate order
                    }
                    self.candidate_weights();
                    self.cut_top_p(p.top_p);
                }
            }
            None => self.top_p_prefix(p.top_p),
        }
        self.race_candidates(p)
    }

    /// Candidates without top-k: top-p over the whole vocabulary's softmax (`cut_sorted_prefixes`
    /// on the tokens above a pivot first, at a large vocabulary, then on every token if the cut
    /// is not among them). Leaves the candidates' weights in `weights`.
    fn top_p_prefix(&mut self, top_p: f32) {
        let vocab = self.lg.len();
        let max = row_max(&self.lg);
        exp_shifted(&mut self.scratch, &self.lg, max); // each exp once, by token
        let sum = sum_weights(&self.scratch);
        // a large vocabulary's cut usually falls among its first few hundred tokens: top-p runs
        // on those at or above a sampled pivot, past where the cut can first fall, and on the
        // whole row only if the cut is not among them
        let mut keep = None;
        if let Some((t, passing)) = self.pivot(least_kept(top_p, sum).max(64).min(vocab)) {
            self.keys.clear();
            self.keys.resize(passing + 1, 0);
            let mut m = 0;
            for (i, &x) in self.lg.iter().enumerate() {
                self.keys[m] = key(x, i as u32);
                m += usize::from(rank(x) <= t);
            }
            self.keys.truncate(passing);
            keep = cut_sorted_prefixes(&mut self.keys, &self.scratch, sum, top_p, 64);
        }
        let keep = keep.unwrap_or_else(|| {
            self.keys.clear();
            self.keys.extend(self.lg.iter().enumerate().map(|(i, &x)| key(x, i as u32)));
            cut_sorted_prefixes(&mut self.keys, &self.scratch, sum, top_p, 64).unwrap_or(vocab)
        });
        self.cand.clear();
        self.cand.extend(self.keys[..keep].iter().map(|&k| id_of(k)));
        // by candidate now, relative to the largest candidate's logit: the same values unless
        // that is not `max` (a NaN row), when they are computed again
        let first = self.keys[..keep].iter().min().map_or(max, |&k| self.lg[id_of(k) as usize]);
        if first.to_bits() == max.to_bits() {
            self.weights.clear();
            self.weights.extend(self.cand.iter().map(|&c| self.scratch[c as usize]));
        } else {
            self.candidate_weights();
        }
    }

    /// The candidates' weights, exp(x - the largest x), in `weights`.
    fn candidate_weights(&mut self) {
        let lg = &self.lg;
        self.scratch.clear();
        self.scratch.extend(self.cand.iter().map(|&c| lg[c as usize]));
        let max = row_max(&self.scratch);
        exp_shifted(&mut self.weights, &self.scratch, max);
    }

    /// Top-p after top-k over more than `SORT_ALL_MAX` candidates: the mass is the softmax over
    /// the candidates, whose weights are in `weights`. Takes the candidates by descending logit
    /// (ties by id) until the mass before one exceeds p (`cut_sorted_prefixes`: blocks surely
    /// kept, then sorted prefixes from 16). Leaves the kept candidates and their weights,
    /// aligned.
    fn cut_top_p(&mut self, top_p: f32) {
        let n = self.cand.len();
        let sum = sum_weights(&self.weights);
        let lg = &self.lg;
        self.keys.clear();
        self.keys.extend(self.cand.iter().enumerate().map(|(j, &c)| key(lg[c as usize], j as u32)));
        let keep = cut_sorted_prefixes(&mut self.keys, &self.weights, sum, top_p, 16).unwrap_or(n);
        let order = &self.keys[..keep];
        self.kept.clear();
        self.kept.extend(order.iter().map(|&k| self.cand[id_of(k) as usize]));
        std::mem::swap(&mut self.cand, &mut self.kept);
        self.scratch.clear();
        self.scratch.extend(order.iter().map(|&k| self.weights[id_of(k) as usize]));
        std::mem::swap(&mut self.weights, &mut self.scratch);
    }

    /// Top-p over candidates already by descending logit (`sort_candidates`; at most
    /// `SORT_ALL_MAX`, where one sort cost less than the selects of `cut_sorted_prefixes`):
    /// keeps those up to the first whose preceding mass exceeds p.
    fn cut_sorted_top_p(&mut self, top_p: f32) {
        let sum = sum_weights(&self.weights);
        let n = self.cand.len();
        let keep = keep_top_p(self.weights.iter().map(|&w| w / sum), top_p, 0.0).map_or(n, |j| j.max(1));
        self.cand.truncate(keep);
        self.weights.truncate(keep);
    }

    /// The race over the candidates, whose weights are in `weights`.
    fn race_candidates(&self, p: &RowParams) -> u32 {
        race(&self.weights, |i| self.cand[i], p).unwrap_or(self.cand[0])
    }

    /// The race over the whole vocabulary (no top-k or top-p).
    fn race_all(&mut self, p: &RowParams) -> u32 {
        let max = row_max(&self.lg);
        exp_shifted(&mut self.weights, &self.lg, max);
        race(&self.weights, |t| t as u32, p).unwrap_or(0)
    }
}

/// The race over `weights[i]`, the weight of token `id(i)`: probability q = w / sum, out of it
/// under min-p × the largest probability (the largest weight is exp(0) = 1). A min-p outside
/// [0, 1] (the engine refuses one) counts as 0 below and 1 above, NaN as 0.
fn race(weights: &[f32], id: impl Fn(usize) -> u32, p: &RowParams) -> Option<u32> {
    let sum = sum_weights(weights);
    let min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    let mut race = Race {
        sum,
        // q = w / sum rounded in float32 is at most w × this (float64) wherever q is a normal
        // float, by far less than the margin the bound test keeps; a subnormal q (under 1.2e-38)
        // may exceed the bound and its token be skipped, a token that never beats the weight-1 one
        above_q: (1.0 / f64::from(sum)) * (1.0 + 1e-6),
        floor: min_p * (1.0 / sum),
        best: 0.0,
        winner: None,
    };
    for (i, &w) in weights.iter().enumerate() {
        race.offer(id(i), w, p);
    }
    race.winner
}

/// The sum of `weights` in float64, rounded to float32: eight running sums the compiler keeps
/// in vector registers (one running sum waited on each addition's latency), added up in a
/// fixed order, so a row's sum never depends on anything but the row. Its float64 value may
/// differ from one running sum's by about n × 2⁻⁵³ relative, so the float32 result differs
/// only where the exact sum lies that close to a float32 rounding midpoint (then either is
/// within rounding of it).
fn sum_weights(weights: &[f32]) -> f32 {
    let mut acc = [0f64; 8];
    let chunks = weights.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a += f64::from(w);
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &w in rest {
        sum += f64::from(w);
    }
    sum as f32
}

/// The race over the weights of one row: the best p / E offered so far (the first one offered
/// wins ties, as an argmax does).
#[derive(Debug)]
struct Race {
    sum: f32,
    /// At least 1 / sum, so that q <= w × `above_q` for every normal float32 q.
    above_q: f64,
    /// min-p × the largest probability: a probability below it is zeroed (and cannot win, the
    /// largest one never being zeroed with min-p at most 1); 0 without min-p.
    floor: f32,
    best: f64,
    winner: Option<u32>,
}

impl Race {
    /// Offers `token` of weight `w`. Every offer min-p keeps hashes its token: skipping the
    /// hash for a probability below best × `U_MIN` (which cannot win either) was a branch the
    /// processor mispredicted on rows whose probabilities span many orders of magnitude, and
    /// cost more than the hash. What is left is a return taken for almost every token once a
    /// winner is set, which the processor predicts.
    #[inline]
    fn offer(&mut self, token: u32, w: f32, p: &RowParams) {
        // the tests below run on a bound of p without the division first, and again exactly
        // for what passes them
        let bound = f64::from(w) * self.above_q;
        if bound < f64::from(self.floor) {
            return; // zeroed by min-p: not hashed (without min-p never taken)
        }
        let u = uniform(p.seed, p.position, token as i64);
        // p / E <= p / (1 - u) since E = -ln(u) >= 1 - u: below the best, it cannot win (0
        // before the first offer: every finite one goes on)
        let margin = self.best * (1.0 - 1e-9);
        if bound < margin * (1.0 - u) {
            return;
        }
        let q = w / self.sum;
        if q < self.floor || q.is_nan() {
            return; // zeroed by min-p, or NaN
        }
        let q = q as f64;
        if q < margin * (1.0 - u) {
            return;
        }
        let r = q / -u.ln();
        if self.winner.is_none() || r > self.best {
            (self.best, self.winner) = (r, Some(token));
        }
    }
}

/// Samples `rows[i]` of `logits` (row-major, `vocab` wide) under `params[i]` into `out[i]`.
/// Panics if a row index is out of range or the lengths differ (the binding checks both).
pub fn sample_rows(logits: &[f32], vocab: usize, rows: &[usize], params: &[RowParams], out: &mut [i64]) {
    assert!(rows.len() == params.len() && rows.len() == out.len());
    let mut s = RowSampler::default();
    for ((&r, p), o) in rows.iter().zip(params).zip(out.iter_mut()) {
        *o = s.sample(&logits[r * vocab..(r + 1) * vocab], p) as i64;
    }
}

/// Every sample of a step on the CPU, sample i from row i of `logits` (row-major, `vocab`
/// wide): the argmax (`argmax_rows`, -1 where the largest logit is not finite), then a random
/// token where `params[i]` is set and the row is finite. Returns the number of -1 rows.
pub fn sample_step(logits: &[f32], vocab: usize, params: &[Option<RowParams>], out: &mut [i32]) -> usize {
    assert_eq!(params.len(), out.len());
    let num_bad = argmax_rows(logits, vocab, out);
    let mut s = RowSampler::default();
    for (i, (p, o)) in params.iter().zip(out.iter_mut()).enumerate() {
        if let Some(p) = p.as_ref().filter(|_| *o >= 0) {
            *o = s.sample(&logits[i * vocab..(i + 1) * vocab], p) as i32;
        }
    }
    num_bad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(seed: i64) -> RowParams {
        RowParams { temperature: 1.0, top_k: -1, top_p: 1.0, min_p: 0.0, seed, position: 3 }
    }

    /// The race with every logarithm taken: the definition the skipping must not change.
    fn naive(logits: &[f32], p: &RowParams) -> u32 {
        let lg: Vec<f32> = logits.iter().map(|&x| x / p.temperature).collect();
        let max = lg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = lg.iter().map(|&x| (x - max).exp()).collect();
        let sum: f32 = w.iter().sum();
        let mut best = (f64::NEG_INFINITY, 0);
        for (t, &w) in w.iter().enumerate() {
            let r = (w / sum) as f64 / -uniform(p.seed, p.position, t as i64).ln();
            if r > best.0 {
                best = (r, t as u32);
            }
        }
        best.1
    }

    /// Every filter by its definition: the vocabulary sorted, top-k by its k-th largest, top-p
    /// by prefix sums in that order, min-p, then the race with every logarithm taken.
    fn naive_filtered(logits: &[f32], p: &RowParams) -> u32 {
        let lg: Vec<f32> = logits.iter().map(|&x| x / p.temperature).collect();
        let mut order: Vec<u32> = (0..lg.len() as u32).collect();
        // descending logits, NaN first, equal ones (-0 and +0 too) by id: the torch sampler's order
        let at = |i: u32| lg[i as usize] + 0.0;
        order.sort_by(|&a, &b| at(b).total_cmp(&at(a)).then(a.cmp(&b)));
        let mut cand: Vec<u32> = order.clone();
        if p.top_k > 0 && (p.top_k as usize) < lg.len() {
            let kth = lg[order[p.top_k as usize - 1] as usize];
            cand.retain(|&c| lg[c as usize] >= kth);
        }
        let max = lg[cand[0] as usize];
        let w: Vec<f32> = cand.iter().map(|&c| exp_nonpositive(lg[c as usize] - max)).collect();
        let sum = w.iter().map(|&w| w as f64).sum::<f64>() as f32;
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            for (j, &w) in w.iter().enumerate() {
                let q = w / sum;
                acc += q as f64;
                if (acc as f32) - q > p.top_p {
                    keep = j.max(1);
                    break;
                }
            }
        }
        let sum = w[..keep].iter().map(|&w| w as f64).sum::<f64>() as f32;
        let mut best = (f64::NEG_INFINITY, 0);
        for (&c, &w) in cand[..keep].iter().zip(&w) {
            let q = w / sum;
            let q = if q < p.min_p * (1.0 / sum) { 0.0 } else { q };
            let r = q as f64 / -uniform(p.seed, p.position, c as i64).ln();
            if r > best.0 {
                best = (r, c);
            }
        }
        best.1
    }

    #[test]
    fn a_min_p_out_of_range_counts_as_its_nearest_end() {
        let mut s = RowSampler::default();
        let lg = logits(300, 3, 8.0);
        let argmax = (0..300).max_by(|&a, &b| lg[a].total_cmp(&lg[b])).unwrap() as u32;
        for seed in 0..50 {
            for top_p in [1.0, 0.9] {
                let p = RowParams { top_p, ..params(seed) };
                assert_eq!(s.sample(&lg, &RowParams { min_p: 2.0, ..p }), argmax);
                let off = s.sample(&lg, &RowParams { min_p: 0.0, ..p });
                assert_eq!(s.sample(&lg, &RowParams { min_p: f32::NAN, ..p }), off);
                assert_eq!(s.sample(&lg, &RowParams { min_p: -1.0, ..p }), off);
            }
        }
    }

    #[test]
    fn filters_match_their_definition() {
        // vocabularies on both sides of the sampled top-k pivot, flat and peaked rows, ties
        let mut s = RowSampler::default();
        for (vocab, scale) in [(259, 0.2f32), (259, 8.0), (3000, 0.5), (3000, 20.0), (2048, 3.0)] {
            for seed in 0..40 {
                let mut lg = logits(vocab, seed as u64 + 100, scale);
                if seed % 4 == 1 {
                    lg.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0); // many ties
                }
                if seed % 4 == 2 {
                    lg.iter_mut().step_by(3).for_each(|x| *x = if *x < 0.0 { -0.0 } else { 0.0 });
                }
                for top_k in [-1, 1, 5, 50, 200] {
                    for (top_p, min_p) in [(1.0, 0.0), (0.9, 0.0), (0.5, 0.05), (0.99, 0.0), (1.0, 0.02)] {
                        let p = RowParams { temperature: 0.8, top_k, top_p, min_p, seed, position: 11 };
                        let want = naive_filtered(&lg, &p);
                        assert_eq!(s.sample(&lg, &p), want, "vocab {vocab} scale {scale} seed {seed} {p:?}");
                    }
                }
            }
        }
    }

    fn logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..n).map(|i| ((uniform(seed as i64, 7, i as i64) as f32) - 0.5) * scale).collect()
    }

    #[test]
    fn a_step_samples_its_random_rows_and_takes_the_argmax_of_the_rest() {
        let vocab = 300;
        let mut lg = logits(4 * vocab, 9, 6.0);
        lg[2 * vocab + 5] = f32::NAN; // a random row that is not finite fails, unsampled
        let p = Some(params(4));
        let mut out = vec![0; 4];
        assert_eq!(sample_step(&lg, vocab, &[None, p, p, None], &mut out), 1);
        let mut greedy = vec![0; 4];
        argmax_rows(&lg, vocab, &mut greedy);
        let random = RowSampler::default().sample(&lg[vocab..2 * vocab], &params(4));
        assert_eq!(out, vec![greedy[0], random as i32, -1, greedy[3]]);
    }

    #[test]
    fn uniform_matches_the_python_sampler() {
        // the Python sampler's _uniform at these (seed, position, token), printed by torch
        assert_eq!(uniform(0, 0, 0), 1e-12); // a zero hash, clamped
        assert_eq!(uniform(5, 9, 11), 0.17782552385244488);
        assert_eq!(uniform(-3, 1000, 151_935), 0.08029358573501844);
        assert_eq!(uniform(123_456_789_012, 7, 2), 0.9795616597003114);
    }

    #[test]
    fn skipping_never_changes_the_winner() {
        let mut s = RowSampler::default();
        for seed in 0..300 {
            for scale in [0.5f32, 4.0, 30.0] {
                let lg = logits(500, seed as u64, scale);
                let p = params(seed);
                assert_eq!(s.sample(&lg, &p), naive(&lg, &p), "seed {seed} scale {scale}");
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        // every 1/4096 over the float range it covers, and the edges
        let mut worst = 0f64;
        for i in 0..=(88 * 4096) {
            let x = -(i as f32) / 4096.0;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            if x >= EXP_MIN {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert_eq!(got, 0.0, "{x}");
            }
        }
        assert!(worst < 2.0 * f32::EPSILON as f64, "relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert!(exp_nonpositive(EXP_MIN) > 0.0);
    }

    #[test]
    fn ranks_round_trip_and_order_like_keys() {
        let xs = [f32::NAN, f32::INFINITY, 2.0, 1e-30, 0.0, -0.0, -1.5, f32::NEG_INFINITY];
        for w in xs.windows(2) {
            assert!(rank(w[0]) < rank(w[1]), "{} {}", w[0], w[1]);
        }
        for x in xs {
            assert_eq!(logit_of(rank(x)).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn keys_order_by_descending_logit_then_id() {
        let xs = [f32::NAN, f32::INFINITY, 2.0, 0.0, -0.0, -1.5, f32::NEG_INFINITY];
        let keys: Vec<u64> = xs.iter().enumerate().map(|(i, &x)| key(x, i as u32)).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:x?}");
        assert!(key(1.0, 3) < key(1.0, 4));
        assert_eq!(id_of(key(-7.0, 42)), 42);
    }

    #[test]
    fn top_k_one_is_the_argmax_and_filters_keep_to_their_set() {
        let mut s = RowSampler::default();
        let lg = logits(300, 1, 10.0);
        let argmax = (0..300).max_by(|&a, &b| lg[a].total_cmp(&lg[b])).unwrap() as u32;
        let mut sorted: Vec<u32> = (0..300).collect();
        sorted.sort_by(|&a, &b| lg[b as usize].total_cmp(&lg[a as usize]));
        for seed in 0..200 {
            assert_eq!(s.sample(&lg, &RowParams { top_k: 1, ..params(seed) }), argmax);
            let t = s.sample(&lg, &RowParams { top_k: 5, ..params(seed) });
            assert!(sorted[..5].contains(&t));
            // a tiny top-p keeps the first token only
            assert_eq!(s.sample(&lg, &RowParams { top_p: 1e-6, ..params(seed) }), argmax);
        }
    }

    #[test]
    fn samples_follow_the_distribution() {
        let lg = [0.0f32, (2.0f32).ln(), f32::NEG_INFINITY, (5.0f32).ln()]; // p = 1/8, 2/8, 0, 5/8
        let mut s = RowSampler::default();
        let mut counts = [0usize; 4];
        for pos in 0..8000 {
            counts[s.sample(&lg, &RowParams { position: pos, ..params(1) }) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        for (c, want) in counts.iter().zip([1000.0, 2000.0, 0.0, 5000.0]) {
            assert!((*c as f64 - want).abs() < 250.0, "{counts:?}");
        }
        // min-p 0.3 of the largest (5/8) zeroes token 0 (1/8 < 0.1875)
        for pos in 0..500 {
            assert_ne!(s.sample(&lg, &RowParams { min_p: 0.3, position: pos, ..params(1) }), 0);
        }
    }

    #[test]
    fn nan_rows_and_all_masked_rows_do_not_panic() {
        let mut s = RowSampler::default();
        let p = RowParams { top_k: 2, top_p: 0.5, ..params(0) };
        s.sample(&[f32::NAN, 1.0, 2.0], &p);
        s.sample(&[f32::NEG_INFINITY; 4], &p);
        s.sample(&[f32::NEG_INFINITY; 4], &params(0));
        s.sample(&[f32::NAN; 4], &params(0));
    }
}
