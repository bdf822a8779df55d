//! Greedy sampling on the CPU: every row's argmax (numpy's: the first index of the largest
//! logit) and, in the same pass, whether that logit is finite, reported as -1 so the engine fails
//! the row. One call gives the engine the argmax, the finiteness check and the int32 ids it hands
//! to `update()`, where numpy took eight calls after the forward, each slow on caches the forward
//! had just flushed.
//!
//! A row is refused when it holds a NaN or +inf, or is all -inf; one -inf among finite logits is
//! an ordinary token of probability zero.

/// Greedy sampling of every row of `logits` (row-major, `vocab` wide) into `out`: each row's
/// first index of its largest logit (numpy's `argmax`), or -1 when that logit is not finite (a
/// NaN or +inf in the row, or all of it -inf), so the caller fails that row. Returns the
/// number of rows set to -1. Panics if `out` does not have one entry per row.
pub fn argmax_rows(logits: &[f32], vocab: usize, out: &mut [i32]) -> usize {
    assert!(vocab > 0 && logits.len() == vocab * out.len());
    let mut num_bad = 0;
    for (row, o) in logits.chunks_exact(vocab).zip(out.iter_mut()) {
        let (max, nan) = max_and_nan(row);
        *o = if nan || !max.is_finite() {
            num_bad += 1;
            -1
        } else {
            first_index_of(row, max) as i32
        };
    }
    num_bad
}

/// The first index of `v` in `row`, which holds it: sixteen compares at a time, the compiler
/// vectorizes them (a plain `position` compares one by one: half of `argmax_rows`' time at 259).
#[inline]
fn first_index_of(row: &[f32], v: f32) -> usize {
    const WIDTH: usize = 16;
    let chunks = row.chunks_exact(WIDTH);
    let done = chunks.len() * WIDTH;
    for (i, c) in chunks.enumerate() {
        if c.iter().fold(false, |hit, &x| hit | (x == v)) {
            return i * WIDTH + c.iter().position(|&x| x == v).expect("found above");
        }
    }
    done + row[done..].iter().position(|&x| x == v).expect("the value is in the row")
}

/// A row's largest value ignoring NaN (-inf when empty or all NaN), as `max_and_nan` finds it:
/// what `fold(f32::NEG_INFINITY, f32::max)` gives, up to which zero of ±0, in vector registers
/// instead of one compare after another.
#[inline]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    max_and_nan(row).0
}

/// A row's largest value ignoring NaN, and whether it holds a NaN: eight lanes the compiler
/// keeps in one vector register, then the lanes and the tail.
#[inline]
fn max_and_nan(row: &[f32]) -> (f32, bool) {
    const LANES: usize = 8;
    let mut lane = [f32::NEG_INFINITY; LANES];
    let mut nan = [false; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            lane[l] = if c[l] > lane[l] { c[l] } else { lane[l] };
            nan[l] |= c[l].is_nan();
        }
    }
    let mut max = lane.iter().copied().fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m });
    let mut any_nan = nan.iter().any(|&n| n);
    for &x in tail {
        max = if x > max { x } else { max };
        any_nan |= x.is_nan();
    }
    (max, any_nan)
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: usize = 19; // two lanes' worth and a tail

    #[test]
    fn argmax_rows_takes_the_first_maximum_and_refuses_rows_that_are_not_finite() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let mut lg = logits(11 * W);
        let at = |row: usize, col: usize| row * W + col;
        lg[at(0, 17)] = 99.0; // the maximum in the tail
        lg[at(1, 3)] = 50.0;
        lg[at(1, 12)] = 50.0; // a tie: the first wins
        lg[at(2, 4)] = nan;
        lg[at(3, 18)] = inf;
        lg[at(4, 0)..at(5, 0)].fill(-inf);
        lg[at(5, 6)] = -inf; // one -inf among finite logits is an ordinary row
        lg[at(6, 0)..at(7, 0)].fill(2.5); // all equal: index 0
        lg[at(7, 18)] = nan; // NaN in the tail only
        lg[at(8, 0)..at(9, 0)].fill(-inf);
        lg[at(8, 18)] = -1e30; // the only finite logit, in the tail
        let mut out = vec![0; 11];
        let bad = argmax_rows(&lg, W, &mut out);
        assert_eq!(bad, 4);
        assert_eq!(&out[..9], &[17, 3, -1, -1, -1, out[5], 0, -1, 18]);
        for r in [5, 9, 10] {
            let row = &lg[at(r, 0)..at(r + 1, 0)];
            let want = (0..W).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(out[r], want as i32, "row {r}");
        }
    }

    /// Distinct-ish values without a generator: a hash of the index, scaled to about ±4.
    fn logits(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i as u64).wrapping_mul(2_654_435_761) % 1000) as f32 / 125.0 - 4.0).collect()
    }
}
