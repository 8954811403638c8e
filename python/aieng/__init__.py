"""aieng: an LLM inference engine for Python with a Rust core."""

from aieng._core import __version__
from aieng.errors import (
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
    "__version__",
]
