"""From a validated request body to `SamplingParams`: defaults, cross-field checks, limits."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.responses import Response

from aieng.sampling import SamplingParams
from aieng.server.errors import ApiError, invalid
from aieng.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from aieng.server.structured import constraint_of

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-aieng-ignored-fields"
MAX_WARNED_FIELDS = 1024  # names warned about, kept so each is logged once (bounded)
MAX_HEADER_FIELDS = 32
_HEADER_SAFE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Request fields that fall back to the model's generation_config.json when not given.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# Known fields that would change the output if honoured, so ignoring them would mislead: each
# is refused unless its value is one of the no-op values listed.
NOT_SUPPORTED: dict[str, tuple[str, tuple[object, ...]]] = {
    # tools are fields of chat requests; on /v1/completions they are refused, as OpenAI does
    "tools": ("tool calling is on /v1/chat/completions", (None, [])),
    "tool_choice": ("tool calling is on /v1/chat/completions", (None, "none")),
    "functions": ("use tools and tool_choice (functions is deprecated)", (None, [])),
    "function_call": ("use tools and tool_choice (function_call is deprecated)", (None, "none")),
    "guided_json": ("use structured_outputs or response_format", (None,)),
    "guided_regex": ("use structured_outputs or response_format", (None,)),
    "guided_choice": ("use structured_outputs or response_format", (None,)),
    "guided_grammar": ("use structured_outputs or response_format", (None,)),
    "prompt_logprobs": ("use echo with logprobs on /v1/completions", (None,)),
}


def check_request(req: SamplingFields) -> None:
    """Cross-field rules, each naming the field at fault."""
    extra = req.model_extra or {}
    for name, (why, no_ops) in NOT_SUPPORTED.items():
        if name in extra and not any(_same(extra[name], ok) for ok in no_ops):
            raise invalid(f"unsupported field {name!r}: {why}", name, "unsupported_field")
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


def note_ignored_fields(req: SamplingFields, warned: set[str]) -> list[str]:
    """The request's unknown fields; each name is logged at WARNING the first time it is seen
    (`warned` holds the names seen so far)."""
    names = req.ignored_fields
    for name in names:
        if name not in warned and len(warned) < MAX_WARNED_FIELDS:
            warned.add(name)
            logger.warning(
                "ignoring the unknown request field %s (logged once per field name)", ascii(name)
            )
    return names


def mark_ignored_fields(response: Response, names: list[str]) -> Response:
    """Lists the ignored fields in a response header (names unfit for a header left out)."""
    shown = [n for n in dict.fromkeys(names) if _HEADER_SAFE.fullmatch(n)][:MAX_HEADER_FIELDS]
    if shown:
        response.headers[IGNORED_FIELDS_HEADER] = ",".join(shown)
    return response


def _same(value: object, expected: object) -> bool:
    """JSON equality without Python's 1 == True."""
    return type(value) is type(expected) and value == expected


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
        "structured_outputs": constraint_of(req),
        "logit_bias": {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words or None,
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
