//! `Detok`: one sequence's incremental detokenizer, on owned state (no borrow of the tokenizer),
//! so it can live in the request arena.
//!
//! Semantics are those of the Python detokenizer this replaced (vLLM's prefix/read offsets): text
//! is emitted token by token; nothing is emitted while the text since the last emission ends
//! in U+FFFD (an incomplete UTF-8 character, or a replacement character that a later token may
//! still change), and `flush` emits that held text as the full decode shows it. The emitted
//! pieces concatenate to `tokenizer.decode(ids, skip_special_tokens=True)`; made with `after`
//! (the scheduler's way), to what the output adds to its prompt's decode (a SentencePiece
//! decoder's strip of the first space then applies to the prompt, not to the output).
//!
//! Two paths, chosen by the tokenizer:
//! - **table** (`Pieces`): per token, one table lookup and a UTF-8 check of the few bytes not yet
//!   emitted; no allocation once the buffers have grown.
//! - **generic**: the prefix/read scheme over `tokenizers`' decode. `ids` holds the window from
//!   the prefix offset on, `read` is where the emitted text ends inside it, `before_chars` is the
//!   length in chars of the window's decode up to `read` (Python compares lengths in chars).
//!
//! Each table-path push costs O(the token's bytes), however long the held text grows: in
//! `Mode::Lossy` every byte but an incomplete last character is decoded once, into `text`; in
//! `Mode::ByteRuns` a run's validity is checked from where the last check stopped, and a run with
//! an invalid sequence stays invalid (its bytes all become U+FFFD), so it is not checked again.
//! (A model that emits invalid UTF-8 for a long stretch made every push re-decode all of it.)
//!
//! Invariants: on the table path `ids` is empty; in `Mode::Lossy` `raw` is at most an incomplete
//! character (< 4 bytes) and `text` the held text before it; in `Mode::ByteRuns` `raw` holds only
//! the trailing byte tokens, its first `run_valid` bytes are valid UTF-8 unless `run_broken`, and
//! `text` is what the tokens since the last emission decode to apart from `raw`.

use super::pieces::{push_run, Kind, Mode, Pieces};
use super::Tokenizer;
use crate::error::CoreResult;

const REPLACEMENT: char = '\u{FFFD}';
/// Prompt tokens the generic path decodes before the output (vLLM's initial prefix offset).
const PROMPT_CONTEXT: usize = 5;

/// Incremental detokenizer state of one sequence.
#[derive(Debug, Clone)]
pub(crate) struct Detok {
    /// The tokenizer's path, fixed at construction.
    path: Path,
    /// The character the decoder strips from the start of the text, and how many are left.
    strip_char: char,
    strip_left: usize,
    /// Held, not yet emitted text: decoded text (ByteRuns), or the text `flush` would emit
    /// (generic).
    text: String,
    /// An incomplete trailing character (Lossy), or the trailing run of byte tokens (ByteRuns).
    raw: Vec<u8>,
    /// ByteRuns: how much of `raw` is known valid UTF-8, and whether it holds an invalid sequence.
    run_valid: usize,
    run_broken: bool,
    /// Generic path: the decode window, the emitted end inside it, and chars of its decode there.
    ids: Vec<u32>,
    read: usize,
    before_chars: usize,
}

impl Detok {
    /// Fresh state for a sequence decoded with `tok`.
    pub fn new(tok: &Tokenizer) -> Self {
        let (strip_char, strip_left) = tok.pieces().map_or((' ', 0), |p| (p.strip_char, p.strip_count));
        Self {
            path: Path::of(tok),
            strip_char,
            strip_left,
            text: String::new(),
            raw: Vec::new(),
            run_valid: 0,
            run_broken: false,
            ids: vec![],
            read: 0,
            before_chars: 0,
        }
    }

    /// Fresh state for an output that continues `prompt` (vLLM's rule: the output's text is
    /// what it adds to the prompt's): a decoder's strip of the text's start applies only if the
    /// prompt has no text (special tokens only), and the generic path starts its window with the
    /// prompt's last tokens, so a leading space of the first output token is kept.
    pub fn after(tok: &Tokenizer, prompt: &[u32]) -> Self {
        let mut d = Self::new(tok);
        match tok.pieces() {
            Some(p) => {
                if prompt.iter().rev().any(|&id| p.get(id).0 != Kind::Skip) {
                    d.strip_left = 0;
                }
            }
            None => {
                let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
                if let Ok(text) = tok.decode(tail) {
                    (d.ids, d.read, d.before_chars) = (tail.to_vec(), tail.len(), text.chars().count());
                }
            }
        }
        d
    }

    /// Adds `id`; appends to `out` the text this makes emittable (possibly none). `tok` must be
    /// the tokenizer (or a tokenizer of the same path) the state was made for.
    pub fn push(&mut self, tok: &Tokenizer, id: u32, out: &mut String) -> CoreResult<()> {
        debug_assert_eq!(self.path, Path::of(tok), "SeqText pushed with another kind of tokenizer");
        match (self.path, tok.pieces()) {
            (Path::Lossy, Some(p)) => self.push_lossy(p, id, out),
            (Path::Runs, Some(p)) => self.push_runs(p, id, out),
            _ => self.push_generic(tok, id, out)?,
        }
        Ok(())
    }

    /// Appends everything held, as the full decode shows it (an incomplete character as U+FFFD).
    pub fn flush(&mut self, out: &mut String) {
        match self.path {
            Path::Lossy if !self.raw.is_empty() => self.text.push(REPLACEMENT), // the cut character
            Path::Runs => self.resolve_run(),
            _ => {}
        }
        self.raw.clear();
        out.push_str(&self.text);
        self.text.clear();
    }

    /// Held text = `text` + the lossy decode of `raw` (U+FFFD if `raw` is not empty); it is
    /// emitted when it is not empty and does not end in U+FFFD.
    /// The raw bytes held, and whether they are a broken run (tests: the state stays bounded).
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> (usize, bool) {
        (self.raw.len(), self.run_broken)
    }

    fn push_lossy(&mut self, p: &Pieces, id: u32, out: &mut String) {
        let (Kind::Piece, piece) = p.get(id) else { return };
        self.raw.extend_from_slice(piece);
        loop {
            match std::str::from_utf8(&self.raw) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.raw.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.text.push_str(std::str::from_utf8(&self.raw[..valid]).expect("valid up to here"));
                    match e.error_len() {
                        // the bytes end inside a character: keep it, the decode ends in U+FFFD
                        None => {
                            self.raw.drain(..valid);
                            break;
                        }
                        Some(n) => {
                            self.text.push(REPLACEMENT);
                            self.raw.drain(..valid + n);
                        }
                    }
                }
            }
        }
        if self.raw.is_empty() && !self.text.is_empty() && !self.text.ends_with(REPLACEMENT) {
            out.push_str(&self.text);
            self.text.clear();
        }
    }

    fn push_runs(&mut self, p: &Pieces, id: u32, out: &mut String) {
        match p.get(id) {
            (Kind::Skip, _) => return,
            (Kind::Byte(b), _) => self.raw.push(b),
            (Kind::Piece, piece) => {
                self.resolve_run();
                // table pieces of this mode are valid UTF-8 (Pieces' invariant)
                self.put_text(std::str::from_utf8(piece).unwrap_or_default());
            }
        }
        if !self.raw.is_empty() {
            if self.run_broken {
                return; // an invalid sequence stays invalid: all U+FFFD, held until resolved
            }
            match std::str::from_utf8(&self.raw[self.run_valid..]) {
                Ok(_) => self.resolve_run(),
                Err(e) => {
                    // the run decodes to U+FFFDs so far: hold
                    self.run_valid += e.valid_up_to();
                    self.run_broken = e.error_len().is_some();
                    return;
                }
            }
        }
        if !self.text.is_empty() && !self.text.ends_with(REPLACEMENT) {
            out.push_str(&self.text);
            self.text.clear();
        }
    }

    /// Moves the run of byte tokens into `text` as `ByteFallback` decodes it.
    fn resolve_run(&mut self) {
        (self.run_valid, self.run_broken) = (0, false);
        if self.raw.is_empty() {
            return;
        }
        if self.strip_left == 0 {
            return push_run(&mut self.text, &mut self.raw);
        }
        let mut s = String::new();
        push_run(&mut s, &mut self.raw);
        self.put_text(&s);
    }

    /// Appends decoded text to `text`, stripping what the decoder strips from the start.
    fn put_text(&mut self, mut s: &str) {
        while self.strip_left > 0 && !s.is_empty() {
            match s.strip_prefix(self.strip_char) {
                Some(rest) => {
                    s = rest;
                    self.strip_left -= 1;
                }
                None => self.strip_left = 0,
            }
        }
        self.text.push_str(s);
    }

    fn push_generic(&mut self, tok: &Tokenizer, id: u32, out: &mut String) -> CoreResult<()> {
        self.ids.push(id);
        let after = tok.decode(&self.ids)?;
        let tail = skip_chars(&after, self.before_chars);
        if after.chars().count() <= self.before_chars || after.ends_with(REPLACEMENT) {
            self.text.clear();
            self.text.push_str(tail);
            return Ok(());
        }
        out.push_str(tail);
        self.text.clear();
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.before_chars = tok.decode(&self.ids)?.chars().count();
        Ok(())
    }
}

/// Which detokenization a sequence runs, from its tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Lossy,
    Runs,
    Generic,
}

impl Path {
    fn of(tok: &Tokenizer) -> Self {
        match tok.pieces().map(|p| p.mode) {
            Some(Mode::Lossy) => Self::Lossy,
            Some(Mode::ByteRuns) => Self::Runs,
            None => Self::Generic,
        }
    }
}

/// `s` without its first `n` chars (empty if it has fewer), as Python's `s[n:]`.
fn skip_chars(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or("", |(i, _)| &s[i..])
}
