"""Hot reload with double buffering, and canary and shadow traffic, through `aieng serve
--model-dir` and the admin API: a new version loads beside the serving one, passes a smoke
generation and is switched in atomically while requests keep flowing — none fails, each is
served wholly by one version — and the old version is freed once its requests finish. A canary
takes its share of requests; a shadow is compared with the primary and never returned.
Refusals (memory, tokenizer, unknown, busy) are clear and leave the serving version untouched."""

from __future__ import annotations

import gc
import json
import logging
import shutil
import threading
import time
import weakref

import httpx
import pytest
from server_fixtures import MODEL_NAME, VOCAB, ThreadServer
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPT = [5, 17, 42, 9, 77, 31]


def version_folder(root, version, seed, memory_bytes=0, tokenizer_from=None):
    folder = root / f"v{version}"
    if tokenizer_from is None:
        save_model_dir(folder, byte_level_bpe(VOCAB))
    else:
        folder.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, folder / name)
    build_checkpoint("llama", folder, seed=seed, vocab_size=VOCAB)
    manifest = {
        "name": MODEL_NAME,
        "version": version,
        "output_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
        "requirements": {"memory_bytes": memory_bytes, "device": "any"},
    }
    (folder / "aieng-model.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    first = version_folder(root, "1.0.0", seed=0)
    version_folder(root, "1.1.0", seed=1, tokenizer_from=first)
    version_folder(root, "2.0.0-rc.1", seed=2, tokenizer_from=first)
    version_folder(root, "3.0.0", seed=3, memory_bytes=1 << 60, tokenizer_from=first)
    version_folder(root, "1.0.1", seed=0, tokenizer_from=first)  # the same weights as 1.0.0
    other = version_folder(root, "1.2.0", seed=4, tokenizer_from=first)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"unk_token"', '"unk_token" ', 1)
    )
    return root


def versions(server) -> dict[str, dict]:
    listing = httpx.get(f"{server.url}/admin/models", headers=ADMIN, timeout=10).json()
    return {v["version"]: v for v in listing["data"]}


def complete(server, model=MODEL_NAME, stream=False):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    if not stream:
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
        return response.status_code, response.headers.get("x-aieng-model-version"), text
    body["stream"] = True
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        text = ""
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return response.status_code, response.headers.get("x-aieng-model-version"), text


def test_the_admin_api_needs_its_own_key(model_dir):
    with ThreadServer(
        model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret"
    ) as s:
        assert httpx.get(f"{s.url}/admin/models").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(f"{s.url}/admin/models", headers=wrong).status_code == 401
        listed = versions(s)
        assert listed["1.0.0"]["state"] == "serving"
        assert listed["2.0.0-rc.1"]["stable"] is False and listed["1.1.0"]["state"] == "available"
    with ThreadServer(model_dir / "v1.0.0") as s:  # no --model-dir: no admin API
        assert httpx.get(f"{s.url}/admin/models", headers=ADMIN).status_code == 404


def test_refused_loads_name_the_problem_and_leave_the_serving_version(model_dir):
    with ThreadServer(
        model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret"
    ) as s:
        url = f"{s.url}/admin/models/{MODEL_NAME}/load"
        cases = [
            ({"version": "3.0.0"}, 507, "requires 1152921504606846976 bytes of memory"),
            ({"version": "9.9.9"}, 404, "has no version '9.9.9'"),
            ({"version": "1.0.0"}, 409, "is already serving"),
            ({"version": "1.2.0"}, 409, "tokenizer.json differs"),
            ({"versions": "1.1.0"}, 400, "field 'version'"),
        ]
        for body, status, message in cases:
            response = httpx.post(url, json=body, headers=ADMIN, timeout=10)
            assert response.status_code == status, (body, response.text)
            assert message in response.json()["error"]["message"]
        other = httpx.post(
            f"{s.url}/admin/models/other/load", json={"version": "1.1.0"}, headers=ADMIN
        )
        assert other.status_code == 404
        serving_delete = httpx.delete(
            f"{s.url}/admin/models/{MODEL_NAME}/versions/1.0.0", headers=ADMIN
        )
        assert serving_delete.status_code == 409
        assert versions(s)["1.0.0"]["state"] == "serving"
        assert complete(s)[:2] == (200, "1.0.0")


def test_a_switch_under_load_fails_no_request_and_frees_the_old_version(model_dir):
    server = ThreadServer(model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret")
    with server as s:
        old_engine = weakref.ref(s.ctx.engine.engine)
        old_model = weakref.ref(s.ctx.engine.engine.runner.model)
        results: list[tuple[float, int, str | None, str | None]] = []
        stop = threading.Event()

        def client(stream: bool) -> None:
            while not stop.is_set():
                started = time.monotonic()
                status, version, text = complete(s, stream=stream)
                results.append((started, status, version, text))

        clients = [threading.Thread(target=client, args=(i % 2 == 1,)) for i in range(4)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        # The load is held until the second request is answered: a tiny model can load, switch
        # and drain before a busy server answers the next request.
        versions_of = s.ctx.catalog.get(MODEL_NAME)
        load_version, held = versions_of._load_version, threading.Event()

        def held_load(folder):
            assert held.wait(60)
            return load_version(folder)

        versions_of._load_version = held_load
        loading = httpx.post(
            f"{s.url}/admin/models/{MODEL_NAME}/load", json={"version": "1.1.0"}, headers=ADMIN
        )
        assert loading.status_code == 202 and loading.json()["state"] == "loading"
        busy = httpx.post(
            f"{s.url}/admin/models/{MODEL_NAME}/load", json={"version": "2.0.0-rc.1"}, headers=ADMIN
        )
        held.set()
        assert busy.status_code == 409  # one load at a time
        deadline = time.monotonic() + 120
        while versions(s)["1.0.0"]["state"] != "unloaded":
            assert time.monotonic() < deadline, versions(s)
            assert versions(s)["1.1.0"]["state"] != "failed", versions(s)
            time.sleep(0.1)
        switched = time.monotonic()
        time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join(60)
        listed = versions(s)

    assert all(status == 200 for _, status, _, _ in results), results
    by_version: dict[str, set[str | None]] = {}
    for _, _, version, text in results:
        by_version.setdefault(version, set()).add(text)
    assert set(by_version) == {"1.0.0", "1.1.0"}
    # each answer came wholly from one version: one greedy text per version, and they differ
    assert len(by_version["1.0.0"]) == 1 and len(by_version["1.1.0"]) == 1
    assert by_version["1.0.0"] != by_version["1.1.0"]
    assert all(v == "1.1.0" for started, _, v, _ in results if started > switched)
    assert listed["1.1.0"]["state"] == "serving" and listed["1.1.0"]["load_s"] > 0
    assert "rss_after_unload" in listed["1.0.0"]
    assert old_model() is None  # its shutdown freed the weights, no garbage collection needed
    gc.collect()
    assert old_engine() is None  # nothing holds the old version's engine


def test_name_at_version_routes_to_the_serving_version(model_dir):
    with ThreadServer(
        model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret"
    ) as s:
        assert complete(s, model=f"{MODEL_NAME}@1.0.0")[:2] == (200, "1.0.0")
        status, _, _ = complete(s, model=f"{MODEL_NAME}@1.1.0")
        assert status == 404
        response = httpx.post(
            f"{s.url}/v1/completions",
            json={"model": f"{MODEL_NAME}@1.1.0", "prompt": "a", "max_tokens": 1},
        )
        assert "version 1.1.0 is not serving (serving: tiny-llama@1.0.0)" in response.text


def wait_state(server, version, state, timeout=120.0):
    deadline = time.monotonic() + timeout
    while (current := versions(server)[version]["state"]) != state:
        assert current != "failed" and time.monotonic() < deadline, versions(server)
        time.sleep(0.05)


def route(server, **body):
    return httpx.post(
        f"{server.url}/admin/models/{MODEL_NAME}/route", json=body, headers=ADMIN, timeout=10
    )


def test_a_canary_takes_its_share_and_ends_cleanly(model_dir):
    with ThreadServer(
        model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret"
    ) as s:
        assert route(s, version="1.1.0", mode="canary", percent=0).status_code == 400
        assert route(s, version="1.1.0", mode="blue").status_code == 400
        assert route(s, version="1.1.0", mode="canary", percent=50).status_code == 202
        wait_state(s, "1.1.0", "canary")
        listing = httpx.get(f"{s.url}/admin/models", headers=ADMIN).json()
        assert listing["route"] == {"version": "1.1.0", "mode": "canary", "percent": 50.0}
        busy = route(s, version="1.0.1", mode="shadow")
        assert busy.status_code == 409 and "end that route first" in busy.text
        answers = [complete(s) for _ in range(40)]
        assert all(status == 200 for status, _, _ in answers)
        by_version: dict[str, set] = {}
        for _, version, text in answers:
            by_version.setdefault(version, set()).add(text)
        assert set(by_version) == {"1.0.0", "1.1.0"}
        assert 8 <= sum(v == "1.1.0" for _, v, _ in answers) <= 32  # 50% of 40, loosely
        assert all(len(texts) == 1 for texts in by_version.values())
        ended = httpx.delete(f"{s.url}/admin/models/{MODEL_NAME}/route", headers=ADMIN)
        assert ended.status_code == 200 and ended.json()["state"] == "unloaded"
        assert {complete(s)[1] for _ in range(6)} == {"1.0.0"}
        assert httpx.get(f"{s.url}/admin/models", headers=ADMIN).json()["route"] is None


@pytest.mark.parametrize("candidate, agrees", [("1.0.1", True), ("1.1.0", False)])
def test_shadow_traffic_is_compared_and_never_returned(model_dir, caplog, candidate, agrees):
    with ThreadServer(
        model_dir / "v1.0.0", model_dir=str(model_dir), admin_key="admin-secret"
    ) as s:
        assert route(s, version=candidate, mode="shadow").status_code == 202
        wait_state(s, candidate, "shadow")
        with caplog.at_level(logging.INFO, logger="aieng.shadow"):
            answers = [complete(s, stream=i % 2 == 1) for i in range(6)]
            deadline = time.monotonic() + 60
            while s.metrics().get("aieng_shadow_requests_total{outcome=compared}", 0) < 6:
                assert time.monotonic() < deadline, s.metrics()
                time.sleep(0.05)
        assert {(status, version) for status, version, _ in answers} == {(200, "1.0.0")}
        metrics = s.metrics()
        assert metrics["aieng_shadow_agreement_total"] == (6 if agrees else 0)
        assert metrics["aieng_shadow_latency_ratio_count"] == 6
        records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "aieng.shadow"]
        assert len(records) == 6
        for record in records:
            assert record["shadow_version"] == candidate and record["exact_match"] is agrees
            assert record["primary_latency_s"] > 0 and record["shadow_latency_s"] > 0
            assert (record["first_difference"] is None) is agrees


def test_shadow_mirrors_are_dropped_first_under_load(model_dir):
    server = ThreadServer(
        model_dir / "v1.0.0",
        engine={"max_num_seqs": 1},
        model_dir=str(model_dir),
        admin_key="admin-secret",
    )
    with server as s:
        assert route(s, version="1.0.1", mode="shadow").status_code == 202
        wait_state(s, "1.0.1", "shadow")
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        long = threading.Thread(
            target=httpx.post,
            args=(f"{s.url}/v1/completions",),
            kwargs={"json": body, "timeout": 120},
        )
        long.start()  # holds the primary's only row
        deadline = time.monotonic() + 30
        while s.metrics()["aieng_num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        clients = []
        for _ in range(6):  # each admitted while earlier ones wait on the primary
            clients.append(threading.Thread(target=complete, args=(s,)))
            clients[-1].start()
            # all six arrive while the long request holds the row, however fast the CPU decodes
            time.sleep(0.02)
        for c in [long, *clients]:
            c.join(120)
        deadline = time.monotonic() + 60
        while True:
            m = s.metrics()
            compared = m.get("aieng_shadow_requests_total{outcome=compared}", 0)
            dropped = m.get("aieng_shadow_requests_total{outcome=dropped}", 0)
            if compared + dropped == 7 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert compared + dropped == 7
    assert dropped >= 4  # with requests waiting on the primary, mirrors are dropped, not queued


def test_serve_all_versions_routes_name_at_version_to_each(model_dir):
    server = ThreadServer(
        model_dir / "v1.0.0",
        model_dir=str(model_dir),
        admin_key="admin-secret",
        serve_all_versions=True,
    )
    with server as s:
        deadline = time.monotonic() + 120
        while any(v["state"] == "loading" for v in versions(s).values()) or (
            versions(s)["1.1.0"]["state"] == "available" and time.monotonic() < deadline
        ):
            assert time.monotonic() < deadline, versions(s)
            time.sleep(0.1)
        listed = versions(s)
        assert listed["1.0.0"]["state"] == "serving"
        # every version that fits is loaded beside the default; the 2**60-byte one is not
        loaded = {v for v, state in listed.items() if state["state"] == "loaded"}
        assert {"1.0.1", "1.1.0", "1.2.0", "2.0.0-rc.1"} <= loaded
        assert listed["3.0.0"]["state"] == "available"
        assert "requires 1152921504606846976 bytes" in listed["3.0.0"]["error"]
        texts = {}
        for version in ("1.0.0", "1.0.1", "1.1.0"):
            status, served, text = complete(s, model=f"{MODEL_NAME}@{version}")
            assert (status, served) == (200, version)
            texts[version] = text
        assert complete(s)[1] == "1.0.0"  # the bare name: the default version
        ids = [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]]
        assert ids[0] == MODEL_NAME and f"{MODEL_NAME}@1.1.0" in ids
        assert f"{MODEL_NAME}@3.0.0" not in ids
        assert texts["1.0.0"] == texts["1.0.1"] != texts["1.1.0"]  # same weights, other weights
        # making a loaded version the default is instant; the old default stays loaded
        switched = httpx.post(
            f"{s.url}/admin/models/{MODEL_NAME}/load", json={"version": "1.1.0"}, headers=ADMIN
        )
        assert switched.status_code == 202 and switched.json()["state"] == "serving"
        assert complete(s)[1] == "1.1.0"
        assert complete(s, model=f"{MODEL_NAME}@1.0.0")[:2] == (200, "1.0.0")
        # unloading a loaded version stops serving it
        gone = httpx.delete(f"{s.url}/admin/models/{MODEL_NAME}/versions/1.0.1", headers=ADMIN)
        assert gone.status_code == 200 and gone.json()["state"] == "unloaded"
        assert complete(s, model=f"{MODEL_NAME}@1.0.1")[0] == 404


def test_a_model_dir_with_two_models_serves_both(tmp_path, model_dir):
    root = tmp_path / "two"
    shutil.copytree(model_dir / "v1.0.0", root / "a-1.0.0")
    other = version_folder(root, "0.1.0", seed=5, tokenizer_from=model_dir / "v1.0.0")
    manifest = json.loads((other / "aieng-model.json").read_text())
    (other / "aieng-model.json").write_text(json.dumps({**manifest, "name": "other"}))
    with ThreadServer(root / "a-1.0.0", model_dir=str(root), admin_key="admin-secret") as s:
        deadline = time.monotonic() + 120
        while complete(s, model="other")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        mine, theirs = complete(s), complete(s, model="other")
        assert mine[:2] == (200, "1.0.0") and theirs[:2] == (200, "0.1.0")
        assert mine[2] != theirs[2]
        assert complete(s, model="other@0.1.0")[:2] == (200, "0.1.0")
        assert complete(s, model="other@9.9.9")[0] == 404
        ids = {m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]}
        assert {MODEL_NAME, "other", "other@0.1.0", f"{MODEL_NAME}@1.0.0"} <= ids
        assert httpx.get(f"{s.url}/v1/models/other@0.1.0").status_code == 200
        listing = httpx.get(f"{s.url}/admin/models", headers=ADMIN).json()
        assert listing["models"]["other"]["serving"] == "other@0.1.0"
        assert {d["name"] for d in listing["data"]} == {MODEL_NAME, "other"}
