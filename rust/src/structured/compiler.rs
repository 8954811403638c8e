//! Constraints compiled once over a vocabulary; each request takes a fresh matcher of one.
//!
//! A grammar is admitted only once it is known to work for a whole request: it compiles, its
//! language is not empty, every rule it reaches can complete, and no parser row it can build
//! is over llguidance's limit (see `admission`); anything else is an `InvalidArgument` naming
//! the kind and the problem, never a failure in the middle of a request.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::api::{ParserLimits, StopReason};
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory, TokenParser};
use parking_lot::Mutex;

use super::admission::{self, GrammarSize, Refusal};
use super::cache::LruCache;
use super::matcher::GrammarMatcher;
use super::spec::GrammarSpec;
use super::vocab::GrammarVocab;
use crate::error::{CoreError, Result};
use crate::text::Tokenizer;

/// Compiled grammars kept for reuse: many requests bring the same schema.
const CACHE_ENTRIES: usize = 256;
/// Estimated bytes the kept grammars may hold together.
const CACHE_BYTES: usize = 256 << 20;

/// Compiles constraints over one tokenizer's vocabulary (the expensive part, once per
/// distinct constraint; kept in a small cache).
pub struct GrammarCompiler {
    vocab: Arc<GrammarVocab>,
    factory: ParserFactory,
    cache: Mutex<LruCache<GrammarSpec, Grammar>>,
}

/// A compiled constraint: the matcher every request using it starts from.
pub struct Grammar {
    spec: GrammarSpec,
    initial: Mutex<Matcher>,
    /// The tokens allowed at the start, with the end token when it may end there.
    first: SimpleVob,
    vocab: Arc<GrammarVocab>,
    /// Estimated memory, for the cache's byte budget.
    bytes: usize,
}

impl GrammarCompiler {
    /// `vocab_size`: the width of the model's logits, which every mask has.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self> {
        let vocab = Arc::new(GrammarVocab::new(tokenizer, vocab_size)?);
        let mut factory = ParserFactory::new_simple(vocab.env())
            .map_err(|e| CoreError::InvalidArgument(format!("structured outputs: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(GrammarCompiler {
            vocab,
            factory,
            cache: Mutex::new(LruCache::new(CACHE_ENTRIES, CACHE_BYTES)),
        })
    }

    pub fn vocab(&self) -> &Arc<GrammarVocab> {
        &self.vocab
    }

    /// The grammar of `spec`; an invalid schema, regex or grammar, one that matches nothing
    /// or one past the grammar engine's limits is an `InvalidArgument` that names the kind
    /// and the reason.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<Grammar>> {
        if let Some(grammar) = self.cache.lock().get(spec) {
            return Ok(grammar);
        }
        let grammar = Arc::new(self.compile_uncached(spec)?);
        let bytes = grammar.bytes;
        self.cache
            .lock()
            .insert(spec.clone(), Arc::clone(&grammar), bytes);
        Ok(grammar)
    }

    /// Grammars in the cache, and their estimated bytes.
    #[cfg(test)]
    pub fn cached(&self) -> (usize, usize) {
        let cache = self.cache.lock();
        (cache.len(), cache.bytes())
    }

    /// The same compiler with a cache of other bounds.
    #[cfg(test)]
    pub fn with_cache(mut self, entries: usize, bytes: usize) -> Self {
        self.cache = Mutex::new(LruCache::new(entries, bytes));
        self
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let invalid = |m: String| CoreError::InvalidArgument(format!("{}: {m}", spec.kind()));
        let top = spec.to_grammar(self.factory.limits())?;
        let mut parser = match catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top))) {
            Ok(Ok(parser)) => parser,
            Ok(Err(e)) => return Err(invalid(engine_reason(&e.to_string()))),
            Err(_) => return Err(invalid(engine_reason("panic"))),
        };
        let size = admit(&parser, self.factory.limits()).map_err(invalid)?;
        let first = first_step(&mut parser).map_err(invalid)?;
        let bytes = estimated_bytes(spec, size, &parser) + first.len() / 8;
        let initial = Matcher::new(Ok(parser));
        Ok(Grammar {
            spec: spec.clone(),
            initial: Mutex::new(initial),
            first,
            vocab: Arc::clone(&self.vocab),
            bytes,
        })
    }
}

/// llguidance's limits, with short errors: the default ones bound each mask's work (the
/// per-request budget), and `initial_lexer_fuel` bounds the lexer a grammar builds.
fn limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// The static checks of `admission`, worded for users.
fn admit(parser: &TokenParser, limits: &ParserLimits) -> std::result::Result<GrammarSize, String> {
    let grammar = parser.parser.grammar();
    admission::check(grammar, limits.max_items_in_row).map_err(|refusal| match refusal {
        Refusal::Unproductive { is_start: true, .. } => {
            "matches nothing: no output can ever complete it".to_string()
        }
        Refusal::Unproductive { rule, .. } => format!(
            "{} can never be completed (each of its alternatives needs itself or another rule \
             that cannot complete)",
            rule_phrase(&rule)
        ),
        Refusal::RowTooLarge { rule, limit } => format!(
            "too many alternatives at one point: {} puts more than {limit} items in one parser \
             step, the grammar engine's limit",
            rule_phrase(&rule)
        ),
        Refusal::TooComplex => "too large to check: simplify the constraint".to_string(),
    })
}

/// A rule by its name where the user wrote it (a Lark rule); rules llguidance made up for a
/// schema or a regex have names like `#12`, which mean nothing to a user.
fn rule_phrase(rule: &str) -> String {
    let written = rule
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && rule.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if written {
        format!("the rule {rule:?}")
    } else {
        "one of its rules".to_string()
    }
}

/// The first token mask, once it is known that the grammar engine's per-step limits hold
/// there, and that some token (or the end) is allowed, so the language is not empty.
fn first_step(parser: &mut TokenParser) -> std::result::Result<SimpleVob, String> {
    let computed = catch_unwind(AssertUnwindSafe(|| {
        parser.start_without_prompt();
        parser.compute_mask()
    }));
    match computed {
        Ok(Ok(mask)) => Ok(mask),
        Ok(Err(_)) if parser.stop_reason() == StopReason::NoExtensionBias => {
            Err("matches nothing: no token is allowed at its start".into())
        }
        Ok(Err(e)) => Err(engine_reason(&e.to_string())),
        Err(_) => Err(engine_reason("panic")),
    }
}

/// What a cached grammar holds, roughly: its lexer's tables, its strings (kept in the grammar,
/// its lexemes and their regexes) and its symbols and rules; fitted to the memory measured
/// for large choices and schemas (a 1,999-string choice of 1.2 MB: about 7 MiB).
fn estimated_bytes(spec: &GrammarSpec, size: GrammarSize, parser: &TokenParser) -> usize {
    let lexer = parser.parser.lexer_stats().num_bytes;
    lexer + 6 * spec.source_len() + 256 * (size.symbols + size.rule_symbols) + (16 << 10)
}

/// llguidance's reason for refusing a grammar, without the trace or parser state after it;
/// a panic inside llguidance becomes a plain sentence, not its text.
fn engine_reason(message: &str) -> String {
    let first = message.lines().next().unwrap_or(message).trim();
    if first.starts_with("panic") {
        if first.contains("u16::MAX") {
            return "too large: the grammar engine supports at most about 65,000 rules and \
                    lexemes"
                .into();
        }
        return "the grammar engine failed on it (an internal error); simplify the constraint"
            .into();
    }
    if let Some(rest) = first.strip_prefix("Parser Error: ") {
        return rest.to_string();
    }
    first.to_string()
}

impl Grammar {
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    #[cfg(test)]
    pub fn estimated_bytes(&self) -> usize {
        self.bytes
    }

    /// Of `token_ids`, those the grammar allows as a request's first output token; `stop_ids`
    /// (the request's EOS and stop token ids) are allowed if it may end at its start (as a
    /// matcher's first mask does).
    pub fn allowed_first(&self, token_ids: &[u32], stop_ids: &[u32]) -> Vec<u32> {
        let maskable = self.vocab.num_maskable();
        let may_end = self.first.is_allowed(self.vocab.end_token());
        token_ids
            .iter()
            .copied()
            .filter(|&t| {
                ((t as usize) < maskable && self.first.is_allowed(t))
                    || (may_end && stop_ids.contains(&t))
            })
            .collect()
    }

    /// A matcher at the start of the grammar; `stop_ids` (the request's EOS and stop token
    /// ids) are allowed wherever the grammar may end.
    pub fn matcher(&self, stop_ids: Vec<u32>) -> GrammarMatcher {
        let matcher = self.initial.lock().deep_clone();
        GrammarMatcher::new(matcher, Arc::clone(&self.vocab), stop_ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_reasons_are_one_line_and_panics_are_never_quoted() {
        let panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n\
                     <backtrace>\n   0: llguidance::earley::grammar\n</backtrace>";
        let reason = engine_reason(panic);
        assert!(reason.starts_with("too large: the grammar engine supports at most"));
        let reason = engine_reason("panic: index out of bounds: the len is 3 but the index is 7");
        assert!(
            !reason.contains("index") && reason.contains("internal error"),
            "{reason}"
        );
        let reason = engine_reason("Parser Error: Current row has 2001 items; max is 2000\nstate");
        assert_eq!(reason, "Current row has 2001 items; max is 2000");
    }
}
