"""Small requests before large bodies: while a request with a small body (or none) waits for its
first answer, the body limit middleware reads no chunk of a large body, for `hold_s` at most;
nothing is refused, and a small request that is never answered stops holding after `hold_s`."""

import asyncio

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aieng.server.config import ServerConfig
from aieng.server.context import ServerContext
from aieng.server.middleware import BodyLimitMiddleware
from aieng.server.offloop import OFF_LOOP_BYTES, OffLoopBodyRoute
from aieng.server.small_first import SMALL_BODY_BYTES, SmallFirst


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_large_chunk_waits_for_every_hold_to_be_released():
    async def scenario() -> None:
        first = SmallFirst(hold_s=30)
        await asyncio.wait_for(first.turn(), 1)  # nothing held: at once
        releases = [first.hold(), first.hold()]
        waiting = asyncio.create_task(first.turn())
        await _turns()
        releases[0]()
        releases[0]()  # a second call does nothing
        await _turns()
        assert not waiting.done() and first.holding == 1
        releases[1]()
        await asyncio.wait_for(waiting, 1)
        assert first.holding == 0

    asyncio.run(scenario())


def test_a_hold_lapses_after_hold_s_and_a_chunk_waits_no_longer():
    async def scenario() -> None:
        first = SmallFirst(hold_s=0.05)
        first.hold()  # never released
        await asyncio.wait_for(first.turn(), 1)  # gave up waiting after hold_s
        await asyncio.sleep(0.1)
        assert first.holding == 0  # and the hold itself lapsed

    asyncio.run(scenario())


def test_hold_s_zero_holds_nothing_and_a_negative_hold_is_refused():
    async def scenario() -> None:
        first = SmallFirst(hold_s=0)
        first.hold()
        assert first.holding == 0
        await asyncio.wait_for(first.turn(), 1)

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="hold_s must be >= 0"):
        SmallFirst(-1)
    with pytest.raises(ValueError, match="small_first_ms must be >= 0"):
        ServerConfig(served_model_name="m", small_first_ms=-1)


def _app(hold_s: float) -> tuple[BodyLimitMiddleware, asyncio.Event, list[str]]:
    answer, events = asyncio.Event(), []

    async def small(request: Request) -> PlainTextResponse:
        events.append(f"small in ({len(await request.body())} bytes)")
        await answer.wait()
        return PlainTextResponse("small")

    async def large(request: Request) -> PlainTextResponse:
        events.append(f"large read ({len(await request.body())} bytes)")
        return PlainTextResponse("large")

    app = Starlette(
        routes=[Route("/small", small, methods=["POST"]), Route("/large", large, methods=["POST"])]
    )
    middleware = BodyLimitMiddleware(app, max_bytes=1 << 20, small_first=SmallFirst(hold_s))
    return middleware, answer, events


def test_a_large_body_is_read_once_the_small_request_is_answered():
    async def scenario() -> None:
        app, answer, events = _app(hold_s=30)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as http:
            small = asyncio.create_task(http.post("/small", content=b"{}"))
            while not events:
                await asyncio.sleep(0.01)
            large = asyncio.create_task(http.post("/large", content=b"x" * (SMALL_BODY_BYTES + 1)))
            await asyncio.sleep(0.2)
            assert not large.done() and events == ["small in (2 bytes)"]
            answer.set()
            assert (await asyncio.wait_for(small, 5)).text == "small"
            assert (await asyncio.wait_for(large, 5)).text == "large"
        assert events == ["small in (2 bytes)", f"large read ({SMALL_BODY_BYTES + 1} bytes)"]
        assert app.small_first.holding == 0

    asyncio.run(scenario())


def test_a_small_request_never_answered_holds_a_large_body_for_hold_s_only():
    async def scenario() -> None:
        app, answer, events = _app(hold_s=0.1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as http:
            small = asyncio.create_task(http.post("/small", content=b"{}"))
            while not events:
                await asyncio.sleep(0.01)
            body = b"x" * (SMALL_BODY_BYTES + 1)
            assert (await asyncio.wait_for(http.post("/large", content=body), 5)).text == "large"
            assert not small.done()  # read while the small request still waits
            answer.set()
            await small

    asyncio.run(scenario())


def test_small_bodies_do_not_wait_for_each_other():
    async def scenario() -> None:
        app, answer, events = _app(hold_s=30)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as http:
            first = asyncio.create_task(http.post("/small", content=b"{}"))
            second = asyncio.create_task(http.post("/small", content=b"x" * SMALL_BODY_BYTES))
            while len(events) < 2:
                await asyncio.sleep(0.01)
            assert app.small_first.holding == 2
            answer.set()
            await asyncio.gather(first, second)
        assert app.small_first.holding == 0

    asyncio.run(scenario())


class _Text(BaseModel):
    text: str


def test_a_large_body_is_parsed_once_the_small_request_is_answered():
    """A large body already read waits before its scan and parse too (the parsing pool's
    core and the GIL go to the small request), for `hold_s` at most."""
    router = APIRouter(route_class=OffLoopBodyRoute)

    @router.post("/echo")
    async def echo(body: _Text) -> dict:
        return {"size": len(body.text)}

    async def scenario(hold_ms: float) -> tuple[bool, dict]:
        app = FastAPI()
        app.include_router(router)
        ctx = app.state.context = ServerContext(
            ServerConfig(served_model_name="m", small_first_ms=hold_ms)
        )
        release = ctx.small_first.hold()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as http:
            body = {"text": "x" * (OFF_LOOP_BYTES + 1)}
            parsed = asyncio.create_task(http.post("/echo", json=body))
            await asyncio.sleep(0.3)
            waited = not parsed.done()
            release()
            response = await asyncio.wait_for(parsed, 5)
        return waited, response.json()

    assert asyncio.run(scenario(30_000)) == (True, {"size": OFF_LOOP_BYTES + 1})
    # a hold that lapses lets the parse go on without the release
    assert asyncio.run(scenario(50)) == (False, {"size": OFF_LOOP_BYTES + 1})
