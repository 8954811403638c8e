"""Structured outputs in requests: OpenAI's `response_format` and vLLM's `structured_outputs`
read into a constraint, compiled before the request reaches the engine (in the grammar pool, so
neither the event loop nor the engine loop waits on a large schema) so that an invalid schema,
regex or grammar, one that matches nothing or one past the grammar engine's limits is a 400
naming the field and the problem."""

from __future__ import annotations

from aieng.engine.engine_client import EngineClient
from aieng.errors import InvalidArgumentError, error_field
from aieng.sampling import SamplingParams
from aieng.server.errors import invalid
from aieng.server.grammar_pool import grammar_pool
from aieng.server.protocol import SamplingFields
from aieng.structured_outputs import StructuredOutputsParams, from_request_fields


def constraint_field(req: SamplingFields) -> str:
    """The request field that carries the constraint, for error messages."""
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def constraint_of(req: SamplingFields) -> StructuredOutputsParams | None:
    try:
        return from_request_fields(req.structured_outputs, req.response_format)
    except ValueError as error:
        message = str(error)
        field = "response_format" if message.startswith("response_format") else None
        raise invalid(message, field or constraint_field(req)) from error


async def compile_constraint(
    engine: EngineClient, params: SamplingParams, req: SamplingFields
) -> None:
    """Compiles the request's constraint into the engine's cache; refuses an invalid one, and
    one whose first step allows none of the request's allowed_token_ids."""
    if params.structured_outputs is None:
        return
    field = constraint_field(req)
    try:
        grammar = await grammar_pool().run(field, lambda: engine.compile_grammar(params))
    except InvalidArgumentError as error:
        raise invalid(f"{field}: {error}", field) from error
    try:
        params.check_satisfiable(engine.model_info.eos_token_ids, grammar=grammar)
    except InvalidArgumentError as error:
        raise invalid(str(error), error_field(error)) from error
