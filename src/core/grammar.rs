//! Structured outputs: grammars compiled with llguidance, one matcher per sequence.
//!
//! - `GrammarSpec`: what a request constrains its output to: a JSON schema, any JSON object, a
//!   regular expression, one of a list of strings, or a Lark grammar (llguidance's dialect).
//! - `GrammarCompiler`: the tokenizer environment llguidance needs (every token's bytes, read
//!   from the tokenizer.json; special tokens marked so no grammar text matches them) and its
//!   parser factory. Built once per scheduler, on the first request that asks for a grammar.
//! - `Grammar`: one sequence's matcher. Cloning it (a fork of `n > 1`) copies the parser state,
//!   so forks advance independently.
//!
//! Invariant: a sequence's matcher has consumed exactly its output tokens except a final stop
//! token (EOS or a stop id), so `fill_mask` gives the tokens allowed next. The scheduler keeps
//! it so: it computes masks only for sequences with no sample in flight, and the matcher lives
//! with the request through recompute and swap preemption (the output tokens stay).
//!
//! JSON grammars default to compact output (no whitespace between tokens), which keeps small
//! models from spending their tokens on whitespace; a schema's own `x-guidance` options win.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::text::Tokenizer;

/// The kinds of constraint a request may ask for (`GrammarSpec::kind`).
pub const GRAMMAR_KINDS: [&str; 5] = ["json", "json_object", "regex", "choice", "lark"];

/// A request's output constraint: `kind` is one of `GRAMMAR_KINDS`; `data` is the JSON schema
/// (text), the regex, a JSON array of the allowed strings, or the Lark grammar (empty for
/// `json_object`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GrammarSpec {
    pub kind: String,
    pub data: String,
}

/// An object schema that lists `properties` and says nothing of any others allows no others, in
/// `schema` and every schema under it (vLLM's default, xgrammar's strict mode, and what OpenAI's
/// `strict: true` asks); `"additionalProperties": true` keeps an object open. The members of an
/// `allOf` are left as written (closing each would refuse the properties of the others), and so
/// is a union's members wherever properties come from beside them (the schema's own, another
/// combinator's members) or from outside (inside an `allOf` member), and a schema with such
/// members itself (each side would refuse the other's); the objects under all of them close.
fn close_objects(schema: &mut Value) {
    close(schema, true)
}

/// Whether some schema of the list `l` names properties, itself or through its own anyOf /
/// oneOf / allOf members (the depth is bounded: serde_json parses at most 128 levels).
fn members_name_properties(l: &Value) -> bool {
    let combinators =
        |s: &Value| ["anyOf", "oneOf", "allOf"].iter().any(|k| s.get(*k).is_some_and(members_name_properties));
    l.as_array().is_some_and(|l| l.iter().any(|s| s.get("properties").is_some() || combinators(s)))
}

/// `close_objects`, closing `schema` itself only if `here` (false: it is an `allOf` member, or
/// a union member beside other properties, whose own properties combine with those).
fn close(schema: &mut Value, here: bool) {
    let Value::Object(m) = schema else { return };
    let open = ["additionalProperties", "unevaluatedProperties", "patternProperties"];
    // properties its anyOf / oneOf / allOf members name are its own too: it and they stay open
    let names = |k: &str| m.get(k).is_some_and(members_name_properties);
    let (any_of, one_of, all_of) = (names("anyOf"), names("oneOf"), names("allOf"));
    let named = m.contains_key("properties");
    if here && named && !(any_of || one_of || all_of) && !open.iter().any(|k| m.contains_key(*k)) {
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    // a union's members close only where nothing beside them names properties (the schema
    // itself, another combinator's members) and the schema takes none from outside (`here`)
    let close_any_of = here && !(named || one_of || all_of);
    let close_one_of = here && !(named || any_of || all_of);
    for (keyword, sub) in m.iter_mut() {
        match (keyword.as_str(), sub) {
            (
                "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas",
                Value::Object(named),
            ) => named.values_mut().for_each(close_objects),
            ("anyOf", Value::Array(list)) => list.iter_mut().for_each(|s| close(s, close_any_of)),
            ("oneOf", Value::Array(list)) => list.iter_mut().for_each(|s| close(s, close_one_of)),
            ("allOf", Value::Array(list)) => list.iter_mut().for_each(|s| close(s, false)),
            ("prefixItems" | "items", Value::Array(list)) => list.iter_mut().for_each(close_objects),
            (
                "items" | "additionalProperties" | "additionalItems" | "not" | "if" | "then" | "else" | "contains",
                sub,
            ) => close_objects(sub),
            _ => {}
        }
    }
}

impl GrammarSpec {
    /// The llguidance grammar this spec stands for, or why it is not one.
    fn to_top_level(&self) -> Result<TopLevelGrammar, String> {
        let json = |schema: Value| -> Result<TopLevelGrammar, String> {
            let mut schema = schema;
            close_objects(&mut schema);
            if let Value::Object(m) = &mut schema {
                m.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
            } else if !matches!(schema, Value::Bool(_)) {
                return Err("a JSON schema must be an object or a boolean".into());
            }
            Ok(TopLevelGrammar::from_json_schema(schema))
        };
        match self.kind.as_str() {
            "json" => json(serde_json::from_str(&self.data).map_err(|e| format!("the JSON schema is not JSON: {e}"))?),
            "json_object" => json(serde_json::json!({"type": "object"})),
            "regex" => Ok(TopLevelGrammar::from_regex(&self.data)),
            "lark" => Ok(TopLevelGrammar::from_lark(self.data.clone())),
            "choice" => {
                let choices: Vec<String> =
                    serde_json::from_str(&self.data).map_err(|e| format!("choice must be a list of strings: {e}"))?;
                if choices.is_empty() {
                    return Err("choice must list at least one string".into());
                }
                // each choice as a quoted Lark literal (JSON string escapes)
                let alts: Vec<String> = choices.iter().map(|c| Value::String(c.clone()).to_string()).collect();
                Ok(TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | "))))
            }
            other => Err(format!("unknown structured output kind {other:?}; expected one of {GRAMMAR_KINDS:?}")),
        }
    }
}

/// The tokenizer environment and parser factory grammars are compiled against.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    eos: u32,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab_size", &self.vocab_size).field("eos", &self.eos).finish()
    }
}

impl GrammarCompiler {
    /// Reads every token's bytes from `tok`'s tokenizer.json (byte-level BPE or SentencePiece
    /// byte-fallback decoders); `eos` is the token a finished grammar allows.
    pub fn new(tok: &Tokenizer, eos: u32) -> Result<Self, String> {
        let json: Value =
            serde_json::from_str(&tok.hf().to_string(false).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        // llguidance's reader asserts on vocabularies it does not expect: keep a panic an error
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| "the tokenizer's vocabulary could not be read".to_string())?
            .map_err(|e| format!("structured outputs need a byte-level or byte-fallback tokenizer: {e}"))?;
        // an EOS id past the tokenizer sized every mask by it (2**31 - 1: a 48 GiB allocation)
        let known = words.len().max(tok.hf().get_vocab_size(true));
        if eos as usize >= known {
            return Err(format!("the EOS token id {eos} is not in the tokenizer's {known} tokens"));
        }
        let vocab_size = words.len().max(eos as usize + 1);
        let mut words = words;
        words.resize(vocab_size, Vec::new());
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, eos), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory, vocab_size, eos })
    }

    /// Tokens the masks cover (bit `t` of word `t / 32`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `u32` words of one mask.
    pub fn mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// A fresh matcher for `spec`, or the reason the spec does not compile.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, String> {
        let parser = self.factory.create_parser(spec.to_top_level()?).map_err(|e| e.to_string())?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        // some grammars compile yet cannot give a first mask (a `$ref` to itself, a rule that
        // only recurses): refused here, at admission, not as an empty answer later
        matcher.compute_mask().map_err(|e| {
            // the parser's message is its whole state; its first line names the cause
            let cause = e.to_string();
            let cause = cause.lines().next().unwrap_or_default();
            format!("the grammar allows no output (a $ref to itself, or a rule that only recurses?): {cause}")
        })?;
        Ok(Grammar { matcher, eos: self.eos })
    }
}

/// One sequence's grammar state.
pub struct Grammar {
    matcher: Matcher,
    eos: u32,
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Self { matcher: self.matcher.deep_clone(), eos: self.eos }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Grammar {
    /// Writes the tokens allowed next as a bitmask over `out` (`mask_words` words); where the
    /// grammar may end, every id of `stop_ids` is allowed too. A matcher in error allows only
    /// the stop ids (the sequence then ends), and the error is returned.
    pub fn fill_mask(&mut self, out: &mut [u32], stop_ids: impl IntoIterator<Item = u32>) -> Result<(), String> {
        let res = self.matcher.compute_mask_or_eos();
        out.fill(0);
        let mut can_end = true;
        let err = match res {
            Ok(mask) => {
                let bits = mask.as_slice();
                let n = bits.len().min(out.len());
                out[..n].copy_from_slice(&bits[..n]);
                can_end = mask.is_allowed(self.eos);
                None
            }
            Err(e) => Some(e.to_string()),
        };
        if can_end {
            for t in stop_ids {
                if let Some(w) = out.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Advances past `token`; true once the grammar is complete (nothing may follow).
    pub fn consume(&mut self, token: u32) -> Result<bool, String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::fixtures;

    fn compiler() -> (GrammarCompiler, u32) {
        let eos = fixtures::byte_level().hf().token_to_id("<|endoftext|>").expect("a special token");
        (GrammarCompiler::new(&fixtures::byte_level(), eos).expect("byte-level vocabulary"), eos)
    }

    fn allowed(mask: &[u32], t: u32) -> bool {
        mask[t as usize / 32] >> (t % 32) & 1 == 1
    }

    #[test]
    fn choice_masks_follow_the_text_and_end_at_the_stop_ids() {
        let (c, eos) = compiler();
        let tok = fixtures::byte_level();
        let spec = GrammarSpec { kind: "choice".into(), data: r#"["yes","no"]"#.into() };
        let mut g = c.compile(&spec).unwrap();
        let mut mask = vec![0u32; c.mask_words()];
        let ids = tok.hf().encode("no", false).unwrap().get_ids().to_vec();
        let other = tok.hf().encode("x", false).unwrap().get_ids()[0];
        let stop = eos + 1; // another special token, standing for a second EOS id
        for (i, &t) in ids.iter().enumerate() {
            g.fill_mask(&mut mask, [eos, stop]).unwrap();
            assert!(allowed(&mask, t) && !allowed(&mask, other));
            assert!(!allowed(&mask, eos) && !allowed(&mask, stop), "no end before a whole choice");
            // complete (nothing may follow "no") exactly at its last token
            assert_eq!(g.consume(t).unwrap(), i + 1 == ids.len());
        }
        g.fill_mask(&mut mask, [eos, stop]).unwrap();
        assert!(allowed(&mask, eos) && allowed(&mask, stop) && !allowed(&mask, other));
    }

    #[test]
    fn a_fork_advances_on_its_own() {
        let (c, eos) = compiler();
        let tok = fixtures::byte_level();
        let spec = GrammarSpec { kind: "regex".into(), data: "a+b".into() };
        let mut g = c.compile(&spec).unwrap();
        let a = tok.hf().encode("a", false).unwrap().get_ids()[0];
        let b = tok.hf().encode("b", false).unwrap().get_ids()[0];
        g.consume(a).unwrap();
        let mut fork = g.clone();
        assert!(fork.consume(b).unwrap(), "a+b is complete after ab");
        let mut mask = vec![0u32; c.mask_words()];
        g.fill_mask(&mut mask, [eos]).unwrap();
        assert!(allowed(&mask, a) && allowed(&mask, b) && !allowed(&mask, eos));
    }

    #[test]
    fn objects_allow_no_properties_they_do_not_name_unless_they_say_so() {
        let (c, eos) = compiler();
        let tok = fixtures::byte_level();
        let accepts = |schema: &str, text: &str| {
            let mut g = c.compile(&GrammarSpec { kind: "json".into(), data: schema.into() }).unwrap();
            let ids = tok.hf().encode(text, false).unwrap().get_ids().to_vec();
            let mut mask = vec![0u32; c.mask_words()];
            ids.iter().all(|&t| {
                g.fill_mask(&mut mask, [eos]).unwrap();
                allowed(&mask, t) && g.consume(t).is_ok()
            })
        };
        let named = r#"{"type": "object", "properties": {"a": {"type": "integer"}}}"#;
        assert!(accepts(named, r#"{"a":1}"#));
        assert!(!accepts(named, r#"{"a":1,"b":2}"#), "b is not named");
        let nested = r#"{"type": "array", "items": {"properties": {"a": {"type": "integer"}}}}"#;
        assert!(!accepts(nested, r#"[{"a":1,"b":2}]"#), "closed inside items too");
        let open = r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true}"#;
        assert!(accepts(open, r#"{"a":1,"b":2}"#));
        assert!(accepts(r#"{"type": "object"}"#, r#"{"b":2}"#), "no properties listed: open");
        let mixed =
            r#"{"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"type": "integer"}}}]}"#;
        assert!(accepts(mixed, r#"{"a":1,"b":2}"#), "b is named by a member");
        // a union of objects (nothing named beside it): each member closes; and the objects
        // under an allOf member close, the member itself staying as written
        let union = r#"{"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}"#;
        assert!(accepts(union, r#"{"a":1}"#) && accepts(union, r#"{"b":true}"#));
        assert!(!accepts(union, r#"{"a":1,"c":3}"#), "c is named by no member");
        let all = r#"{"allOf": [{"properties": {"inner": {"properties": {"x": {"type": "integer"}}}}},
            {"properties": {"y": {"type": "integer"}}}]}"#;
        assert!(accepts(all, r#"{"inner":{"x":1},"y":2}"#), "members stay open to each other");
        assert!(!accepts(all, r#"{"inner":{"x":1,"z":2}}"#), "inner is closed");
        // a union beside an allOf that names properties, or inside one of its members, stays open
        // to them (closed, it refused what the allOf requires: an unsatisfiable schema)
        let a = r#"{"properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
        let b = r#"{"properties": {"b": {"type": "integer"}}, "required": ["b"]}"#;
        let beside = format!(r#"{{"type": "object", "allOf": [{a}], "anyOf": [{b}]}}"#);
        let inside = format!(r#"{{"type": "object", "allOf": [{a}, {{"anyOf": [{b}]}}]}}"#);
        let nested = format!(r#"{{"properties": {{"z": {{"type": "integer"}}}}, "anyOf": [{{"anyOf": [{b}]}}]}}"#);
        for schema in [&beside, &inside] {
            assert!(accepts(schema, r#"{"a":1,"b":2}"#), "{schema}");
        }
        assert!(accepts(&nested, r#"{"z":1,"b":2}"#), "open down a chain of unions");
    }

    #[test]
    fn bad_specs_are_errors() {
        let (c, _) = compiler();
        let bad = [
            ("json", "{"),
            ("json", "3"),
            ("json", r##"{"$ref": "#"}"##),
            ("choice", "[]"),
            ("regex", "("),
            ("lark", "start: start"),
            ("xml", ""),
        ];
        for (kind, data) in bad {
            assert!(c.compile(&GrammarSpec { kind: kind.into(), data: data.into() }).is_err(), "{kind} {data}");
        }
    }
}
