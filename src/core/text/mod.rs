//! The per-token text path: detokenization and stop strings, for `update()` to run per sample.
//!
//! - `Tokenizer`: a shared handle (`Arc`) on a `tokenizers::Tokenizer` loaded from tokenizer.json,
//!   with a per-token table when its decoder allows (`pieces`), which makes detokenizing one
//!   token a lookup instead of a decode.
//! - `SeqText`: one sequence's text state, owned data only (it lives with the request):
//!   the incremental detokenizer (`detokenize`), the stop strings (`stop`), the text not yet
//!   released and the text released so far. `push` adds a token and reports a stop-string
//!   match; `take_delta` appends the text a stream may send now to a step-wide buffer;
//!   `finish` flushes and releases everything.
//!
//! Semantics (those of the Python detokenizer and stop-string check this replaced; vLLM's stop
//! strings): all deltas of a sequence concatenate to `decode(output_ids, skip_special_tokens=True)`
//! (with `after_prompt`, the scheduler's way: to what the output adds to its prompt's decode),
//! cut at the earliest stop-string match (before it, or after it with
//! `include_stop_str_in_output`). As in vLLM, stop strings are looked for only from the token
//! after the first `min_tokens`; a match then may still begin in the text before. Text that could
//! still begin a stop string is held back until it cannot, so nothing released is ever cut later.
//!
//! Invariants: `text[..released]` was released and `text[released..]` is held, both valid
//! UTF-8; every stop-string match starts in the held part; once `finished`, nothing more is
//! pushed and `take_delta` releases all of it.

mod detokenize;
#[doc(hidden)]
pub mod fixtures;
mod pieces;
mod stop;

use std::path::Path;
use std::sync::Arc;

use crate::error::{CoreError, CoreResult};
use detokenize::Detok;
use pieces::{Kind, Mode, Pieces};
use stop::Stops;

/// A loaded tokenizer, cheap to clone and share between threads.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tk: tokenizers::Tokenizer,
    pieces: Option<Pieces>,
}

/// How a tokenizer's text is produced token by token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetokPath {
    /// Per-token table, byte-level decoder (lossy UTF-8 over token bytes).
    ByteLevel,
    /// Per-token table, SentencePiece-style decoder (strings, `<0xNN>` byte runs, strip).
    ByteFallback,
    /// `tokenizers`' decode over a window of recent tokens.
    Generic,
}

impl Tokenizer {
    /// Loads a tokenizer.json file.
    pub fn from_file(path: impl AsRef<Path>) -> CoreResult<Self> {
        let path = path.as_ref();
        let tk = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| CoreError::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        Ok(Self::new(tk))
    }

    /// Loads a tokenizer from the bytes of a tokenizer.json.
    pub fn from_bytes(json: &[u8]) -> CoreResult<Self> {
        let tk = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| CoreError::Tokenizer(format!("cannot load tokenizer.json: {e}")))?;
        Ok(Self::new(tk))
    }

    /// Wraps `tk`, building its per-token table when its decoder allows.
    pub fn new(tk: tokenizers::Tokenizer) -> Self {
        let pieces = Pieces::build(&tk);
        Self { inner: Arc::new(Inner { tk, pieces }) }
    }

    /// Wraps `tk` without a per-token table: every sequence decodes through `tokenizers`
    /// (the reference the table path is tested against).
    pub fn new_generic(tk: tokenizers::Tokenizer) -> Self {
        Self { inner: Arc::new(Inner { tk, pieces: None }) }
    }

    /// `decode(ids, skip_special_tokens=True)`: the text all of a sequence's deltas add up to.
    pub fn decode(&self, ids: &[u32]) -> CoreResult<String> {
        self.inner.tk.decode(ids, true).map_err(|e| CoreError::Tokenizer(format!("decode failed: {e}")))
    }

    /// A token's own bytes, as OpenAI's logprobs report them: what it adds to the text before
    /// UTF-8 decoding (a byte-level token's raw bytes, a `<0xNN>` token's byte), so the bytes of
    /// a character split over tokens join up; its decoded text where the decoder has no per-token
    /// table, and for a special token; nothing for an id the vocabulary does not have.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self.pieces().map(|p| p.get(id)) {
            Some((Kind::Piece, b)) => b.to_vec(),
            Some((Kind::Byte(b), _)) => vec![b],
            _ => self.inner.tk.decode(&[id], false).map(String::into_bytes).unwrap_or_default(),
        }
    }

    /// Which detokenization sequences of this tokenizer run.
    pub fn detok_path(&self) -> DetokPath {
        match self.pieces().map(|p| p.mode) {
            Some(Mode::Lossy) => DetokPath::ByteLevel,
            Some(Mode::ByteRuns) => DetokPath::ByteFallback,
            None => DetokPath::Generic,
        }
    }

    /// The wrapped `tokenizers` tokenizer (for encoding, the vocabulary, ...).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner.tk
    }

    fn pieces(&self) -> Option<&Pieces> {
        self.inner.pieces.as_ref()
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.tk.get_vocab_size(true))
            .field("detok_path", &self.detok_path())
            .finish()
    }
}

/// What a pushed token did to the sequence's text.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    /// No stop string matched.
    Continue,
    /// Stop string number `.0` (in the caller's list) matched: the text is cut where it starts
    /// and the sequence is finished (finish reason "stop").
    Stop(usize),
}

/// One sequence's text: detokenizer, stop strings, and the text released and held.
#[derive(Debug, Clone)]
pub struct SeqText {
    detok: Detok,
    stops: Stops,
    /// Detokenized text so far: the released part (what the deltas add up to), then the part
    /// held back, where every stop-string match starts.
    text: String,
    /// Bytes of `text` released.
    released: usize,
    finished: bool,
    /// Tokens pushed, and how many of the first ones are never checked for stop strings.
    num_pushed: usize,
    min_tokens: usize,
    /// A match keeps the stop string in the text.
    include_stop: bool,
}

impl SeqText {
    /// A sequence with no output yet, decoded with `tok`, stopping at any of `stop` (empty
    /// strings never match).
    pub fn new<S: AsRef<str>>(tok: &Tokenizer, stop: &[S]) -> Self {
        Self::with_options(tok, stop, 0, false)
    }

    /// `new`, with stop strings looked for only after the first `min_tokens` tokens, and a match
    /// kept in the text when `include_stop`.
    pub fn with_options<S: AsRef<str>>(tok: &Tokenizer, stop: &[S], min_tokens: usize, include_stop: bool) -> Self {
        Self {
            detok: Detok::new(tok),
            stops: Stops::new(stop),
            text: String::new(),
            released: 0,
            finished: false,
            num_pushed: 0,
            min_tokens,
            include_stop,
        }
    }

    /// The same state for an output that continues `prompt` (`Detok::after`): its first token's
    /// leading space is kept, as in the decode of prompt and output together.
    pub fn after_prompt(mut self, tok: &Tokenizer, prompt: &[u32]) -> Self {
        self.detok = Detok::after(tok, prompt);
        self
    }

    /// Adds a sampled token (special tokens add no text). On a stop-string match the text is cut
    /// at its start and the sequence is finished. Pushing after that (or after `finish`) is an
    /// `OutOfOrder` error; a decode failure (generic path only) is a `Tokenizer` error.
    pub fn push(&mut self, tok: &Tokenizer, token_id: u32) -> CoreResult<Push> {
        if self.finished {
            return Err(CoreError::OutOfOrder("SeqText::push after the sequence finished"));
        }
        let new_start = self.text.len();
        self.detok.push(tok, token_id, &mut self.text)?;
        self.num_pushed += 1;
        Ok(self.check_stops(new_start))
    }

    /// Ends the sequence (any finish reason): flushes an incomplete character as the full decode
    /// shows it (U+FFFD), checks that text for stop strings too, and releases everything held.
    /// Calling it again does nothing.
    pub fn finish(&mut self) -> Push {
        if self.finished {
            return Push::Continue;
        }
        let new_start = self.text.len();
        self.detok.flush(&mut self.text);
        let push = self.check_stops(new_start);
        self.finished = true;
        push
    }

    /// Appends the text that may be released now (UTF-8) to `out` and returns its length in
    /// bytes: everything but the longest tail that could begin a stop string, or everything once
    /// finished.
    pub fn take_delta(&mut self, out: &mut Vec<u8>) -> usize {
        let held = &self.text[self.released..];
        let n = held.len() - if self.finished { 0 } else { self.stops.hold_len(held) };
        out.extend_from_slice(&held.as_bytes()[..n]);
        self.released += n;
        n
    }

    /// Everything `take_delta` has released.
    pub fn released(&self) -> &str {
        &self.text[..self.released]
    }

    /// Whether a stop string (or a stop token's text: `update()`) stays in the output.
    pub fn includes_stop(&self) -> bool {
        self.include_stop
    }

    /// Whether a stop string matched or `finish` was called.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn check_stops(&mut self, new_start: usize) -> Push {
        if self.text.len() == new_start || self.stops.is_empty() || self.num_pushed <= self.min_tokens {
            return Push::Continue;
        }
        match self.stops.find(&self.text[self.released..], new_start - self.released) {
            Some((at, index)) => {
                let keep = if self.include_stop { self.stops.len_of(index) } else { 0 };
                self.text.truncate(self.released + at + keep);
                self.finished = true;
                Push::Stop(index)
            }
            None => Push::Continue,
        }
    }
}

#[cfg(test)]
mod tests;
