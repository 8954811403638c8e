"""From a validated request body to `SamplingParams`: defaults, cross-field checks, limits."""

from __future__ import annotations

from typing import Any

from aieng.sampling import SamplingParams
from aieng.server.errors import ApiError, invalid
from aieng.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Request fields that fall back to the model's generation_config.json when not given.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_request(req: SamplingFields) -> None:
    """Cross-field rules, each naming the field at fault."""
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest) and req.best_of not in (None, req.n):
        raise invalid(f"best_of ({req.best_of}) other than n ({req.n}) is not supported", "best_of")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
        both = req.max_tokens is not None and req.max_completion_tokens is not None
        if both and req.max_tokens != req.max_completion_tokens:
            raise invalid("max_tokens and max_completion_tokens differ", "max_completion_tokens")


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    default: int | None,
    param: str = "max_tokens",
) -> int:
    """The output budget; refuses a prompt plus budget beyond the context, with both numbers."""
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens but the model's context is {max_model_len} "
            f"tokens: at most {max_model_len - 1} prompt tokens leave room for an output token",
            "prompt",
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > max_model_len:
        raise ApiError(
            400,
            f"the model's context is {max_model_len} tokens, but {prompt_len + requested} were "
            f"asked for ({prompt_len} in the prompt and {requested} in {param})",
            param,
            "context_length_exceeded",
        )
    return requested


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    model_defaults: dict[str, Any],
) -> SamplingParams:
    fields: dict[str, Any] = {
        "n": req.n,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "logprobs": logprobs,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
    }
    for name in MODEL_DEFAULTED:
        value = getattr(req, name)
        if value is None:
            value = model_defaults.get(name)
        if value is not None:
            fields[name] = value
    if req.min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )
    try:
        return SamplingParams(**fields)
    except ValueError as error:  # SamplingParams names the field first
        message = str(error)
        name = message.split(" ", 1)[0]
        raise invalid(message, name if name in fields else None) from error
