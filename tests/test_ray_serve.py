"""aieng on Ray Serve (`aieng.ray`): replicas behind the OpenAI ingress, on a local Ray cluster
with this machine's 2 CPUs, reached with the openai client like a plain `aieng serve`."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import ray
from ray import serve
from ray_fixtures import RayApp, ray_cluster, shutdown_cluster
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir, wait_ready
from test_hot_reload import version_folder

from aieng.config.engine_args import EngineArgs
from aieng.ray import RayServeOptions, build_app

# 64 blocks of 4 tokens a replica (1 KiB each in bfloat16, the CPU's default cache): its prefix
# cache holds 4 or 5 of the routing test's 8 prefixes, so a replica that sees all 8 evicts what it
# will need next. Two requests run at once on a replica, the others wait (not yet streaming).
ENGINE = dict(kv_cache_memory=64 * 1024, block_size=4, max_model_len=256, max_num_seqs=2)
GREEDY = dict(temperature=0, max_tokens=12)
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module", autouse=True)
def cluster_stopped_after():
    """The last of the Ray modules (by name) leaves no Ray processes to the tests after it."""
    yield
    shutdown_cluster()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def pair(model):
    """Two replicas, prefix-aware routing."""
    app = RayApp("pair", model, ENGINE, num_replicas=2, routing="prefix")
    yield app
    app.delete()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def answers(client: openai.OpenAI) -> list:
    """Greedy completions and chats, whole and streamed (as text and token counts)."""
    out = []
    for prompt in PROMPTS:
        whole = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
        streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY)
        chunks = list(streamed)
        out.append((whole.choices[0].text, whole.usage.completion_tokens))
        out.append(
            ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)
        )
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, stream=True, **GREEDY
        )
        out.append(chat.choices[0].message.content)
        out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return out


def test_two_replicas_answer_as_one_plain_server(model, pair):
    with ThreadServer(model, engine=ENGINE) as plain:
        expected = answers(client_of(plain.url))
    got = answers(client_of(pair.url))
    assert got == expected
    assert expected[0][1] == GREEDY["max_tokens"] and expected[1][1] == "length"


def fanned_out(client: openai.OpenAI) -> list:
    """Requests the ingress splits into several replica calls: a prompt list, n, several
    embedding inputs (each within a bounded time: a lost call would hang the request)."""
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, **GREEDY)
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, stream=True, **GREEDY)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    vectors = client.embeddings.create(
        model=MODEL_NAME, input=PROMPTS, encoding_format="float", extra_body={"pooling": "mean"}
    )
    return [
        [c.text for c in batch.choices],
        [(c.index, c.text) for c in both.choices],
        texts,
        np.array([d.embedding for d in vectors.data]),
    ]


def test_requests_that_fan_out_answer_as_one_plain_server(model, pair):
    with ThreadServer(model, engine=ENGINE) as plain:
        expected = fanned_out(client_of(plain.url))
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused", max_retries=0, timeout=30)
    got = fanned_out(client)
    assert got[:3] == expected[:3]
    np.testing.assert_allclose(got[3], expected[3], atol=1e-5)
    assert len(expected[0]) == 3 and len(expected[1]) == 4 and expected[3].shape[0] == 3


def ray_log_lines(phrase: str, process: str = "") -> list[str]:
    """The lines of this Ray session's logs that hold `phrase`: every process's, or only those
    of the processes whose log holds `process` (an actor's name)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    texts = [p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()]
    return [
        line for text in texts if process in text for line in text.splitlines() if phrase in line
    ]


def test_a_client_cancel_ends_its_replica_calls_without_tracebacks(pair):
    """Clients that go away mid-request (streamed, whole, fanned out): their replica calls end,
    the KV blocks come back, and the ingress logs no "Task exception was never retrieved"."""
    never_retrieved = len(ray_log_lines("exception was never retrieved"))
    ingress = f"ServeReplica:{pair.name}:OpenAIIngress"
    tracebacks = len(ray_log_lines("Traceback", ingress))
    cancels = len(ray_log_lines("disconnected, cancelling request"))
    body = {"model": MODEL_NAME, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    for prompt, stream in (("a", True), ("b", False), (["c", "d", "e"], False), (["f", "g"], True)):
        with httpx.Client(timeout=httpx.Timeout(0.5, connect=10)) as client:
            try:
                with client.stream(
                    "POST",
                    f"{pair.url}/v1/completions",
                    json={**body, "prompt": prompt, "stream": stream},
                ) as response:
                    for _ in response.iter_bytes():
                        break  # the first chunk, then the client goes
            except httpx.ReadTimeout:
                pass

    def idle() -> bool:
        m = pair.metrics()
        return m["aieng_num_requests_running"] == 0 and m["aieng_kv_cache_usage_perc"] == 0

    assert pair.wait_for(idle, timeout=30, step=0.2), pair.metrics()
    seen = lambda: len(ray_log_lines("disconnected, cancelling request")) >= cancels + 4  # noqa: E731
    assert pair.wait_for(seen, timeout=30, step=0.5)  # Ray's one line per cancel
    time.sleep(2.0)  # what the ingress logs on the way reaches its files
    assert len(ray_log_lines("exception was never retrieved")) == never_retrieved
    assert len(ray_log_lines("Traceback", ingress)) == tracebacks


def test_build_app_without_a_model_serves_the_bundled_one_under_its_name():
    """`build_app(EngineArgs())`: the bundled model, called aieng-kjv-6m (not 'None')."""
    port = ray_cluster()
    engine = EngineArgs(kv_cache_memory=1 << 22, max_model_len=128)
    app = build_app(engine, RayServeOptions(replica_num_cpus=0))
    serve.run(app, name="bundled", route_prefix="/bundled", blocking=False)
    url = f"http://127.0.0.1:{port}/bundled"
    try:
        wait_ready(url, timeout=120)
        client = client_of(url)
        assert [m.id for m in client.models.list()] == ["aieng-kjv-6m"]
        reply = client.completions.create(model="aieng-kjv-6m", prompt="In the", max_tokens=4)
        assert reply.model == "aieng-kjv-6m" and reply.choices[0].finish_reason == "length"
    finally:
        serve.delete("bundled")


def test_the_ingress_validates_like_the_server(pair):
    with pytest.raises(openai.BadRequestError) as error:
        client_of(pair.url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-1)
    assert error.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as error:  # checked by the replica's engine
        client_of(pair.url).completions.create(model=MODEL_NAME, prompt=[5] * 300, max_tokens=4)
    assert error.value.body["param"] == "prompt"


def test_the_ingress_metrics_are_labelled_by_replica(pair):
    """Each replica's load, KV cache and prefix-cache hits under its Ray Serve replica id, and
    the pooled figures their sums."""
    client = client_of(pair.url)
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    for prompt in prompts * 2:  # the repeats hit the prefix cache of their replica
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    actors = {n.rsplit("#", 1)[1] for n in names if n.startswith(f"SERVE_REPLICA::{pair.name}#")}
    time.sleep(0.6)  # the replicas' stats reach the ingress every 0.2 s
    metrics = pair.metrics()
    prefix = "aieng_replica_kv_cache_num_blocks{replica="
    replicas = {k[len(prefix) : -1] for k in metrics if k.startswith(prefix)}
    assert len(replicas) == 2 and replicas <= actors, (replicas, actors)
    labelled = {
        r: {k: v for k, v in metrics.items() if k.endswith(f"{{replica={r}}}")} for r in replicas
    }
    for replica, series in labelled.items():
        name = f"{{replica={replica}}}"
        assert series[f"aieng_replica_kv_cache_num_blocks{name}"] == 64
        assert series[f"aieng_replica_num_requests_running{name}"] == 0
        assert series[f"aieng_replica_kv_cache_usage_perc{name}"] == 0
        assert series[f"aieng_replica_draining{name}"] == 0
        queries = series[f"aieng_replica_prefix_cache_queries_total{name}"]
        hits = series[f"aieng_replica_prefix_cache_hits_total{name}"]
        assert 0 <= hits <= queries
        rate = series[f"aieng_replica_prefix_cache_hit_rate{name}"]
        assert rate == pytest.approx(hits / queries if queries else 0.0)
        assert metrics[f"aieng_replica_model_info{{replica={replica},version=}}"] == 1
    for pooled in ("prefix_cache_hits_total", "prefix_cache_queries_total", "kv_cache_num_blocks"):
        assert metrics[f"aieng_{pooled}"] == metrics[f"aieng_replica_{pooled}"]
    assert metrics["aieng_replica_prefix_cache_hits_total"] > 0  # the repeats hit


def shared_prefix_workload(seed: int) -> list[list[int]]:
    """8 prefixes of 48 tokens, each in 8 requests with their own 4-token suffix, shuffled
    (in turn, round-robin over 2 replicas would send each prefix to one replica)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 300) for _ in range(48)] for _ in range(8)]
    prompts = [prefixes[i % 8] + [rng.randrange(10, 300) for _ in range(4)] for i in range(64)]
    rng.shuffle(prompts)
    return prompts


def prefix_hits(app: RayApp, seed: int) -> float:
    """Prompt tokens the replicas found in their prefix caches over the workload."""
    client = client_of(app.url)
    before = app.metrics()["aieng_prefix_cache_hits_total"]
    prompts = shared_prefix_workload(seed)

    def run(prompt: list[int]) -> str:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        return out.choices[0].finish_reason

    with ThreadPoolExecutor(2) as pool:
        assert set(pool.map(run, prompts)) <= {"length", "stop"}
    time.sleep(0.6)  # the replicas' stats reach the ingress every 0.2 s
    after = app.metrics()
    assert after["aieng_kv_cache_num_blocks"] == 2 * 64
    return after["aieng_prefix_cache_hits_total"] - before


def test_prefix_aware_routing_finds_more_cached_tokens_than_round_robin(model, pair):
    round_robin = RayApp("round-robin", model, ENGINE, num_replicas=2, routing="round_robin")
    try:
        rr_hits = prefix_hits(round_robin, seed=1)
    finally:
        round_robin.delete()
    prefix = prefix_hits(pair, seed=2)
    prompt_tokens = 64 * 52
    print(
        f"prefix-cache hits: prefix-aware {prefix / prompt_tokens:.0%}, round-robin "
        f"{rr_hits / prompt_tokens:.0%}"
    )
    assert prefix > 1.3 * rr_hits
    assert prefix > 0.6 * 56 * 48  # the first request of each prefix misses


def test_a_killed_replica_fails_only_its_streams_cleanly_and_comes_back(pair):
    client = client_of(pair.url)
    first_tokens = threading.Event()

    def stream(i: int) -> str:
        try:
            chunks = client.completions.create(
                model=MODEL_NAME,
                prompt=[10 + i, 20, 30, 40],
                max_tokens=40,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            tokens, reason = 0, None
            for chunk in chunks:
                first_tokens.set()
                tokens += 1 if chunk.choices and chunk.choices[0].text is not None else 0
                reason = chunk.choices[0].finish_reason if chunk.choices else reason
            return f"ok:{reason}"
        except openai.APIStatusError as error:
            return f"status:{error.status_code}"
        except openai.APIError as error:  # the error event of a stream that had started
            return f"event:{error.message}"

    with ThreadPoolExecutor(8) as pool:
        results = [pool.submit(stream, i) for i in range(8)]
        assert first_tokens.wait(30)
        victim = pair.replica_actors()[0]
        ray.kill(victim, no_restart=True)
        outcomes = [r.result(timeout=60) for r in results]
    # the victim's running streams (at most max_num_seqs) end with an error event; its waiting
    # requests are retried on the other replica and finish there, as do that one's own
    failed = [o for o in outcomes if o != "ok:length"]
    assert all("replica" in o and "retry the request" in o for o in failed), outcomes
    assert len(failed) <= ENGINE["max_num_seqs"], outcomes

    def replaced() -> bool:
        actors = pair.replica_actors()
        new = all(a._actor_id != victim._actor_id for a in actors)
        return new and len(actors) == 2 and pair.running_replicas() == 2

    assert pair.wait_for(replaced, timeout=60, step=0.5)
    # a new request is served, and nothing is left running or holding KV blocks
    answer = client.completions.create(model=MODEL_NAME, prompt="after", max_tokens=2)
    assert answer.choices[0].finish_reason == "length"

    def idle() -> bool:
        m = pair.metrics()
        return (
            m["aieng_num_requests_running"] == 0
            and m["aieng_num_requests_waiting"] == 0
            and m["aieng_kv_cache_usage_perc"] == 0
            and m["aieng_kv_cache_num_blocks"] > 0
        )

    assert pair.wait_for(idle, timeout=20, step=0.2), pair.metrics()


def test_a_replica_dying_mid_fan_out_ends_the_request_cleanly(pair):
    """A prompt list spread over both replicas, streamed and whole; one replica is killed once
    tokens flow: each request ends within bounded time, complete or with a clean error naming
    the lost replica (no hang), and the pool serves again after Ray replaces it."""
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [[10 + i, 20, 30, 40] for i in range(4)]
    body = dict(model=MODEL_NAME, prompt=prompts, max_tokens=60, temperature=0)
    started = threading.Event()

    def streamed() -> str:
        try:
            for _ in client.completions.create(
                **body, stream=True, extra_body={"ignore_eos": True}
            ):
                started.set()
            return "ok"
        except openai.APIError as error:
            return f"error:{error.message}"

    def whole() -> str:
        try:
            reply = client.completions.create(**body, extra_body={"ignore_eos": True})
            return "ok" if len(reply.choices) == 4 else f"choices:{len(reply.choices)}"
        except openai.APIStatusError as error:
            return f"status:{error.status_code}:{error.message}"

    before = {a._actor_id for a in pair.replica_actors()}
    with ThreadPoolExecutor(2) as pool:
        results = [pool.submit(streamed), pool.submit(whole)]
        assert started.wait(30)
        victim = pair.replica_actors()[0]
        ray.kill(victim, no_restart=True)
        outcomes = [r.result(timeout=90) for r in results]
    assert all(o == "ok" or "replica" in o for o in outcomes), outcomes

    def replaced() -> bool:
        actors = pair.replica_actors()
        return len(actors) == 2 and victim._actor_id not in {a._actor_id for a in actors}

    assert before and pair.wait_for(replaced, timeout=60, step=0.5)
    assert pair.wait_for(lambda: pair.running_replicas() == 2, timeout=60, step=0.5)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=2)
    assert [c.finish_reason for c in again.choices] == ["length"] * 3


def test_autoscaling_adds_a_replica_under_load_and_drains_it_after(model):
    app = RayApp(
        "scaling",
        model,
        dict(kv_cache_memory=1 << 20, block_size=4, max_num_seqs=8),
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        upscale_delay_s=0.5,
        downscale_delay_s=1.0,
        look_back_period_s=1.0,
    )
    client = client_of(app.url)
    streams = [4]  # load thread i sends streams while i < streams[0]
    stop = threading.Event()
    outcomes: list[str] = []

    def load(i: int) -> None:
        while not stop.is_set():
            if i >= streams[0]:
                time.sleep(0.05)
                continue
            try:
                chunks = client.completions.create(
                    model=MODEL_NAME,
                    prompt=[7, 8, 9],
                    max_tokens=48,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
                outcomes.append(f"ok:{reasons[-1]}")
            except openai.APIError as error:
                outcomes.append(f"error:{error.message}")

    pool = ThreadPoolExecutor(4)
    try:
        assert app.running_replicas() == 1
        for i in range(4):  # 4 streams at a time: 2 per replica wanted
            pool.submit(load, i)
        assert app.wait_for(lambda: app.running_replicas() == 2, timeout=60, step=0.2)
        streams[0] = 1  # 1 stream at a time: 1 replica wanted, the other drains
        assert app.wait_for(lambda: app.running_replicas() == 1, timeout=60, step=0.2)
    finally:
        stop.set()
        pool.shutdown()
        app.delete()
    assert outcomes and set(outcomes) == {"ok:length"}, outcomes


def test_the_kuberay_manifest_builds_the_app_it_names(model):
    """deploy/ray/rayservice.yaml's arguments, through `serve run`'s application builder."""
    import yaml

    from aieng.ray import app

    manifest = Path(__file__).resolve().parents[1] / "deploy/ray/rayservice.yaml"
    serve_config = yaml.safe_load(yaml.safe_load(manifest.read_text())["spec"]["serveConfigV2"])
    [application] = serve_config["applications"]
    assert application["import_path"] == "aieng.ray:app"
    args = {**application["args"], "model": str(model), "enable_prefix_caching": "false"}
    built = app(args)
    replicas = built._bound_deployment.init_args[0]._bound_deployment
    assert replicas._deployment_config.autoscaling_config.max_replicas == 4
    assert replicas.ray_actor_options["num_gpus"] == 1
    engine = replicas.init_args[0]
    assert engine.max_num_seqs == 64 and engine.enable_prefix_caching is False
    with pytest.raises(SystemExit):  # argparse names the bad value on stderr
        app({**args, "routing": "random"})


def test_prefix_hashes_chain_the_leading_full_blocks():
    from aieng.ray.router import prefix_hashes

    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4, max_blocks=4)
    b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 9, 9, 9], block_size=4, max_blocks=4)
    assert len(a) == 2 and len(b) == 3  # the partial last block is not cached, not hashed
    assert a[0] == b[0] and a[1] != b[1]  # a block's hash names its whole prefix
    assert prefix_hashes([4, 3, 2, 1, 5, 6, 7, 8], 4, 4)[1] != a[1]
    assert len(prefix_hashes(list(range(100)), block_size=4, max_blocks=3)) == 3


def test_pooled_stats_weigh_kv_usage_by_blocks():
    from aieng.engine.engine_client import EngineStats
    from aieng.ray.pool_client import pooled_stats

    small = EngineStats(num_running=1, kv_cache_usage=1.0, num_blocks=10, prefix_cache_hits=4)
    large = EngineStats(num_running=2, kv_cache_usage=0.0, num_blocks=30, prefix_cache_hits=6)
    pooled = pooled_stats([small, large])
    assert (pooled.num_running, pooled.num_blocks, pooled.prefix_cache_hits) == (3, 40, 10)
    assert pooled.kv_cache_usage == pytest.approx(0.25) and pooled.heartbeat > 0
    assert pooled_stats([]).heartbeat == 0  # no replica reports: /health says dead


def test_ray_options_refuse_what_cannot_run():
    from aieng.ray import RayServeOptions

    with pytest.raises(ValueError, match="min_replicas and max_replicas"):
        RayServeOptions(min_replicas=1)
    with pytest.raises(ValueError, match="routing"):
        RayServeOptions(routing="random")
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        RayServeOptions(min_replicas=3, max_replicas=2)
    assert "autoscaling_config" in RayServeOptions(
        min_replicas=0, max_replicas=2
    ).replica_deployment(16, "board")


# ---------------------------------------------------------------------- rolling upgrade

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Versions 1.0.0 and 2.0.0 of one model (other weights, one tokenizer), and two that may
    not replace 1.0.0: another tokenizer, an output field removed."""
    root = tmp_path_factory.mktemp("versions")
    first = version_folder(root, "1.0.0", seed=0)
    second = version_folder(root, "2.0.0", seed=1, tokenizer_from=first)
    other_tokenizer = version_folder(root, "2.1.0", seed=1, tokenizer_from=first)
    text = (other_tokenizer / "tokenizer.json").read_text()
    (other_tokenizer / "tokenizer.json").write_text(text.replace('"unk_token"', '"unk_token" ', 1))
    breaking = version_folder(root, "3.0.0", seed=1, tokenizer_from=first)
    manifest = json.loads((breaking / "aieng-model.json").read_text())
    manifest["output_schema"] = {"type": "object", "properties": {}}
    (breaking / "aieng-model.json").write_text(json.dumps(manifest))
    return first, second, other_tokenizer, breaking


def test_a_rolling_upgrade_moves_every_replica_to_the_new_version_with_no_failed_request(
    versions,
):
    first, second, other_tokenizer, breaking = versions
    body = {"model": MODEL_NAME, "prompt": [5, 17, 42, 9, 77, 31], "max_tokens": 8}
    body |= {"temperature": 0, "ignore_eos": True}
    with ThreadServer(second, engine=ENGINE) as plain:
        new_answer = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()
    app = RayApp("upgrade", first, ENGINE, server={"admin_key": "admin-secret"}, num_replicas=2)
    outcomes: list[tuple[float, str]] = []  # (when the request was sent, its text or error)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                answer = httpx.post(f"{app.url}/v1/completions", json=body, timeout=60)
                text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else None
                outcomes.append(
                    (sent, text if text is not None else f"status {answer.status_code}")
                )
            except httpx.HTTPError as error:
                outcomes.append((sent, f"error {error!r}"))
            time.sleep(0.05)

    def upgrade(model, key=ADMIN) -> httpx.Response:
        return httpx.post(f"{app.url}/admin/upgrade", json={"model": str(model)}, headers=key)

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(2)]
    try:
        # the gate: the admin key, one tokenizer, schemas the old clients can read
        assert upgrade(second, {"Authorization": "Bearer wrong"}).status_code == 401
        refused = upgrade(other_tokenizer)
        assert (
            refused.status_code == 409 and refused.json()["error"]["code"] == "tokenizer_mismatch"
        )
        refused = upgrade(breaking)
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "incompatible_schema"
        assert "output" in refused.json()["error"]["message"]
        for thread in threads:
            thread.start()
        assert app.wait_for(lambda: len(outcomes) >= 4, timeout=30)
        started = upgrade(second)
        assert started.status_code == 202, started.text
        assert started.json()["from_version"] == "1.0.0"
        assert started.json()["to_version"] == "2.0.0"

        def status() -> dict:
            return httpx.get(f"{app.url}/admin/upgrade", headers=ADMIN, timeout=10).json()

        assert app.wait_for(lambda: status()["state"] != "running", timeout=120, step=0.2)
        done_at = time.monotonic()
        final = status()
        assert final["state"] == "done", final
        assert len(final["replicas_done"]) == 2
        again = upgrade(second)  # the ingress knows what its replicas serve now
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_serving"
        count = len(outcomes)
        assert app.wait_for(lambda: len(outcomes) >= count + 6, timeout=30)
        time.sleep(0.6)  # the replicas' reports reach the ingress every 0.2 s
        metrics = app.metrics()
    finally:
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=60)
        app.delete()
    texts = {text for _, text in outcomes}
    new_text = new_answer["choices"][0]["text"]
    old_text = outcomes[0][1]
    assert old_text != new_text  # other weights: the versions answer differently
    assert texts <= {old_text, new_text}, texts  # no failed request, no third answer
    after = [text for sent, text in outcomes if sent > done_at]
    assert after and set(after) == {new_text}
    assert metrics["aieng_replica_model_info"] == 2
    assert sum(v for k, v in metrics.items() if "version=2.0.0" in k) == 2
