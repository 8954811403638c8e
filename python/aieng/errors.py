"""The exception hierarchy of aieng, rooted at `AiengError` (defined by the Rust core)."""

from aieng._core import (
    AiengError,
    ChatTemplateError,
    EngineStateError,
    InvalidArgumentError,
    OutOfBlocksError,
    RequestTooLargeError,
    TokenizerError,
    UnknownRequestError,
)

__all__ = [
    "AiengError",
    "ChatTemplateError",
    "EngineStateError",
    "InvalidArgumentError",
    "OutOfBlocksError",
    "RequestTooLargeError",
    "TokenizerError",
    "UnknownRequestError",
]
