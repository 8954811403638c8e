"""Where a request's time to first token went: at debug level the request log names each stage
(body read, parsed and tokenized, fair gate, the engine's own stages, delivered to the event
loop, a stream's first chunk sent) with its seconds, and the token budget of the step that first
ran it, and the engine's thread logs each step's times; at info neither."""

import logging
import time

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir

from aieng.server.stages import mark, stage_times

REQUESTS = logging.getLogger("aieng.server.requests")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.fields: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(record.fields)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("step "):
            self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ThreadServer(make_model_dir(tmp_path_factory.mktemp("model"))) as s:
        yield s
        s.wait_idle()


@pytest.fixture
def records():
    handler, level = _Records(), REQUESTS.level
    REQUESTS.addHandler(handler)
    yield handler
    REQUESTS.removeHandler(handler)
    REQUESTS.setLevel(level)


def test_stage_times_are_each_from_the_stage_before():
    scope: dict = {"state": {"arrival": 10.0}}
    assert stage_times(scope["state"]) is None
    scope["state"]["stages"] = {"gate": 10.5, "body_read": 10.125, "engine": 12.0}
    mark(scope, "gate")  # the first mark of a stage stands
    assert scope["state"]["stages"]["gate"] == 10.5
    assert stage_times(scope["state"]) == "body_read:0.125000,gate:0.375000,engine:1.500000"


@pytest.mark.parametrize("stream", [False, True])
def test_the_debug_request_log_names_each_stage(server, records, stream):
    REQUESTS.setLevel(logging.DEBUG)
    body = {"prompt": "The", "max_tokens": 2, "temperature": 0, "stream": stream}
    sent_at = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    answered_at = time.monotonic()
    assert response.status_code == 200, response.text
    server.wait_idle()
    (fields,) = [f for f in records.fields if f["endpoint"] == "/v1/completions"]
    stages = {k: float(v) for k, v in (part.split(":") for part in fields["stages"].split(","))}
    # The engine's own times (it took the request, scheduled it, drew its first token) lie
    # between the gate and the event loop's receipt of the first output; a stream's first
    # chunk is then sent.
    in_order = ["body_read", "prepared", "gate", "queued", "scheduled", "first_token"]
    assert list(stages) == [*in_order, "delivered", *(["sent"] if stream else [])]
    assert all(seconds >= 0 for seconds in stages.values())
    to_first = sum(seconds for name, seconds in stages.items() if name != "sent")
    assert to_first == pytest.approx(fields["ttft"], abs=1e-5)
    # its arrival on the machine's monotonic clock: a client on the machine places it too
    assert sent_at < fields["arrival"] < answered_at
    # The budget of the step that first ran it: one client alone, the full budget.
    metrics = httpx.get(f"{server.url}/metrics", timeout=60).text
    (gauge,) = [
        line for line in metrics.splitlines() if line.startswith("aieng_step_token_budget{")
    ]
    assert fields["step_budget"] == int(float(gauge.rsplit(" ", 1)[1])) > 16


def test_the_debug_log_times_each_engine_step(server):
    engine_log = logging.getLogger("aieng.engine.async_engine")
    handler, level = _Lines(), engine_log.level
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.DEBUG)
    try:
        body = {"prompt": "The", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        server.wait_idle()
    finally:
        engine_log.removeHandler(handler)
        engine_log.setLevel(level)
    steps = [dict(p.split("=") for p in line.split()[1:]) for line in handler.lines]
    steps = [{k: float(v) for k, v in step.items()} for step in steps if step]
    # the prompt's step, then a step per further token (at least), each timed
    assert len(steps) >= 3 and steps[0]["tokens"] >= 1
    for step in steps:
        assert 0 <= step["cpu_s"] and 0 < step["step_s"] <= step["turn_s"]


def test_the_info_request_log_has_no_stages(server, records):
    REQUESTS.setLevel(logging.INFO)
    body = {"prompt": "The", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    server.wait_idle()
    (fields,) = [f for f in records.fields if f["endpoint"] == "/v1/completions"]
    assert fields["stages"] is None and fields["step_budget"] is None and fields["arrival"] is None
    assert fields["ttft"] is not None
