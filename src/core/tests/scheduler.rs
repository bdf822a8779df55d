//! Exact-plan tests of the scheduler on tiny pools: block ids, queues, plans and events.

mod common;

use std::collections::HashMap;

use common::{add, cfg, fake_token, params, step};
use ferryman_core::{
    CoreError, FinishReason, Policy, PreemptionMode, PreemptionModeConfig, PreemptionReason, RequestParams,
    RequestStatus, Scheduler,
};

type Lens = HashMap<(i64, i32), usize>;

#[test]
fn one_request_from_prefill_to_length_finish() {
    let mut s = Scheduler::new(cfg(4, 4, 0)).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![10, 11, 12, 13, 14], params(3));

    let (o, r) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(o.input_ids, vec![10, 11, 12, 13, 14]);
    assert_eq!(o.positions, vec![0, 1, 2, 3, 4]);
    assert_eq!(o.qo_indptr, vec![0, 5]);
    assert_eq!(o.seq_lens, vec![5]);
    assert_eq!((&o.kv_indptr, &o.kv_indices, &o.kv_last_page_len), (&vec![0, 2], &vec![1, 2], &vec![1]));
    assert_eq!(o.slot_mapping, vec![4, 5, 6, 7, 8]);
    assert_eq!(o.logits_indices, vec![4]);
    assert_eq!(o.sample_req_ids, vec![1]);
    assert_eq!(r.new_token_ids, vec![fake_token(1, 0, 5)]);
    assert_eq!(r.finish_reasons, vec![None]);

    let (o, _) = step(&mut s, &mut lens);
    assert_eq!((&o.input_ids, &o.positions, &o.slot_mapping), (&vec![fake_token(1, 0, 5)], &vec![5], &vec![9]));
    assert_eq!((&o.seq_lens, &o.kv_indices, &o.kv_last_page_len), (&vec![6], &vec![1, 2], &vec![2]));

    let (o, r) = step(&mut s, &mut lens);
    assert_eq!(o.slot_mapping, vec![10]);
    assert_eq!(r.finish_reasons, vec![Some(FinishReason::Length)]);
    assert!(!s.has_unfinished_requests());
    // block 2 (partial, uncached) is reused first; block 1 (cached prefix) is kept longest
    assert_eq!(s.device_free_list(), vec![2, 3, 4, 1]);

    let o = s.schedule().unwrap();
    assert_eq!(o.finished_req_ids, vec![1]);
    assert!(o.req_ids.is_empty() && o.logits_indices.is_empty());
    s.update(&[]).unwrap();
}

#[test]
fn stop_token_and_eos_finish_with_stop() {
    let mut s = Scheduler::new(cfg(4, 8, 0)).unwrap();
    let eos = fake_token(1, 0, 2) as u32;
    let p = RequestParams { eos_token_ids: vec![eos], ..params(10) };
    s.add_request(1, vec![1, 2], p.clone()).unwrap();
    s.add_request(2, vec![1, 2], RequestParams { ignore_eos: true, stop_token_ids: vec![], ..p }).unwrap();
    s.schedule().unwrap();
    let r = s.update(&[eos as i32, eos as i32]).unwrap();
    assert_eq!(r.finish_reasons, vec![Some(FinishReason::Stop), None]);
}

#[test]
fn chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes() {
    let mut c = cfg(4, 16, 0);
    c.max_num_batched_tokens = 4;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1, 2], params(8));
    add(&mut s, &mut lens, 2, (20..30).collect(), params(2));
    // step 0: request 1's prompt (2) + the first 2 tokens of request 2
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1, 2]);
    assert_eq!(o.qo_indptr, vec![0, 2, 4]);
    assert_eq!(o.logits_indices, vec![1]); // request 2's chunk is not final: nothing sampled
    assert_eq!(o.stats.num_prefill_tokens, 4);
    // the whole prompt's blocks were allocated at admission: [2, 3, 4]
    assert_eq!(s.block_table(2, 0).unwrap(), vec![2, 3, 4]);
    // step 1: decode of 1 + 3 more prompt tokens of 2
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.input_ids[1..], [22, 23, 24]);
    assert_eq!(o.positions, vec![2, 2, 3, 4]);
    assert_eq!(o.slot_mapping, vec![6, 10, 11, 12]);
    assert_eq!(o.logits_indices, vec![0]);
    // step 2: decode of 1 + 3 tokens of 2; step 3: decode + the last 2 prompt tokens, sampled
    step(&mut s, &mut lens);
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.qo_indptr, vec![0, 1, 3]);
    assert_eq!(o.logits_indices, vec![0, 2]);
    assert!(o.stats.num_scheduled_tokens <= 4);
}

#[test]
fn prefix_cache_hits_full_blocks_but_never_the_whole_prompt() {
    let mut s = Scheduler::new(cfg(4, 8, 0)).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, (1..=9).collect(), params(1));
    step(&mut s, &mut lens);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.device_free_list(), vec![3, 4, 5, 6, 7, 8, 2, 1]);

    let mut prompt: Vec<u32> = (1..=8).collect();
    prompt.extend([50, 51]);
    add(&mut s, &mut lens, 2, prompt, params(1));
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.input_ids, vec![50, 51]);
    assert_eq!(o.positions, vec![8, 9]);
    assert_eq!(o.kv_indices, vec![1, 2, 3]);
    assert_eq!(o.slot_mapping, vec![12, 13]);

    // an exact repeat of two full blocks: only the first is reused, 4 tokens are computed
    add(&mut s, &mut lens, 3, (1..=8).collect(), params(1));
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.input_ids, vec![5, 6, 7, 8]);
    assert_eq!(o.kv_indices[0], 1);
    let c = s.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (9 + 10 + 8, 8 + 4));
}

/// Two requests of 3 prompt tokens in a pool of 4 blocks of 2: at the third step the first
/// needs a block and the second is preempted.
fn two_requests(mode: PreemptionModeConfig, host: usize) -> (Scheduler, Lens) {
    let mut c = cfg(2, 4, host);
    c.preemption_mode = mode;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1, 2, 3], params(4));
    add(&mut s, &mut lens, 2, vec![4, 5, 6], params(4));
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.kv_indices, vec![1, 2, 3, 4]);
    step(&mut s, &mut lens);
    (s, lens)
}

#[test]
fn recompute_preemption_frees_the_latest_arrival_and_requeues_it_first() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Recompute, 0);
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.preempted_req_ids, vec![2]);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(o.kv_indices, vec![1, 2, 4]); // block 4 (tail of the victim) was reused first
    assert!(o.blocks_to_swap_out.is_empty());
    assert_eq!(s.request_status(2, 0), Some(RequestStatus::Waiting));
    let ev = s.drain_events();
    assert_eq!(ev.len(), 1);
    let e = &ev[0];
    assert_eq!((e.req_id, e.mode, e.reason, e.for_req_id), (2, PreemptionMode::Recompute, PreemptionReason::Config, 1));
    assert_eq!((e.num_blocks_freed, e.num_tokens_to_recompute, e.bytes_to_move), (2, 4, 0));
    assert_eq!((e.num_free_device_blocks, e.num_preemptions, e.token_budget_left), (2, 1, 64));

    // step 3: request 1 finishes; request 2 does not fit yet (needs 4 blocks, 1 free)
    let (o, r) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(r.finish_reasons, vec![Some(FinishReason::Length)]);
    // step 4: request 2 comes back, hitting its own first block (3) in the prefix cache
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![2]);
    assert_eq!(o.positions, vec![2, 3, 4]);
    assert_eq!(o.kv_indices, vec![3, 4, 2]);
    assert_eq!(o.input_ids, vec![6, fake_token(2, 0, 3), fake_token(2, 0, 4)]);
    while s.has_unfinished_requests() {
        step(&mut s, &mut lens);
    }
    assert_eq!(lens[&(2, 0)], 7);
    let c = s.counters();
    assert_eq!((c.num_preemptions_recompute, c.num_preemptions_swap, c.num_events), (1, 0, 1));
    // vLLM's: the victim's resume, which hit its own block, is not a prefix-cache query
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (3 + 3, 0));
}

#[test]
fn swap_preemption_moves_blocks_out_and_back_in() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Swap, 4);
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.preempted_req_ids, vec![2]);
    assert_eq!(o.blocks_to_swap_out, vec![[3, 1], [4, 2]]);
    assert_eq!(s.request_status(2, 0), Some(RequestStatus::Swapped));
    let e = &s.drain_events()[0];
    assert_eq!((e.mode, e.reason, e.num_tokens_to_recompute), (PreemptionMode::Swap, PreemptionReason::Config, 0));
    assert_eq!(e.bytes_to_move, (2.0 * s.config().bytes_per_block) as u64);

    let (o, _) = step(&mut s, &mut lens); // request 1 finishes; 2 cannot come back yet
    assert!(o.blocks_to_swap_in.is_empty());
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.blocks_to_swap_in, vec![[1, 3], [2, 4]]);
    assert_eq!(o.req_ids, vec![2]);
    assert_eq!(o.positions, vec![4]); // it continues where it stopped: nothing recomputed
    assert_eq!(o.kv_indices, vec![3, 4, 2]);
    assert_eq!(o.input_ids, vec![fake_token(2, 0, 4)]);
    assert_eq!(s.current().num_free_host_blocks, 4);
    while s.has_unfinished_requests() {
        step(&mut s, &mut lens);
    }
    assert_eq!(lens[&(2, 0)], 7);
}

#[test]
fn swap_falls_back_to_recompute_when_the_host_pool_is_short() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Swap, 1);
    let (o, _) = step(&mut s, &mut lens);
    assert!(o.blocks_to_swap_out.is_empty());
    let e = &s.drain_events()[0];
    assert_eq!((e.mode, e.reason), (PreemptionMode::Recompute, PreemptionReason::HostFull));
    assert_eq!(s.counters().num_swap_fallbacks, 1);
    assert_eq!(s.request_status(2, 0), Some(RequestStatus::Waiting));
}

#[test]
fn auto_picks_the_cheaper_restore_per_victim() {
    for (bytes_per_block, want) in [(1e3, PreemptionMode::Swap), (1e12, PreemptionMode::Recompute)] {
        let mut c = cfg(2, 4, 4);
        c.preemption_mode = PreemptionModeConfig::Auto;
        c.bytes_per_block = bytes_per_block;
        let mut s = Scheduler::new(c).unwrap();
        let mut lens = Lens::new();
        add(&mut s, &mut lens, 1, vec![1, 2, 3], params(4));
        add(&mut s, &mut lens, 2, vec![4, 5, 6], params(4));
        for _ in 0..3 {
            step(&mut s, &mut lens);
        }
        let e = &s.drain_events()[0];
        assert_eq!((e.mode, e.reason), (want, PreemptionReason::Cost));
        assert!(e.swap_cost_s.is_finite() && e.recompute_cost_s > 0.0);
        while s.has_unfinished_requests() {
            step(&mut s, &mut lens);
        }
    }
}

#[test]
fn priority_policy_preempts_the_least_important_not_the_latest() {
    let mut c = cfg(2, 4, 0);
    c.policy = Policy::Priority;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1, 2, 3], RequestParams { priority: 5, ..params(4) });
    add(&mut s, &mut lens, 2, vec![4, 5, 6], RequestParams { priority: 0, ..params(4) });
    for _ in 0..3 {
        step(&mut s, &mut lens);
    }
    // request 2 is admitted first (more important), runs first, and its growth preempts 1
    let e = &s.drain_events()[0];
    assert_eq!((e.req_id, e.for_req_id), (1, 2));
    assert_eq!(s.request_status(1, 0), Some(RequestStatus::Waiting));
}

#[test]
fn parallel_sampling_shares_the_prompt_and_copies_on_write() {
    let mut s = Scheduler::new(cfg(4, 8, 0)).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 7, vec![1, 2, 3, 4, 5, 6], RequestParams { n: 2, ..params(2) });
    let (o, r) = step(&mut s, &mut lens);
    assert_eq!(o.logits_indices, vec![5, 5]);
    assert_eq!(o.sample_seq_indices, vec![0, 1]);
    assert_eq!(r.seq_indices, vec![0, 1]);
    assert_eq!(s.block_table(7, 0).unwrap(), vec![1, 2]);
    assert_eq!(s.block_table(7, 1).unwrap(), vec![1, 2]);
    let (o, r) = step(&mut s, &mut lens);
    assert_eq!(o.blocks_to_copy, vec![[2, 3]]); // the first writer of shared block 2 copies it
    assert_eq!(o.kv_indices, vec![1, 3, 1, 2]);
    assert_eq!(o.slot_mapping, vec![14, 10]);
    assert_eq!(o.seq_indices, vec![0, 1]);
    assert_eq!(r.finish_reasons, vec![Some(FinishReason::Length); 2]);
    assert_eq!(s.current().num_free_device_blocks, 8);
}

#[test]
fn requests_that_could_never_fit_are_rejected_at_admission() {
    let mut s = Scheduler::new(cfg(4, 4, 0)).unwrap();
    assert!(matches!(s.add_request(1, vec![1; 60], params(5)), Err(CoreError::RequestTooLong { .. })));
    assert!(matches!(s.add_request(1, vec![1; 14], params(3)), Err(CoreError::RequestTooLarge { num_blocks: 5, .. })));
    assert!(matches!(s.add_request(1, vec![], params(3)), Err(CoreError::InvalidRequest { .. })));
    assert!(matches!(s.add_request(1, vec![1], params(0)), Err(CoreError::InvalidRequest { .. })));
    assert!(matches!(
        s.add_request(1, vec![1], RequestParams { n: 0, ..params(1) }),
        Err(CoreError::InvalidRequest { .. })
    ));
    s.add_request(1, vec![1; 13], params(3)).unwrap(); // exactly the whole pool
    assert_eq!(s.add_request(1, vec![1], params(1)), Err(CoreError::DuplicateRequest(1)));
    let o = s.schedule().unwrap();
    assert_eq!(o.num_scheduled_tokens(), 13);
    assert!(matches!(s.update(&[1, 2]), Err(CoreError::BatchSizeMismatch { expected: 1, got: 2 })));
    assert!(matches!(s.schedule(), Err(CoreError::OutOfOrder(_))));
    s.update(&[1]).unwrap();
    assert!(matches!(s.update(&[1]), Err(CoreError::OutOfOrder(_))));
    assert_eq!(s.finish_request(9, FinishReason::Stop, None), Err(CoreError::UnknownRequest(9)));
}

#[test]
fn abort_frees_everything_at_once_even_mid_step() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Swap, 4);
    step(&mut s, &mut lens); // 2 is swapped out
    assert!(s.abort_request(2));
    assert_eq!(s.current().num_free_host_blocks, 4);
    s.check_invariants().unwrap();
    let o = s.schedule().unwrap();
    assert!(s.abort_request(1)); // between schedule() and update()
    s.check_invariants().unwrap();
    let r = s.update(&vec![0; o.logits_indices.len()]).unwrap();
    // the aborted request's sample is dropped: a row with no output token and no finish reason
    assert_eq!((r.finish_reasons, r.num_output_tokens), (vec![None], vec![0]));
    assert!(!s.abort_request(1));
    assert_eq!(s.current().num_free_device_blocks, 4);
    assert!(!s.has_unfinished_requests());
    s.check_invariants().unwrap();
}

#[test]
fn a_victim_whose_copy_on_write_is_dropped_swaps_out_from_the_copy_source() {
    // n=3 forks of a 6-token prompt share blocks [1, 2] (block 2 partly filled). Fork 0 copies
    // block 2 into 3 on write; fork 1 then needs a copy too, but the pool is empty, so auto
    // preempts fork 0 (the only fork holding a block of its own) by swap. Fork 0's copy is
    // dropped and block 3 is reused by fork 1's copy, so fork 0's second block must be swapped
    // out from block 2, which still holds the content when the swap-out runs. Its first block
    // (full, cached, held by the other forks) stays on the device and is not copied.
    let mut c = cfg(4, 3, 4);
    c.preemption_mode = PreemptionModeConfig::Auto;
    c.bytes_per_block = 1.0;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 16, vec![1, 2, 3, 4, 5, 6], RequestParams { n: 3, ..params(3) });
    step(&mut s, &mut lens);
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.preempted_req_ids, vec![16]);
    let e = &s.drain_events()[0];
    assert_eq!((e.seq_index, e.mode), (0, PreemptionMode::Swap));
    assert_eq!(o.blocks_to_swap_out, vec![[2, 1]]);
    assert_eq!(o.blocks_to_copy, vec![[2, 3]]);
    assert_eq!(o.seq_indices, vec![1, 2]);
    while s.has_unfinished_requests() {
        step(&mut s, &mut lens);
    }
}

#[test]
fn the_watermark_holds_back_admission_only_while_others_run() {
    let mut c = cfg(4, 10, 0);
    c.watermark = 0.2; // keep 2 of 10 blocks free
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1; 20], params(1)); // 5 blocks
    add(&mut s, &mut lens, 2, vec![2; 13], params(2)); // 4 blocks: 10 - 5 - 4 = 1 < 2 free
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(o.num_waiting(), 1);
    let (o, _) = step(&mut s, &mut lens); // 1 finished: nothing runs, so no watermark
    assert_eq!(o.req_ids, vec![2]);
}

#[test]
fn nothing_is_admitted_in_a_step_that_preempted() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Recompute, 0);
    add(&mut s, &mut lens, 3, vec![9], params(1)); // would fit in the blocks the victim frees
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.preempted_req_ids, vec![2]);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(s.request_status(3, 0), Some(RequestStatus::Waiting));
}

#[test]
fn a_preempted_request_resumes_whole_and_first() {
    let (mut s, mut lens) = two_requests(PreemptionModeConfig::Recompute, 0);
    step(&mut s, &mut lens); // 2 is preempted, requeued at the front
    add(&mut s, &mut lens, 3, vec![7], params(1));
    // request 1 runs to its end; 2 needs its 5 known tokens plus one block to grow (4 blocks),
    // so it waits although a partial re-prefill would fit, and 3 (which would fit) may not pass
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1]);
    assert_eq!(s.request_status(3, 0), Some(RequestStatus::Waiting));
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![2, 3]);
    assert_eq!(o.qo_indptr, vec![0, 3, 4]); // 2's whole re-prefill at once (its first block was cached)
}

#[test]
fn an_unforked_parallel_request_counts_as_n_sequences() {
    let mut c = cfg(4, 16, 0);
    c.max_num_seqs = 3;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1, 2], RequestParams { n: 2, ..params(3) });
    add(&mut s, &mut lens, 2, vec![3, 4], RequestParams { n: 2, ..params(3) });
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.req_ids, vec![1]); // 2 + 2 > 3
    assert_eq!(o.num_running(), 1);
    assert!(s.add_request(3, vec![1], RequestParams { n: 4, ..params(1) }).is_err());
}

#[test]
fn swap_leaves_a_shared_cached_prefix_on_the_device_and_takes_it_back() {
    // request 2 shares request 1's two full prompt blocks [1, 2] through the prefix cache; when
    // it is swapped out only its own blocks move, and swap-in takes [1, 2] back by hash
    let mut c = cfg(2, 6, 8);
    c.preemption_mode = PreemptionModeConfig::Swap;
    let mut s = Scheduler::new(c).unwrap();
    let mut lens = Lens::new();
    add(&mut s, &mut lens, 1, vec![1, 2, 3, 4, 5], params(6));
    step(&mut s, &mut lens);
    add(&mut s, &mut lens, 2, vec![1, 2, 3, 4, 9], params(6));
    let (o, _) = step(&mut s, &mut lens);
    assert_eq!(o.kv_indices, vec![1, 2, 3, 1, 2, 4]);
    let mut preempted = None;
    while preempted.is_none() {
        let (o, _) = step(&mut s, &mut lens);
        if !o.preempted_req_ids.is_empty() {
            preempted = Some(o);
        }
    }
    let o = preempted.unwrap();
    assert_eq!(o.preempted_req_ids, vec![2]);
    // the victim's table was [1, 2, 4, 6]: only 4 and 6 are copied to the host
    assert_eq!(o.blocks_to_swap_out.iter().map(|p| p[0]).collect::<Vec<_>>(), vec![4, 6]);
    let e = &s.drain_events()[0];
    assert_eq!((e.mode, e.bytes_to_move), (PreemptionMode::Swap, (2.0 * s.config().bytes_per_block) as u64));
    let swapped_in = loop {
        let (o, _) = step(&mut s, &mut lens);
        if !o.blocks_to_swap_in.is_empty() {
            break o;
        }
    };
    assert_eq!(swapped_in.blocks_to_swap_in.len(), 2);
    let at = swapped_in.req_ids.iter().position(|&r| r == 2).unwrap();
    let table = &swapped_in.kv_indices[swapped_in.kv_indptr[at] as usize..swapped_in.kv_indptr[at + 1] as usize];
    assert_eq!(&table[..2], &[1, 2]); // the shared prefix, taken back from the cache
    while s.has_unfinished_requests() {
        step(&mut s, &mut lens);
    }
    assert_eq!((lens[&(1, 0)], lens[&(2, 0)]), (11, 11));
    let c = s.counters();
    assert_eq!((c.num_blocks_swapped_out, c.num_blocks_swapped_in, c.num_swap_prefix_lost), (2, 2, 0));
}

#[test]
fn a_finished_sequence_names_the_stop_string_that_ended_it() {
    use ferryman_core::text::fixtures;
    use ferryman_core::TextParams;

    let tok = fixtures::byte_level();
    let ids = |t: &str| tok.hf().encode(t, false).unwrap().get_ids().to_vec();
    let mut s = Scheduler::new(cfg(4, 16, 0)).unwrap();
    s.set_tokenizer(tok.clone());
    let stop = vec!["zz".to_string(), "c".to_string()];
    let text = Some(TextParams { stop, ..TextParams::default() });
    s.add_request(1, ids("x"), RequestParams { max_tokens: 8, text: text.clone(), ..params(8) }).unwrap();
    s.add_request(2, ids("x"), RequestParams { max_tokens: 2, text, ..params(2) }).unwrap();
    let (abc, de) = (ids("abc"), ids("de"));
    let mut stops = HashMap::new();
    for k in 0..3 {
        let out = s.schedule().unwrap();
        let sampled: Vec<i32> =
            out.sample_req_ids.iter().map(|&r| if r == 1 { abc[k] } else { de[k.min(1)] } as i32).collect();
        let r = s.update(&sampled).unwrap();
        s.check_invariants().unwrap();
        for (f, &row) in r.finished_rows.iter().enumerate() {
            stops.insert(r.req_ids[row as usize], (r.finish_reasons[row as usize], r.stop_string_indices[f]));
        }
    }
    assert_eq!(stops[&1], (Some(FinishReason::Stop), 1), "\"c\", the second stop string");
    assert_eq!(stops[&2], (Some(FinishReason::Length), -1), "a length is no stop string");
}
