"""No client can starve the others: a text too long for the context is refused by its length
before it is tokenized, tokenizing runs in a pool of its own in fair shares between clients,
and the fair queue serves a light flow before a heavy flow's backlog."""

import asyncio
import threading
import time

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir

from aieng.server.fair_queue import FairQueue
from aieng.server.tokenizing import INLINE_COST, TokenizerPool, longest_token_bytes

HEAVY, LIGHT = ("10.0.0.1", ""), ("10.0.0.2", "")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model, engine={"max_model_len": 256}) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


# ---------------------------------------------------------------------------- the fair queue


def test_a_light_flow_is_served_before_a_heavy_backlog():
    queue: FairQueue[str] = FairQueue(depth=1)
    for i in range(10):
        queue.push(("heavy",), f"h{i}", 100)
    assert queue.pop() == "h0"
    queue.push(("light",), "l0", 1)
    queue.push(("light",), "l1", 1)
    assert [queue.pop() for _ in range(3)] == ["l0", "l1", "h1"]
    assert len(queue) == 8


def test_shares_follow_cost_not_count():
    queue: FairQueue[str] = FairQueue(depth=1)
    for i in range(6):
        queue.push(("big",), f"b{i}", 30)
    for i in range(60):
        queue.push(("small",), f"s{i}", 1)
    served = [queue.pop() for _ in range(66)]
    first_half = served[:33]
    big_cost = 30 * sum(s.startswith("b") for s in first_half)
    small_cost = sum(s.startswith("s") for s in first_half)
    assert abs(big_cost - small_cost) <= 30, first_half  # equal service, within one item


def test_idle_time_earns_no_credit():
    queue: FairQueue[str] = FairQueue(depth=1)
    for i in range(50):  # "a" is served alone for a long time...
        queue.push(("a",), f"a{i}", 1)
    for _ in range(40):
        queue.pop()
    for i in range(10):  # ...then "b" arrives: it shares from now on, it does not get 40 first
        queue.push(("b",), f"b{i}", 1)
    order = [queue.pop() for _ in range(20)]
    assert sum(x.startswith("a") for x in order[:10]) >= 4, order


def test_levels_nest_kinds_then_clients():
    queue: FairQueue[str] = FairQueue(depth=2)
    for client in "abcd":  # four generation clients, one embedding client
        for i in range(5):
            queue.push(("generate", client), f"{client}{i}", 1)
    for i in range(20):
        queue.push(("embed", "e"), f"e{i}", 1)
    first = [queue.pop() for _ in range(20)]
    assert sum(x.startswith("e") for x in first) == 10  # the kinds share equally
    generated = [x[0] for x in first if not x.startswith("e")]
    assert all(2 <= generated.count(c) <= 3 for c in "abcd"), generated  # then the clients


def test_removed_items_are_not_served_nor_charged():
    queue: FairQueue[str] = FairQueue(depth=1)
    queue.push(("a",), "a0", 5)
    queue.push(("a",), "a1", 5)
    assert queue.remove(("a",), "a0") and not queue.remove(("a",), "gone")
    assert len(queue) == 1 and queue.pop() == "a1"
    with pytest.raises(IndexError):
        queue.pop()


# ---------------------------------------------------------------------------- the tokenizer pool


def test_the_pool_serves_a_light_client_before_a_heavy_clients_queue():
    order: list[str] = []
    release = threading.Event()

    def job(name: str) -> str:
        if name == "h0":
            release.wait(10)
        order.append(name)
        return name

    async def scenario():
        pool = TokenizerPool(threads=1)
        try:
            heavy = [
                asyncio.create_task(pool.run(HEAVY, 100 * INLINE_COST, job, f"h{i}"))
                for i in range(5)
            ]
            await asyncio.sleep(0.05)  # h0 holds the only thread; h1..h4 wait
            light = asyncio.create_task(pool.run(LIGHT, INLINE_COST + 1, job, "l0"))
            await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(*heavy, light)
        finally:
            pool.shutdown()

    assert asyncio.run(scenario()) == ["h0", "h1", "h2", "h3", "h4", "l0"]
    assert order[:2] == ["h0", "l0"], order


def test_a_cancelled_job_leaves_the_pool():
    release = threading.Event()

    async def scenario():
        pool = TokenizerPool(threads=1)
        try:
            busy = asyncio.create_task(pool.run(HEAVY, INLINE_COST + 1, release.wait, 10))
            await asyncio.sleep(0.05)
            waiting = asyncio.create_task(pool.run(LIGHT, INLINE_COST + 1, lambda: "never"))
            await asyncio.sleep(0.05)
            assert pool.num_waiting == 1
            waiting.cancel()
            await asyncio.sleep(0.05)
            assert pool.num_waiting == 0
            release.set()
            assert await busy is True
            assert await pool.run(LIGHT, 1, lambda: "next") == "next"
        finally:
            pool.shutdown()

    asyncio.run(scenario())


def test_a_job_of_at_most_inline_cost_runs_on_the_event_loop_at_once():
    release = threading.Event()

    async def scenario():
        pool = TokenizerPool(threads=1)
        try:
            busy = asyncio.create_task(pool.run(HEAVY, INLINE_COST + 1, release.wait, 10))
            await asyncio.sleep(0.05)  # the only thread is taken
            here = threading.get_ident()
            # no thread hop (nor a wait for the busy thread) for a small job
            assert await pool.run(LIGHT, INLINE_COST, threading.get_ident) == here
            assert pool.num_waiting == 0
            waiting = asyncio.create_task(pool.run(LIGHT, INLINE_COST + 1, threading.get_ident))
            await asyncio.sleep(0.05)
            assert pool.num_waiting == 1  # a larger one goes to the pool
            release.set()
            assert await busy is True and await waiting != here
        finally:
            pool.shutdown()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- the byte bound


def _limit(server) -> tuple[int, int]:
    """(bytes per token, the most prompt tokens) of the server's model."""
    per_token = server.in_engine(lambda engine: longest_token_bytes(engine.tokenizer)) + 4
    return per_token, server.ctx.engine.model_info.max_model_len - 1


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        ("/v1/completions", "prompt", "prompt"),
        ("/v1/embeddings", "input", "input"),
        ("/tokenize", "prompt", "prompt"),
    ],
)
def test_a_text_longer_than_the_context_can_hold_is_refused_by_its_bytes(
    server, path, field, param
):
    per_token, most = _limit(server)
    most += path == "/tokenize"  # a text to count, not a prompt: the whole context
    text = "a" * (most * per_token + 1)
    body = {field: text, **({"pooling": "mean"} if path == "/v1/embeddings" else {})}
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert f"{len(text)} bytes of text" in error["message"]
    assert "can never fit" in error["message"]


def test_a_chat_longer_than_the_context_can_hold_is_refused_by_its_bytes(server):
    per_token, most = _limit(server)
    messages = [{"role": "user", "content": "é" * (most * per_token)}]
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": messages}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "bytes of text" in error["message"]


def test_a_text_within_the_bound_is_tokenized_and_judged_by_its_tokens(server):
    _, most = _limit(server)
    text = "ab " * most  # short enough in bytes, too long in tokens
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": text}, timeout=60)
    assert response.status_code == 400, response.text
    assert "tokens" in response.json()["error"]["message"]
    assert "bytes of text" not in response.json()["error"]["message"]


def test_a_batch_of_many_texts_is_tokenized_in_parts_in_order(server):
    texts = [f"word {i} " * 40 for i in range(200)]  # about 80 kB: several parts
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": texts[7]}, timeout=60)
    expected = server.in_engine(lambda engine: engine.tokenizer.encode_batch(texts, True))
    assert response.json()["tokens"] == expected[7]

    async def encode():
        return await server.ctx.tokenizing.encode(
            LIGHT, server.ctx.engine.tokenizer, texts, True, "input", 255
        )

    got = asyncio.run_coroutine_threadsafe(encode(), server.loop).result(60)
    assert got == expected


# ---------------------------------------------------------------------------- fair admission

HEAVY_INPUTS = 160
QUEUE = HEAVY_INPUTS + 8
WORDS = "the quick brown fox jumps over the lazy dog and runs far away "


@pytest.fixture(scope="module")
def fair_server(model):
    # A step of 64 tokens keeps about two heavy inputs in the engine at a time: the rest wait
    # at the gate, where the order is decided.
    engine = {"max_model_len": 256, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    with ThreadServer(model, engine=engine, max_queue_requests=QUEUE) as s:
        yield s
        s.wait_idle(60)
        s.in_engine(lambda engine: engine.check_pool_whole())


def _key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


async def _light_beside_heavy(server, light_key: str) -> tuple[httpx.Response, int, bool]:
    """A heavy embedding request of HEAVY_INPUTS inputs from the key "heavy", then a short
    completion from `light_key` once the heavy inputs wait at the gate. -> (the light
    response, heavy inputs still waiting when it came back, whether the heavy one was done)."""
    admission = server.ctx.admission
    inputs = [f"{i} {WORDS}" for i in range(HEAVY_INPUTS)]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        heavy = asyncio.create_task(
            client.post(
                "/v1/embeddings",
                json={"input": inputs, "pooling": "mean"},
                headers=_key("heavy"),
            )
        )
        end = time.monotonic() + 30
        while server.in_loop(lambda: admission.num_at_gates) < HEAVY_INPUTS // 2:
            assert time.monotonic() < end, "the heavy inputs never waited at the gate"
            await asyncio.sleep(0.01)
        light = await client.post(
            "/v1/completions",
            json={"prompt": "The", "max_tokens": 2, "temperature": 0},
            headers=_key(light_key),
        )
        waiting = server.in_loop(lambda: admission.num_at_gates)
        heavy_done = heavy.done()
        assert (await heavy).status_code == 200
    return light, waiting, heavy_done


@pytest.mark.parametrize("light_key", ["light", "heavy"])
def test_a_light_request_is_not_stuck_behind_a_heavy_clients_queue(fair_server, light_key):
    """Another client, or the same client's generation beside its embeddings: either way the
    short completion goes in after at most a step's worth of the heavy inputs, while most of
    them still wait (first come, first served would have run all of them first)."""
    light, waiting, heavy_done = asyncio.run(_light_beside_heavy(fair_server, light_key))
    assert light.status_code == 200, light.text
    assert not heavy_done and waiting >= HEAVY_INPUTS // 4, waiting


def test_a_full_queue_refuses_the_client_that_fills_it_not_a_newcomer(model):
    """One seat, taken by a long stream: client a fills the queue of 8; a newcomer b is still
    admitted (it holds less than its share), a's next request is refused."""
    long = {"prompt": "The quick", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    short = {"max_tokens": 2, "temperature": 0}
    config = {"engine": {"max_num_seqs": 1}, "max_queue_requests": 8}
    with ThreadServer(model, **config) as server:
        admission = server.ctx.admission

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                async with client.stream(
                    "POST", "/v1/completions", json=long, headers=_key("a")
                ) as blocker:
                    lines = blocker.aiter_lines()
                    async for line in lines:  # it runs: the only seat is taken
                        if line.startswith("data: "):
                            break
                    batch = {**short, "prompt": [[7, 8, 9]] * 8}
                    filling = asyncio.create_task(
                        client.post("/v1/completions", json=batch, headers=_key("a"))
                    )
                    while server.in_loop(lambda: admission.num_queued) < 8:
                        await asyncio.sleep(0.01)
                    one = {**short, "prompt": "The"}
                    more = await client.post("/v1/completions", json=one, headers=_key("a"))
                    other = asyncio.create_task(
                        client.post("/v1/completions", json=one, headers=_key("b"))
                    )
                    while server.in_loop(lambda: admission.num_queued) < 9:
                        await asyncio.sleep(0.01)
                return await filling, more, await other

        filling, more, other = asyncio.run(scenario())
        assert filling.status_code == 200, filling.text
        assert more.status_code == 429 and more.json()["error"]["code"] == "queue_requests"
        assert "its share" in more.json()["error"]["message"]
        assert other.status_code == 200, other.text
        server.wait_idle()


def test_the_requests_waiting_at_the_gate_are_a_metric(fair_server):
    admission = fair_server.ctx.admission
    inputs = [f"{i} {WORDS}" for i in range(HEAVY_INPUTS)]

    async def scenario() -> tuple[float, int, float]:
        async with httpx.AsyncClient(base_url=fair_server.url, timeout=120) as client:
            body = {"input": inputs, "pooling": "mean"}
            heavy = asyncio.create_task(client.post("/v1/embeddings", json=body))
            end = time.monotonic() + 30
            while fair_server.in_loop(lambda: admission.num_at_gates) < HEAVY_INPUTS // 2:
                assert time.monotonic() < end, "the heavy inputs never waited at the gate"
                await asyncio.sleep(0.01)
            before = fair_server.in_loop(lambda: admission.num_at_gates)
            waiting = (await asyncio.to_thread(fair_server.metrics))["aieng_admission_waiting"]
            assert (await heavy).status_code == 200
        return waiting, before, fair_server.metrics()["aieng_admission_waiting"]

    waiting, before, after = asyncio.run(scenario())
    assert HEAVY_INPUTS // 4 <= waiting <= before, (waiting, before)
    assert after == 0
