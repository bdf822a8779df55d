//! Small tokenizers built in code, for tests and benches (no files, no downloads).
//!
//! - `byte_level()`: byte-level BPE over the 256-character GPT-2 byte alphabet (as
//!   tests/python/tiny_models.py's `save_byte_tokenizer`), plus a few merges, some of which stop
//!   inside a UTF-8 character (`€`'s first two bytes, `東`'s last two), and three special tokens.
//! - `sentencepiece()`: Llama-2 style: BPE with `byte_fallback` over `<0x00>`..`<0xFF>`, `▁` and
//!   printable ASCII, a Metaspace pre-tokenizer, and the decoder Replace(`▁`→` `), ByteFallback,
//!   Fuse, Strip(1 leading space). Characters outside the vocabulary encode as byte tokens.

use serde_json::{json, Map, Value};

use super::Tokenizer;

/// Text with multi-byte characters, for tests and benches.
pub const SAMPLE_TEXT: &str = "The naïve café served crème brûlée — 東京 has 🚀 rockets, the end. \
    Hello world! Whitespace   and\nnewlines\tand tabs; the thing is interesting.";

/// The byte-level BPE tokenizer (special tokens `<|endoftext|>`, `<|im_end|>`, `<|im_start|>`).
pub fn byte_level() -> Tokenizer {
    Tokenizer::from_bytes(byte_level_json().as_bytes()).expect("the byte-level fixture loads")
}

/// The SentencePiece-style tokenizer (special tokens `<unk>`, `<s>`, `</s>`).
pub fn sentencepiece() -> Tokenizer {
    Tokenizer::from_bytes(sentencepiece_json().as_bytes()).expect("the sentencepiece fixture loads")
}

/// tokenizer.json of `byte_level()`.
pub fn byte_level_json() -> String {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut byte_char = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        byte_char[b as usize] = if printable(b) { char::from(b) } else { char::from_u32(256 + n).unwrap_or('\0') };
        n += u32::from(!printable(b));
    }
    let mut alphabet: Vec<char> = byte_char.to_vec();
    alphabet.sort_unstable();
    let mut vocab: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
    let words: [&[u8]; 10] =
        [b" the", b"he", b"in", b"ing", b" a", b"er", "\u{e9}".as_bytes(), b"\xE2\x82", b"\x9D\xB1", b"\n\n"];
    let words: Vec<Vec<char>> = words.iter().map(|w| w.iter().map(|&b| byte_char[b as usize]).collect()).collect();
    let merges = merges_for(&words, &mut vocab);
    let specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"];
    tokenizer_json(
        &vocab,
        &merges,
        &specials,
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        json!({"fuse_unk": false, "byte_fallback": false, "unk_token": null}),
    )
}

/// tokenizer.json of `sentencepiece()`.
pub fn sentencepiece_json() -> String {
    let specials = ["<unk>", "<s>", "</s>"];
    let mut vocab: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    vocab.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    vocab.push("\u{2581}".into());
    vocab.extend((b'!'..=b'~').map(|b| char::from(b).to_string()));
    let words: Vec<Vec<char>> =
        ["▁the", "▁Hello", "▁world", "ing", "▁a", "he", "er", "▁▁"].iter().map(|w| w.chars().collect()).collect();
    let merges = merges_for(&words, &mut vocab);
    let replace = json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "});
    let strip = json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
    tokenizer_json(
        &vocab,
        &merges,
        &specials,
        json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false}),
        json!({"type": "Sequence", "decoders": [replace, {"type": "ByteFallback"}, {"type": "Fuse"}, strip]}),
        json!({"fuse_unk": true, "byte_fallback": true, "unk_token": "<unk>"}),
    )
}

/// Merges that build each word left to right; adds the merged tokens to `vocab`.
fn merges_for(words: &[Vec<char>], vocab: &mut Vec<String>) -> Vec<[String; 2]> {
    let mut merges: Vec<[String; 2]> = Vec::new();
    for w in words {
        let mut acc = w[0].to_string();
        for c in &w[1..] {
            let pair = [acc.clone(), c.to_string()];
            acc.push(*c);
            if !merges.contains(&pair) {
                merges.push(pair);
            }
            if !vocab.contains(&acc) {
                vocab.push(acc.clone());
            }
        }
    }
    merges
}

fn tokenizer_json(
    vocab: &[String],
    merges: &[[String; 2]],
    specials: &[&str],
    pre_tokenizer: Value,
    decoder: Value,
    model_opts: Value,
) -> String {
    let mut vocab_map = Map::new();
    for (i, t) in vocab.iter().enumerate() {
        vocab_map.insert(t.clone(), json!(i));
    }
    // specials in the vocabulary keep their ids; the others come after it
    let mut next = vocab.len();
    let mut added = Vec::new();
    for s in specials {
        let id = vocab.iter().position(|t| t == s).unwrap_or_else(|| {
            next += 1;
            next - 1
        });
        added.push(json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}));
    }
    let mut model = json!({"type": "BPE", "dropout": null, "continuing_subword_prefix": null,
                           "end_of_word_suffix": null, "ignore_merges": false,
                           "vocab": vocab_map, "merges": merges});
    for (k, v) in model_opts.as_object().into_iter().flatten() {
        model[k] = v.clone();
    }
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
           "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
           "decoder": decoder, "model": model})
    .to_string()
}
