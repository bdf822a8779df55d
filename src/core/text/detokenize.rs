//! `Detok`: one sequence's incremental detokenizer, on owned state (no borrow of the tokenizer),
//! so it can live in the request arena.
//!
//! Semantics are those of the Python detokenizer this replaced (vLLM's prefix/read offsets): text
//! is emitted token by token; nothing is emitted while the text since the last emission ends
//! in U+FFFD (an incomplete UTF-8 character, or a replacement character that a later token may
//! still change), and `flush` emits that held text as the full decode shows it. The emitted
//! pieces concatenate to `tokenizer.decode(ids, skip_special_tokens=True)`.
//!
//! Two paths, chosen by the tokenizer:
//! - **table** (`Pieces`): per token, one table lookup and a UTF-8 check of the few bytes not yet
//!   emitted; no allocation once the buffers have grown.
//! - **generic**: the prefix/read scheme over `tokenizers`' decode. `ids` holds the window from
//!   the prefix offset on, `read` is where the emitted text ends inside it, `before_chars` is the
//!   length in chars of the window's decode up to `read` (Python compares lengths in chars).
//!
//! Invariants: on the table path `ids` is empty; in `Mode::ByteRuns` `run` holds only the trailing
//! byte tokens, and `text` is what the tokens since the last emission decode to apart from `run`.

use super::pieces::{push_run, Kind, Mode, Pieces};
use super::Tokenizer;
use crate::error::CoreResult;

const REPLACEMENT: char = '\u{FFFD}';

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
    /// Held raw bytes (Lossy), or the trailing run of byte tokens (ByteRuns).
    raw: Vec<u8>,
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
            ids: vec![],
            read: 0,
            before_chars: 0,
        }
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
            Path::Lossy if !self.raw.is_empty() => out.push_str(&String::from_utf8_lossy(&self.raw)),
            Path::Runs => self.resolve_run(),
            _ => {}
        }
        self.raw.clear();
        out.push_str(&self.text);
        self.text.clear();
    }

    fn push_lossy(&mut self, p: &Pieces, id: u32, out: &mut String) {
        let (Kind::Piece, piece) = p.get(id) else { return };
        self.raw.extend_from_slice(piece);
        match std::str::from_utf8(&self.raw) {
            Ok(s) if !s.is_empty() && !s.ends_with(REPLACEMENT) => out.push_str(s),
            Ok(_) => return,
            // the bytes end inside a character: the decode ends in U+FFFD
            Err(e) if e.error_len().is_none() => return,
            Err(_) => {
                let s = String::from_utf8_lossy(&self.raw);
                if s.ends_with(REPLACEMENT) {
                    return;
                }
                out.push_str(&s);
            }
        }
        self.raw.clear();
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
            if std::str::from_utf8(&self.raw).is_err() {
                return; // the run decodes to U+FFFDs so far: hold
            }
            self.resolve_run();
        }
        if !self.text.is_empty() && !self.text.ends_with(REPLACEMENT) {
            out.push_str(&self.text);
            self.text.clear();
        }
    }

    /// Moves the run of byte tokens into `text` as `ByteFallback` decodes it.
    fn resolve_run(&mut self) {
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
