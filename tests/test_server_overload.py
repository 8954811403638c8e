"""Admission control and timeouts on a server that runs one request at a time
(max_num_seqs=1), so that what waits and what is refused is exact."""

import asyncio
import json
import time

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir

# LONG must outlast the 1.5 s timeout however fast the CPU decodes (8,000 tokens of the tiny model).
LONG = {"prompt": "The quick brown fox", "max_tokens": 8000, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "The", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"), max_positions=8192)


async def first_chunk(lines) -> dict:
    async for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended before its first chunk")


async def rest_of(lines) -> list[dict]:
    chunks = []
    async for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def test_a_full_queue_refuses_exactly_the_overflow(model):
    with ThreadServer(
        model, engine={"max_num_seqs": 1}, max_queue_requests=3, max_queue_tokens=200
    ) as server:
        admission = server.ctx.admission

        async def scenario():
            url = f"{server.url}/v1/completions"
            async with httpx.AsyncClient(timeout=60) as client:
                async with client.stream("POST", url, json=LONG) as blocker:
                    lines = blocker.aiter_lines()  # held: dropping it would close the stream
                    await first_chunk(lines)  # it runs: the only seat is taken
                    big = asyncio.create_task(client.post(url, json={**SHORT, "prompt": [7] * 150}))
                    while admission.num_queued < 1:
                        await asyncio.sleep(0.01)
                    over_tokens = await client.post(url, json={**SHORT, "prompt": [7] * 60})
                    burst = [asyncio.create_task(client.post(url, json=SHORT)) for _ in range(6)]
                    end = time.monotonic() + 10
                    while sum(t.done() for t in burst) < 4 and time.monotonic() < end:
                        await asyncio.sleep(0.02)  # the refusals come back at once
                    await asyncio.sleep(0.2)
                    assert sum(t.done() for t in burst) == 4  # the other two still wait
                    assert admission.num_queued == 3 and not big.done()
                # leaving the block closes the blocker: it is aborted, the three queued run
                responses = [*await asyncio.gather(*burst), await big]
                never = await client.post(url, json={"prompt": [7] * 201, "max_tokens": 2})
            return responses, over_tokens, never

        responses, over_tokens, never = asyncio.run(scenario())
        assert sorted(r.status_code for r in responses) == [200, 200, 200, 429, 429, 429, 429]
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_requests"
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        assert over_tokens.status_code == 429
        assert over_tokens.json()["error"]["code"] == "queue_tokens"
        assert "150 of at most 200" in over_tokens.json()["error"]["message"]
        assert never.status_code == 400  # it could never be queued: retrying cannot help
        assert "201" in never.json()["error"]["message"]
        m = server.wait_idle()
        assert m["aieng_request_rejected_total{reason=queue_requests}"] == 4
        assert m["aieng_request_rejected_total{reason=queue_tokens}"] == 1
        assert m["aieng_request_rejected_total{reason=exceeds_queue_limits}"] == 1
        assert m["aieng_request_success_total{finished_reason=abort}"] == 1
        assert m["aieng_request_success_total{finished_reason=length}"] == 3
        server.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def timeout_server(model):
    with ThreadServer(
        model, engine={"max_num_seqs": 1}, request_timeout=1.5, kv_cache_watermark=0.01
    ) as server:
        yield server
        server.wait_idle()
        server.in_engine(lambda engine: engine.check_pool_whole())


def test_past_the_kv_watermark_a_request_is_refused_while_others_wait(timeout_server):
    url = f"{timeout_server.url}/v1/completions"
    blocker_body = {**LONG, "prompt": [9] * 200, "max_tokens": 7800}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url, json=blocker_body) as blocker:
                lines = blocker.aiter_lines()
                await first_chunk(lines)
                waiting = asyncio.create_task(client.post(url, json=SHORT))
                while timeout_server.ctx.admission.num_queued == 0:
                    await asyncio.sleep(0.01)
                refused = await client.post(url, json=SHORT)
                chunks = await rest_of(lines)
            return refused, await waiting, chunks

    refused, waited, chunks = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "kv_cache"
    assert waited.status_code == 200
    # The blocker ran past the 1.5 s request timeout: aborted, its stream still ends properly.
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < sum(1 for c in chunks if c["choices"][0]["text"])


def test_a_running_request_past_the_timeout_returns_what_it_has(timeout_server):
    started = time.monotonic()
    body = {**LONG, "stream": False}
    response = httpx.post(f"{timeout_server.url}/v1/completions", json=body, timeout=60)
    assert 1.4 < time.monotonic() - started < 10
    assert response.status_code == 200
    out = response.json()
    assert out["choices"][0]["finish_reason"] == "abort"
    assert 0 < out["usage"]["completion_tokens"] < 8000


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_never_started_gets_an_error_status(timeout_server, stream):
    # The engine thread is held for 2.5 s, as by a very long step: the request, queued behind
    # it, passes its 1.5 s timeout before it is ever scheduled.
    hold = timeout_server.ctx.engine.call(lambda engine: time.sleep(2.5))
    future = asyncio.run_coroutine_threadsafe(hold, timeout_server.loop)
    response = httpx.post(
        f"{timeout_server.url}/v1/completions", json={**SHORT, "stream": stream}, timeout=60
    )
    future.result(10)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and "1.5" in error["message"]
    m = timeout_server.wait_idle()
    assert m["aieng_kv_cache_usage_perc"] == 0.0
