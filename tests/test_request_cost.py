"""Each request's share of engine step time (`RequestMetrics.engine_seconds`: every step's wall
time split over its requests by scheduled tokens) and its cost in the server's request log at
`--cost-per-hour`."""

import logging
import time

import httpx
import pytest
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

from aieng import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cost"))


def test_step_time_is_split_over_the_requests_that_used_it(model):
    llm = LLM(str(model), kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[7] * 4, [9] * 200, [11] * 4, [13] * 4]
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - start
    seconds = [o.metrics.engine_seconds for o in outputs]
    assert all(s > 0 for s in seconds)
    assert sum(seconds) <= wall  # shares of steps inside this call
    assert sum(seconds) > 0.5 * wall  # the steps are most of it
    assert seconds[1] > max(seconds[0], seconds[2], seconds[3])  # 200 prompt tokens cost more
    llm.engine.check_pool_whole()


def test_the_request_log_carries_each_requests_cost(model, caplog):
    with ThreadServer(model, cost_per_hour=36.0) as server:  # 1 cent a second
        with caplog.at_level(logging.INFO, logger="aieng.server"):
            body = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 6}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).is_success
            server.wait_idle()
    [record] = [r for r in caplog.records if getattr(r, "fields", None)]
    fields = record.fields
    assert fields["engine_s"] > 0
    assert fields["cost_usd"] == pytest.approx(fields["engine_s"] / 100, rel=1e-3, abs=2e-6)
