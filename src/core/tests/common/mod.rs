//! Helpers shared by the core's integration tests: configs with tiny pools and a fake model.
#![allow(dead_code)]

use ferryman_core::{PreemptionModeConfig, RequestParams, Scheduler, SchedulerConfig, SchedulerOutput, StepOutputs};

/// A config with `num_device_blocks` blocks of `block_size` tokens and `num_host_blocks` host
/// blocks; no watermark, so exact block ids are easy to follow.
pub fn cfg(block_size: usize, num_device_blocks: usize, num_host_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_device_blocks,
        num_host_blocks,
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 64,
        watermark: 0.0,
        preemption_mode: PreemptionModeConfig::Recompute,
        ..SchedulerConfig::default()
    }
}

/// `max_tokens` tokens, ignoring EOS.
pub fn params(max_tokens: usize) -> RequestParams {
    RequestParams { max_tokens, n: 1, ..RequestParams::default() }
}

/// The fake model: the token a sequence produces at position `pos` (deterministic, so that a
/// recomputed or swapped request must produce the same tokens as an undisturbed one).
pub fn fake_token(req_id: i64, seq_index: i32, pos: usize) -> i32 {
    ((req_id as usize * 31 + seq_index as usize * 7 + pos * 13) % 97 + 3) as i32
}

/// A step's plan with the per-token arrays a runner derives from it (each row's block table as
/// the scheduler holds it when the step is planned).
pub struct Planned {
    pub out: SchedulerOutput,
    /// [T] each token's position.
    pub positions: Vec<i64>,
    /// [T] each token's KV slot (block * block_size + offset).
    pub slot_mapping: Vec<i64>,
    /// [kv_indptr[-1]] each row's blocks.
    pub kv_indices: Vec<i32>,
}

impl std::ops::Deref for Planned {
    type Target = SchedulerOutput;
    fn deref(&self) -> &SchedulerOutput {
        &self.out
    }
}

/// Derives `Planned`'s arrays from the scheduler's block tables, right after `schedule()`.
pub fn derive(s: &Scheduler, out: SchedulerOutput) -> Planned {
    let bs = s.config().block_size;
    let (mut positions, mut slot_mapping, mut kv_indices) = (vec![], vec![], vec![]);
    for b in 0..out.req_ids.len() {
        let table = s.block_table(out.req_ids[b] as u64, out.seq_indices[b] as u32).expect("scheduled");
        let len = out.seq_lens[b] as usize;
        let num_new = (out.qo_indptr[b + 1] - out.qo_indptr[b]) as usize;
        for p in len - num_new..len {
            positions.push(p as i64);
            slot_mapping.push(table[p / bs] as i64 * bs as i64 + (p % bs) as i64);
        }
        kv_indices.extend(table[..len.div_ceil(bs)].iter().map(|&t| t as i32));
    }
    Planned { out, positions, slot_mapping, kv_indices }
}

/// Runs one step with the fake model and checks the invariants after each half. `lens` maps
/// (req_id, seq_index) to the sequence's length; a new fork starts from its parent's.
pub fn step(s: &mut Scheduler, lens: &mut std::collections::HashMap<(i64, i32), usize>) -> (Planned, StepOutputs) {
    let out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    let out = derive(s, out);
    let bases: Vec<usize> = out
        .sample_req_ids
        .iter()
        .zip(&out.sample_seq_indices)
        .map(|(&r, &k)| lens.get(&(r, k)).or_else(|| lens.get(&(r, 0))).copied().expect("known request"))
        .collect();
    let sampled: Vec<i32> = out
        .sample_req_ids
        .iter()
        .zip(&out.sample_seq_indices)
        .zip(&bases)
        .map(|((&r, &k), &len)| fake_token(r, k, len))
        .collect();
    let res = s.update(&sampled).unwrap();
    s.check_invariants().unwrap();
    for ((&r, &k), &base) in res.req_ids.iter().zip(&res.seq_indices).zip(&bases) {
        lens.insert((r, k), base + 1);
    }
    (out, res)
}

/// Adds a request and registers its prompt length with the fake model's bookkeeping.
pub fn add(
    s: &mut Scheduler,
    lens: &mut std::collections::HashMap<(i64, i32), usize>,
    req_id: u64,
    prompt: Vec<u32>,
    p: RequestParams,
) {
    lens.insert((req_id as i64, 0), prompt.len());
    s.add_request(req_id, prompt, p).unwrap();
}
