"""Which failures stop the engine (typed where torch types them), and the request field an
InvalidArgumentError carries to the server's 400."""

import pytest
import torch
import torch.distributed

from aieng.errors import (
    EngineFatalError,
    InvalidArgumentError,
    error_field,
    invalid_field,
    is_fatal,
)
from aieng.sampling import SamplingParams


@pytest.mark.parametrize(
    "error",
    [
        EngineFatalError("rank 1 died"),
        torch.AcceleratorError("an illegal memory access was encountered"),
        torch.distributed.DistBackendError("the communicator was aborted"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"),
    ],
    ids=["engine-fatal", "accelerator", "dist-backend", "cublas-text"],
)
def test_device_failures_are_fatal(error):
    assert is_fatal(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("shape '[2, 3]' is invalid for input of size 5"),
        ValueError("CUDA error"),  # text that only looks like a device failure
        InvalidArgumentError("prompt: CUDA error: device-side assert"),
        KeyError("CUDA error"),
    ],
    ids=["shape", "value-error-text", "invalid-argument-text", "key-error-text"],
)
def test_other_failures_are_not(error):
    assert not is_fatal(error)


def test_invalid_field_carries_the_field():
    error = invalid_field("logit_bias", "logit_bias: token id 9 is outside the vocabulary")
    assert isinstance(error, InvalidArgumentError) and isinstance(error, ValueError)
    assert error_field(error) == "logit_bias"
    assert error_field(InvalidArgumentError("the prompt is empty")) is None


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(logprobs=9), "logprobs"),
        (SamplingParams(prompt_logprobs=9), "prompt_logprobs"),
        (SamplingParams(stop_token_ids=[8]), "stop_token_ids"),
        (SamplingParams(logit_bias={8: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[0, 8]), "allowed_token_ids"),
    ],
)
def test_engine_checks_name_their_field(params, field):
    with pytest.raises(InvalidArgumentError) as raised:
        params.verify(vocab_size=8, max_logprobs=5)
    assert error_field(raised.value) == field
    assert str(raised.value).startswith(field)
