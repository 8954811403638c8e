"""The exception hierarchy of aieng, rooted at `AiengError` (defined by the Rust core)."""

from aieng._core import (
    AiengError,
    EngineStateError,
    InvalidArgumentError,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownRequestError,
)

__all__ = [
    "AiengError",
    "EngineStateError",
    "InvalidArgumentError",
    "OutOfBlocksError",
    "RequestTooLargeError",
    "UnknownRequestError",
]
