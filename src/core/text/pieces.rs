//! `Pieces`: what each token id adds to the text, precomputed once per tokenizer, for decoders
//! that work token by token (the fast path of `detokenize`).
//!
//! Two decoder families qualify, recognized from the decoder's steps:
//! - **byte-level** (GPT-2, Llama-3, SmolLM): `ByteLevel`. Each token maps to raw bytes; the text
//!   is the lossy UTF-8 decode of their concatenation (`Mode::Lossy`).
//! - **SentencePiece-style** (Llama-2, Mistral, Gemma): a `Sequence` of string `Replace`s, then
//!   optionally `ByteFallback`, `Fuse`, and a `Strip` of the fused text's start (the layout
//!   transformers' `LlamaTokenizer` writes). Each token maps to
//!   its replaced string, or (`<0xNN>`) to one byte; a run of byte tokens decodes as UTF-8 if it is
//!   valid, else as one U+FFFD per byte token (`Mode::ByteRuns`).
//!
//! Anything else (WordPiece, CTC, Metaspace as the decoder, regex `Replace`, ...) gets no table and
//! goes through `tokenizers`' own decode. A table is kept only if `decode_exact` agrees with
//! `tokenizers`' decode on a fixed sample of random id sequences (`self_check`).
//!
//! Invariant: `starts.len() == kinds.len() + 1`; a `Kind::Piece` id's text is
//! `data[starts[id]..starts[id + 1]]`; in `Mode::ByteRuns` that range is valid UTF-8.

use tokenizers::{DecoderWrapper, Tokenizer as HfTokenizer};

const REPLACEMENT: char = '\u{FFFD}';

/// How the pieces of consecutive tokens combine into text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Concatenated bytes, decoded as lossy UTF-8 (byte-level BPE).
    Lossy,
    /// Concatenated strings; runs of byte tokens decode as UTF-8 or one U+FFFD per token.
    ByteRuns,
}

/// What one token id contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Nothing: a special token (skipped), or an id the vocabulary does not have.
    Skip,
    /// Its piece in `Pieces::data`.
    Piece,
    /// A `<0xNN>` byte token (`Mode::ByteRuns` with `ByteFallback` only).
    Byte(u8),
}

/// The per-token table of a tokenizer whose decoder works token by token.
#[derive(Debug)]
pub(crate) struct Pieces {
    pub mode: Mode,
    kinds: Vec<Kind>,
    starts: Vec<u32>,
    data: Vec<u8>,
    /// Strip up to this many leading `strip_char`s from the start of the whole text.
    pub strip_count: usize,
    pub strip_char: char,
}

/// The decoder steps the table reproduces, read from the decoder's serialized form.
struct Recipe {
    mode: Mode,
    replaces: Vec<(String, String)>,
    byte_fallback: bool,
    strip: Option<(char, usize)>,
}

impl Pieces {
    /// The table of `tk`, or `None` when its decoder is not token by token or the self-check fails.
    pub fn build(tk: &HfTokenizer) -> Option<Self> {
        let recipe = recognize(tk.get_decoder()?)?;
        let num_ids = tk.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
        let added = tk.get_added_vocabulary();
        let char_bytes = gpt2_char_bytes();
        let mut p = Self {
            mode: recipe.mode,
            kinds: Vec::with_capacity(num_ids),
            starts: Vec::with_capacity(num_ids + 1),
            data: Vec::new(),
            strip_count: recipe.strip.map_or(0, |s| s.1),
            strip_char: recipe.strip.map_or(' ', |s| s.0),
        };
        p.starts.push(0);
        for id in 0..num_ids as u32 {
            let kind = match tk.id_to_token(id) {
                None => Kind::Skip,
                Some(t) if added.is_special_token(&t) => Kind::Skip,
                Some(t) => match recipe.mode {
                    Mode::Lossy => {
                        let mapped: Option<Vec<u8>> =
                            t.chars().map(|c| char_bytes.get(c as usize).copied().flatten()).collect();
                        p.data.extend_from_slice(mapped.as_deref().unwrap_or(t.as_bytes()));
                        Kind::Piece
                    }
                    Mode::ByteRuns => match byte_token(&t).filter(|_| recipe.byte_fallback) {
                        Some(b) => Kind::Byte(b),
                        None => {
                            let text = recipe.replaces.iter().fold(t, |s, (pat, to)| s.replace(pat.as_str(), to));
                            p.data.extend_from_slice(text.as_bytes());
                            Kind::Piece
                        }
                    },
                },
            };
            p.kinds.push(kind);
            p.starts.push(u32::try_from(p.data.len()).ok()?);
        }
        p.self_check(tk).then_some(p)
    }

    /// What `id` contributes: its kind and (for `Kind::Piece`) its bytes.
    #[inline]
    pub fn get(&self, id: u32) -> (Kind, &[u8]) {
        let i = id as usize;
        match self.kinds.get(i) {
            Some(&k @ Kind::Piece) => (k, &self.data[self.starts[i] as usize..self.starts[i + 1] as usize]),
            Some(&k) => (k, &[]),
            None => (Kind::Skip, &[]),
        }
    }

    /// The whole text of `ids`, exactly as the recognized decoder makes it (skipping specials).
    pub fn decode_exact(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        let mut text = String::new();
        let mut run: Vec<u8> = Vec::new();
        for &id in ids {
            match (self.mode, self.get(id)) {
                (_, (Kind::Skip, _)) => {}
                (Mode::Lossy, (_, piece)) => bytes.extend_from_slice(piece),
                (Mode::ByteRuns, (Kind::Byte(b), _)) => run.push(b),
                (Mode::ByteRuns, (_, piece)) => {
                    push_run(&mut text, &mut run);
                    text.push_str(std::str::from_utf8(piece).unwrap_or_default());
                }
            }
        }
        push_run(&mut text, &mut run);
        if self.mode == Mode::Lossy {
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text.split_off(stripped_len(&text, self.strip_char, self.strip_count))
    }

    /// Does `decode_exact` agree with `tokenizers`' decode on 256 random sequences of 1..=16 ids?
    fn self_check(&self, tk: &HfTokenizer) -> bool {
        let n = self.kinds.len() as u64;
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..256).all(|_| {
            let len = 1 + next() % 16;
            let ids: Vec<u32> = (0..len).map(|_| (next() % n.max(1)) as u32).collect();
            tk.decode(&ids, true).is_ok_and(|want| want == self.decode_exact(&ids))
        })
    }
}

/// Bytes of a leading prefix of up to `count` `c`s in `text`.
fn stripped_len(text: &str, c: char, count: usize) -> usize {
    text.chars().take(count).take_while(|&x| x == c).map(char::len_utf8).sum()
}

/// Appends a run of byte tokens as `ByteFallback` decodes it, and empties it.
pub(crate) fn push_run(text: &mut String, run: &mut Vec<u8>) {
    if run.is_empty() {
        return;
    }
    match std::str::from_utf8(run) {
        Ok(s) => text.push_str(s),
        Err(_) => run.iter().for_each(|_| text.push(REPLACEMENT)),
    }
    run.clear();
}

/// `<0xNN>` → NN, as `ByteFallback` reads byte tokens.
fn byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() == 2 {
        u8::from_str_radix(hex, 16).ok()
    } else {
        None
    }
}

/// The byte each GPT-2 byte-level character stands for (indexed by the char), None elsewhere.
fn gpt2_char_bytes() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = vec![None; 256 + 68];
    let mut n = 0;
    for b in 0..=255u8 {
        if printable(b) {
            map[b as usize] = Some(b);
        } else {
            map[256 + n] = Some(b);
            n += 1;
        }
    }
    map
}

/// The recipe of a decoder the table can reproduce.
fn recognize(decoder: &DecoderWrapper) -> Option<Recipe> {
    let steps = match decoder {
        DecoderWrapper::Sequence(seq) => seq.get_decoders(),
        one => std::slice::from_ref(one),
    };
    if let [DecoderWrapper::ByteLevel(_)] = steps {
        return Some(Recipe { mode: Mode::Lossy, replaces: vec![], byte_fallback: false, strip: None });
    }
    let mut r = Recipe { mode: Mode::ByteRuns, replaces: vec![], byte_fallback: false, strip: None };
    // the order the table can follow: Replace*, ByteFallback?, Fuse?, Strip? (of the fused text)
    let mut phase = 0;
    for step in steps {
        phase = match (step, phase) {
            (DecoderWrapper::Replace(rep), 0) => {
                // the pattern is private: read it from the tokenizer.json form, {"String": ...}
                let form = serde_json::to_value(rep).ok()?;
                r.replaces.push((form["pattern"]["String"].as_str()?.to_owned(), rep.content.clone()));
                0
            }
            (DecoderWrapper::ByteFallback(_), 0) => {
                r.byte_fallback = true;
                1
            }
            (DecoderWrapper::Fuse(_), 0 | 1) => 2,
            (DecoderWrapper::Strip(strip), 2) if strip.stop == 0 => {
                r.strip = Some((strip.content, strip.start));
                3
            }
            _ => return None,
        };
    }
    Some(r)
}
