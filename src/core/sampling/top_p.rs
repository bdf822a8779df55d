//! Top-p's cut over sort keys (`keys.rs`): how many of the tokens, by descending logit, top-p
//! keeps, selecting and sorting as little of the row as the probabilities allow.

use super::keys::id_of;

/// Top-p over sort keys whose ids index `w` (weights, summing to `sum`, the largest 1): how
/// many keys it keeps, those then first in `keys` (by descending logit in blocks, the blocks in
/// order, the last sorted), or None if no cut falls inside `keys`.
///
/// No probability exceeds 1 / sum, so at least p × sum keys are surely kept; and after a block of
/// mass `acc` whose least probability is b, at least (p - acc) / b more. While that is many
/// (`SURE_MIN`, for at most `SURE_BLOCKS` blocks), they are selected (not sorted) and their mass
/// added. Then prefixes of what is left, `first` keys and then 4× as many, are selected and
/// sorted until the cut falls inside one. A peaked row sorts a few keys; a flat one selects a
/// few blocks instead of sorting most of its vocabulary. The mass of a block is summed in its
/// own order (float64, as the prefix sums): that can move the cut only where the mass before a
/// token is within float64 rounding of a float32 boundary.
pub(super) fn cut_sorted_prefixes(keys: &mut [u64], w: &[f32], sum: f32, top_p: f32, first: usize) -> Option<usize> {
    const SURE_MIN: usize = 32;
    const SURE_BLOCKS: usize = 6;
    let q = |k: &u64| w[id_of(*k) as usize] / sum;
    // `bound`: no key from `lo` on has a larger probability (the keys before it all do)
    let (mut lo, mut acc, mut bound) = (0, 0f64, 1.0 / sum);
    for _ in 0..SURE_BLOCKS {
        let sure = ((top_p as f64 - acc) / bound as f64 * (1.0 - 1e-6)).floor();
        if !(sure >= SURE_MIN as f64 && sure < (keys.len() - lo) as f64) {
            break;
        }
        let sure = sure as usize;
        keys[lo..].select_nth_unstable(sure);
        let block = keys[lo..lo + sure].iter().map(q);
        let (mass, least) = block.fold((0f64, f32::INFINITY), |(m, l), q| (m + q as f64, l.min(q)));
        (acc, bound, lo) = (acc + mass, least, lo + sure);
    }
    let rest = &mut keys[lo..];
    let mut m = first.clamp(1, rest.len().max(1));
    loop {
        if m < rest.len() {
            rest.select_nth_unstable(m - 1);
        }
        rest[..m].sort_unstable();
        if let Some(j) = keep_top_p(rest[..m].iter().map(q), top_p, acc) {
            return Some((lo + j).max(1));
        }
        if m >= rest.len() {
            return None;
        }
        m = (m * 4).min(rest.len());
    }
}

/// A little past the fewest keys top-p can keep: no probability exceeds 1 / sum (the largest
/// weight is 1), so the cut comes after at least p × sum keys; an eighth more.
pub(super) fn least_kept(top_p: f32, sum: f32) -> usize {
    let bound = (top_p * sum * 1.125).ceil();
    if bound.is_finite() && bound > 0.0 {
        bound as usize
    } else {
        0
    }
}

/// How many of the probabilities `q` (by descending logit, after mass `acc`) top-p keeps: up to
/// the first whose preceding mass exceeds `top_p` (the prefix sum accumulated in float64 and
/// rounded, minus the probability itself, in float32); `None` if none does.
pub(super) fn keep_top_p(q: impl Iterator<Item = f32>, top_p: f32, mut acc: f64) -> Option<usize> {
    for (j, q) in q.enumerate() {
        acc += q as f64;
        if (acc as f32) - q > top_p {
            return Some(j);
        }
    }
    None
}
