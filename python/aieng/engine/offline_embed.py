"""`LLM.embed`: a batch of prompts through the engine as embedding (prefill-only) requests, run
to completion, the pooled vectors back in input order."""

from __future__ import annotations

from collections.abc import Sequence

from aieng.engine.llm_engine import LLMEngine
from aieng.errors import InvalidArgumentError
from aieng.outputs import EmbeddingRequestOutput, RequestOutput
from aieng.pooling import PoolingParams, check_dimensions, resolve_pooling, truncate_dimensions


def embed_prompts(
    engine: LLMEngine,
    prompts: Sequence[str | Sequence[int]],
    pooling: PoolingParams | str | None,
    dimensions: int | None,
) -> list[EmbeddingRequestOutput]:
    info = engine.model_info
    params = resolve_pooling(pooling, info.pooling)
    check_dimensions(dimensions, info.hidden_size)
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    try:
        for prompt in prompts:
            if isinstance(prompt, str) and not prompt:
                raise InvalidArgumentError("prompt: an empty string has nothing to embed")
            rid = engine.new_request_id()
            engine.add_request(rid, prompt, params)
            ids.append(rid)
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    results = []
    for rid in ids:
        out = done[rid]
        if out.embedding is None:  # it ended without its prompt pooled (an error)
            reason = out.outputs[0].stop_reason if out.outputs else None
            raise RuntimeError(f"embedding request {rid} failed: {reason}")
        vector = truncate_dimensions(out.embedding, dimensions)
        results.append(EmbeddingRequestOutput(rid, out.prompt, out.prompt_token_ids, vector))
    return results
