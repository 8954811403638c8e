"""A large body whose prompt can never fit is refused before Python parses it.

`json.loads` of a 4 MB body holds the GIL for tens of milliseconds in one C call, and the
engine's thread, which takes the GIL many times per step, waits behind it: a flood of such
bodies slowed every other client's steps three times over, though each body only ever earned
a 400. For the routes in `TEXT_FIELDS`, a body past `offloop.OFF_LOOP_BYTES` is first scanned
by the core's `oversize_text` with the GIL released (serde_json): if a text of its field is
longer in UTF-8 bytes than the route's token limit times the tokenizer's bytes per token (the
bound `tokenizing.check_sizes` applies after parsing), it gets the same 400, unparsed. The scan
answers only for strict JSON objects; anything else (NaN, lone surrogates, not UTF-8) is parsed
as before. With several model versions served (`--model-dir`) the limit depends on the version
the request names, so no body is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from aieng._core import oversize_text
from aieng.server.context import ServerContext
from aieng.server.tokenizing import too_long

# The text field of each route and the tokens of the model's context it may take, less than
# max_model_len by this much: a completion's prompt and an embedding's input leave room for
# one more token, /tokenize takes the whole context (as the routes check it).
TEXT_FIELDS: dict[str, tuple[str, int]] = {
    "/v1/completions": ("prompt", 1),
    "/v1/embeddings": ("input", 1),
    "/tokenize": ("prompt", 0),
}


@dataclass(frozen=True)
class TextBound:
    field: str
    most: int  # tokens
    limit: int  # UTF-8 bytes


@dataclass(frozen=True)
class Oversize:
    """A text of the body past the bound: the body is refused unparsed."""

    model: str | None
    index: int | None
    size: int


async def text_bound(ctx: ServerContext, path: str) -> TextBound | None:
    """The bound on the route's text, or None where no body is scanned."""
    rule = TEXT_FIELDS.get(path)
    engine = ctx.engine
    if rule is None or engine is None or ctx.versions is not None or ctx.catalog:
        return None
    field, room = rule
    most = engine.model_info.max_model_len - room
    return TextBound(field, most, most * await ctx.tokenizing.bytes_per_token(engine.tokenizer))


def scan(bound: TextBound, body: bytes) -> Oversize | None:
    """The body's first text past the bound (in a pool thread: the scan releases the GIL)."""
    found = oversize_text(body, bound.field, bound.limit)
    return None if found is None else Oversize(*found)


def refuse(ctx: ServerContext, bound: TextBound, found: Oversize) -> None:
    """Raises the answer the route would give after parsing: the model's, then the 400."""
    ctx.check_model(found.model)
    raise too_long(bound.field, found.index, found.size, bound.limit, bound.most)
