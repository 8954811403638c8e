//! The one error enum of the core. The bindings map each variant to a class of
//! the Python hierarchy rooted at `aieng.AiengError`.

use thiserror::Error;

use crate::text::TextError;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A bad argument: a value out of range, an empty prompt, a duplicate id.
    #[error("{0}")]
    InvalidArgument(String),
    /// A request that can never be served with this configuration.
    #[error("{0}")]
    RequestTooLarge(String),
    /// The pool has fewer free blocks than an allocation needs.
    #[error("{0}")]
    OutOfBlocks(String),
    /// No request with this id is known.
    #[error("unknown request id {0:?}")]
    UnknownRequest(String),
    /// A call made in the wrong state (a released table, update without schedule).
    #[error("{0}")]
    State(String),
    /// A tokenizer file that cannot be read or parsed, or a failed encode/decode.
    #[error("{0}")]
    Tokenizer(String),
    /// No chat template, or one that fails to render (raise_exception included).
    #[error("{0}")]
    ChatTemplate(String),
}

impl From<TextError> for CoreError {
    fn from(err: TextError) -> Self {
        match err {
            TextError::InvalidArgument(m) => CoreError::InvalidArgument(m),
            TextError::NoChatTemplate(_) | TextError::Template(_) => {
                CoreError::ChatTemplate(err.to_string())
            }
            other => CoreError::Tokenizer(other.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, CoreError>;
