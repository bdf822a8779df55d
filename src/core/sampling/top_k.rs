//! Top-k's candidates (`RowSampler::top_k`): the tokens not below the k-th largest scaled logit,
//! selected, not sorted; and their order by descending logit for a top-p after it.

use std::cmp::Ordering;

use super::keys::{id_of, key, logit_of, rank, rank_of};
use super::{RowSampler, PIVOT_MIN_VOCAB};

impl RowSampler {
    /// Candidates: every token not below the k-th largest scaled logit; ties with the k-th are
    /// kept (the Python sampler masks `lg < kth` only). Nothing is sorted. From
    /// `PIVOT_MIN_VOCAB` on, a pivot a little past the k-th largest, read off a strided sample of
    /// the row, splits off the few tokens that can be candidates (a count first, which the
    /// compiler vectorizes, then one pass that writes them out), the k-th is selected among
    /// those, and the candidates come out in id order (returns false). Below it, for a k too
    /// large for a pivot to gain (`pivot`), or if the sample misjudged (fewer than k pass, or the
    /// k-th is the pivot itself, which a tie of -0 and +0 could straddle), the k-th is selected
    /// among every token's sort key, which leaves the k
    /// candidates first in `keys` without a pass to filter them out; the tokens tied with the
    /// k-th past them join them (a count of equal ranks, which the compiler vectorizes, finds
    /// whether there are any). Then `keys` holds the candidates' keys, `cand` their ids in the
    /// same order (returns true).
    pub(super) fn top_k(&mut self, k: usize) -> bool {
        if let Some((t, passing)) = self.pivot(k) {
            if self.top_k_below(t, passing, k) {
                return false;
            }
        }
        self.keys.clear();
        self.keys.extend(self.lg.iter().enumerate().map(|(i, &x)| key(x, i as u32)));
        let kth = rank_of(*self.keys.select_nth_unstable(k - 1).1);
        // a tie is an equal logit: the same rank (the row holds no -0; a NaN row keeps what it may)
        let tied = |key: &u64| rank_of(*key) == kth;
        let mut m = k;
        if self.keys[k..].iter().filter(|&key| tied(key)).count() > 0 {
            for j in k..self.keys.len() {
                if tied(&self.keys[j]) {
                    self.keys.swap(m, j);
                    m += 1;
                }
            }
        }
        self.keys.truncate(m);
        self.cand.clear();
        self.cand.extend(self.keys.iter().map(|&key| id_of(key)));
        true
    }

    /// The candidates of `top_k`'s keyed path in id order instead (what `cut_top_p` expects):
    /// every token not below the least candidate's logit, in one pass over the row.
    pub(super) fn candidates_by_id(&mut self) {
        let Some(kth) = self.keys.iter().map(|&k| rank_of(k)).max() else { return };
        let kth = logit_of(kth);
        self.cand.clear();
        self.cand.resize(self.lg.len(), 0);
        let mut m = 0;
        for (i, &x) in self.lg.iter().enumerate() {
            self.cand[m] = i as u32; // branch-free: write every id, advance past the kept ones
            m += usize::from(x.partial_cmp(&kth) != Some(Ordering::Less));
        }
        self.cand.truncate(m);
    }

    /// The candidates by descending logit, ties by id: their keys (built here unless `keyed`)
    /// sorted, and `cand` in their order.
    pub(super) fn sort_candidates(&mut self, keyed: bool) {
        if !keyed {
            let lg = &self.lg;
            self.keys.clear();
            self.keys.extend(self.cand.iter().map(|&c| key(lg[c as usize], c)));
        }
        self.keys.sort_unstable();
        self.cand.clear();
        self.cand.extend(self.keys.iter().map(|&key| id_of(key)));
    }

    /// A rank `t` that at least `m` of the row's tokens are at or above (a prefix of the tokens
    /// by descending logit), and how many are: the `j`-th of a strided sample of the row's ranks,
    /// `j` about 1.5 m in the row's proportion and a margin, then a count the compiler
    /// vectorizes. None for a small vocabulary, an `m` too large to gain, or a sample that
    /// misjudged (fewer than m pass).
    pub(super) fn pivot(&mut self, m: usize) -> Option<(u32, usize)> {
        let n = self.lg.len();
        let sample = (n / 16).clamp(64, 1024);
        let j = m * sample * 3 / (2 * n) + 2;
        if n < PIVOT_MIN_VOCAB || j >= sample / 2 {
            return None;
        }
        self.ranks.clear();
        self.ranks.extend((0..sample).map(|i| rank(self.lg[i * n / sample])));
        let t = *self.ranks.select_nth_unstable(j).1;
        let passing = self.lg.iter().map(|&x| u32::from(rank(x) <= t)).sum::<u32>() as usize;
        (passing >= m).then_some((t, passing))
    }

    /// `top_k` among the `passing` tokens whose rank is at most `t` (at least k of them): false,
    /// leaving `cand` to be rebuilt, if the k-th is `t` itself.
    pub(super) fn top_k_below(&mut self, t: u32, passing: usize, k: usize) -> bool {
        // branch-free: write every token, advance past the passing ones
        self.cand.clear();
        self.cand.resize(passing + 1, 0);
        self.ranks.clear();
        self.ranks.resize(passing + 1, 0);
        let mut m = 0;
        for (i, &x) in self.lg.iter().enumerate() {
            let r = rank(x);
            self.cand[m] = i as u32;
            self.ranks[m] = r;
            m += usize::from(r <= t);
        }
        // the filter below compares logits, so the ranks can be reordered in place
        let kth = *self.ranks[..passing].select_nth_unstable(k - 1).1;
        if kth == t {
            return false;
        }
        let kth = logit_of(kth);
        let mut kept = 0;
        for j in 0..passing {
            let c = self.cand[j];
            self.cand[kept] = c;
            kept += usize::from(self.lg[c as usize].partial_cmp(&kth) != Some(Ordering::Less));
        }
        self.cand.truncate(kept);
        true
    }
}
