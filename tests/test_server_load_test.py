"""The load test (aieng.benchmarks.load_test, `aieng bench --serve`) against a real server: a
few seconds of Poisson load with disconnecting clients and canaries; its books balance and every
check passes."""

import json

from server_fixtures import ThreadServer, make_model_dir

from aieng.benchmarks import load_test


def test_a_short_load_run_balances_its_books(tmp_path):
    model = make_model_dir(tmp_path / "model")
    with ThreadServer(model, engine={"max_num_seqs": 8}, max_queue_requests=4) as server:
        argv = [
            "--url", server.url,
            "--rate", "auto", "--load-factor", "2.0",  # past capacity: some are refused
            "--calibrate-seconds", "1", "--calibrate-concurrency", "4,8",
            "--duration", "4", "--canary-every", "1",
            "--disconnect-fraction", "0.2",
            "--short-output", "16", "--long-output", "48", "--long-prompt", "200",
            "--out", str(tmp_path), "--label", "_smoke.1",  # a dot in the label is kept
        ]  # fmt: skip
        status = load_test.main(argv)
        server.in_engine(lambda engine: engine.check_pool_whole())
    result = json.loads((tmp_path / "load_test_smoke.1.json").read_text())
    summary = result["summary"]
    assert summary["sent"] == sum(summary["outcomes"].values()) > 0
    assert summary["outcomes"].get("aborted_client", 0) > 0
    assert result["cross_check"] == [], result["cross_check"]
    assert result["canaries"]["sent"] >= 3 and not result["canaries"]["failed"]
    assert result["end_state"]["ok"], result["end_state"]
    canaries = result["canaries"]
    assert status == (0 if canaries["matched"] == canaries["answered"] > 0 else 1)
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert (tmp_path / "load_test_smoke.1.png").stat().st_size > 10_000
    assert "| sent | completed |" in (tmp_path / "load_test_smoke.1.md").read_text()
