"""The load test (aieng.benchmarks.load_test, `aieng bench --serve`) against a real server: a
few seconds of Poisson load past capacity with disconnecting clients and canaries; its books
balance, every canary answered matches the idle run, every completion has exactly the tokens it
asked for, and the program exits 0."""

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
            # Canaries are refused like any request past the queue limit (at one a second all
            # three could be): send enough that some are answered.
            "--duration", "4", "--canary-every", "0.1",
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
    assert summary["outcomes"].get("refused_429", 0) > 0  # the run was past capacity
    assert result["cross_check"] == [], result["cross_check"]
    canaries = result["canaries"]
    assert canaries["answered"] > 0 and not canaries["failed"], canaries
    assert canaries["matched"] == canaries["answered"], canaries["mismatched"]
    assert result["end_state"]["ok"], result["end_state"]
    assert status == 0 and result["ok"]
    # Every completion streamed exactly its max_tokens (ignore_eos): 16 or 48 tokens each.
    completed = summary["outcomes"]["completed"]
    tokens = round(summary["throughput_out_tok_s"] * summary["elapsed_s"])
    long, rest = divmod(tokens - 16 * completed, 48 - 16)
    assert rest == 0 and 0 <= long <= completed, (tokens, completed)
    # Latencies were measured for the requests that streamed, and none exceeds the run.
    assert 0 < summary["ttft_s"]["p50"] and summary["ttft_s"]["p99"] < summary["elapsed_s"]
    assert summary["tpot_s"]["p50"] is not None
    assert (tmp_path / "load_test_smoke.1.png").stat().st_size > 10_000
    assert "| sent | completed |" in (tmp_path / "load_test_smoke.1.md").read_text()
