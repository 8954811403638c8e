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
    "EngineFatalError",
    "EngineStateError",
    "InvalidArgumentError",
    "OutOfBlocksError",
    "RequestTooLargeError",
    "TokenizerError",
    "UnknownRequestError",
    "is_fatal",
    "is_fatal_device_error",
]


class EngineFatalError(RuntimeError):
    """A failure after which the engine cannot serve (no one request's fault): a tensor-parallel
    group out of step, a device left unusable."""


# Failures after which the device cannot be trusted: the engine stops instead of serving garbage.
FATAL_DEVICE_ERRORS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS",
    "cuDNN error",
    "NCCL error",
)


def is_fatal_device_error(message: str) -> bool:
    """Whether an error with this text left the device unusable (not one request's fault).
    torch reports CUDA failures as plain RuntimeErrors: their text is all there is to go on."""
    return any(marker in message for marker in FATAL_DEVICE_ERRORS)


def is_fatal(error: BaseException) -> bool:
    """Whether `error` leaves the engine unable to serve: a typed EngineFatalError, or a
    device failure torch reported."""
    return isinstance(error, EngineFatalError) or is_fatal_device_error(str(error))
