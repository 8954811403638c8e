"""deploy/prometheus and deploy/grafana against the real tools and a live server:
- the alert rules pass `promtool check rules` and their unit tests (`promtool test rules`);
- every dashboard query parses (promtool) and every metric the rules and the dashboard name is
  one a live `aieng serve` exports;
- a real Prometheus scraping a live server fires the queue-refusal and error-rate alerts when
  the test drives refusals (429) and server errors (503).

Prometheus comes from Debian's `prometheus` package (scripts/test.sh installs it); outside CI a
machine without it skips these tests, in CI (CI=true) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from server_fixtures import MODEL_NAME, ThreadServer, free_port, make_model_dir

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "aieng.json"
METRIC = re.compile(r"\baieng_[a-z0-9_]+")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (scripts/test.sh installs Debian's prometheus)")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_alert_rules_check_and_pass_their_unit_tests():
    promtool = _tool("promtool")
    checked = _run(promtool, "check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = _run(promtool, "test", "rules", str(ALERTS.with_name("alerts_test.yml")))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = {rule["alert"] for rule in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]}
    unit_tested = set(
        re.findall(r"alertname: (\w+)", ALERTS.with_name("alerts_test.yml").read_text())
    )
    assert names == unit_tested  # every alert has its unit test


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [
        re.sub(r"^label_values\((\w+),.*\)$", r"\1", v["query"])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    # Grafana's variables, as Grafana would substitute them
    return [q.replace("$__rate_interval", "5m").replace("$instance", ".*") for q in queries]


def test_every_dashboard_query_parses(tmp_path):
    promtool = _tool("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q}
                    for i, q in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = _run(promtool, "check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("monitored"))


SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported_metric_names(url: str) -> set[str]:
    """The series names /metrics declares (`# TYPE` lines, a counter's `_total` and a
    histogram's `_bucket` included) — also those with no series yet, like a refusal counter
    before the first refusal — and every series name it holds."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        base = name.removesuffix("_total")
        names |= {base + suffix for suffix in SERIES_SUFFIXES.get(kind, ("",))}
    return names


def test_every_metric_the_rules_and_dashboard_name_is_exported(model):
    named = set(METRIC.findall(ALERTS.read_text()))
    for query in dashboard_queries():
        named |= set(METRIC.findall(query))
    with ThreadServer(model, cost_per_hour=3.5) as server:
        body = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        exported = exported_metric_names(server.url)
        metrics = server.metrics()
    missing = sorted(named - exported)
    assert not missing, f"named but not exported: {missing}"
    assert metrics["aieng_cost_usd_total"] > 0
    assert metrics["aieng_cost_per_1k_output_tokens"] > 0
    assert metrics["aieng_engine_dead"] == 0
    phases = {k for k in metrics if k.startswith("aieng_model_load_seconds{")}
    expected = {"build", "read", "place", "repack", "kv_cache"}
    assert phases == {f"aieng_model_load_seconds{{phase={p}}}" for p in expected}
    assert metrics["aieng_model_load_seconds"] > 0


# --- a real Prometheus, a live server, alerts firing ------------------------------------------


class Prometheus:
    """`prometheus` scraping one target every second, evaluating `rules` every second."""

    def __init__(self, folder: Path, target: str, rules: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "aieng", "static_configs": [{"targets": [target]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> Prometheus:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert self.proc.poll() is None, "prometheus exited; see its log"
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready after 60 s")

    def __exit__(self, *_exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def firing(self) -> dict[str, dict]:
        alerts = httpx.get(f"{self.url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return {a["labels"]["alertname"]: a for a in alerts if a["state"] == "firing"}


def hold_a_slow_body(url: str, seconds: float) -> threading.Thread:
    """A client that sends a request's headers and a part of its body, then waits: it holds
    the server's only body-read slot, so bodies sent meanwhile get 503."""
    host, port = url.removeprefix("http://").split(":")

    def hold() -> None:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": '
            )
            time.sleep(seconds)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


def test_a_real_prometheus_fires_the_alerts_on_a_live_server(model, tmp_path):
    # The shipped rules, with their `for:` durations shortened so that the test need not wait
    # minutes; the expressions are the shipped ones.
    rules = tmp_path / "alerts.yml"
    rules.write_text(re.sub(r"for: \d+m", "for: 0s", ALERTS.read_text()))
    server = ThreadServer(
        model,
        engine={"max_num_seqs": 1},
        max_queue_requests=1,
        max_concurrent_body_reads=1,
        request_read_timeout=120.0,
        cost_per_hour=1.0,
    )
    with server, Prometheus(tmp_path, f"127.0.0.1:{server.port}", rules) as prometheus:
        body = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 24}
        statuses: list[int] = []

        def post() -> None:
            try:
                response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
                statuses.append(response.status_code)
            except httpx.TransportError:
                statuses.append(0)

        firing: dict[str, dict] = {}
        end = time.monotonic() + 90
        while time.monotonic() < end and not {"AiengQueueRefusals", "AiengErrorRateHigh"} <= set(
            firing
        ):
            # capacity refusals: one runs, one waits, the rest are refused with 429
            clients = [threading.Thread(target=post) for _ in range(4)]
            for client in clients:
                client.start()
            for client in clients:
                client.join(60)
            # server errors: a held body read leaves none for the next request (503)
            holder = hold_a_slow_body(server.url, 1.5)
            time.sleep(0.3)
            post()
            holder.join(5)
            firing = prometheus.firing()
        assert 429 in statuses and 503 in statuses, statuses
        assert {"AiengQueueRefusals", "AiengErrorRateHigh"} <= set(firing), firing
        refusals = firing["AiengQueueRefusals"]
        assert refusals["labels"]["model_name"] == MODEL_NAME
        assert "requests/s refused for capacity" in refusals["annotations"]["summary"]
        assert "batch fill" in refusals["annotations"]["description"]
        assert "AiengEngineDead" not in firing
