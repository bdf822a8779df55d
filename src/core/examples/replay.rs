//! Replays a `benchmarks/sched_overhead.py` trace through the core alone (no binding), with
//! the same fake model and token ids (its default seed, 0), and prints the core's time per
//! output token: the program to profile (`perf record`, `valgrind --tool=callgrind` or
//! `--tool=cachegrind`) when working on the hot path.
//!
//!     cargo run --release -p ferryman-core --example replay -- trace.json [num_device_blocks]
//!
//! `FERRYMAN_REPLAY_EVICT_KIB=N` writes an N KiB buffer after each `schedule()` and `update()`,
//! as a model forward on the CPU would, so the core's state is cold in the caches when the next
//! call starts (8192 evicts this machine kind's L2; 256 its L1 under cachegrind's simulation).
//!
//! `FERRYMAN_REPLAY_PREFIX_CACHING=0` turns prefix caching off (on by default, as in the engine),
//! to see what it costs.
//!
//! Uses mimalloc, the allocator the Python extension uses.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::Instant;

use ferryman_core::{PreemptionModeConfig, RequestParams, Scheduler, SchedulerConfig};

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The token of request `r` at position `p` (workload_trace.py's, seed 0).
fn token(r: u64, p: u64) -> u32 {
    (splitmix64((r << 24) | p) % 151_936) as u32
}

/// The trace's requests as `[id, arrival_step, prompt_len, output_len]`: each JSON object of
/// the list holds those four integer fields (no other JSON is expected).
fn read_trace(text: &str) -> Vec<[u64; 4]> {
    const KEYS: [&str; 4] = ["\"id\"", "\"arrival_step\"", "\"prompt_len\"", "\"output_len\""];
    text.split('}')
        .filter(|obj| obj.contains("\"id\""))
        .map(|obj| {
            KEYS.map(|key| {
                let at = obj.find(key).unwrap_or_else(|| panic!("trace object without {key}: {obj}"));
                let rest = obj[at + key.len()..].trim_start_matches([':', ' ']);
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().unwrap_or_else(|_| panic!("{key} is not an integer in {obj}"))
            })
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: replay TRACE.json [NUM_DEVICE_BLOCKS]");
    let mut trace = read_trace(&std::fs::read_to_string(path).expect("readable trace"));
    trace.sort_by_key(|r| (r[1], r[0]));
    let mut cfg = SchedulerConfig {
        block_size: 16,
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
        max_model_len: trace.iter().map(|r| (r[2] + r[3]) as usize).max().unwrap_or(1),
        preemption_mode: PreemptionModeConfig::Recompute,
        enable_prefix_caching: std::env::var("FERRYMAN_REPLAY_PREFIX_CACHING").map_or(true, |v| v != "0"),
        ..SchedulerConfig::default()
    };
    // default: every request fits at once, as in sched_overhead.py
    let need: usize = trace.iter().map(|r| cfg.blocks_for((r[2] + r[3]) as usize)).sum();
    cfg.num_device_blocks = args.get(2).map_or(need, |a| a.parse().expect("NUM_DEVICE_BLOCKS"));
    let mut s = Scheduler::new(cfg).expect("config");
    let mut lens = vec![0u64; trace.iter().map(|r| r[0] as usize).max().unwrap_or(0) + 1];
    let (mut next, mut step, mut generated) = (0, 0u64, 0u64);
    // a model forward runs between the calls and evicts the core's state from the caches;
    // FERRYMAN_REPLAY_EVICT_KIB=N writes an N KiB buffer after `schedule()` and after `update()`
    let evict_kib: usize = std::env::var("FERRYMAN_REPLAY_EVICT_KIB").map_or(0, |v| v.parse().expect("KiB"));
    let mut scratch = vec![0u8; evict_kib << 10];
    let mut evict = |round: u8| {
        for line in scratch.chunks_mut(64) {
            line[0] = line[0].wrapping_add(round);
        }
        std::hint::black_box(&scratch);
    };
    let started = Instant::now();
    while next < trace.len() || s.has_unfinished_requests() {
        while next < trace.len() && trace[next][1] <= step {
            let [id, _, prompt_len, output_len] = trace[next];
            let prompt = (0..prompt_len).map(|p| token(id, p)).collect();
            let p = RequestParams { max_tokens: output_len as usize, ignore_eos: true, n: 1, ..Default::default() };
            s.add_request(id, prompt, p).expect("valid request");
            lens[id as usize] = prompt_len;
            next += 1;
        }
        let out = s.schedule().expect("schedule");
        evict(1);
        let sampled: Vec<i32> = out.sample_req_ids.iter().map(|&r| token(r as u64, lens[r as usize]) as i32).collect();
        let res = s.update(&sampled).expect("update");
        evict(2);
        for &r in &res.req_ids {
            lens[r as usize] += 1;
        }
        generated += res.req_ids.len() as u64;
        step += 1;
    }
    let wall = started.elapsed().as_nanos() as f64;
    let core = s.counters().scheduler_ns as f64;
    println!(
        "steps {step} output_tokens {generated} core_ns_per_output_token {:.1} wall_ns_per_output_token {:.1}",
        core / generated as f64,
        wall / generated as f64
    );
}
