//! One sequence's place in its grammar: its token mask, and the tokens it accepted.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::Matcher;
use parking_lot::Mutex;

use super::vocab::GrammarVocab;

/// A matcher shared by the request that owns it and the step's mask worker.
pub type SharedMatcher = Arc<Mutex<GrammarMatcher>>;

pub struct GrammarMatcher {
    matcher: Matcher,
    vocab: Arc<GrammarVocab>,
    stop_ids: Vec<u32>,
    /// Set when llguidance failed (an error or a panic): no token is allowed from here.
    failed: Option<String>,
}

impl GrammarMatcher {
    pub(crate) fn new(matcher: Matcher, vocab: Arc<GrammarVocab>, stop_ids: Vec<u32>) -> Self {
        GrammarMatcher {
            matcher,
            vocab,
            stop_ids,
            failed: None,
        }
    }

    pub fn shared(self) -> SharedMatcher {
        Arc::new(Mutex::new(self))
    }

    /// Words of a mask: 32 tokens per u32, token t at bit t % 32 of word t / 32.
    pub fn mask_words(&self) -> usize {
        self.vocab.mask_width().div_ceil(32)
    }

    /// Writes the allowed tokens into `words` (`mask_words()` long, zeroed by the caller):
    /// what the grammar allows next, and the stop ids where it may end. On failure nothing is
    /// allowed, so the sampler fails the row instead of drawing an unconstrained token.
    pub fn fill_mask(&mut self, words: &mut [u32]) {
        if self.failed.is_some() {
            return;
        }
        let (allowed, accepting) = if self.matcher.is_stopped() {
            (None, true)
        } else {
            let computed = catch_unwind(AssertUnwindSafe(|| self.matcher.compute_mask()));
            match computed {
                Ok(Ok(mask)) => {
                    let accepting = mask.is_allowed(self.vocab.end_token());
                    (Some(mask), accepting)
                }
                Ok(Err(e)) => return self.fail(e.to_string()),
                Err(_) => return self.fail("the grammar engine panicked".into()),
            }
        };
        if let Some(mask) = allowed {
            let n = self.vocab.num_maskable();
            let full = n / 32;
            let source = mask.as_slice();
            words[..full].copy_from_slice(&source[..full]);
            if !n.is_multiple_of(32) {
                words[full] = source[full] & ((1u32 << (n % 32)) - 1);
            }
        }
        if accepting {
            for &t in &self.stop_ids {
                if let Some(word) = words.get_mut(t as usize / 32) {
                    *word |= 1 << (t % 32);
                }
            }
        }
    }

    /// How many of `draft`'s tokens the grammar takes in order from here: up to the first
    /// token it forbids, the first stop id (a draft ends before it), or the token that
    /// completes the grammar (included). Checked on a copy: this matcher does not move.
    pub fn valid_prefix(&self, draft: &[u32]) -> usize {
        if self.failed.is_some() || self.matcher.is_stopped() {
            return 0;
        }
        let upto = draft
            .iter()
            .position(|t| self.stop_ids.contains(t))
            .unwrap_or(draft.len());
        let mut scratch = self.scratch();
        let mut taken = 0;
        for &token in &draft[..upto] {
            match scratch.accept(token) {
                Ok(complete) => {
                    taken += 1;
                    if complete {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        taken
    }

    /// The masks after each prefix of `draft` (which `valid_prefix` took whole), one after the
    /// other in `words` ((len + 1) · `mask_words()`, zeroed by the caller): the mask here, then
    /// after the first draft token, and so on; computed on a copy, so this matcher does not move.
    pub fn fill_masks_along(&mut self, draft: &[u32], words: &mut [u32]) {
        let width = self.mask_words();
        self.fill_mask(&mut words[..width]);
        if draft.is_empty() {
            return;
        }
        let mut scratch = self.scratch();
        for (i, &token) in draft.iter().enumerate() {
            if scratch.accept(token).is_err() {
                return; // not a valid draft: its later rows allow nothing (the row fails)
            }
            scratch.fill_mask(&mut words[(i + 1) * width..][..width]);
        }
    }

    /// An independent copy at this matcher's place in the grammar.
    fn scratch(&self) -> GrammarMatcher {
        GrammarMatcher {
            matcher: self.matcher.deep_clone(),
            vocab: Arc::clone(&self.vocab),
            stop_ids: self.stop_ids.clone(),
            failed: self.failed.clone(),
        }
    }

    /// Advances by one generated token; true when the grammar is complete (the sequence
    /// must end). A token the grammar does not allow is an error.
    pub fn accept(&mut self, token: u32) -> Result<bool, String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        let consumed = catch_unwind(AssertUnwindSafe(|| self.matcher.consume_token(token)));
        match consumed {
            Ok(Ok(())) => Ok(self.matcher.is_stopped()),
            Ok(Err(e)) => {
                self.fail(e.to_string());
                Err(self.failed.clone().unwrap_or_default())
            }
            Err(_) => {
                self.fail("the grammar engine panicked".into());
                Err(self.failed.clone().unwrap_or_default())
            }
        }
    }

    /// Whether the grammar may end after the tokens accepted so far.
    pub fn is_accepting(&mut self) -> bool {
        self.failed.is_none() && self.matcher.is_accepting().unwrap_or(false)
    }

    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn fail(&mut self, why: String) {
        let line = why.lines().next().unwrap_or("").trim().to_string();
        self.failed = Some(format!("structured output: {line}"));
    }
}
