//! The CPU sampler's cases, shared by the criterion bench (`benches/sampling.rs`) and the
//! `sampler_rows` example: the filter sets the engine passes and N(0, std²) logits.

use ferryman_core::sampling::uniform;

/// (name, top_k, top_p, min_p)
pub const FILTERS: [(&str, i64, f32, f32); 5] = [
    ("temperature", -1, 1.0, 0.0),
    ("top_k=50", 50, 1.0, 0.0),
    ("top_p=0.9", -1, 0.9, 0.0),
    ("top_k=50,top_p=0.9", 50, 0.9, 0.0),
    ("min_p=0.05", -1, 1.0, 0.05),
];

/// `rows` rows of `vocab` logits, N(0, `std`²) (a hash of the index, Box-Muller).
pub fn logits(rows: usize, vocab: usize, std: f64) -> Vec<f32> {
    (0..rows * vocab)
        .map(|i| {
            let (u1, u2) = (uniform(1, i as i64, 0), uniform(2, i as i64, 0));
            (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}
