//! Structured outputs through the scheduler: a mask per constrained sample, the matcher advanced
//! by `update()`, forks of `n > 1` advancing on their own, and recompute and swap preemption
//! leaving every output as it is with room to spare; `check_invariants()` after every call.

mod common;

use std::collections::BTreeMap;

use common::cfg;
use ferryman_core::text::fixtures;
use ferryman_core::{FinishReason, GrammarSpec, PreemptionModeConfig, RequestParams, Scheduler, TextParams};

/// (req_id, seq_index) -> (text, finish reason)
type Finished = BTreeMap<(i64, i32), (String, Option<FinishReason>)>;

fn guided(kind: &str, data: &str, n: u32, eos: u32) -> RequestParams {
    RequestParams {
        max_tokens: 24,
        n,
        eos_token_ids: vec![eos],
        text: Some(TextParams::default()),
        grammar: Some(GrammarSpec { kind: kind.into(), data: data.into() }),
        ..RequestParams::default()
    }
}

/// Runs four constrained requests to the end. The "model" picks, among the tokens a sample's
/// mask allows, one that depends only on the sequence and its length, so any preemption must
/// leave the outputs unchanged.
fn run(num_device_blocks: usize, mode: PreemptionModeConfig) -> (Finished, u64) {
    let mut c = cfg(4, num_device_blocks, 64);
    c.preemption_mode = mode;
    c.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(c).unwrap();
    let tok = fixtures::byte_level();
    let eos = tok.hf().token_to_id("<|endoftext|>").unwrap();
    s.set_tokenizer(tok.clone());
    let prompt = |t: &str| tok.hf().encode(t, false).unwrap().get_ids().to_vec();
    s.add_request(1, prompt("pick ab then c:"), guided("regex", "[ab]{6,9}c", 2, eos)).unwrap();
    s.add_request(2, prompt("yes or no?"), guided("choice", r#"["yes","no","nope"]"#, 1, eos)).unwrap();
    let schema = r#"{"type":"object","properties":{"k":{"enum":["x","yy"]},"n":{"type":"integer","minimum":0,"maximum":99}},"required":["k","n"],"additionalProperties":false}"#;
    s.add_request(3, prompt("json please"), guided("json", schema, 1, eos)).unwrap();
    s.add_request(4, prompt("a list"), guided("lark", r#"start: "[" ("a" | "a,a" | "a,a,a")? "]""#, 1, eos)).unwrap();
    let mut done = Finished::new();
    let mut lens: BTreeMap<(i64, i32), usize> = BTreeMap::new();
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        let words = out.grammar_mask_words;
        assert_eq!(out.grammar_sample_indices.len(), out.sample_req_ids.len(), "every sample is constrained");
        let mut sampled = vec![0i32; out.sample_req_ids.len()];
        for (g, &i) in out.grammar_sample_indices.iter().enumerate() {
            let mask = &out.grammar_masks[g * words..(g + 1) * words];
            let allowed: Vec<usize> = (0..words * 32).filter(|&t| mask[t / 32] >> (t % 32) & 1 == 1).collect();
            assert!(!allowed.is_empty());
            let key = (out.sample_req_ids[i as usize], out.sample_seq_indices[i as usize]);
            let len = lens.entry(key).or_insert(0);
            sampled[i as usize] = allowed[(key.0 as usize * 7 + key.1 as usize * 3 + *len * 5) % allowed.len()] as i32;
            *len += 1;
        }
        let res = s.update(&sampled).unwrap();
        s.check_invariants().unwrap();
        for (f, &row) in res.finished_rows.iter().enumerate() {
            let text = &res.output_text[res.output_text_offsets[f] as usize..res.output_text_offsets[f + 1] as usize];
            let key = (res.req_ids[row as usize], res.seq_indices[row as usize]);
            done.insert(key, (String::from_utf8(text.to_vec()).unwrap(), res.finish_reasons[row as usize]));
        }
    }
    let c = s.counters();
    assert_eq!(c.num_grammar_errors, 0);
    assert!(c.num_grammar_masks > 0 && c.grammar_mask_ns > 0);
    (done, c.num_preemptions_recompute + c.num_preemptions_swap)
}

#[test]
fn outputs_follow_their_grammars_through_forks_and_preemption() {
    let (want, preempted) = run(64, PreemptionModeConfig::Recompute);
    assert_eq!(preempted, 0);
    assert_eq!(want.len(), 5, "two forks of request 1, one sequence of each other");
    for ((req, _), (text, reason)) in &want {
        assert_eq!(*reason, Some(FinishReason::Stop), "{req}: {text}");
        let ok = match req {
            1 => {
                text.ends_with('c')
                    && (7..=10).contains(&text.len())
                    && text[..text.len() - 1].chars().all(|c| "ab".contains(c))
            }
            2 => ["yes", "no", "nope"].contains(&text.as_str()),
            3 => {
                let v: serde_json::Value = serde_json::from_str(text).unwrap();
                ["x", "yy"].contains(&v["k"].as_str().unwrap()) && v["n"].as_u64().unwrap() <= 99
            }
            _ => {
                text.starts_with('[')
                    && text.ends_with(']')
                    && text[1..text.len() - 1].split(',').all(|p| p == "a" || p.is_empty())
            }
        };
        assert!(ok, "request {req}: {text:?}");
    }
    assert_ne!(want[&(1, 0)].0, want[&(1, 1)].0, "the forks took different paths");
    for mode in [PreemptionModeConfig::Recompute, PreemptionModeConfig::Swap] {
        let (got, preempted) = run(9, mode);
        assert!(preempted > 0, "{mode:?}: the pool is tight enough to preempt");
        assert_eq!(got, want, "{mode:?}");
    }
}

#[test]
fn a_grammar_needs_a_tokenizer_and_compiles_at_admission() {
    let mut s = Scheduler::new(cfg(4, 16, 0)).unwrap();
    let no_text = RequestParams { text: None, ..guided("regex", "a", 1, 0) };
    let err = s.add_request(1, vec![5], no_text).unwrap_err().to_string();
    assert!(err.contains("need a tokenizer"), "{err}");
    s.set_tokenizer(fixtures::byte_level());
    // the first grammar builds the tokenizer environment, around the request's first EOS id
    let err = s.add_request(2, vec![5], RequestParams { eos_token_ids: vec![], ..guided("regex", "a", 1, 0) });
    assert!(err.unwrap_err().to_string().contains("EOS"));
    let err = s.add_request(1, vec![5], guided("regex", "(", 1, 0)).unwrap_err().to_string();
    assert!(err.contains("structured outputs"), "{err}");
    s.add_request(3, vec![5], guided("regex", "a", 1, 0)).unwrap();
    s.check_invariants().unwrap();
}
