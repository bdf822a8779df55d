//! criterion: the CPU sampler (`sample_rows`) on a batch of rows, at a tiny vocabulary (259, the
//! test models') and SmolLM2's (49152), under each filter set the engine passes: temperature
//! alone, top-k, top-p, top-k with top-p, and min-p.
//!
//! The logits are N(0, 4²) (a hash of the row and token, Box-Muller), temperature 0.8, each row
//! its own seed: the same shape of input as `benchmarks/sampler_cpu.py`, so the figures compare.
//! `flat` rows are N(0, 0.2²), what a random test model gives (`benchmarks/host_overhead.py`):
//! top-p then keeps nearly every top-k survivor and the race visits them all.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferryman_core::sampling::uniform;
use ferryman_core::{sample_rows, RowParams};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// (name, top_k, top_p, min_p)
const FILTERS: [(&str, i64, f32, f32); 5] = [
    ("temperature", -1, 1.0, 0.0),
    ("top_k=50", 50, 1.0, 0.0),
    ("top_p=0.9", -1, 0.9, 0.0),
    ("top_k=50,top_p=0.9", 50, 0.9, 0.0),
    ("min_p=0.05", -1, 1.0, 0.05),
];

/// `rows` rows of `vocab` logits, N(0, `std`²).
fn logits(rows: usize, vocab: usize, std: f64) -> Vec<f32> {
    (0..rows * vocab)
        .map(|i| {
            let (u1, u2) = (uniform(1, i as i64, 0), uniform(2, i as i64, 0));
            (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for (vocab, batch, std) in [(259usize, 256usize, 4.0), (259, 256, 0.2), (49_152, 8, 4.0)] {
        let lg = logits(batch, vocab, std);
        let rows: Vec<usize> = (0..batch).collect();
        let mut out = vec![0i64; batch];
        let mut g = c.benchmark_group(format!("sample_rows/v{vocab}/b{batch}{}", if std < 1.0 { "/flat" } else { "" }));
        g.throughput(Throughput::Elements(batch as u64));
        for (name, top_k, top_p, min_p) in FILTERS {
            let params: Vec<RowParams> = (0..batch as i64)
                .map(|r| RowParams { temperature: 0.8, top_k, top_p, min_p, seed: r, position: 100 + r })
                .collect();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| sample_rows(&lg, vocab, &rows, &params, &mut out));
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
