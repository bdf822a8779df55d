//! `Request`: one sequence of tokens the scheduler drives from arrival to finish.
//!
//! A request with `n > 1` (parallel sampling) is admitted as one request; when its prompt is
//! computed it is forked into `n` requests that share `req_id` (told apart by `seq_index`) and
//! share the prompt's blocks by reference count. After the fork each runs, is preempted and
//! finishes on its own. The KV cache manager, not the request, owns the block table.
//!
//! A request with `TextParams` also owns its text state (`SeqText`): the detokenized output so
//! far and its stop strings, advanced by the scheduler's `update()` with every token. A request
//! with a `GrammarSpec` owns its grammar's matcher (`Grammar`), advanced the same way; a fork
//! gets its own copy.
//!
//! With async scheduling a step is planned before the previous step's samples are known: those
//! samples are *in flight* (`num_inflight`), and a decode may compute the position of a token
//! still in flight (its input is then the sample the runner holds).
//!
//! Invariant: `num_computed_tokens <= token_ids.len() + num_inflight`; `token_ids` starts with
//! the prompt.

use crate::grammar::{Grammar, GrammarSpec};
use crate::text::SeqText;

/// Which queue a live request is in. A finished request is dropped at once (its id is reported
/// in the next `finished_req_ids`), so there is no finished status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    Swapped,
}

/// Why a request finished, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    /// "stop" | "length" | "abort".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// Stop conditions checked in Rust after every sampled token (24 bytes: a boxed slice, not a
/// vector, so it shares a cache line with what the policies read of a `Request`).
#[derive(Debug, Clone, Default, PartialEq)]
#[repr(C)]
pub struct StopParams {
    /// Output tokens at most.
    pub max_tokens: usize,
    /// Finish with "stop" on any of these: the model's EOS ids (unless `ignore_eos`) and the
    /// request's stop token ids, in one list so that a token is checked in one pass.
    pub stop_ids: Box<[u32]>,
}

impl StopParams {
    /// The stop conditions `p` asks for.
    pub fn of(p: &RequestParams) -> Self {
        let eos = if p.ignore_eos { &[][..] } else { &p.eos_token_ids[..] };
        let mut ids: Vec<u32> = eos.iter().chain(&p.stop_token_ids).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        Self { max_tokens: p.max_tokens, stop_ids: ids.into_boxed_slice() }
    }

    /// Whether `token` is one of `stop_ids`. A plain loop: the lists are a few ids or none, where
    /// `contains`' wide search costs more than it saves.
    #[inline(always)]
    pub fn stops_on(&self, token: u32) -> bool {
        for &t in &*self.stop_ids {
            if t == token {
                return true;
            }
        }
        false
    }
}

/// Detokenization of a request's output (needs the scheduler's tokenizer; special tokens add
/// no text).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TextParams {
    /// Finish with "stop" at the earliest of these in the text; the text ends before it (after
    /// it with `include_stop_str_in_output`).
    pub stop: Vec<String>,
    /// Stop strings are looked for only once more than this many tokens are out (vLLM's
    /// `min_tokens`: text before then never stops the sequence).
    pub min_tokens: usize,
    /// The matched stop string stays in the text (vLLM's `include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
}

/// Sampling-independent parameters of a new request: the one record a request crosses the
/// boundary with, checked by `validate` (the scheduler adds the checks that need its config).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestParams {
    /// Output tokens at most (>= 1).
    pub max_tokens: usize,
    /// Lower is more important (policy "priority").
    pub priority: i32,
    /// Stop on any of these (the model's EOS ids) unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Stop on any of these.
    pub stop_token_ids: Vec<u32>,
    /// Ignore `eos_token_ids`.
    pub ignore_eos: bool,
    /// Parallel samples (>= 1).
    pub n: u32,
    /// Detokenize the output and apply stop strings; `None`: token ids only.
    pub text: Option<TextParams>,
    /// Never take prefix-cache hits: every prompt position is computed (the runner needs the
    /// logits of each, for prompt logprobs).
    pub skip_reading_prefix_cache: bool,
    /// Constrain the output to this grammar (structured outputs; needs the scheduler's
    /// tokenizer).
    pub grammar: Option<GrammarSpec>,
}

impl RequestParams {
    /// Checks the record on its own: `max_tokens >= 1`, `n >= 1`, token ids within i32, no
    /// empty stop string; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("max_tokens must be >= 1".into());
        }
        if self.n == 0 {
            return Err("n must be >= 1".into());
        }
        let ids = self.eos_token_ids.iter().chain(&self.stop_token_ids);
        if let Some(t) = ids.copied().find(|&t| t > i32::MAX as u32) {
            return Err(format!("token id {t} out of range"));
        }
        if self.text.as_ref().is_some_and(|t| t.stop.iter().any(String::is_empty)) {
            return Err("a stop string is empty".into());
        }
        if let Some(g) = self.grammar.as_ref().filter(|g| !crate::grammar::GRAMMAR_KINDS.contains(&g.kind.as_str())) {
            let kinds = crate::grammar::GRAMMAR_KINDS;
            return Err(format!("unknown structured output kind {:?}; expected one of {kinds:?}", g.kind));
        }
        Ok(())
    }
}

/// One sequence under the scheduler's control.
///
/// Layout: every step touches each running request twice, once in `schedule()` and once in
/// `update()`, with a model forward in between that evicts it from the CPU's caches. The
/// fields a decode reads come first, in declaration order (`repr(C)`), from a cache-line
/// boundary: `schedule()` reads the first two lines of a decode, `update()` the first three
/// (the third holds the stop conditions and what the policies read). Three lines in all: the
/// arena's stride of 192 bytes spreads the requests over every set of the L1 cache (a stride of
/// 256 would put all their first lines in a quarter of the sets, which then conflict). Measured
/// with cachegrind on a replayed trace (docs/benchmarks.md): the old layout spread one decode
/// over ~10 lines of the request.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Request {
    // line 1: what `schedule()` reads of a decode
    /// Prompt followed by generated tokens (i32, the dtype they cross the boundary in).
    pub token_ids: Vec<i32>,
    /// The caller's id; shared by the forks of a parallel-sampling request.
    pub req_id: u64,
    /// Tokens whose KV is in this request's blocks.
    pub num_computed_tokens: usize,
    /// Length of the prompt at the front of `token_ids`.
    pub num_prompt_tokens: usize,
    /// Samples of this sequence scheduled but not yet applied by `update()` (at most 2).
    pub num_inflight: u32,
    /// Forks still to make when the prompt completes (n for an unforked parent, else 1).
    pub num_pending_forks: u32,
    /// Index of its latest sample among the samples of the step that made it.
    pub last_sample: u32,
    /// Which of the `n` forks this is (0 for `n == 1`).
    pub seq_index: u32,
    // line 2: the rest of a decode's bookkeeping (its row, the prefix cache's, text, grammar)
    /// Its row of the persistent batch, while running and once scheduled.
    pub row: Option<u32>,
    /// Times this request was preempted; each raises its precedence.
    pub num_preemptions: u32,
    /// Where the request is.
    pub status: RequestStatus,
    /// Admission never takes prefix-cache hits for it (`RequestParams::skip_reading_prefix_cache`).
    pub skip_reading_prefix_cache: bool,
    /// Leading blocks already registered in (or hit from) the prefix cache.
    pub num_cached_blocks: usize,
    /// The output's text state and stop strings, when the request asked for text.
    pub text: Option<Box<SeqText>>,
    /// Its grammar's matcher, when the request asked for structured output.
    pub grammar: Option<Box<Grammar>>,
    /// Prefix hashes of this request's full blocks, computed once, in block order.
    pub block_hashes: Vec<u128>,
    // line 3: `update()`'s stop checks, then what the policies and swapping read
    /// Stop conditions.
    pub stop: StopParams,
    /// Arrival order (monotonic); ties in every policy break on it.
    pub arrival: u64,
    /// Lower is more important (vLLM's convention); used by policy "priority".
    pub priority: i32,
    /// While swapped: leading blocks left on the device (cached and held by others) instead of
    /// copied to the host; swap-in takes them back from the prefix cache.
    pub num_swap_prefix_blocks: u32,
}

impl Request {
    /// A new waiting request: `prompt_token_ids` (each at most `i32::MAX`), arrived `arrival`th.
    pub fn new(req_id: u64, arrival: u64, prompt_token_ids: &[u32], p: RequestParams) -> Self {
        let num_prompt_tokens = prompt_token_ids.len();
        // room for every token the request can have, so appending never reallocates
        let mut token_ids: Vec<i32> = Vec::with_capacity(num_prompt_tokens.saturating_add(p.max_tokens));
        token_ids.extend(prompt_token_ids.iter().map(|&t| t as i32));
        Self {
            req_id,
            seq_index: 0,
            arrival,
            priority: p.priority,
            token_ids,
            num_prompt_tokens,
            num_computed_tokens: 0,
            stop: StopParams::of(&p),
            num_pending_forks: p.n,
            skip_reading_prefix_cache: p.skip_reading_prefix_cache,
            text: None,    // the scheduler attaches it: it holds the tokenizer
            grammar: None, // likewise: compiled against the scheduler's tokenizer
            row: None,
            num_inflight: 0,
            last_sample: 0,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            block_hashes: Vec::new(),
            num_cached_blocks: 0,
            num_swap_prefix_blocks: 0,
        }
    }

    /// Tokens known so far (prompt + output).
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Generated tokens so far.
    #[inline]
    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Tokens known or in flight: what the next step may compute up to.
    #[inline]
    pub fn num_tokens_scheduled(&self) -> usize {
        self.token_ids.len() + self.num_inflight as usize
    }

    /// Longest this request can become.
    #[inline]
    pub fn max_len(&self) -> usize {
        self.num_prompt_tokens + self.stop.max_tokens
    }

    /// Appends a sampled token and says whether (and why) the request is now finished.
    #[inline(always)]
    pub fn append_token(&mut self, token: u32, max_model_len: usize) -> Option<FinishReason> {
        self.token_ids.push(token as i32);
        if self.stop.stops_on(token) {
            Some(FinishReason::Stop)
        } else if self.token_ids.len() >= self.max_len().min(max_model_len) {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(max_tokens: usize) -> Request {
        Request {
            req_id: 1,
            seq_index: 0,
            arrival: 0,
            priority: 0,
            token_ids: vec![5, 6, 7],
            num_prompt_tokens: 3,
            num_computed_tokens: 0,
            stop: StopParams { max_tokens, stop_ids: Box::new([2, 9]) },
            num_pending_forks: 1,
            skip_reading_prefix_cache: false,
            status: RequestStatus::Running,
            num_preemptions: 0,
            block_hashes: vec![],
            num_swap_prefix_blocks: 0,
            num_cached_blocks: 0,
            text: None,
            grammar: None,
            row: None,
            num_inflight: 0,
            last_sample: 0,
        }
    }

    #[test]
    fn hot_fields_take_three_cache_lines() {
        // the layout the struct's header describes; a field added in the wrong place breaks it
        let r = req(4);
        let base = &r as *const Request as usize;
        let line = |f: usize| (f - base) / 64;
        assert_eq!(base % 64, 0);
        assert_eq!(line(&r.seq_index as *const u32 as usize), 0);
        assert_eq!(line(&r.row as *const Option<u32> as usize), 1);
        assert_eq!(line(&r.block_hashes as *const Vec<u128> as usize + 23), 1);
        assert_eq!(line(&r.stop as *const StopParams as usize), 2);
        assert_eq!(line(&r.num_swap_prefix_blocks as *const u32 as usize + 3), 2);
        assert_eq!(std::mem::size_of::<Option<Request>>(), 3 * 64);
    }

    #[test]
    fn stops_on_eos_stop_token_max_tokens_and_max_model_len() {
        assert_eq!(req(4).append_token(2, 100), Some(FinishReason::Stop));
        assert_eq!(req(4).append_token(9, 100), Some(FinishReason::Stop));
        let mut r = req(2);
        assert_eq!(r.append_token(4, 100), None);
        assert_eq!(r.append_token(4, 100), Some(FinishReason::Length));
        assert_eq!(req(10).append_token(4, 4), Some(FinishReason::Length));
        let p = RequestParams {
            max_tokens: 4,
            eos_token_ids: vec![2, 7],
            stop_token_ids: vec![9, 2],
            ..Default::default()
        };
        assert_eq!(&*StopParams::of(&p).stop_ids, &[2, 7, 9]);
        let ignoring = StopParams::of(&RequestParams { ignore_eos: true, ..p });
        assert_eq!(&*ignoring.stop_ids, &[2, 9], "a stop token id stops even when it is an ignored EOS");
        let mut r = req(4);
        r.stop = StopParams::of(&RequestParams {
            max_tokens: 4,
            eos_token_ids: vec![2],
            ignore_eos: true,
            ..Default::default()
        });
        assert_eq!(r.append_token(2, 100), None);
    }
}
