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
//! candidates tie to within rounding.
//!
//! What makes it cheap: top-k by selection (O(V)) of the k-th largest logit and one pass for
//! the tokens not below it, not a sort of the vocabulary; top-p by sorting growing prefixes found
//! by selection (16 candidates first after top-k, 64 tokens over the whole vocabulary), so a
//! peaked row sorts tens of tokens; exponentials in a loop the compiler vectorizes
//! (`exp_nonpositive`); and the race never takes the logarithm of a token that cannot win: since
//! -ln(u) ≥ 1 - u, a token whose p / (1 - u) is below the best race value so far is out, exactly,
//! and one whose p is below the best value × 1e-12 (u ≤ 1 - 1e-12) is out without hashing.
//!
//! A row with NaN logits returns some token without panicking; the caller fails such a row
//! (its largest logit is not finite).
//!
//! `sample_step` is a whole step's samples: every row's argmax and finiteness check from
//! `greedy.rs`, then the rows with parameters drawn here.

use std::cmp::Ordering;

use crate::greedy::argmax_rows;

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

/// An order key of scaled logit `x`: ascending ranks are descending logits (in `total_cmp`'s
/// order, NaN first); plain integer compares.
#[inline]
fn rank(x: f32) -> u32 {
    let b = x.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ascending
}

/// The logit of a `rank`.
#[inline]
fn logit_of(rank: u32) -> f32 {
    let a = !rank;
    f32::from_bits(if a >> 31 == 1 { a & 0x7fff_ffff } else { !a })
}

/// A sort key of token (or candidate) `id` with scaled logit `x`: ascending keys are descending
/// logits, ties by ascending id.
#[inline]
fn key(x: f32, id: u32) -> u64 {
    (u64::from(rank(x)) << 32) | u64::from(id)
}

/// The token id of a `key`.
#[inline]
fn id_of(key: u64) -> u32 {
    key as u32
}

/// The lowest argument of `exp_shifted`: below it e^x is under the smallest normal float and
/// counts as 0.
const EXP_MIN: f32 = -87.336_55;

/// e^x for x ≤ 0 in float32, within about 2 ulp of the correctly rounded value: x = n ln 2 + r
/// with |r| ≤ ln 2 / 2, a degree-7 polynomial for e^r (Cephes' coefficients), times 2^n built in
/// the exponent bits. 0 below `EXP_MIN`, NaN for NaN; x > 0 is not an input (it gives 1). No
/// calls and no branches, so a loop of it vectorizes (libm's `expf`, a call per element, was a
/// third of a row's time).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 × 2^23: adding it rounds to an integer in the low bits
    const LN2_HI: f32 = 0.693_359_4; // ln 2 in two parts, n × LN2_HI exact for |n| ≤ 127
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(EXP_MIN, 0.0); // NaN stays NaN
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let q = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = q * (r * r) + r + 1.0;
    // t's bits are ROUND's plus n; 2^n for n in [-126, 0] has exponent bits n + 127
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < EXP_MIN {
        0.0
    } else {
        er * scale
    }
}

/// `out[i] = e^(xs[i] - shift)`, with `shift` at least every `xs[i]` (or NaN rows).
fn exp_shifted(out: &mut Vec<f32>, xs: &[f32], shift: f32) {
    out.clear();
    out.resize(xs.len(), 0.0);
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = exp_nonpositive(x - shift);
    }
}

/// Reusable buffers: sampling many rows allocates once.
#[derive(Debug, Default, Clone)]
pub struct RowSampler {
    /// The row's scaled logits.
    lg: Vec<f32>,
    /// The survivors' token ids: after top-k in id order, once sorted by descending logit.
    cand: Vec<u32>,
    /// Selection buffer of sort keys: every token's (top-p alone) or every candidate's.
    keys: Vec<u64>,
    /// Top-k's selection buffer: every token's `rank`.
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
        self.lg.extend(logits.iter().map(|&x| x / p.temperature));
        let top_k = usize::try_from(p.top_k).ok().filter(|&k| k > 0 && k < vocab);
        let top_p = p.top_p < 1.0;
        if top_k.is_none() && !top_p {
            return self.race_all(p);
        }
        match top_k {
            Some(k) => {
                self.top_k(k);
                self.candidate_weights();
                if top_p {
                    self.cut_top_p(p.top_p);
                }
            }
            None => self.top_p_prefix(p.top_p),
        }
        self.race_candidates(p)
    }

    /// Candidates: every token not below the k-th largest scaled logit, in id order. Ties with
    /// the k-th are kept, and so is NaN (the Python sampler masks `lg < kth` only). The k-th is
    /// found by selection over 32-bit ranks; nothing is sorted.
    fn top_k(&mut self, k: usize) {
        self.ranks.clear();
        self.ranks.extend(self.lg.iter().map(|&x| rank(x)));
        let kth = logit_of(*self.ranks.select_nth_unstable(k - 1).1);
        // branch-free: write every id, advance past the kept ones
        self.cand.clear();
        self.cand.resize(self.lg.len(), 0);
        let mut n = 0;
        for (i, &x) in self.lg.iter().enumerate() {
            self.cand[n] = i as u32;
            n += usize::from(x.partial_cmp(&kth) != Some(Ordering::Less));
        }
        self.cand.truncate(n);
    }

    /// Candidates without top-k: top-p over the whole vocabulary's softmax, on sorted prefixes
    /// of growing length until the cut falls inside one (or the prefix is the vocabulary).
    /// Leaves the candidates' weights in `weights`.
    fn top_p_prefix(&mut self, top_p: f32) {
        let vocab = self.lg.len();
        let max = self.lg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exp_shifted(&mut self.scratch, &self.lg, max); // each exp once, by token
        let sum = self.scratch.iter().map(|&w| w as f64).sum::<f64>() as f32;
        self.keys.clear();
        self.keys.extend(self.lg.iter().enumerate().map(|(i, &x)| key(x, i as u32)));
        let keep = cut_sorted_prefixes(&mut self.keys, &self.scratch, sum, top_p, 64.min(vocab));
        self.cand.clear();
        self.cand.extend(self.keys[..keep].iter().map(|&k| id_of(k)));
        // by candidate now, relative to the first candidate's logit: the same values unless
        // that is not `max` (a NaN row), when they are computed again
        let first = self.cand.first().map_or(max, |&c| self.lg[c as usize]);
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
        let max = self.scratch.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exp_shifted(&mut self.weights, &self.scratch, max);
    }

    /// Top-p after top-k: the mass is the softmax over the candidates, whose weights are in
    /// `weights`. Walks the candidates by descending logit (ties by id) until the mass before one
    /// exceeds p: the first 16 by repeated minimum (a peaked row stops after a few), the rest by
    /// sorting growing prefixes. Leaves the kept candidates and their weights in that order.
    fn cut_top_p(&mut self, top_p: f32) {
        const WALK: usize = 16;
        let n = self.cand.len();
        let sum = self.weights.iter().map(|&w| w as f64).sum::<f64>() as f32;
        let lg = &self.lg;
        self.keys.clear();
        self.keys.extend(self.cand.iter().enumerate().map(|(j, &c)| key(lg[c as usize], j as u32)));
        let mut keep = None;
        let mut acc = 0f64;
        for j in 0..n.min(WALK) {
            let (at, _) = self.keys[j..].iter().enumerate().min_by_key(|&(_, &k)| k).expect("j < n");
            self.keys.swap(j, j + at);
            let q = self.weights[id_of(self.keys[j]) as usize] / sum;
            acc += q as f64;
            if (acc as f32) - q > top_p {
                keep = Some(j.max(1));
                break;
            }
        }
        let keep = match keep {
            Some(keep) => keep,
            None if n <= WALK => n,
            None => cut_sorted_prefixes(&mut self.keys, &self.weights, sum, top_p, (WALK * 4).min(n)),
        };
        let order = &self.keys[..keep];
        self.kept.clear();
        self.kept.extend(order.iter().map(|&k| self.cand[id_of(k) as usize]));
        std::mem::swap(&mut self.cand, &mut self.kept);
        self.scratch.clear();
        self.scratch.extend(order.iter().map(|&k| self.weights[id_of(k) as usize]));
        std::mem::swap(&mut self.weights, &mut self.scratch);
    }

    /// The race over the candidates, whose weights are in `weights`.
    fn race_candidates(&self, p: &RowParams) -> u32 {
        race(&self.weights, |i| self.cand[i], p).unwrap_or(self.cand[0])
    }

    /// The race over the whole vocabulary (no top-k or top-p).
    fn race_all(&mut self, p: &RowParams) -> u32 {
        let max = self.lg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exp_shifted(&mut self.weights, &self.lg, max);
        race(&self.weights, |t| t as u32, p).unwrap_or(0)
    }
}

/// The race over `weights[i]`, the weight of token `id(i)`: probability q = w / sum, zeroed
/// under min-p × the largest probability (the largest weight is exp(0) = 1).
fn race(weights: &[f32], id: impl Fn(usize) -> u32, p: &RowParams) -> Option<u32> {
    let sum = weights.iter().map(|&w| w as f64).sum::<f64>() as f32;
    let floor = p.min_p * (1.0 / sum);
    let mut race = Race::default();
    for (i, &w) in weights.iter().enumerate() {
        let q = w / sum;
        race.offer(id(i), if q < floor { 0.0 } else { q }, p);
    }
    race.winner
}

/// Top-p over sort keys whose ids index `w` (weights, summing to `sum`): sorts growing prefixes
/// of `keys` (selected, then sorted; `first` keys, then 4× as many) until the cut falls inside
/// one. Returns how many keys top-p keeps; `keys[..kept]` are then in order.
fn cut_sorted_prefixes(keys: &mut [u64], w: &[f32], sum: f32, top_p: f32, first: usize) -> usize {
    let mut m = first;
    loop {
        if m < keys.len() {
            keys.select_nth_unstable(m - 1);
        }
        keys[..m].sort_unstable();
        let keep = keep_top_p(keys[..m].iter().map(|&k| w[id_of(k) as usize] / sum), top_p);
        if keep.is_some() || m == keys.len() {
            return keep.unwrap_or(m);
        }
        m = (m * 4).min(keys.len());
    }
}

/// How many of the probabilities `q` (by descending logit) top-p keeps: up to the first whose
/// preceding mass exceeds `top_p` (the prefix sum accumulated in float64 and rounded, minus the
/// probability itself, in float32); `None` if none does.
fn keep_top_p(q: impl Iterator<Item = f32>, top_p: f32) -> Option<usize> {
    let mut acc = 0f64;
    for (j, q) in q.enumerate() {
        acc += q as f64;
        if (acc as f32) - q > top_p {
            return Some(j.max(1));
        }
    }
    None
}

/// The best p / E offered so far (the first one offered wins ties, as an argmax does).
#[derive(Debug, Default)]
struct Race {
    best: f64,
    winner: Option<u32>,
}

impl Race {
    #[inline]
    fn offer(&mut self, token: u32, q: f32, p: &RowParams) {
        let q = q as f64;
        if self.winner.is_some() {
            // p / E <= p / (1 - u) <= p / U_MIN: skip what provably cannot beat the best
            let margin = self.best * (1.0 - 1e-9);
            if q < margin * U_MIN {
                return;
            }
            let u = uniform(p.seed, p.position, token as i64);
            if q < margin * (1.0 - u) {
                return; // q / (1 - u) < margin, without a division
            }
            let r = q / -u.ln();
            if r > self.best {
                (self.best, self.winner) = (r, Some(token));
            }
        } else {
            let r = q / -uniform(p.seed, p.position, token as i64).ln();
            if !r.is_nan() {
                (self.best, self.winner) = (r, Some(token));
            }
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
