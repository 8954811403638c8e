"""The OpenAPI document of the model being served: the bounds that depend on it.

The request models state every bound they can; a few depend on the loaded model, and the
document says them once it is loaded: every token id below the vocabulary's size, and
`pooling` required on `/v1/embeddings` when the model declares none.
"""

from __future__ import annotations

import copy
from typing import Any

from aieng.engine.engine_client import ModelInfo
from aieng.server.protocol import TOKEN_ID_MARK


def served_schema(base: dict[str, Any], info: ModelInfo | None) -> dict[str, Any]:
    """`base` (not changed) with the bounds of the model `info` describes (None: not loaded)."""
    if info is None:
        return base
    schema = copy.deepcopy(base)
    stack: list[Any] = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get(TOKEN_ID_MARK):
                item.pop("maximum", None)
                item["exclusiveMaximum"] = info.vocab_size
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    if info.pooling is None:
        embedding = schema.get("components", {}).get("schemas", {}).get("EmbeddingRequest")
        if embedding is not None:
            pooling = embedding["properties"]["pooling"]
            given = [s for s in pooling.get("anyOf", [pooling]) if s.get("type") != "null"]
            embedding["properties"]["pooling"] = {**given[0], "description": _POOLING_REQUIRED}
            embedding["required"] = sorted({*embedding.get("required", []), "pooling"})
    return schema


_POOLING_REQUIRED = "The served model declares no pooling: name one."
