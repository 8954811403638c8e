"""The HTTP service: `POST /v1/ask` ({"question", "conversation_id"?, "stream"?}) runs the
pipeline and answers {answer, citations, degraded, skipped, timings_ms, errors}; with "stream"
it sends server-sent events: {"delta": text} as the answer is generated, then the whole
response. `GET /metrics` has every step's time and outcome; `GET /health` says it is up."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from kjv_rag.conversation import Conversation
from kjv_rag.pipeline import Pipeline
from kjv_rag.steps import RagContext

MAX_CONVERSATIONS = 1000  # the least recently used are forgotten past this


class AskRequest(BaseModel):
    question: str = Field(min_length=1, max_length=2000)
    conversation_id: str | None = Field(None, max_length=100)
    stream: bool = False


@dataclass
class Conversations:
    window: int = 3

    def __post_init__(self) -> None:
        self._by_id: OrderedDict[str, Conversation] = OrderedDict()

    def get(self, conversation_id: str) -> Conversation:
        conversation = self._by_id.pop(conversation_id, None) or Conversation(self.window)
        self._by_id[conversation_id] = conversation
        while len(self._by_id) > MAX_CONVERSATIONS:
            self._by_id.popitem(last=False)
        return conversation


def response_body(ctx: RagContext, conversation_id: str) -> dict:
    return {
        "conversation_id": conversation_id,
        "question": ctx.question,
        "query": ctx.query,
        "answer": ctx.answer,
        "citations": [
            {"n": c.n, "id": c.id, "verses": list(c.verses), "text": c.text, "cited": c.cited}
            for c in ctx.citations
        ],
        "degraded": ctx.degraded,
        "skipped": ctx.skipped,
        "timings_ms": {name: round(s * 1000, 2) for name, s in ctx.timings.items()},
        "errors": ctx.errors,
    }


def build_service(pipeline: Pipeline, conversations: Conversations | None = None) -> FastAPI:
    app = FastAPI(title="KJV RAG over aieng")
    memory = conversations or Conversations()

    async def answer(body: AskRequest, ctx: RagContext, conversation_id: str) -> dict:
        await pipeline.run(ctx)
        if ctx.answer:
            ctx.history.add(body.question, ctx.answer)
        return response_body(ctx, conversation_id)

    @app.post("/v1/ask")
    async def ask(body: AskRequest) -> Response:
        conversation_id = body.conversation_id or uuid.uuid4().hex
        ctx = RagContext(body.question, memory.get(conversation_id))
        if not body.stream:
            return JSONResponse(await answer(body, ctx, conversation_id))
        events: asyncio.Queue = asyncio.Queue()

        async def on_delta(text: str) -> None:
            await events.put({"delta": text})

        ctx.on_delta = on_delta

        async def run() -> None:
            try:
                await events.put({"response": await answer(body, ctx, conversation_id)})
            except Exception as error:
                await events.put({"error": f"{type(error).__name__}: {error}"})
            await events.put(None)

        task = asyncio.create_task(run())

        async def sse() -> AsyncIterator[bytes]:
            try:
                while (event := await events.get()) is not None:
                    yield f"data: {json.dumps(event)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                if not task.done():
                    task.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(pipeline.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app
