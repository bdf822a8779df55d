//! The CPU sampler's time per row, for comparing two builds on a noisy machine: each case is
//! `sample_rows` over a batch, repeated, and the fastest repetition is printed (µs per row); the
//! minimum moves far less with other work on the machine than criterion's mean does. Run two
//! builds' binaries alternately and compare case by case.
//!
//! Cases: the criterion bench's (`benches/sampling.rs`: temperature 0.8, each row its own seed,
//! the five filter sets), on N(0, std²) logits: 259 tokens × 256 rows at std 4, 0.2 (a random
//! test model's flat rows) and 1; 49,152 (SmolLM2) × 8 rows at std 4 and 1.
//!
//!     cargo run --release -p ferryman-core --example sampler_rows

use std::time::Instant;

use ferryman_core::{sample_rows, RowParams};

#[path = "../benches/common/mod.rs"]
mod common;
use common::{logits, FILTERS};

fn main() {
    // (vocabulary, rows, std, repetitions)
    let cases = [
        (259usize, 256usize, 4.0, 60),
        (259, 256, 0.2, 60),
        (259, 256, 1.0, 60),
        (49_152, 8, 4.0, 20),
        (49_152, 8, 1.0, 20),
    ];
    for (vocab, batch, std, reps) in cases {
        let lg = logits(batch, vocab, std);
        let rows: Vec<usize> = (0..batch).collect();
        let mut out = vec![0i64; batch];
        for (name, top_k, top_p, min_p) in FILTERS {
            let params: Vec<RowParams> = (0..batch as i64)
                .map(|r| RowParams { temperature: 0.8, top_k, top_p, min_p, seed: r, position: 100 + r })
                .collect();
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = Instant::now();
                sample_rows(&lg, vocab, &rows, &params, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!("v{vocab} std{std} {name:<20} {:9.3} us/row", best * 1e6 / batch as f64);
        }
    }
}
