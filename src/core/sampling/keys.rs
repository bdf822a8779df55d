//! The sampler's order keys and exponentials: 32-bit ranks and 64-bit sort keys whose integer
//! order is descending logits (ties by id), and a float32 e^x for x ≤ 0 that vectorizes.

/// An order key of scaled logit `x`: ascending ranks are descending logits (in `total_cmp`'s
/// order, NaN first); plain integer compares. -0 ranks below +0, so the sampler's scaled logits
/// hold no -0 (`RowSampler::sample`): equal logits tie, as in the torch sampler's sort.
#[inline]
pub(super) fn rank(x: f32) -> u32 {
    let b = x.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ascending
}

/// The logit of a `rank`.
#[inline]
pub(super) fn logit_of(rank: u32) -> f32 {
    let a = !rank;
    f32::from_bits(if a >> 31 == 1 { a & 0x7fff_ffff } else { !a })
}

/// A sort key of token (or candidate) `id` with scaled logit `x`: ascending keys are descending
/// logits, ties by ascending id.
#[inline]
pub(super) fn key(x: f32, id: u32) -> u64 {
    (u64::from(rank(x)) << 32) | u64::from(id)
}

/// The rank of a `key`.
#[inline]
pub(super) fn rank_of(key: u64) -> u32 {
    (key >> 32) as u32
}

/// The token id of a `key`.
#[inline]
pub(super) fn id_of(key: u64) -> u32 {
    key as u32
}

/// The lowest argument of `exp_shifted`: below it e^x is under the smallest normal float and
/// counts as 0.
pub(super) const EXP_MIN: f32 = -87.336_55;

/// e^x for x ≤ 0 in float32, within about 2 ulp of the correctly rounded value: x = n ln 2 + r
/// with |r| ≤ ln 2 / 2, a degree-7 polynomial for e^r (Cephes' coefficients), times 2^n built in
/// the exponent bits. 0 below `EXP_MIN`, NaN for NaN; x > 0 is not an input (it gives 1). No
/// calls and no branches, so a loop of it vectorizes (libm's `expf`, a call per element, was a
/// third of a row's time).
#[inline(always)]
pub(super) fn exp_nonpositive(x: f32) -> f32 {
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
pub(super) fn exp_shifted(out: &mut Vec<f32>, xs: &[f32], shift: f32) {
    out.clear();
    out.resize(xs.len(), 0.0);
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = exp_nonpositive(x - shift);
    }
}
