"""`within`: an await with a time limit, run in the caller's own task (no task of its own, so
no extra turns of the event loop: each body chunk the middleware reads, the fair gate's wait,
each engine output), with the builtin TimeoutError past its limit."""

import asyncio
import sys

import pytest

from aieng.engine.within import within


async def _current_task_after(seconds: float) -> asyncio.Task | None:
    await asyncio.sleep(seconds)
    return asyncio.current_task()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
def test_within_awaits_in_the_callers_task():
    async def scenario() -> None:
        caller = asyncio.current_task()
        assert await within(_current_task_after(0), 1.0) is caller
        assert await within(_current_task_after(0), None) is caller

    asyncio.run(scenario())


def test_within_raises_the_builtin_timeout_error_past_its_limit():
    async def scenario() -> None:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(10), 0.05)
        assert asyncio.get_running_loop().time() - started < 5

    asyncio.run(scenario())


def test_within_gives_the_result_and_the_error_of_what_it_awaits():
    async def fails() -> None:
        raise ValueError("bad")

    async def scenario() -> None:
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(ValueError, match="bad"):
            await within(fails(), 1.0)

    asyncio.run(scenario())
