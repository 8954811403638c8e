"""The exception hierarchy of aieng, rooted at `AiengError` (defined by the Rust core), and
which failures leave the device unusable."""

import sys

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
    "error_field",
    "invalid_field",
    "is_fatal",
    "is_fatal_device_error",
]


def invalid_field(field: str, message: str) -> InvalidArgumentError:
    """An InvalidArgumentError about one request field, which it carries as `field` (the server's
    400 names it as its `param`); the message names it too, for library users."""
    error = InvalidArgumentError(message)
    error.field = field  # type: ignore[attr-defined]
    return error


def error_field(error: BaseException) -> str | None:
    """The request field an InvalidArgumentError is about (`invalid_field`); None when it names
    none (the prompt, or the request as a whole)."""
    return getattr(error, "field", None)


class EngineFatalError(RuntimeError):
    """A failure after which the engine cannot serve (no one request's fault): a tensor-parallel
    group out of step, a device left unusable."""


def _device_error_types() -> tuple[type[BaseException], ...]:
    """The failures torch types: a CUDA error (an illegal address, a device-side assert: the
    context is lost) and a collective's backend failing (NCCL). Read from an imported torch (an
    error of torch's cannot exist before it is imported; importing it here would make every
    `import aieng` pay for it), and absent from an older torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    distributed = sys.modules.get("torch.distributed")
    found = (
        getattr(torch, "AcceleratorError", None),
        getattr(distributed, "DistBackendError", None),
    )
    return tuple(t for t in found if isinstance(t, type))


# What torch still reports as a plain RuntimeError whose text is all there is to go on: cuBLAS and
# cuDNN failures, and CUDA errors on a torch without AcceleratorError.
FATAL_DEVICE_ERRORS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS",
    "cuDNN error",
    "NCCL error",
)


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether `error` left the device unusable (not one request's fault)."""
    if isinstance(error, _device_error_types()):
        return True
    if type(error) is not RuntimeError:  # the untyped ones are plain RuntimeErrors
        return False
    message = str(error)
    return any(marker in message for marker in FATAL_DEVICE_ERRORS)


def is_fatal(error: BaseException) -> bool:
    """Whether `error` leaves the engine unable to serve: a typed EngineFatalError, or a
    device failure torch reported."""
    return isinstance(error, EngineFatalError) or is_fatal_device_error(error)
