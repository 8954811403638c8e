//! Structured outputs: constrained decoding with the `llguidance` grammar engine.
//!
//! A [`GrammarCompiler`] turns a request's constraint ([`GrammarSpec`]: a JSON schema, a
//! regex, a list of choices or a Lark grammar) into a [`Grammar`] over the loaded tokenizer's
//! vocabulary; an invalid constraint is an `InvalidArgument` naming the problem. Each
//! constrained sequence gets its own [`GrammarMatcher`]: the scheduler starts a
//! [`PendingMasks`] job on a worker thread when it plans a step (the masks are computed while
//! the model runs), the runner waits for it when it samples, and the scheduler advances the
//! matcher with every accepted token, ending the request when its grammar is complete.

mod admission;
mod cache;
mod compiler;
mod masks;
mod matcher;
mod spec;
mod vocab;

pub use compiler::{Grammar, GrammarCompiler};
pub use masks::{GrammarMasks, PendingMasks};
pub use matcher::{GrammarMatcher, SharedMatcher};
pub use spec::GrammarSpec;
pub use vocab::GrammarVocab;

#[cfg(test)]
mod core_tests;
#[cfg(test)]
mod tests;
