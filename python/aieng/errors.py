"""The exception hierarchy of aieng, rooted at `AiengError` (defined by the Rust core), and
which failures leave the device unusable."""

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
    "is_fatal_device_error",
]

# Failures after which the device cannot be trusted: the engine stops instead of serving garbage.
FATAL_DEVICE_ERRORS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS",
    "cuDNN error",
    "NCCL error",
    "tensor-parallel group failed",  # aieng.distributed.executor.FAILURE: ranks out of step
)


def is_fatal_device_error(message: str) -> bool:
    """Whether an error with this text left the device unusable (not one request's fault)."""
    return any(marker in message for marker in FATAL_DEVICE_ERRORS)
