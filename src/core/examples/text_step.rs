//! ns per token of the text path (`SeqText::push` + `take_delta`), as `update()` will run it:
//! `rows` sequences decode `steps` tokens each, one token per row per step, every row's delta
//! appended to one step buffer (cleared each step) with its offset recorded.
//!
//!     cargo run --release -p ferryman-core --example text_step -- [rows] [steps] [rounds]
//!     FERRYMAN_TOKENIZER_JSON=path/to/tokenizer.json cargo run ...   (adds that tokenizer)
//!
//! Tokenizers: the byte-level and SentencePiece-style fixtures (table path), and the same through
//! `tokenizers`' decode (generic path); each without stop strings and with two that never match
//! but whose prefixes occur (so hold-back works). Rows run serially, and with rayon over chunks
//! of rows (each chunk its own buffer, concatenated after, as `update()` would have to). Prints
//! the best of `rounds` per line. Uses mimalloc, the allocator of the Python extension.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;
use std::time::Instant;

use ferryman_core::text::fixtures::{self, SAMPLE_TEXT};
use ferryman_core::text::{SeqText, Tokenizer};
use rayon::prelude::*;

const STOPS: [&str; 2] = ["\n\nUser:", "the end?"];

/// `rows` token streams of `steps` ids: the sample text (repeated) encoded, from a different
/// character offset per row.
fn workload(tok: &Tokenizer, rows: usize, steps: usize) -> Vec<Vec<u32>> {
    let text = SAMPLE_TEXT.repeat(1 + 8 * steps / SAMPLE_TEXT.len().max(1));
    let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    (0..rows)
        .map(|r| {
            let from = starts[(r * 13) % (starts.len() / 2)];
            let ids = tok.hf().encode(&text[from..], false).expect("encodes").get_ids().to_vec();
            assert!(ids.len() >= steps, "text too short for {steps} tokens");
            ids[..steps].to_vec()
        })
        .collect()
}

/// One pass over the workload; returns ns per token.
fn run(tok: &Tokenizer, ids: &[Vec<u32>], stops: &[&str], chunks: Option<usize>) -> f64 {
    let steps = ids[0].len();
    let mut seqs: Vec<SeqText> = ids.iter().map(|_| SeqText::new(tok, stops)).collect();
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
    let mut offsets: Vec<u32> = Vec::with_capacity(ids.len() + 1);
    let mut parts: Vec<Vec<u8>> = Vec::new();
    let t0 = Instant::now();
    for step in 0..steps {
        buf.clear();
        offsets.clear();
        offsets.push(0);
        match chunks {
            None => {
                for (s, row) in seqs.iter_mut().zip(ids) {
                    let _ = s.push(tok, row[step]).expect("push");
                    s.take_delta(&mut buf);
                    offsets.push(buf.len() as u32);
                }
            }
            Some(chunk) => {
                let n = seqs.len().div_ceil(chunk);
                parts.resize_with(n, Vec::new);
                seqs.par_chunks_mut(chunk).zip(ids.par_chunks(chunk)).zip(parts.par_iter_mut()).for_each(
                    |((ss, rows), part)| {
                        part.clear();
                        for (s, row) in ss.iter_mut().zip(rows) {
                            let _ = s.push(tok, row[step]).expect("push");
                            s.take_delta(part);
                        }
                    },
                );
                for p in &parts {
                    buf.extend_from_slice(p);
                }
                offsets.push(buf.len() as u32);
            }
        }
        black_box(&buf);
    }
    t0.elapsed().as_nanos() as f64 / (ids.len() * steps) as f64
}

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (rows, steps, rounds) = (arg(1, 256), arg(2, 128), arg(3, 20));
    let mut toks: Vec<(String, Tokenizer)> = vec![
        ("byte-level".into(), fixtures::byte_level()),
        ("sentencepiece".into(), fixtures::sentencepiece()),
        ("byte-level generic".into(), Tokenizer::new_generic(fixtures::byte_level().hf().clone())),
        ("sentencepiece generic".into(), Tokenizer::new_generic(fixtures::sentencepiece().hf().clone())),
    ];
    if let Ok(path) = std::env::var("FERRYMAN_TOKENIZER_JSON") {
        let t0 = Instant::now();
        let hf = tokenizers::Tokenizer::from_file(&path).expect("loads");
        let t1 = Instant::now();
        let tok = Tokenizer::new(hf);
        let (load, table) = (t1 - t0, t1.elapsed());
        println!("{path}: tokenizers load {load:.1?}, per-token table + self-check {table:.1?}");
        toks.push((format!("{path} ({:?})", tok.detok_path()), tok));
    }
    println!("{rows} rows x {steps} tokens, best of {rounds}; ns per token (push + take_delta)");
    println!("{:<44} {:>9} {:>9} {:>12} {:>12}", "tokenizer", "no stop", "2 stops", "rayon 2stop", "bytes/token");
    for (name, tok) in &toks {
        let ids = workload(tok, rows, steps);
        let total_bytes = ids.iter().map(|r| tok.decode(r).map_or(0, |t| t.len())).sum::<usize>();
        let generic = name.contains("generic");
        let r = if generic { rounds.min(3) } else { rounds };
        let best = |stops: &[&str], chunks| (0..r).map(|_| run(tok, &ids, stops, chunks)).fold(f64::MAX, f64::min);
        let (plain, stopped) = (best(&[], None), best(&STOPS, None));
        let par = if generic { f64::NAN } else { best(&STOPS, Some(rows.div_ceil(rayon::current_num_threads()))) };
        let per = total_bytes as f64 / (rows * steps) as f64;
        println!("{name:<44} {plain:>9.1} {stopped:>9.1} {par:>12.1} {per:>12.2}");
    }
}
