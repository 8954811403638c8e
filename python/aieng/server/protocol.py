"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated strictly.

Strict types (no "1" for 1, no true for 1), no NaN or Infinity, and no string with a lone
surrogate (it has no UTF-8 form). An unknown top-level field of a completion or chat request
is ignored, as vLLM does: the route logs it once per name and lists it in the
`x-aieng-ignored-fields` response header. A field that is known but would change the output
if honoured (`functions`, `guided_json`, ...) is refused with a 400 naming it
(see `params.check_request`).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from aieng.sampling import FLOAT32_TINY, MAX_TOKENS, MAX_TOP_K

MAX_N = 16
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_ALLOWED_TOKENS = 1 << 20  # allowed_token_ids: bounded by the body size anyway
MAX_BAD_WORDS = 256
MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
MAX_MESSAGES = 4096  # messages of one chat request: bounds the validation work a body can ask for
MAX_SCHEMA_NESTING = 64  # objects and arrays in a tool's parameters (serde's limit is 128)
INT64 = 1 << 63
# The largest int64 a double holds exactly: JSON tools read numbers as doubles, and 2**63 - 1
# reads back as 2**63, so a bound written as it would not be the bound they apply.
MAX_SEED = int(math.nextafter(2.0**63, 0))


def check_unicode(value: str) -> str:
    """Refuses a lone surrogate (JSON's "\\ud800" escape): no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the string has a lone surrogate at character {error.start}, which is not "
            "valid Unicode"
        ) from None
    return value


Str = Annotated[str, AfterValidator(check_unicode)]


def integral(value: object) -> object:
    """A JSON number with no fraction (1.0) as the integer it is: JSON Schema's "integer"
    includes it, so the server does too; 1.5, "1" and true stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _takes_float(annotation: object) -> bool:
    return annotation is float or any(_takes_float(a) for a in get_args(annotation))


# A token id: its bound in the served document is the model's vocabulary (served_schema.py).
TOKEN_ID_MARK = "x-aieng-token-id"
TokenId = Annotated[int, Field(ge=0, lt=INT64, json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[Str, Field(min_length=1)]
NOT_BLANK = r"\S"  # a character other than a space
Prompt = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _integers(cls, value: object, info: ValidationInfo) -> object:
        """Integral floats as integers in the fields that take no float (lists included)."""
        if not isinstance(value, (float, list)) or info.field_name is None:
            return value
        if _takes_float(cls.model_fields[info.field_name].annotation):
            return value
        return _integral_ids(value) if isinstance(value, list) else integral(value)


class _Lenient(_Strict):
    """Unknown fields are kept aside (in `model_extra`) rather than refused."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class SamplingFields(_Lenient):
    """Fields shared by completions and chat completions."""

    model: Str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1.0)  # below it float32 has 0
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-INT64, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # at least 3e-39: the sampler divides by it, and 1/3e-39 is still finite in float32
    repetition_penalty: float | None = Field(None, ge=3e-39, le=2.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKENS
    )
    # a word with something other than spaces in it
    bad_words: (
        list[
            Annotated[
                Str,
                Field(max_length=256, pattern=NOT_BLANK, json_schema_extra={"pattern": NOT_BLANK}),
            ]
        ]
        | None
    ) = Field(None, max_length=MAX_BAD_WORDS)
    # Structured outputs (aieng.structured_outputs reads them): OpenAI's and vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: object) -> object:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's form: token ids as strings, biases in [-100, 100]."""
        for key, bias in (value or {}).items():
            if not key.isdigit() or len(key) > 18:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        return value

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown fields of the body (and of its stream_options), as given."""
        names = list(self.model_extra or ())
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in self.stream_options.model_extra or ()]
        return names


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # 0: score the prompt only (with echo and logprobs), as lm-evaluation-harness asks
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    echo: bool = False
    suffix: Str | None = Field(None, json_schema_extra={"type": "null"})  # not supported
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: object) -> object:
        return check_prompt_shape(value)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The batch of prompts: each a string or token ids."""
        return prompt_list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: Str


class FunctionCall(_Strict):
    name: Annotated[Str, Field(min_length=1)]
    arguments: Str  # a JSON object as text (OpenAI's form)


class ToolCall(_Strict):
    id: Str
    type: Literal["function"] = "function"
    function: FunctionCall


_NOT_NULL = {"not": {"type": "null"}}


def _role_is(role: str) -> dict[str, Any]:
    return {"properties": {"role": {"const": role}}, "required": ["role"]}


class ChatMessage(_Strict):
    """A message of the conversation: content is null only for an assistant message (one
    that calls tools); a `tool` message answers the call named by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None
    name: Str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Str | None = Field(None, validate_default=True)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The document states the rules of the validators below, by role."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["required"] = [name for name in schema.get("required", []) if name != "content"]
        schema["allOf"] = [
            {
                "if": _role_is("assistant"),
                "else": {
                    "required": ["content"],
                    "properties": {"content": _NOT_NULL, "tool_calls": {"type": "null"}},
                },
            },
            {
                "if": _role_is("tool"),
                "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": _NOT_NULL}},
                "else": {"properties": {"tool_call_id": {"type": "null"}}},
            },
        ]
        return schema

    @model_validator(mode="before")
    @classmethod
    def _assistant_content(cls, data: object) -> object:
        """An assistant message may leave content out (the openai client drops a null one)."""
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: object, info: ValidationInfo) -> object:
        role = info.data.get("role", "assistant")  # absent: the role itself was invalid
        if value is None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        if (
            value is None
            or isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(part, dict) for part in value))
        ):
            return value
        raise ValueError("must be a string or a list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> object:
        if value is not None and info.data.get("role", "assistant") != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and value is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if role not in (None, "tool") and value is not None:
            raise ValueError("only tool messages have a tool_call_id")
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Lenient):
    name: Annotated[Str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        depth = nesting_depth(value)
        if depth > MAX_SCHEMA_NESTING:  # the template and grammar engines read it recursively
            raise ValueError(f"nests {depth} levels deep, more than {MAX_SCHEMA_NESTING}")
        try:  # what the chat template and the grammar engine must read back as JSON
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, UnicodeEncodeError) as error:
            raise ValueError(f"must be a JSON schema in valid JSON: {error}") from None
        return value


class Tool(_Lenient):
    """An OpenAI function tool; fields beyond OpenAI's are kept (the chat template gets the
    tool as sent) but must be JSON the template can read."""

    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="after")
    def _json(self) -> Tool:
        sent = self.model_dump(exclude_unset=True)
        _check_strings(sent)
        try:
            json.dumps(sent, ensure_ascii=False, allow_nan=False)
        except ValueError as error:
            raise ValueError(f"must be valid JSON: {error}") from None
        return self


class NamedFunction(_Lenient):
    name: Str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Strict):
    """Exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    )

    model: Str | None = None
    prompt: Str = None  # type: ignore[assignment]  # absent, never null: see oneOf
    messages: list[ChatMessage] = Field(None, min_length=1, max_length=MAX_MESSAGES)  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Str | None = None
    tokens: list[TokenId]


def _check_strings(value: object) -> None:
    """Refuses a lone surrogate anywhere in a JSON value (keys included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            check_unicode(item)


def nesting_depth(value: object) -> int:
    """How deep objects and arrays nest in a JSON value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt_shape(value: object) -> object:
    """A prompt (completions' `prompt`, embeddings' `input`): a string, strings, token ids or
    token-id lists, none empty, of one kind (token ids written 1.0 are integers)."""
    value = _integral_ids(value)
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list) and items and all(_is_int(t) for t in items):
        items = [items]
    shaped = isinstance(items, list) and all(
        isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in items
    )
    if not shaped or (items and len({isinstance(p, str) for p in items}) > 1):
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if not items or not all(items):
        raise ValueError("the prompt is empty")
    bad = next((t for p in items if isinstance(p, list) for t in p if not 0 <= t < INT64), None)
    if bad is not None:  # said here: the union's members would each give their own error
        sign = ": a token id must be >= 0" if bad < 0 else ""
        raise ValueError(f"token id {bad} is outside the vocabulary{sign}")
    return value


def _integral_ids(value: object) -> object:
    if not isinstance(value, list):
        return value
    return [_integral_ids(v) if isinstance(v, list) else integral(v) for v in value]


def prompt_list(prompt: Any) -> list[str] | list[list[int]]:
    """A checked prompt as a batch of prompts: each a string or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return prompt
