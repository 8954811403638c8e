"""Tool calling on `/v1/chat/completions`: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` mean for the prompt, the constraint and the reading of the output.

- `"none"`: the tools still go to the chat template (the model knows they exist, as with
  OpenAI and vLLM's default), the output is not parsed: it is all content.
- `"auto"` (the default when tools are given): the output is free and read by the parser the
  server was started with (`--tool-call-parser`); without one the request is refused with a 400
  naming the flag, as vLLM does, since calls would silently come back as text.
- `"required"` or a named function: the output is constrained, with the structured-outputs
  machinery, to calls in the parser's markup (`hermes` when the server has none: the grammar
  fixes the markup, so reading it needs no guess) whose arguments follow the function's schema,
  so every call parses and validates; a string argument whose schema sets no bound (no
  maxLength, enum, const, pattern or format) is held to DEFAULT_STRING_MAX_LENGTH characters,
  so the call always closes. The output is exactly one call, and ends there, unless the request
  sends `parallel_tool_calls: true` (then one or more; a named function: always one).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aieng.engine.engine_client import EngineClient
from aieng.errors import InvalidArgumentError
from aieng.sampling import SamplingParams
from aieng.server.errors import invalid
from aieng.server.grammar_pool import grammar_pool
from aieng.server.protocol import ChatCompletionRequest, NamedToolChoice
from aieng.server.structured import constraint_of
from aieng.server.tool_parsers import FunctionSpec, ToolParser, tool_parser
from aieng.structured_outputs import StructuredOutputsParams

CONSTRAINED_DEFAULT_PARSER = "hermes"
# OpenAI: a function defined without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # what the chat template gets as `tools`
    parser: ToolParser | None  # reads the output into calls; None: the output is content
    grammar: str | None  # the Lark constraint of required / named calls


NO_TOOLS = ToolPlan(None, None, None)


def plan_tools(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """Checks the request's tool fields against each other and the server's parser."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools: the request offers none", "tool_choice")
        return NO_TOOLS
    names = [t.function.name for t in req.tools]
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise invalid(f"tools: the function name {repeated[0]!r} is given twice", "tools")
    template_tools = [t.model_dump(exclude_unset=True) for t in req.tools]  # as the client sent
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if choice == "auto":
        if parser_name is None:
            raise invalid(
                'tool_choice "auto" needs a tool-call parser: start the server with '
                "--tool-call-parser (for example --tool-call-parser hermes), or ask for "
                'tool_choice "required" or a named function',
                "tool_choice",
            )
        return ToolPlan(template_tools, tool_parser(parser_name), None)
    parser = tool_parser(parser_name or CONSTRAINED_DEFAULT_PARSER)
    functions = [
        FunctionSpec(t.function.name, forced_call_schema(t.function.parameters or NO_PARAMETERS))
        for t in req.tools
    ]
    # Several calls only when the client asks for them: a small model that may call again
    # tends to repeat its call until the token budget runs out.
    parallel = "parallel_tool_calls" in req.model_fields_set and req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        functions = [f for f in functions if f.name == wanted]
        if not functions:
            raise invalid(
                f"tool_choice names the function {wanted!r}, which is not among the tools "
                f"({', '.join(names)})",
                "tool_choice",
            )
        parallel = False
    if constraint_of(req) is not None:
        raise invalid(
            "tool_choice required or a named function constrains the output already: give "
            "no response_format or structured_outputs with it",
            "tool_choice",
        )
    return ToolPlan(template_tools, parser, parser.grammar(functions, parallel))


async def constrain_to_calls(
    engine: EngineClient, params: SamplingParams, plan: ToolPlan
) -> SamplingParams:
    """`params` constrained to the plan's calls, compiled off the event loop; a function whose
    parameters are not a usable JSON schema is a 400 naming `tools`."""
    if plan.grammar is None:
        return params
    constrained = dataclasses.replace(
        params, structured_outputs=StructuredOutputsParams(grammar=plan.grammar)
    )
    try:
        await grammar_pool().run("tools", lambda: engine.compile_grammar(constrained))
    except InvalidArgumentError as error:
        raise invalid(
            f"tools: a function's parameters schema is not usable: {error}", "tools"
        ) from error
    return constrained


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else")
# The longest string argument of a forced call whose schema sets no bound of its own: without
# one a small model may never close the string, and the call never ends (LangChain's schema of
# `def weather(city: str)` has none).
DEFAULT_STRING_MAX_LENGTH = 128
# What bounds a string already (or fixes its values): such a schema is kept as it is.
STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")


def forced_call_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments schema a forced call is constrained to: objects closed, strings bounded."""
    return _rewrite(parameters, _bounded_string)


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing of others (xgrammar's strict mode, which vLLM constrains tool calls with):
    a function takes the arguments it declares, and a model must not pad a call with invented
    keys. Members of an `allOf` stay open (closing each would refuse the others' keys)."""
    return _rewrite(schema, lambda node: node)


def _bounded_string(node: dict[str, Any]) -> dict[str, Any]:
    """A string schema without a bound gets `maxLength` DEFAULT_STRING_MAX_LENGTH."""
    kinds = node.get("type")
    is_string = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    if is_string and not any(k in node for k in STRING_BOUNDS):
        return {**node, "maxLength": DEFAULT_STRING_MAX_LENGTH}
    return node


def _rewrite(
    schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]], in_all_of: bool = False
) -> Any:
    """Every subschema of `schema` rewritten by `change`, and its objects closed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _rewrite(sub, change) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_rewrite(sub, change) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_rewrite(sub, change, in_all_of=True) for sub in out["allOf"]]
    for key in SCHEMA_VALUES:
        if key in out:
            value = out[key]
            out[key] = (
                [_rewrite(v, change) for v in value]
                if isinstance(value, list)
                else _rewrite(value, change)
            )
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not in_all_of and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return change(out)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
