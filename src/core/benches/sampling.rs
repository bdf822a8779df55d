//! criterion: the CPU sampler (`sample_rows`) on a batch of rows, at a tiny vocabulary (259, the
//! test models') and SmolLM2's (49152), under each filter set the engine passes: temperature
//! alone, top-k, top-p, top-k with top-p, and min-p.
//!
//! The logits are N(0, 4²) (a hash of the row and token, Box-Muller), temperature 0.8, each row
//! its own seed: the same shape of input as `benchmarks/sampler_cpu.py`, so the figures compare.
//! `flat` rows are N(0, 0.2²), what a random test model gives (`benchmarks/host_overhead.py`):
//! top-p then keeps nearly every top-k survivor and the race visits them all.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferryman_core::{sample_rows, RowParams};

mod common;
use common::{logits, FILTERS};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
