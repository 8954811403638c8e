"""The core's token budget in fair shares between clients: the key a request carries from the
library and the server, and what the scheduler does with it (its rules are tested in Rust,
beside `rust/src/fair_share.rs`)."""

import asyncio

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir

from aieng.core import EngineCore
from aieng.server.clients import fair_share_key


def _prefill_tokens_per_request(keys: tuple[str | None, str | None]) -> dict[str, int]:
    """A long prompt from one client prefills in chunks; a short one from another arrives
    after the first chunk. -> the tokens each computes in the second step."""
    core = EngineCore(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core.add_request("heavy", list(range(1, 601)), max_tokens=2, client=keys[0])
    core.schedule()
    core.update([])
    core.add_request("light", list(range(701, 711)), max_tokens=2, client=keys[1])
    plan = core.schedule()
    starts = plan.query_start_loc
    return {rid: int(starts[i + 1] - starts[i]) for i, rid in enumerate(plan.request_ids)}


def test_another_clients_prompt_shares_a_long_prefills_budget():
    assert _prefill_tokens_per_request(("heavy", "light")) == {"heavy": 54, "light": 10}


@pytest.mark.parametrize("keys", [(None, None), ("same", "same")])
def test_one_client_is_served_in_arrival_order(keys):
    assert _prefill_tokens_per_request(keys) == {"heavy": 64}


def test_the_server_names_a_client_by_key_else_address():
    assert fair_share_key(("10.0.0.1", "")) == "address:10.0.0.1"
    assert fair_share_key(("10.0.0.1", "abc")) == "key:abc"
    assert fair_share_key(("10.0.0.2", "abc")) == fair_share_key(("10.0.0.1", "abc"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ThreadServer(make_model_dir(tmp_path_factory.mktemp("model"))) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def test_the_server_passes_each_requests_client_to_the_engine(server):
    body = {"prompt": "The", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def clients_while_streaming() -> set:
        headers = {"Authorization": "Bearer tenant-a"}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
                return server.in_engine(lambda e: {q.client for q in e.requests.values()})

    [client] = asyncio.run(clients_while_streaming())
    assert client.startswith("key:") and "tenant-a" not in client  # the key, hashed
