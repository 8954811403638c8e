//! The tokenizer as llguidance sees it: every token's bytes in a token trie.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{CoreError, Result};
use crate::text::Tokenizer;

/// Special tokens are marked in the trie by a leading 0xFF byte (never valid UTF-8), so no
/// grammar over text can produce them; this one stands for "the grammar may end here".
const END_TOKEN: &[u8] = b"\xff<|aieng_grammar_end|>";

/// The vocabulary of one tokenizer for llguidance, and the width of the model's logits.
///
/// The trie holds the tokenizer's tokens plus one extra special token after them, used as
/// llguidance's EOS: a mask that allows it means the grammar accepts here, and the request's
/// own stop tokens are allowed in its place.
pub struct GrammarVocab {
    env: TokEnv,
    /// Tokens of the tokenizer (the trie has one more: the end token).
    num_tokens: usize,
    /// Width of the model's logits: the masks' width.
    mask_width: usize,
}

/// Tokenizes by the trie, greedily: a tokenizer's own pre-tokenization (a Metaspace prefix,
/// say) would be wrong on the fragments llguidance asks about, and llguidance then treats
/// tokenization as non-canonical, which a mask does not need.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl GrammarVocab {
    /// `vocab_size`: the model's logits width (may differ from the tokenizer's size).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self> {
        if vocab_size == 0 {
            return Err(CoreError::InvalidArgument(
                "structured outputs: vocab_size must be positive".into(),
            ));
        }
        let mut words = token_bytes(tokenizer)?;
        let num_tokens = words.len();
        words.push(END_TOKEN.to_vec());
        let info = TokRxInfo::new(words.len() as u32, num_tokens as TokenId);
        let trie = TokTrie::from(&info, &words);
        Ok(GrammarVocab {
            env: Arc::new(Env { trie }),
            num_tokens,
            mask_width: vocab_size,
        })
    }

    pub fn env(&self) -> &TokEnv {
        &self.env
    }

    /// The token id that means "the grammar may end here".
    pub fn end_token(&self) -> TokenId {
        self.num_tokens as TokenId
    }

    /// Tokens a mask may allow: those of both the tokenizer and the model.
    pub fn num_maskable(&self) -> usize {
        self.num_tokens.min(self.mask_width)
    }

    pub fn mask_width(&self) -> usize {
        self.mask_width
    }

    /// The bytes of a token (empty for an id without one).
    pub fn token_bytes(&self, token: TokenId) -> &[u8] {
        let trie = self.env.tok_trie();
        if (token as usize) < self.num_tokens {
            trie.token(token)
        } else {
            &[]
        }
    }
}

/// Every token's bytes, from the tokenizer's JSON form (byte-level and byte-fallback
/// vocabularies; special tokens marked as llguidance expects).
fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>> {
    let unsupported = |why: String| {
        CoreError::InvalidArgument(format!(
            "structured outputs are not supported with this tokenizer: {why}"
        ))
    };
    let text = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| unsupported(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| unsupported(e.to_string()))?;
    let mut words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
        .map_err(|_| unsupported("its vocabulary could not be read".into()))?
        .map_err(|e| unsupported(e.to_string()))?;
    let size = tokenizer.inner().get_vocab_size(true);
    if words.len() < size {
        words.resize(size, Vec::new());
    }
    Ok(words)
}
