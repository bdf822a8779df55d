//! `Stops`: a sequence's stop strings (vLLM's `stop`, with `include_stop_str_in_output = false`):
//! where the earliest one matches, and how much of the text a stream must hold back.
//!
//! Both work on the text not yet released (the held part of `SeqText::text`): a match always
//! starts there, because release keeps back every suffix that could begin a stop string. Empty
//! stop strings never match. Offsets are in bytes of valid UTF-8, so a match always falls on char boundaries.

/// The stop strings of one sequence, in the caller's order (a match reports its index).
#[derive(Debug, Clone, Default)]
pub(crate) struct Stops {
    strs: Box<[Box<str>]>,
}

impl Stops {
    pub fn new<S: AsRef<str>>(stop: &[S]) -> Self {
        Self { strs: stop.iter().map(|s| s.as_ref().into()).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.strs.is_empty()
    }

    /// Bytes of stop string `index`.
    pub fn len_of(&self, index: usize) -> usize {
        self.strs[index].len()
    }

    /// The earliest match in `text` that ends after `new_start` (the start of the text just
    /// added): `(byte offset, index of the stop string)`; on a tie the lower index wins. Each
    /// string's search starts `len - 1` bytes before `new_start`, as earlier matches were seen.
    pub fn find(&self, text: &str, new_start: usize) -> Option<(usize, usize)> {
        let t = text.as_bytes();
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in self.strs.iter().enumerate() {
            let s = s.as_bytes();
            let Some(&first) = s.first() else { continue };
            // the window is short (the new text plus len - 1 bytes), so a plain scan beats
            // building a searcher; `from` may fall inside a character, but a match cannot start
            // there, as `s` starts with a character's first byte
            let from = new_start.saturating_sub(s.len() - 1);
            let end = best.map_or(t.len(), |(b, _)| (b + s.len()).min(t.len()));
            let hit = (from..(end + 1).saturating_sub(s.len())).find(|&at| t[at] == first && t[at..].starts_with(s));
            if let Some(at) = hit {
                if !matches!(best, Some((b, _)) if b <= at) {
                    best = Some((at, i));
                }
            }
        }
        best
    }

    /// Bytes at the end of `text` to hold back: the longest suffix that is a proper prefix of
    /// some stop string (such a suffix starts and ends on char boundaries of `text`).
    pub fn hold_len(&self, text: &str) -> usize {
        let t = text.as_bytes();
        let mut best = 0;
        for s in self.strs.iter() {
            let s = s.as_bytes();
            let longest = s.len().saturating_sub(1).min(t.len());
            // candidates start where t has s's first byte; try the longest first
            for k in (best + 1..=longest).rev() {
                if t[t.len() - k] == s[0] && t.ends_with(&s[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::Stops;

    #[test]
    fn earliest_match_wins_and_ties_go_to_the_first_listed() {
        let s = Stops::new(&["cd", "bc", "b"]);
        assert_eq!(s.find("abcde", 0), Some((1, 1)));
        assert_eq!(s.find("xxabcd", 4), Some((3, 1)), "a match may start before the new text");
        assert_eq!(s.find("abxcd", 4), Some((3, 0)));
        assert_eq!(s.find("bcd", 2), Some((1, 0)), "starts len-1 bytes back: 'bc' ended before");
        assert_eq!(Stops::new(&["", "z"]).find("abc", 0), None, "empty stop strings never match");
    }

    #[test]
    fn hold_back_keeps_the_longest_suffix_that_begins_a_stop() {
        let s = Stops::new(&["</s>", "\n\nUser:"]);
        assert_eq!(s.hold_len("hello <"), 1);
        assert_eq!(s.hold_len("hello </"), 2);
        assert_eq!(s.hold_len("hello\n\nUse"), 5);
        assert_eq!(s.hold_len("hello\n"), 1);
        assert_eq!(s.hold_len("hello"), 0);
        assert_eq!(s.hold_len("</s"), 3);
        assert_eq!(Stops::new(&["é!"]).hold_len("café"), 2, "a multi-byte prefix is held whole");
        assert_eq!(Stops::new(&["aab"]).hold_len("xaa"), 2);
        assert_eq!(Stops::new(&["aab"]).hold_len("xa"), 1);
    }
}
