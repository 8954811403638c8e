"""aieng: an LLM inference engine for Python with a Rust core."""

from aieng import core
from aieng._core import __version__
from aieng.errors import (
    AiengError,
    ChatTemplateError,
    EngineStateError,
    InvalidArgumentError,
    OutOfBlocksError,
    RequestTooLargeError,
    TokenizerError,
    UnknownRequestError,
)

__all__ = [  # noqa: RUF022
    "LLM",
    "EngineArgs",
    "CompletionOutput",
    "RequestOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "AiengError",
    "ChatTemplateError",
    "EngineStateError",
    "InvalidArgumentError",
    "OutOfBlocksError",
    "RequestTooLargeError",
    "TokenizerError",
    "UnknownRequestError",
    "__version__",
    "core",
]

_LAZY = {
    "LLM": "aieng.llm",
    "EngineArgs": "aieng.config.engine_args",
    "SamplingParams": "aieng.sampling",
    "StructuredOutputsParams": "aieng.structured_outputs",
    "RequestOutput": "aieng.outputs",
    "CompletionOutput": "aieng.outputs",
    "EmbeddingRequestOutput": "aieng.outputs",
    "PoolingParams": "aieng.pooling",
}


def __getattr__(name: str):
    """The engine's names load torch; import them only when asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aieng' has no attribute {name!r}")
