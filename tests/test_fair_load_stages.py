"""benches/fair_load_stages.py: the light client's time to first token split into the server's
stages from its debug log — before the server (client send to arrival), each stage, after it
(first chunk sent to the client reading it) — and the engine's steps of each phase."""

from __future__ import annotations

import importlib
import sys
from datetime import datetime
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


@pytest.fixture(scope="module")
def stages():
    sys.path.insert(0, str(BENCHES))
    try:
        return importlib.import_module("fair_load_stages")
    finally:
        sys.path.remove(str(BENCHES))


_LIGHT = (
    "2026-12-07 22:00:00,100 INFO aieng.server.requests: request_id=light-load-0 "
    "endpoint=/v1/chat/completions status=200 stages=body_read:0.001000,prepared:0.002000,"
    "gate:0.001000,queued:0.004000,scheduled:0.000100,first_token:0.010000,delivered:0.001900,"
    "sent:0.002000 arrival=100.005000"
)
_STEP = (
    "2026-12-07 22:00:{} DEBUG aieng.engine.async_engine: "
    "step tokens={} step_s={} cpu_s={} turn_s={}"
)
LOG = "\n".join(
    [
        _LIGHT,
        _STEP.format("00,105", 16, 0.012, 0.003, 0.0125),
        _STEP.format("09,000", 2048, 0.9, 0.5, 0.9001),
        "2026-12-07 22:00:00,200 INFO aieng.server.requests: request_id=other "
        "endpoint=/v1/embeddings status=200 stages=body_read:0.5 arrival=1.0",
        "not a log line",
    ]
)


def test_a_light_request_is_split_into_before_the_server_its_stages_and_after(stages):
    requests, steps = stages.parse_log(LOG)
    assert set(requests) == {"light-load-0", "other"}
    seconds, arrival = requests["light-load-0"]
    assert arrival == 100.005 and seconds["first_token"] == 0.01 and len(seconds) == 8
    # sent at 100.000, first content read 0.030 s later; the server's span is 0.022 s
    table = stages.stage_rows({"load": {"light-load-0": (100.0, 0.030)}}, requests)["load"]
    assert table["to_server"] == [pytest.approx(0.005)]
    assert table["to_client"] == [pytest.approx(0.030 - 0.005 - 0.022)]
    assert table["queued"] == [0.004] and table["engine"] == [0.0] and table["ttft"] == [0.030]
    assert sum(v[0] for k, v in table.items() if k != "ttft") == pytest.approx(0.030)
    assert [(at.second, f["tokens"]) for at, f in steps] == [(0, 16), (9, 2048)]


def test_a_server_without_arrival_puts_all_the_time_outside_before_it(stages):
    line = _LIGHT.replace(" arrival=100.005000", "")
    requests, _ = stages.parse_log(line)
    table = stages.stage_rows({"load": {"light-load-0": (100.0, 0.030)}}, requests)["load"]
    assert table["to_server"] == [pytest.approx(0.008)]
    assert table["to_client"] == [pytest.approx(0.0, abs=1e-9)]


def test_the_report_keeps_the_steps_that_started_in_each_phase(stages):
    windows = {
        "alone": (datetime(2026, 12, 7, 21, 59), datetime(2026, 12, 7, 21, 59, 59)),
        "load": (datetime(2026, 12, 7, 22, 0), datetime(2026, 12, 7, 22, 0, 5)),
    }
    ttfts = {"alone": {"light-load-0": (100.0, 0.030)}, "load": {"light-load-0": (100.0, 0.030)}}
    text = stages.markdown(ttfts, LOG, windows, {"load": {"aieng-engine": (0.25, 0.5)}})
    assert "| steps | - | 1 |" in text  # the 2,048-token step started after the phase
    assert "| step ms p50 | - | 12.00 |" in text
    assert "| aieng-engine | 0.00 / 0.00 | 0.25 / 0.50 |" in text
    assert "| engine |" not in text  # a stage this server does not mark has no row
