//! How close the core's decode step is to the floor the contract sets, side by side in one run.
//!
//! For every running decode row, any `schedule()` + `update()` that honours the contract (v2:
//! the persistent batch) must write the row's entries of `req_ids`, `rows`, `input_ids`,
//! `qo_indptr`, `seq_lens`, `kv_indptr`, `kv_last_page_len`, `logits_indices` and the sample
//! ids, send a block-table entry every `block_size` tokens, and then append the sampled token
//! and report it, taking a new block every `block_size` tokens. The runner holds the block
//! tables, so no row's table is copied. The "floor" below does only that, with the cheapest layout we know
//! (dense per-row scalars, block tables at a fixed stride in one arena) and no policy, no prefix
//! cache, no stop checks and no binding. The same rows then run through the core, with prefix
//! caching on (the default) and off. The three alternate for `rounds` rounds; prints the median
//! ns per decode row of each and the ratios.
//!
//!     cargo run --release -p ferryman-core --example decode_floor -- [rows] [steps] [rounds]
//!
//! Rows start at contexts of 1000..1500 tokens (the steady state of `sched_overhead.py`'s trace)
//! and decode `steps` tokens each. Uses mimalloc, the allocator the Python extension uses.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;
use std::time::Instant;

use ferryman_core::{RequestParams, Scheduler, SchedulerConfig};

const BLOCK_SIZE: usize = 16;

fn context_len(row: usize) -> usize {
    1000 + (row * 7) % 500
}

/// The contract's decode arrays with nothing else; returns ns per decode row.
fn floor(rows: usize, steps: usize) -> f64 {
    let stride = (1500 + steps) / BLOCK_SIZE + 2;
    let mut tables = vec![0i32; rows * stride];
    let (mut num_blocks, mut pos, mut last) = (vec![0usize; rows], vec![0usize; rows], vec![0i32; rows]);
    let mut next_block = 1i32;
    for r in 0..rows {
        pos[r] = context_len(r); // the position the next decode computes: the first output token
        num_blocks[r] = pos[r] / BLOCK_SIZE + 1;
        for b in &mut tables[r * stride..r * stride + num_blocks[r]] {
            *b = next_block;
            next_block += 1;
        }
        last[r] = r as i32;
    }
    let started = Instant::now();
    for _ in 0..steps {
        let v = |n: usize| Vec::<i32>::with_capacity(n);
        let (mut req_ids, mut row_ids, mut input_ids) = (Vec::<i64>::with_capacity(rows), v(rows), v(rows));
        let (mut qo_indptr, mut seq_lens, mut kv_indptr, mut kv_last_page_len) =
            (v(rows + 1), v(rows), v(rows + 1), v(rows));
        let (mut logits_indices, mut sample_ids) = (Vec::<i64>::with_capacity(rows), Vec::<i64>::with_capacity(rows));
        let (mut table_rows, mut table_cols, mut table_blocks) = (v(rows), v(rows), v(rows));
        qo_indptr.push(0i32);
        kv_indptr.push(0i32);
        let mut pages = 0;
        for r in 0..rows {
            let (p, n) = (pos[r], num_blocks[r]);
            req_ids.push(r as i64);
            row_ids.push(r as i32);
            input_ids.push(last[r]);
            qo_indptr.push(r as i32 + 1);
            seq_lens.push(p as i32 + 1);
            pages += n;
            kv_indptr.push(pages as i32);
            kv_last_page_len.push((p + 1 - (n - 1) * BLOCK_SIZE) as i32);
            logits_indices.push(r as i64);
            sample_ids.push(r as i64);
            if p % BLOCK_SIZE == 0 {
                table_rows.push(r as i32);
                table_cols.push(n as i32 - 1);
                table_blocks.push(tables[r * stride + n - 1]);
            }
        }
        black_box((&req_ids, &row_ids, &input_ids, &qo_indptr, &seq_lens, &kv_indptr, &kv_last_page_len));
        black_box((&logits_indices, &sample_ids, &table_rows, &table_cols, &table_blocks));
        let sampled: Vec<i32> = black_box(vec![7; rows]);
        let mut new_token_ids = Vec::with_capacity(rows);
        for r in 0..rows {
            last[r] = sampled[r];
            new_token_ids.push(sampled[r]);
            pos[r] += 1;
            if pos[r] % BLOCK_SIZE == 0 {
                tables[r * stride + num_blocks[r]] = next_block;
                next_block += 1;
                num_blocks[r] += 1;
            }
        }
        black_box(&new_token_ids);
    }
    started.elapsed().as_nanos() as f64 / (rows * steps) as f64
}

/// The same rows through the core's `schedule()` + `update()`; returns ns per decode row.
fn core(rows: usize, steps: usize, enable_prefix_caching: bool) -> f64 {
    let cfg = SchedulerConfig {
        block_size: BLOCK_SIZE,
        num_device_blocks: rows * ((1500 + steps + 64) / BLOCK_SIZE + 1),
        max_num_batched_tokens: 8192,
        max_num_seqs: rows,
        max_model_len: 1500 + steps + 64,
        enable_prefix_caching,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).expect("config");
    for r in 0..rows {
        let prompt = (0..context_len(r)).map(|p| ((r * 7919 + p * 104_729) % 151_936) as u32).collect();
        let p = RequestParams { max_tokens: steps + 64, ignore_eos: true, n: 1, ..Default::default() };
        s.add_request(r as u64, prompt, p).expect("valid request");
    }
    // prefill every prompt and sample its first token (untimed): from here each row decodes
    while s.current().num_waiting > 0 || s.last_step().num_prefill_tokens > 0 || s.last_step().step == 0 {
        let out = s.schedule().expect("schedule");
        s.update(&vec![7; out.logits_indices.len()]).expect("update");
    }
    let started = Instant::now();
    for _ in 0..steps {
        let out = s.schedule().expect("schedule");
        assert_eq!(out.req_ids.len(), rows, "every row decodes in every timed step");
        let sampled: Vec<i32> = black_box(vec![7; out.logits_indices.len()]);
        black_box(s.update(&sampled).expect("update"));
    }
    started.elapsed().as_nanos() as f64 / (rows * steps) as f64
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("an integer"));
    let (rows, steps, rounds) = (arg(1, 256), arg(2, 400), arg(3, 5));
    let (mut f, mut c, mut c_off) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        f.push(floor(rows, steps));
        c.push(core(rows, steps, true));
        c_off.push(core(rows, steps, false));
    }
    let (f, c, c_off) = (median(f), median(c), median(c_off));
    println!(
        "rows {rows} steps {steps} rounds {rounds} median ns_per_decode_row: floor {f:.1} core {c:.1} \
         core_without_prefix_caching {c_off:.1}; core/floor {:.2} core_without_prefix_caching/floor {:.2}",
        c / f,
        c_off / f
    );
}
