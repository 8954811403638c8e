//! The text layer: tokenizer, streaming detokenizer, stop strings and chat templates.
//! Plain Rust; the Python bindings wrap these types.

mod chat_template;
mod config;
mod detokenizer;
mod error;
mod python_format;
mod stop;
mod strftime;
mod template_value;
mod tokenizer;

#[cfg(test)]
mod chat_template_parity;
#[cfg(test)]
pub(crate) mod test_tokenizers;

pub use chat_template::ChatTemplate;
pub use config::TokenizerConfig;
pub use detokenizer::IncrementalDetokenizer;
pub use error::{Result, TextError};
pub use stop::{StopStep, StopStrings};
pub use tokenizer::Tokenizer;
