"""The fair gate between admission and the engine: a client with nothing in the engine goes
in at once, whatever another client holds there or queues at the gate; the others wait in
fair shares for room."""

import asyncio

import pytest

from aieng.server.fair_gate import FairGate

HEAVY = ("embed", "10.0.0.1", "")
LIGHT = ("generate", "10.0.0.2", "")
OTHER = ("generate", "10.0.0.3", "")


async def _fill(gate: FairGate, count: int) -> list[asyncio.Task]:
    """`count` heavy requests of 100 tokens; returns their tasks once each entered or waits."""
    tasks = [
        asyncio.create_task(gate.enter(HEAVY, f"h{i}", 100), name=f"h{i}") for i in range(count)
    ]
    await settle()
    return tasks


async def settle() -> None:
    """Lets woken tasks run to their next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_light_client_goes_in_at_once_beside_a_full_gate():
    async def scenario() -> None:
        gate = FairGate(max_requests=2, max_tokens=150)
        heavy = await _fill(gate, 6)
        assert sum(t.done() for t in heavy) == 2 and gate.num_waiting == 4
        # the light client holds nothing inside: it does not wait for a heavy request to start
        await asyncio.wait_for(gate.enter(LIGHT, "l0", 5), 1)
        assert gate.num_waiting == 4
        # its second request, while the first is inside and not started, waits its turn
        second = asyncio.create_task(gate.enter(LIGHT, "l1", 5))
        await settle()
        assert not second.done() and gate.num_waiting == 5
        # a third client is a newcomer too
        await asyncio.wait_for(gate.enter(OTHER, "o0", 5), 1)
        # the bypass took no room: two started newcomers free nothing for the waiting ones
        gate.started("l0")
        gate.started("o0")
        await settle()
        assert gate.num_waiting == 5
        # room comes as the requests inside start, and the waiting ones go in by fair shares
        for index in range(6):
            gate.started(f"h{index}")
            await settle()
        await asyncio.wait_for(second, 1)
        await asyncio.wait_for(asyncio.gather(*heavy), 1)
        gate.started("l1")
        for index in range(6):
            gate.started(f"h{index}")
        assert gate.idle

    asyncio.run(scenario())


def test_a_newcomer_does_not_jump_its_own_flows_queue():
    """A flow with requests waiting (and, after they all started, none inside) queues behind
    them: the bypass is for a flow with nothing in the engine and nothing waiting."""

    async def scenario() -> None:
        gate = FairGate(max_requests=1, max_tokens=1000)
        heavy = await _fill(gate, 3)
        assert [t.done() for t in heavy] == [True, False, False]
        late = asyncio.create_task(gate.enter(HEAVY, "h3", 100))
        await settle()
        assert not late.done() and gate.num_waiting == 3
        gate.started("h0")
        await settle()
        assert heavy[1].done() and not heavy[2].done() and not late.done()
        for index in (1, 2, 3):
            gate.started(f"h{index}")
            await settle()
        assert late.done() and gate.idle

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_no_count_behind():
    async def scenario() -> None:
        gate = FairGate(max_requests=1, max_tokens=1000)
        heavy = await _fill(gate, 2)
        heavy[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await heavy[1]
        gate.started("h0")
        assert gate.idle
        # the flow is a newcomer again: nothing of it inside or waiting
        await asyncio.wait_for(gate.enter(HEAVY, "h9", 100), 1)
        await asyncio.wait_for(gate.enter(LIGHT, "l0", 5), 1)
        gate.started("h9")
        gate.started("l0")
        assert gate.idle

    asyncio.run(scenario())


def test_shutdown_fails_every_waiting_request():
    async def scenario() -> None:
        gate = FairGate(max_requests=1, max_tokens=1000)
        heavy = await _fill(gate, 3)
        gate.abort_waiting(RuntimeError("shutting down"))
        results = await asyncio.gather(*heavy, return_exceptions=True)
        assert results[0] is None
        assert all(isinstance(r, RuntimeError) for r in results[1:])
        gate.started("h0")
        assert gate.idle
        await asyncio.wait_for(gate.enter(HEAVY, "h9", 100), 1)  # counts cleared

    asyncio.run(scenario())


def test_try_enter_lets_in_without_a_turn_of_the_loop_or_refuses_without_queueing():
    async def scenario() -> None:
        gate = FairGate(max_requests=1, max_tokens=1000)
        heavy = await _fill(gate, 2)
        assert gate.num_waiting == 1
        # a newcomer flow goes in synchronously: no await, so no other task runs before it
        assert gate.try_enter(LIGHT, "l0", 5)
        # the same flow again must wait its turn: refused, and nothing queued for it
        assert not gate.try_enter(LIGHT, "l1", 5)
        assert gate.num_waiting == 1
        waiting = asyncio.create_task(gate.enter(LIGHT, "l1", 5))
        await settle()
        assert not waiting.done() and gate.num_waiting == 2
        for name in ("l0", "h0", "h1"):
            gate.started(name)
            await settle()
        await asyncio.wait_for(asyncio.gather(waiting, *heavy), 1)
        gate.started("l1")
        assert gate.idle

    asyncio.run(scenario())
