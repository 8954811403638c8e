//! The one error type of the text layer; the bindings map each variant to a Python exception.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, TextError>;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("no chat template: {0}")]
    NoChatTemplate(String),
    #[error("chat template error: {0}")]
    Template(String),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
}

impl From<minijinja::Error> for TextError {
    fn from(err: minijinja::Error) -> Self {
        use std::fmt::Write;
        // minijinja keeps the underlying cause (e.g. raise_exception's message) in the source chain.
        let mut message = err.to_string();
        let mut source = std::error::Error::source(&err);
        while let Some(cause) = source {
            let _ = write!(message, ": {cause}");
            source = cause.source();
        }
        TextError::Template(message)
    }
}

impl From<tokenizers::Error> for TextError {
    fn from(err: tokenizers::Error) -> Self {
        TextError::Tokenizer(err.to_string())
    }
}
