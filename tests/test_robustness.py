"""The engine never dies from one request: what a hostile client sends or a broken checkpoint
holds is refused at the door with an error naming it, a failed step ends only that step's
requests, and a dead engine loop is reported by /health and /ready alike and ends the server
with a non-zero status so that its supervisor restarts it."""

import json
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_fixtures import MODEL_NAME, VOCAB, ThreadServer, free_port, make_model_dir, wait_ready

from aieng import LLM, SamplingParams
from aieng.config.model_config import ModelConfig
from aieng.engine.llm_engine import LLMEngine
from aieng.errors import InvalidArgumentError, invalid_field

OUT_OF_VOCAB = 5000  # > VOCAB
OK_BODY = {"prompt": "The", "max_tokens": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def llm(model):
    engine = LLM(str(model), kv_cache_memory=1 << 22, block_size=4)
    yield engine
    engine.engine.check_pool_whole()


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def assert_serves(url: str) -> None:
    ok = httpx.post(f"{url}/v1/completions", json=OK_BODY, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- token ids outside the vocabulary


def test_llm_refuses_stop_token_ids_outside_the_vocabulary_and_keeps_working(llm):
    bad = SamplingParams(stop_token_ids=[OUT_OF_VOCAB], min_tokens=1, max_tokens=4)
    with pytest.raises((InvalidArgumentError, ValueError), match="stop_token_ids"):
        llm.generate(["The"], bad, use_tqdm=False)
    [out] = llm.generate(["The"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    llm.engine.check_pool_whole()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_server_refuses_stop_token_ids_outside_the_vocabulary_with_400(server, endpoint):
    sampling = {"stop_token_ids": [OUT_OF_VOCAB], "min_tokens": 1, "max_tokens": 4}
    if endpoint == "chat":
        url = f"{server.url}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], **sampling}
    else:
        url, body = f"{server.url}/v1/completions", {"prompt": "The", **sampling}
    assert_error(httpx.post(url, json=body), 400, "stop_token_ids", str(OUT_OF_VOCAB))
    assert_serves(server.url)
    assert server.ctx.engine.alive


def test_an_invalid_argument_from_the_engine_thread_is_a_400_naming_the_field(server, monkeypatch):
    engine = server.ctx.engine.engine
    message = f"stop_token_ids: token id {OUT_OF_VOCAB} is outside the vocabulary [0, {VOCAB})"

    def add_request(*_args, **_kwargs):
        raise invalid_field("stop_token_ids", message)  # the field travels with the error

    monkeypatch.setattr(engine, "add_request", add_request)
    for stream in (False, True):
        body = {**OK_BODY, "stream": stream}
        response = httpx.post(f"{server.url}/v1/completions", json=body)
        assert_error(response, 400, "stop_token_ids", str(OUT_OF_VOCAB))
    monkeypatch.undo()
    assert_serves(server.url)
    assert server.ctx.engine.alive


@pytest.mark.parametrize(
    ("file", "field", "value"),
    [
        ("config.json", "eos_token_id", VOCAB),
        ("config.json", "eos_token_id", [2, OUT_OF_VOCAB]),
        ("config.json", "bos_token_id", OUT_OF_VOCAB),
        ("generation_config.json", "eos_token_id", [OUT_OF_VOCAB]),
        ("generation_config.json", "bos_token_id", OUT_OF_VOCAB),
    ],
)
def test_a_checkpoint_with_special_ids_outside_the_vocabulary_is_refused_at_load(
    model, tmp_path, file, field, value
):
    folder = tmp_path / "broken"
    shutil.copytree(model, folder)
    path = folder / file
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, field: value}))
    for load in (ModelConfig.from_pretrained, lambda f: LLM(str(f), kv_cache_memory=1 << 22)):
        with pytest.raises(ValueError) as refused:
            load(folder)
        message = str(refused.value)
        for word in (str(path), field, f"vocab_size {VOCAB}"):
            assert word in message


# ---------------------------------------------------------------- numbers float32 cannot hold


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e39),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e-39),  # its inverse overflows
        ("repetition_penalty", 1e39),
        ("top_p", 1e-50),
    ],
)
def test_sampling_values_that_do_not_survive_float32_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field} .*float32"):
        SamplingParams(**{field: value})


def test_sampling_values_at_the_float32_limits_are_accepted():
    SamplingParams(temperature=3e38, repetition_penalty=3e38)
    SamplingParams(repetition_penalty=3e-39, top_p=1e-30)


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 1e39), ("repetition_penalty", 1e-300)]
)
def test_server_refuses_sampling_values_float32_cannot_hold_with_400(server, field, value):
    response = httpx.post(f"{server.url}/v1/completions", json={**OK_BODY, field: value})
    assert_error(response, 400, field)
    assert_serves(server.url)


# ---------------------------------------------------------------- a failed step


def test_a_failed_step_ends_its_requests_with_error_and_the_engine_keeps_serving(llm, monkeypatch):
    runner = llm.engine.runner
    execute = runner.execute
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_once)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = llm.generate(["The", "The quick brown fox"], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "error"]
    llm.engine.check_pool_whole()
    [out] = llm.generate(["The"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    llm.engine.check_pool_whole()


def _fail_the_next_step(monkeypatch, cause: str) -> None:
    """The engine's behaviour for a failed step: its requests finish with "error", the engine
    frees them and goes on."""
    step = LLMEngine.step
    failed = []

    def step_that_fails_once(engine):
        if failed:
            return step(engine)
        failed.append(1)
        outputs = [engine.abort(request_id) for request_id in list(engine.requests)]
        for out in outputs:
            for completion in out.outputs:
                completion.finish_reason, completion.stop_reason = "error", cause
        return outputs

    monkeypatch.setattr(LLMEngine, "step", step_that_fails_once)


def test_a_request_whose_step_failed_gets_500_naming_it_and_the_server_keeps_serving(
    server, monkeypatch
):
    _fail_the_next_step(monkeypatch, "RuntimeError: boom")
    headers = {"X-Request-Id": "doomed-1"}
    response = httpx.post(f"{server.url}/v1/completions", json=OK_BODY, headers=headers)
    error = assert_error(response, 500, None, "doomed-1", "RuntimeError: boom")
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    monkeypatch.undo()
    assert_serves(server.url)
    assert server.ctx.engine.alive


def test_a_stream_whose_step_failed_ends_with_an_error_event(server, monkeypatch):
    body = {**OK_BODY, "stream": True, "max_tokens": 1000, "ignore_eos": True}
    headers = {"X-Request-Id": "doomed-2"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line)
        first = next(lines)  # the status line went out with the first chunk
        _fail_the_next_step(monkeypatch, "RuntimeError: boom")
        rest = list(lines)
    monkeypatch.undo()
    assert "choices" in json.loads(first.removeprefix("data: "))
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "doomed-2" in error["message"] and "boom" in error["message"]

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="The",
        max_tokens=1000,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    next(iter(stream))
    _fail_the_next_step(monkeypatch, "RuntimeError: boom")
    with pytest.raises(openai.APIError, match="boom"):
        for _ in stream:
            pass
    monkeypatch.undo()
    assert_serves(server.url)


# ---------------------------------------------------------------- a dead engine loop


def _assert_dead(url: str, *words: str) -> None:
    for route in ("/health", "/ready"):
        response = httpx.get(f"{url}{route}")
        assert response.status_code == 503 and response.json()["status"] == "dead", route
        for word in words:
            assert word in response.json()["reason"], route
    start = time.monotonic()
    error = assert_error(httpx.post(f"{url}/v1/completions", json=OK_BODY), 503, None, *words)
    assert error["code"] == "engine_dead" and time.monotonic() - start < 5


@pytest.mark.parametrize("how", ["step raises", "dead_reason"])
def test_a_dead_engine_loop_fails_every_request_and_both_probes_say_so(model, monkeypatch, how):
    step = LLMEngine.step

    def fatal_step(engine):
        if how == "step raises":
            raise RuntimeError("device lost")
        outputs = step(engine)
        engine.dead_reason = "device lost"
        return outputs

    with ThreadServer(model) as s:
        assert httpx.get(f"{s.url}/ready").status_code == 200
        monkeypatch.setattr(LLMEngine, "step", fatal_step)
        body = {**OK_BODY, "max_tokens": 50, "ignore_eos": True}
        in_flight = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert_error(in_flight, 503, None, "device lost")
        _assert_dead(s.url, "device lost")
        assert s.ctx.engine_failed


def test_serve_exits_non_zero_when_the_engine_loop_dies(model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = (
        "import sys\n"
        "from aieng.engine.llm_engine import LLMEngine\n"
        "def fatal_step(engine): raise RuntimeError('device lost')\n"
        "LLMEngine.step = fatal_step\n"
        "from aieng.server.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = [str(model), "--port", str(port), "--kv-cache-memory", str(1 << 22)]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=log, stderr=log)
    try:
        wait_ready(url, proc=proc)
        response = httpx.post(f"{url}/v1/completions", json=OK_BODY, timeout=30)
        assert response.status_code == 503
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert "device lost" in (tmp_path / "server.log").read_text()
