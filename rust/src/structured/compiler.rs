//! Constraints compiled once over a vocabulary; each request takes a fresh matcher of one.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::{Matcher, ParserFactory};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::matcher::GrammarMatcher;
use super::spec::GrammarSpec;
use super::vocab::GrammarVocab;
use crate::error::{CoreError, Result};
use crate::text::Tokenizer;

/// Compiled grammars kept for reuse: many requests bring the same schema.
const CACHE_CAPACITY: usize = 256;

/// Compiles constraints over one tokenizer's vocabulary (the expensive part, once per
/// distinct constraint; kept in a small cache).
pub struct GrammarCompiler {
    vocab: Arc<GrammarVocab>,
    factory: ParserFactory,
    cache: Mutex<FxHashMap<GrammarSpec, Arc<Grammar>>>,
}

/// A compiled constraint: the matcher every request using it starts from.
pub struct Grammar {
    spec: GrammarSpec,
    initial: Mutex<Matcher>,
    vocab: Arc<GrammarVocab>,
}

impl GrammarCompiler {
    /// `vocab_size`: the width of the model's logits, which every mask has.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self> {
        let vocab = Arc::new(GrammarVocab::new(tokenizer, vocab_size)?);
        let mut factory = ParserFactory::new_simple(vocab.env())
            .map_err(|e| CoreError::InvalidArgument(format!("structured outputs: {e}")))?;
        factory.quiet();
        Ok(GrammarCompiler {
            vocab,
            factory,
            cache: Mutex::new(FxHashMap::default()),
        })
    }

    pub fn vocab(&self) -> &Arc<GrammarVocab> {
        &self.vocab
    }

    /// The grammar of `spec`; an invalid schema, regex or grammar is an `InvalidArgument`
    /// that names the kind and llguidance's reason.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<Grammar>> {
        if let Some(grammar) = self.cache.lock().get(spec) {
            return Ok(Arc::clone(grammar));
        }
        let grammar = Arc::new(self.compile_uncached(spec)?);
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_CAPACITY {
            cache.clear();
        }
        cache.insert(spec.clone(), Arc::clone(&grammar));
        Ok(grammar)
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let top = spec.to_grammar()?;
        let invalid = |m: String| CoreError::InvalidArgument(format!("{}: {m}", spec.kind()));
        let parser = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| invalid("the constraint could not be compiled".into()))?
            .map_err(|e| invalid(first_line(&e.to_string())))?;
        Ok(Grammar {
            spec: spec.clone(),
            initial: Mutex::new(Matcher::new(Ok(parser))),
            vocab: Arc::clone(&self.vocab),
        })
    }
}

/// llguidance's errors can carry a long trace after the reason.
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).trim().to_string()
}

impl Grammar {
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// A matcher at the start of the grammar; `stop_ids` (the request's EOS and stop token
    /// ids) are allowed wherever the grammar may end.
    pub fn matcher(&self, stop_ids: Vec<u32>) -> GrammarMatcher {
        let matcher = self.initial.lock().deep_clone();
        GrammarMatcher::new(matcher, Arc::clone(&self.vocab), stop_ids)
    }
}
