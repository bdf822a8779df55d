//! SeqText against `tokenizers`' decode: the fixtures of `fixtures.rs`, and any tokenizer.json
//! named by FERRYMAN_TOKENIZER_JSON (skipped when unset), e.g. a real model's.

use super::fixtures::{self, SAMPLE_TEXT};
use super::*;

/// A deterministic xorshift generator.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.hf().encode(text, false).expect("encodes").get_ids().to_vec()
}

fn vocab_len(tok: &Tokenizer) -> usize {
    tok.hf().get_vocab(true).values().max().map_or(0, |&m| m as usize + 1)
}

/// What a stream of `ids` releases after each token (`finish` after the last, or at a stop),
/// and the stop that ended it.
fn stream(tok: &Tokenizer, ids: &[u32], stops: &[&str]) -> (Vec<String>, Option<usize>) {
    let mut s = SeqText::new(tok, stops);
    let mut deltas = Vec::new();
    let mut stopped = None;
    for (i, &id) in ids.iter().enumerate() {
        let mut out = Vec::new();
        let mut push = s.push(tok, id).expect("push");
        if i + 1 == ids.len() && push == Push::Continue {
            push = s.finish();
        }
        s.take_delta(&mut out);
        deltas.push(String::from_utf8(out).expect("deltas are UTF-8"));
        if let Push::Stop(k) = push {
            stopped = Some(k);
            break;
        }
    }
    (deltas, stopped)
}

fn joined(tok: &Tokenizer, ids: &[u32]) -> String {
    stream(tok, ids, &[]).0.concat()
}

/// Up to `max_len` pieces: mostly encodings of short random strings (encoded apart, so the
/// token boundaries are unusual; in SentencePiece, non-ASCII characters are byte tokens), and
/// any id a quarter of the time (specials, broken characters, unknown ids).
fn random_ids(rng: &mut Rng, tok: &Tokenizer, n: usize, max_len: usize) -> Vec<u32> {
    let pool: Vec<char> = "ab the\n€é東🚀".chars().collect();
    let mut ids = Vec::new();
    for _ in 0..1 + rng.below(max_len) {
        if rng.below(4) == 0 {
            ids.push(rng.below(n + 2) as u32);
        } else {
            let chunk: String = (0..1 + rng.below(3)).map(|_| pool[rng.below(pool.len())]).collect();
            ids.extend(encode(tok, &chunk));
        }
    }
    ids
}

/// Deltas concatenate to the full decode, and the table path's deltas equal the generic path's
/// token by token, on real text and on random ids (specials, broken characters, byte tokens).
fn check_against_decode(tok: &Tokenizer, texts: &[&str], rounds: usize) {
    let generic = Tokenizer::new_generic(tok.hf().clone());
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let n = vocab_len(tok);
    let mut cases: Vec<Vec<u32>> = texts.iter().map(|t| encode(tok, t)).collect();
    cases.extend((0..rounds).map(|_| random_ids(&mut rng, tok, n, 16)));
    let mut checked = 0;
    for ids in &cases {
        let want = tok.decode(ids).unwrap();
        // a byte-token run that is not valid UTF-8 decodes as one U+FFFD per token only as a
        // whole; streaming (here and in Python) may split it (see the module docs)
        if tok.detok_path() == DetokPath::ByteFallback && want.contains('\u{FFFD}') {
            continue;
        }
        let deltas = stream(tok, ids, &[]).0;
        assert_eq!(deltas.concat(), want, "ids {ids:?}");
        assert_eq!(deltas, stream(&generic, ids, &[]).0, "table and generic paths differ on {ids:?}");
        checked += 1;
    }
    assert!(checked * 4 >= cases.len(), "only {checked} of {} cases were checked", cases.len());
}

#[test]
fn fixtures_load_with_their_table_paths() {
    assert_eq!(fixtures::byte_level().detok_path(), DetokPath::ByteLevel);
    assert_eq!(fixtures::sentencepiece().detok_path(), DetokPath::ByteFallback);
    let generic = Tokenizer::new_generic(fixtures::byte_level().hf().clone());
    assert_eq!(generic.detok_path(), DetokPath::Generic);
    let err = Tokenizer::from_bytes(b"{\"nope\": 1}").unwrap_err();
    assert!(matches!(&err, CoreError::Tokenizer(m) if m.starts_with("cannot load tokenizer.json")), "{err}");
    assert!(Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err().to_string().contains("/nonexistent"));
}

#[test]
fn deltas_concatenate_to_the_full_decode() {
    let texts = [SAMPLE_TEXT, "a€b", " leading space", "  two", "é", "東京東"];
    check_against_decode(&fixtures::byte_level(), &texts, 400);
    check_against_decode(&fixtures::sentencepiece(), &texts, 400);
}

/// An output after `prompt`: its deltas, with `SeqText::after_prompt`.
fn stream_after(tok: &Tokenizer, prompt: &[u32], ids: &[u32]) -> String {
    let mut s = SeqText::new(tok, &[] as &[&str]).after_prompt(tok, prompt);
    let mut out = Vec::new();
    for &id in ids {
        _ = s.push(tok, id).expect("push");
        s.take_delta(&mut out);
    }
    _ = s.finish();
    s.take_delta(&mut out);
    String::from_utf8(out).expect("UTF-8")
}

#[test]
fn an_output_continues_its_prompt_as_the_joint_decode_does() {
    // what the output adds to the prompt's decode (vLLM's text), on every path; a SentencePiece
    // decoder strips the whole text's first space, which is in the prompt
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for tok in [fixtures::byte_level(), fixtures::sentencepiece()] {
        let generic = Tokenizer::new_generic(tok.hf().clone());
        let (prompt, out) = (encode(&tok, "hello"), encode(&tok, "the the"));
        let joint = [&prompt[..], &out[..]].concat();
        let want = tok.decode(&joint).unwrap()[tok.decode(&prompt).unwrap().len()..].to_string();
        if tok.detok_path() == DetokPath::ByteFallback {
            assert_eq!(want, " the the"); // "▁the▁the": the first space is the prompt's to strip
        }
        assert_eq!(stream_after(&tok, &prompt, &out), want);
        assert_eq!(stream_after(&generic, &prompt, &out), want);
        let n = vocab_len(&tok);
        let mut checked = 0;
        for _ in 0..300 {
            let (prompt, out) = (random_ids(&mut rng, &tok, n, 6), random_ids(&mut rng, &tok, n, 10));
            let (p_text, joint) =
                (tok.decode(&prompt).unwrap(), tok.decode(&[&prompt[..], &out[..]].concat()).unwrap());
            // a byte run across the boundary, or one the stream splits, decodes differently apart
            if joint.contains('\u{FFFD}') || p_text.contains('\u{FFFD}') || !joint.starts_with(&p_text) {
                continue;
            }
            assert_eq!(stream_after(&tok, &prompt, &out), joint[p_text.len()..], "{prompt:?} {out:?}");
            assert_eq!(stream_after(&generic, &prompt, &out), joint[p_text.len()..], "{prompt:?} {out:?}");
            checked += 1;
        }
        assert!(checked > 100, "only {checked} cases checked");
    }
    // a prompt of special tokens only has no text: the output's first space is stripped
    let tok = fixtures::sentencepiece();
    let special = tok.hf().token_to_id("<s>").expect("a BOS");
    assert_eq!(stream_after(&tok, &[special], &encode(&tok, "the the")), "the the");
}

#[test]
fn multibyte_characters_wait_for_their_last_byte() {
    let tok = fixtures::byte_level();
    let ids = encode(&tok, "a€b"); // 'a', '€' as [E2 82][AC], 'b'
    assert_eq!(ids.len(), 4);
    assert_eq!(stream(&tok, &ids, &[]).0, ["a", "", "€", "b"]);
    let tok = fixtures::sentencepiece();
    let ids = encode(&tok, "a€b"); // '▁a', <0xE2> <0x82> <0xAC>, 'b'
    assert_eq!(ids.len(), 5);
    assert_eq!(stream(&tok, &ids, &[]).0, ["a", "", "", "€", "b"]);
    // the decoder's Strip removes the first space of the whole text only
    assert_eq!(stream(&tok, &encode(&tok, "the the"), &[]).0, ["the", " the"]);
}

#[test]
fn finish_flushes_an_incomplete_character() {
    for tok in [fixtures::byte_level(), fixtures::sentencepiece()] {
        let ids = encode(&tok, "x€");
        let cut = &ids[..ids.len() - 1]; // '€' without its last byte
        let deltas = stream(&tok, cut, &[]).0;
        assert_eq!(deltas.concat(), tok.decode(cut).unwrap());
        assert!(deltas.concat().ends_with('\u{FFFD}'));
        let mut s = SeqText::new(&tok, &["zz"]);
        for &id in cut {
            assert_eq!(s.push(&tok, id), Ok(Push::Continue));
        }
        let mut out = Vec::new();
        s.take_delta(&mut out);
        assert_eq!(out, b"x");
        assert_eq!(s.finish(), Push::Continue);
        assert!(s.is_finished());
        s.take_delta(&mut out);
        assert_eq!(String::from_utf8(out).unwrap(), tok.decode(cut).unwrap());
        assert_eq!(s.finish(), Push::Continue, "finish twice does nothing");
        assert!(matches!(s.push(&tok, cut[0]), Err(CoreError::OutOfOrder(_))));
    }
}

/// The reference: the first token after which any stop string occurs in the text so far ends
/// the stream, cut at the earliest such occurrence (as the Python engine did before).
fn expected_with_stops(tok: &Tokenizer, ids: &[u32], stops: &[&str]) -> (String, Option<usize>) {
    let (deltas, _) = stream(tok, ids, &[]);
    let mut text = String::new();
    for d in deltas {
        text.push_str(&d);
        let hit =
            stops.iter().enumerate().filter(|(_, s)| !s.is_empty()).filter_map(|(i, s)| Some((text.find(s)?, i))).min();
        if let Some((at, i)) = hit {
            text.truncate(at);
            return (text, Some(i));
        }
    }
    (text, None)
}

#[test]
fn stop_strings_cut_at_the_earliest_match_and_nothing_released_is_cut() {
    for tok in [fixtures::byte_level(), fixtures::sentencepiece()] {
        let ids = encode(&tok, SAMPLE_TEXT);
        // a stop split across tokens; a multi-byte one; the earliest of several; one that ends
        // later but starts earlier loses to one found first
        let cases: [&[&str]; 6] = [
            &["café"],
            &["東京"],
            &["rockets", "brûlée", "zzz"],
            &["the end", "Hello"],
            &["crème brûlée —", "rème"],
            &["nowhere"],
        ];
        for stops in cases {
            let (deltas, stopped) = stream(&tok, &ids, stops);
            let (want, want_stop) = expected_with_stops(&tok, &ids, stops);
            assert_eq!((deltas.concat(), stopped), (want, want_stop), "stops {stops:?}");
        }
        assert_eq!(stream(&tok, &ids, &["café"]).0.concat(), "The naïve ");
        let (_, stopped) = stream(&tok, &ids, &["crème brûlée —", "rème"]);
        assert_eq!(stopped, Some(1), "'rème' is found first, so it wins");
    }
}

#[test]
fn hold_back_never_releases_text_that_is_later_cut() {
    let mut rng = Rng(7);
    for tok in [fixtures::byte_level(), fixtures::sentencepiece()] {
        let ids = encode(&tok, SAMPLE_TEXT);
        let full = joined(&tok, &ids);
        for _ in 0..300 {
            // stops taken from the text (so they match, often across tokens), or near misses
            let chars: Vec<char> = full.chars().collect();
            let at = rng.below(chars.len());
            let len = 1 + rng.below(6);
            let mut stop: String = chars[at..(at + len).min(chars.len())].iter().collect();
            if rng.below(3) == 0 {
                stop.push('#');
            }
            let stops = [stop.as_str(), "\n\n", "the end?"];
            let (deltas, stopped) = stream(&tok, &ids, &stops);
            let (want, want_stop) = expected_with_stops(&tok, &ids, &stops);
            assert_eq!(stopped, want_stop, "stops {stops:?}");
            let mut released = String::new();
            for d in &deltas {
                released.push_str(d);
                assert!(want.starts_with(&released), "released {released:?}, final {want:?}");
            }
            assert_eq!(released, want);
        }
    }
}

#[test]
fn release_holds_only_the_longest_possible_stop_prefix() {
    let tok = fixtures::byte_level();
    let mut s = SeqText::new(&tok, &["abcX", "cY"]);
    let mut out = Vec::new();
    for (id, released) in encode(&tok, "xxabc").into_iter().zip(["x", "x", "", "", ""]) {
        assert_eq!(s.push(&tok, id), Ok(Push::Continue));
        let n = s.take_delta(&mut out);
        assert_eq!(&out[out.len() - n..], released.as_bytes());
    }
    // "abc" could begin "abcX", so all three are held; "d" rules both out
    let id = encode(&tok, "d")[0];
    assert_eq!(s.push(&tok, id), Ok(Push::Continue));
    assert_eq!(s.take_delta(&mut out), 4);
    assert_eq!(out, b"xxabcd");
}

/// Every id's piece matches `tokenizers` (ids in windows of 7, so neighbours and merges are
/// exercised), and streams of encoded text match the decode.
fn check_real_tokenizer(tok: &Tokenizer) {
    let n = vocab_len(tok);
    if let Some(p) = tok.pieces() {
        let mut bad = 0;
        for start in (0..n).step_by(7) {
            let ids: Vec<u32> = (start..(start + 7).min(n)).map(|i| i as u32).collect();
            bad += usize::from(p.decode_exact(&ids) != tok.decode(&ids).unwrap());
        }
        assert_eq!(bad, 0, "windows of ids whose table decode differs");
    }
    let texts = [SAMPLE_TEXT, "def f(x):\n    return x ** 2  # 平方\n", "  Ünïcödé   spaces ", "🚀🚀 ok"];
    check_against_decode(tok, &texts, 300);
}

#[test]
fn a_tokenizer_json_from_the_environment_matches_its_decode() {
    let Ok(path) = std::env::var("FERRYMAN_TOKENIZER_JSON") else {
        eprintln!("FERRYMAN_TOKENIZER_JSON unset: skipped");
        return;
    };
    let tok = Tokenizer::from_file(&path).unwrap();
    eprintln!("{path}: {tok:?}");
    check_real_tokenizer(&tok);
}

#[test]
fn a_long_run_of_invalid_bytes_costs_the_same_per_token() {
    // a lead byte repeated: each makes the one before it invalid, and the text always ends in an
    // incomplete character, so nothing is emitted; the state must not grow with the run
    for (tok, lead) in [(fixtures::byte_level(), "æ"), (fixtures::sentencepiece(), "<0xE6>")] {
        let id = tok.hf().token_to_id(lead).expect("the fixture has a token for byte 0xE6");
        let ids = vec![id; 300];
        let deltas = stream(&tok, &ids, &[]).0;
        assert_eq!(deltas.concat(), tok.decode(&ids).unwrap());
        if tok.detok_path() == DetokPath::ByteLevel {
            let generic = Tokenizer::new_generic(tok.hf().clone());
            assert_eq!(deltas, stream(&generic, &ids, &[]).0);
        }
        let mut d = detokenize::Detok::new(&tok);
        let mut out = String::new();
        for _ in 0..20_000 {
            d.push(&tok, id, &mut out).unwrap();
            let (held, broken) = d.held_bytes();
            assert!(held < 4 || broken, "held bytes are re-decoded every push");
        }
        assert!(out.is_empty());
    }
}

/// Pushes `text`'s tokens one by one; the text released and the stop that ended it.
fn stream_with(s: &mut SeqText, tok: &Tokenizer, text: &str) -> (String, Option<usize>) {
    let mut out = Vec::new();
    for id in encode(tok, text) {
        if let Push::Stop(k) = s.push(tok, id).expect("push") {
            s.take_delta(&mut out);
            return (String::from_utf8(out).unwrap(), Some(k));
        }
        s.take_delta(&mut out);
    }
    let _ = s.finish();
    s.take_delta(&mut out);
    (String::from_utf8(out).unwrap(), None)
}

#[test]
fn min_tokens_hides_stop_strings_from_the_first_tokens() {
    let tok = fixtures::byte_level();
    let ids = encode(&tok, "a.b.c.d");
    assert_eq!(ids.len(), 7, "one token per character");
    // stop "." looked for from the third token on: the first "." (token 2) passes, the second
    // (token 4) stops
    for (min_tokens, want) in [(0, "a"), (1, "a"), (2, "a.b"), (3, "a.b"), (4, "a.b.c"), (7, "a.b.c.d")] {
        let mut s = SeqText::with_options(&tok, &["."], min_tokens, false);
        let (text, stopped) = stream_with(&mut s, &tok, "a.b.c.d");
        assert_eq!(text, want, "min_tokens {min_tokens}");
        assert_eq!(stopped.is_some(), min_tokens < 6, "min_tokens {min_tokens}");
    }
    // a match that completes after min_tokens may begin before: "b.c" ends at token 5
    let mut s = SeqText::with_options(&tok, &["b.c"], 4, false);
    assert_eq!(stream_with(&mut s, &tok, "a.b.c.d"), ("a.".to_string(), Some(0)));
}

#[test]
fn include_stop_str_in_output_keeps_the_match() {
    for tok in [fixtures::byte_level(), fixtures::sentencepiece()] {
        let mut s = SeqText::with_options(&tok, &["zz", "the end"], 0, true);
        let (text, stopped) = stream_with(&mut s, &tok, "so that is the end of it");
        assert_eq!(stopped, Some(1));
        assert!(text.ends_with("is the end"), "{text:?}");
        let mut s = SeqText::new(&tok, &["zz", "the end"]);
        assert!(stream_with(&mut s, &tok, "so that is the end of it").0.ends_with("is "));
    }
}
