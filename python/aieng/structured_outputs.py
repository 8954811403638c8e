"""Structured outputs: what a request constrains its output to, with vLLM's and OpenAI's names.

`StructuredOutputsParams` (vLLM's class and fields: exactly one of `json`, `regex`, `choice`,
`grammar`, `json_object`) goes into `SamplingParams(structured_outputs=...)`; its shape is
checked here, and the engine compiles it with the Rust core's llguidance grammar engine, which
refuses an invalid schema, regex or grammar with an `InvalidArgumentError` naming the problem.
`from_response_format` and `from_request_fields` read the OpenAI `response_format` field and
vLLM's `structured_outputs` request field into one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output; `json` is a JSON schema (a dict, or its JSON text)."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if self._gives(k)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar or json_object "
                f"must be given, got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            _check_json_value(value, f"structured_outputs.{name}")
        if self.choice is not None:
            choices = self.choice
            if not isinstance(choices, (list, tuple)) or not choices:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in choices):
                raise ValueError("structured_outputs.choice must hold only strings")
            _check_json_value(list(choices), "structured_outputs.choice")
            object.__setattr__(self, "choice", list(choices))
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a bool")

    def _gives(self, kind: str) -> bool:
        """Whether the field `kind` is set: `json_object=False` is not, but `json=False` is
        (the boolean schema that matches nothing, which compiling refuses)."""
        value = getattr(self, kind)
        return value is not None and (kind != "json_object" or value is not False)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._gives(k))

    def source(self) -> str:
        """The text the Rust core compiles for this kind (a schema or a choice list as JSON)."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)


def _check_schema(schema: object) -> None:
    if isinstance(schema, str):
        _check_json_value(schema, "structured_outputs.json")
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        kind = type(schema).__name__
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {kind}")
    _check_json_value(schema, "structured_outputs.json")


def _check_json_value(value: object, where: str) -> None:
    """What the Rust core can read: JSON values (no NaN or Infinity, string keys) whose
    strings are valid Unicode (no lone surrogate)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds {value}, which JSON cannot express")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{where} has a lone surrogate at character {error.start}, which is not valid "
                "Unicode"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            _check_json_value(k, where)
            _check_json_value(v, where)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_json_value(v, where)
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise ValueError(f"{where} holds a {type(value).__name__}, which is not JSON")


def from_response_format(value: object) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: {"type": "text"} (None: unconstrained), {"type":
    "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.
    Raises ValueError naming the part at fault."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("response_format must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with a schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError("response_format.json_schema.name must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("response_format.json_schema.strict must be a bool")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ValueError("response_format.json_schema.schema must be a JSON schema (an object)")
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as error:
        raise ValueError(
            str(error).replace("structured_outputs.json", "response_format.json_schema.schema")
        ) from None


def from_request_fields(
    structured_outputs: object, response_format: object
) -> StructuredOutputsParams | None:
    """The constraint of a request body: vLLM's `structured_outputs` object (keys as in
    StructuredOutputsParams) or OpenAI's `response_format`, not both."""
    constraint = from_response_format(response_format)
    if structured_outputs is None:
        return constraint
    if constraint is not None:
        raise ValueError("give either structured_outputs or response_format, not both")
    if not isinstance(structured_outputs, dict):
        raise ValueError("structured_outputs must be an object")
    unknown = sorted(set(structured_outputs) - set(KINDS))
    if unknown:
        raise ValueError(
            f"structured_outputs: unknown key {unknown[0]!r} (one of {', '.join(KINDS)})"
        )
    return StructuredOutputsParams(**structured_outputs)
