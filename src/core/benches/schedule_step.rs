//! criterion: one `schedule()` + `update()` step of the core (no binding), at 256 and 1024
//! running requests: decode-only, mixed (decodes plus chunked prefills of waiting requests), and
//! under heavy preemption (every step preempts) in recompute and swap modes.
//!
//! Each scenario builds a template state once; the timed loop steps a clone of it and re-clones
//! every `RESET` steps so the state stays representative. Cloning, dropping and the first step
//! after a clone (which regrows every vector the clone made exact-size) are not timed.
//!
//! Allocations go through mimalloc, the allocator of the Python extension.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ferryman_core::{PreemptionModeConfig, RequestParams, Scheduler, SchedulerConfig};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RESET: u64 = 64;

fn token(r: u64, p: usize) -> u32 {
    ((r.wrapping_mul(0x9E37_79B9) ^ (p as u64).wrapping_mul(0x85EB_CA77)) % 151_936) as u32
}

fn step(s: &mut Scheduler) {
    let out = s.schedule().unwrap();
    let sampled: Vec<i32> =
        out.sample_req_ids.iter().zip(&out.logits_indices).map(|(&r, &i)| token(r as u64, i as usize) as i32).collect();
    s.update(&sampled).unwrap();
}

/// `running` requests with prompts of `prompt_len` tokens plus 0..16 (so decodes cross block
/// boundaries on different steps), prefilled; then `waiting` more queued behind them.
fn template(
    running: usize,
    waiting: usize,
    prompt_len: usize,
    num_device_blocks: usize,
    mode: PreemptionModeConfig,
) -> Scheduler {
    let cfg = SchedulerConfig {
        block_size: 16,
        num_device_blocks,
        num_host_blocks: num_device_blocks,
        max_num_batched_tokens: 8192,
        max_num_seqs: running + waiting.min(running),
        max_model_len: prompt_len + 4096,
        preemption_mode: mode,
        watermark: 0.0,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let add = |s: &mut Scheduler, r: u64| {
        let prompt = (0..prompt_len + r as usize % 16).map(|p| token(r, p)).collect();
        s.add_request(r, prompt, RequestParams { max_tokens: 4000, n: 1, ..RequestParams::default() }).unwrap();
    };
    for r in 0..running as u64 {
        add(&mut s, r);
    }
    while s.current().num_waiting > 0 || s.last_step().num_prefill_tokens > 0 || s.last_step().step == 0 {
        step(&mut s);
    }
    for r in running as u64..(running + waiting) as u64 {
        add(&mut s, r);
    }
    s
}

/// Prints what a step of the scenario holds, so the timings can be read per request.
fn describe(name: &str, tpl: &Scheduler) {
    let mut s = tpl.clone();
    let (mut rows, mut preempted) = (0, 0);
    for _ in 0..RESET {
        let out = s.schedule().unwrap();
        rows += out.req_ids.len();
        preempted += out.preempted_req_ids.len();
        let sampled = vec![1; out.logits_indices.len()];
        s.update(&sampled).unwrap();
    }
    let per = RESET as f64;
    eprintln!("{name}: {:.0} rows and {:.2} preemptions per step", rows as f64 / per, preempted as f64 / per);
}

fn bench_scenario(c: &mut Criterion, name: &str, tpl: &Scheduler) {
    describe(name, tpl);
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let fresh = || {
                let mut s = tpl.clone();
                step(&mut s);
                s
            };
            let mut s = fresh();
            for i in 0..iters {
                if i % RESET == RESET - 1 {
                    s = fresh();
                }
                let t = Instant::now();
                step(&mut s);
                total += t.elapsed();
            }
            total
        })
    });
}

fn benches(c: &mut Criterion) {
    let auto = PreemptionModeConfig::Auto;
    for &n in &[256usize, 1024] {
        let prompt = if n == 256 { 1024 } else { 256 };
        let ample = n * (prompt / 16 + 16) + 64;
        bench_scenario(c, &format!("decode/{n}"), &template(n, 0, prompt, ample, auto));
        // n decodes plus 8192 - n tokens of chunked prefill from a deep waiting queue each step
        bench_scenario(c, &format!("mixed/{n}"), &template(n, 4 * n, prompt, ample * 8, auto));
        // short requests in a pool with one spare block per 8 of them: every step some decodes
        // cross a block boundary and each victim frees only a few blocks, so most steps preempt
        for (mode, label) in [(PreemptionModeConfig::Recompute, "recompute"), (PreemptionModeConfig::Swap, "swap")] {
            let tight = n * 3 + n / 8;
            bench_scenario(c, &format!("preempt_{label}/{n}"), &template(n, 0, 32, tight, mode));
        }
    }
}

criterion_group! {
    name = schedule_step;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    targets = benches
}
criterion_main!(schedule_step);
