"""`python -m aieng.server` as a process: SIGTERM drains (running requests finish, new ones
get 503, exit status 0), the shutdown timeout aborts what is left, logs are one JSON line per
request."""

import argparse
import asyncio
import json

import httpx
import pytest
from server_fixtures import SubprocessServer, make_model_dir

from aieng.server.cli import add_serve_arguments, run_serve

LONG = {"prompt": "The quick brown fox", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


async def _stream_to_end(client: httpx.AsyncClient, url: str, started: asyncio.Event, i: int):
    headers = {"X-Request-Id": f"drain-{i}"}
    body = {**LONG, "stream": True, "seed": i}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        chunks, done = [], False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                started.set()
        return chunks, done


async def _sigterm_during_load(server: SubprocessServer, streams: int):
    url = f"{server.url}/v1/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        events = [asyncio.Event() for _ in range(streams)]
        tasks = [
            asyncio.create_task(_stream_to_end(client, url, e, i)) for i, e in enumerate(events)
        ]
        whole = asyncio.create_task(client.post(url, json=LONG))
        for event in events:
            await event.wait()
        await asyncio.sleep(0.1)  # the non-streaming one is in the engine too
        server.terminate()
        ready = await client.get(f"{server.url}/ready")
        while ready.status_code == 200:
            ready = await client.get(f"{server.url}/ready")
        refused = await client.post(url, json={"prompt": "The", "max_tokens": 2})
        return await asyncio.gather(*tasks), await whole, ready, refused


def test_sigterm_lets_running_requests_finish_then_exits_0(model, tmp_path):
    log = tmp_path / "server.log"
    with SubprocessServer(model, log, "--shutdown-timeout", "60", "--log-format", "json") as s:
        streams, whole, ready, refused = asyncio.run(_sigterm_during_load(s, 3))
        assert s.wait(60) == 0
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    for chunks, done in streams:
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["finish_reason"] == "length"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    finished = {r["request_id"]: r for r in records if r["message"] == "request finished"}
    for i in range(3):
        r = finished[f"drain-{i}"]
        assert r["status"] == 200 and r["completion_tokens"] == 1500
        assert r["finish_reason"] == "length" and r["prompt_tokens"] > 0
        for field in ("cached_tokens", "queue_time", "ttft", "tpot", "e2e"):
            assert field in r
    assert any(r.get("error") == "draining" for r in finished.values())


def test_the_shutdown_timeout_aborts_what_is_left_and_exits_0(model, tmp_path):
    log = tmp_path / "server.log"
    with SubprocessServer(model, log, "--shutdown-timeout", "0.3") as s:
        streams, whole, _, refused = asyncio.run(_sigterm_during_load(s, 2))
        assert s.wait(60) == 0
    assert refused.status_code == 503
    for chunks, done in streams:
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) > 0
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["finish_reason"] == "abort"
    assert "request_id=drain-0" in log.read_text()  # text logs: key=value


def test_a_missing_model_folder_is_a_clear_error(tmp_path, caplog):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(tmp_path / "nothing"), "--port", "1"])
    assert run_serve(args) == 2
