//! Streaming detokenization, one `IncrementalDetokenizer` per request.
//!
//! Each push decodes only a short window of recent ids (the prefix_offset/read_offset technique
//! of vLLM and TGI): `ids[prefix_offset..read_offset]` were emitted already and are decoded again
//! only as context, so that word-joining decoders (SentencePiece's "▁", WordPiece's "##") see
//! what came before; the text past that context is the new delta. A trailing U+FFFD means a
//! multi-byte character may still be completed by the next token, so it is held back. So is the
//! text of a run of `<0xNN>` byte-fallback tokens until the run ends: one invalid byte turns the
//! whole run into U+FFFDs.

use super::tokenizer::Tokenizer;

/// After this many ids without closing the window, text is emitted anyway (inside a byte run: up
/// to the last whole character), so the cost per token stays bounded even if a model emits
/// invalid bytes or silent tokens for ever. Only then can the deltas differ from one-shot decoding.
const MAX_PENDING_IDS: usize = 16;

#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// `decode(ids[prefix_offset..read_offset])`.
    prefix_text: String,
    /// How much of `decode(ids[prefix_offset..])` has been emitted (>= prefix_text.len()).
    emitted_len: usize,
    /// The last id that reaches the decoder (not skipped, not out of vocabulary) is a
    /// byte-fallback token.
    in_byte_run: bool,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            prefix_text: String::new(),
            emitted_len: 0,
            in_byte_run: false,
        }
    }

    /// The text that `id` adds; empty while a character is incomplete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let reaches_decoder =
            !(self.skip_special_tokens && tok.is_special(id)) && tok.id_to_token(id).is_some();
        if reaches_decoder {
            self.in_byte_run = tok.is_byte_fallback(id);
        }
        let text = self.decode(tok, self.prefix_offset);
        let pending = self.ids.len() - self.read_offset;
        let forced = pending >= MAX_PENDING_IDS;
        let clean_len = text.trim_end_matches('\u{FFFD}').len();
        let complete_len = match (self.in_byte_run, forced) {
            (true, false) => self.emitted_len,
            (true, true) if pending < 2 * MAX_PENDING_IDS => clean_len,
            (false, false) => clean_len,
            _ => text.len(),
        };
        let delta = slice_at_char_boundaries(&text, self.emitted_len, complete_len).to_string();
        if complete_len == text.len() && (!delta.is_empty() || forced) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.prefix_text = self.decode_range(tok, self.prefix_offset, self.read_offset);
            self.emitted_len = self.prefix_text.len();
        } else {
            self.emitted_len = self.emitted_len.max(complete_len);
        }
        delta
    }

    /// Whatever is still held back (an incomplete character at the end of the output).
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        let text = self.decode(tok, self.prefix_offset);
        let delta = slice_at_char_boundaries(&text, self.emitted_len, text.len()).to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.prefix_text = self.decode_range(tok, self.prefix_offset, self.read_offset);
        self.emitted_len = self.prefix_text.len();
        delta
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode(&self, tok: &Tokenizer, start: usize) -> String {
        self.decode_range(tok, start, self.ids.len())
    }

    fn decode_range(&self, tok: &Tokenizer, start: usize, end: usize) -> String {
        // decode only fails inside a decoder; such a window adds no text rather than a crash.
        tok.decode(&self.ids[start..end], self.skip_special_tokens)
            .unwrap_or_default()
    }
}

/// `text[start..end]`, with both ends moved forward to character boundaries; empty if reversed.
fn slice_at_char_boundaries(text: &str, start: usize, end: usize) -> &str {
    let ceil = |mut i: usize| {
        while i < text.len() && !text.is_char_boundary(i) {
            i += 1;
        }
        i.min(text.len())
    };
    let (start, end) = (ceil(start), ceil(end));
    if start < end {
        &text[start..end]
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::TokenizerConfig;
    use super::super::test_tokenizers;
    use super::*;

    fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
        test_tokenizers::all()
            .into_iter()
            .map(|(name, inner)| (name, Tokenizer::new(inner, TokenizerConfig::default())))
            .collect()
    }

    /// Streams `ids` one at a time; checks the window stays short on the way.
    fn stream(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> (Vec<String>, String) {
        let mut detok = IncrementalDetokenizer::new(skip_special_tokens);
        let mut deltas: Vec<String> = ids
            .iter()
            .map(|&id| {
                let delta = detok.push(tok, id);
                assert!(detok.ids.len() - detok.prefix_offset <= 4 * MAX_PENDING_IDS);
                delta
            })
            .collect();
        deltas.push(detok.flush(tok));
        let joined = deltas.concat();
        (deltas, joined)
    }

    /// A small deterministic generator (xorshift64*), so the tests need no rand crate.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u32) -> u32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % n
        }
    }

    #[test]
    fn joined_deltas_equal_one_shot_decoding() {
        for (name, tok) in tokenizers() {
            for text in test_tokenizers::hard_texts() {
                let mut ids = tok.encode(&text, true).unwrap();
                ids.extend(tok.encode("<|im_end|></s> tail", false).unwrap());
                for skip in [false, true] {
                    let expected = tok.decode(&ids, skip).unwrap();
                    let (deltas, joined) = stream(&tok, &ids, skip);
                    assert_eq!(joined, expected, "{name} skip={skip}: {text:?}");
                    if !expected.contains('\u{FFFD}') {
                        assert!(
                            deltas.iter().all(|d| !d.contains('\u{FFFD}')),
                            "{name}: {text:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_character_split_over_byte_tokens_is_held_until_complete() {
        let tok = &tokenizers()[2].1; // byte fallback
        let bytes = ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]; // 😀
        let ids: Vec<u32> = bytes.iter().map(|b| tok.token_to_id(b).unwrap()).collect();
        let mut detok = IncrementalDetokenizer::new(true);
        let deltas: Vec<String> = ids.iter().map(|&id| detok.push(tok, id)).collect();
        assert_eq!(deltas, ["", "", "", ""]); // a later byte could still void the whole run
        let space = tok.token_to_id("▁").unwrap();
        assert_eq!(detok.push(tok, space), "😀 ");
        assert_eq!(detok.flush(tok), "");

        // A request that ends inside a character flushes what one-shot decoding shows.
        let mut detok = IncrementalDetokenizer::new(true);
        let hello = tok.encode("hi", false).unwrap();
        let mut pushed: String = hello.iter().map(|&id| detok.push(tok, id)).collect();
        pushed += &detok.push(tok, ids[0]);
        assert_eq!(pushed, "hi");
        assert_eq!(detok.flush(tok), "\u{FFFD}");

        // A newline byte followed by a broken character: one-shot decoding voids both.
        let mut detok = IncrementalDetokenizer::new(true);
        let newline = tok.token_to_id("<0x0A>").unwrap();
        assert_eq!(detok.push(tok, newline) + &detok.push(tok, ids[0]), "");
        assert_eq!(
            detok.flush(tok),
            tok.decode(&[newline, ids[0]], true).unwrap()
        );
        assert_eq!(
            tok.decode(&[newline, ids[0]], true).unwrap(),
            "\u{FFFD}\u{FFFD}"
        );
    }

    #[test]
    fn sentencepiece_strips_only_the_first_space_of_the_output() {
        for (name, tok) in &tokenizers()[2..] {
            let ids = tok.encode("one two three", false).unwrap();
            let (deltas, joined) = stream(tok, &ids, true);
            assert_eq!(joined, "one two three", "{name}");
            assert!(!deltas[0].starts_with(' '), "{name}: {deltas:?}");
        }
    }

    #[test]
    fn random_ids_with_invalid_bytes_and_oov_stream_like_one_shot() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for (name, tok) in tokenizers() {
            let vocab = tok.vocab_size() as u32;
            for _ in 0..200 {
                let len = 1 + rng.below(40) as usize;
                let ids: Vec<u32> = (0..len).map(|_| rng.below(vocab + 20)).collect();
                for skip in [false, true] {
                    let (_, joined) = stream(&tok, &ids, skip);
                    assert_eq!(joined, tok.decode(&ids, skip).unwrap(), "{name}: {ids:?}");
                }
            }
        }
    }

    #[test]
    fn out_of_vocabulary_ids_add_nothing() {
        for (name, tok) in tokenizers() {
            let mut detok = IncrementalDetokenizer::new(false);
            assert_eq!(detok.push(&tok, u32::MAX), "", "{name}");
            let ids = tok.encode("ok", false).unwrap();
            let text: String = ids.iter().map(|&id| detok.push(&tok, id)).collect();
            let oov = detok.push(&tok, tok.vocab_size() as u32);
            assert_eq!(text + &oov + &detok.flush(&tok), "ok", "{name}");
        }
    }
}
