"""Clients that leave mid-generation: their requests are aborted before the next engine step
and their KV blocks freed; afterwards nothing runs, nothing waits, and the pool is whole."""

import asyncio
import json

import httpx
import pytest
from server_fixtures import ENGINE_DEFAULTS, ThreadServer, make_model_dir

from aieng.config.engine_args import EngineArgs
from aieng.engine.async_engine import AsyncLLMEngine
from aieng.engine.llm_engine import LLMEngine
from aieng.sampling import SamplingParams

MAX_TOKENS = 1800


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


def test_leaving_a_stream_aborts_before_the_next_step(model):
    async def scenario():
        engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model), **ENGINE_DEFAULTS)))
        engine.start()
        try:
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            stream = engine.generate("a", [5, 6, 7, 8, 9], params)
            async for out in stream:
                if len(out.outputs[0].token_ids) and engine.stats.num_steps >= 3:
                    break
            steps_seen = engine.stats.num_steps
            await stream.aclose()  # sends the abort; the call below is queued behind it
            present, steps = await engine.call(
                lambda e: ("a" in e.requests, e.core.stats()["num_steps"])
            )
            whole = await engine.call(lambda e: e.check_pool_whole())
            return present, steps - steps_seen, whole
        finally:
            engine.shutdown()

    present, extra_steps, _ = asyncio.run(scenario())
    assert not present
    assert extra_steps <= 1  # at most the step that was in flight


def test_disconnected_clients_free_everything(model):
    with ThreadServer(model) as server:
        url = f"{server.url}/v1/completions"
        before = server.metrics()
        body = {"prompt": "Paged attention keeps the KV cache", "max_tokens": MAX_TOKENS}
        body["ignore_eos"] = True

        async def streaming_client(i: int) -> int:
            async with httpx.AsyncClient(timeout=60) as client:
                stream_body = {**body, "stream": True, "seed": i}
                async with client.stream("POST", url, json=stream_body) as response:
                    chunks = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            json.loads(line[6:])
                            chunks += 1
                            if chunks == 3:
                                break  # leaving the block drops the connection
                    return chunks

        async def impatient_client() -> bool:
            async with httpx.AsyncClient(timeout=0.3) as client:
                try:
                    await client.post(url, json=body)
                except httpx.ReadTimeout:
                    return True
                return False

        async def scenario():
            return await asyncio.gather(
                *(streaming_client(i) for i in range(4)), impatient_client(), impatient_client()
            )

        results = asyncio.run(scenario())
        assert results == [3, 3, 3, 3, True, True]
        m = server.wait_idle()
        assert m["aieng_num_requests_running"] == 0
        assert m["aieng_num_requests_waiting"] == 0
        assert m["aieng_kv_cache_usage_perc"] == 0.0  # what is left is the prefix cache
        assert m["aieng_kv_cache_cached_blocks"] > 0
        assert server.ctx.admission.num_in_flight == 0
        aborted = m["aieng_request_success_total{finished_reason=abort}"] - before.get(
            "aieng_request_success_total{finished_reason=abort}", 0
        )
        assert aborted == 6
        generated = m["aieng_generation_tokens_total"] - before.get(
            "aieng_generation_tokens_total", 0
        )
        assert generated < 6 * MAX_TOKENS / 4  # they were stopped long before their end
        server.in_engine(lambda engine: engine.check_pool_whole())
        again = httpx.post(url, json={"prompt": "The", "max_tokens": 3})
        assert again.status_code == 200
