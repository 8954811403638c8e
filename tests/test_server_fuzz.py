"""Schema fuzzing of the server's own OpenAPI document (schemathesis, valid and invalid
inputs): no request gets a 5xx, every error body is well formed, the pool stays whole."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_fixtures import ThreadServer, make_model_dir

MAX_EXAMPLES = 40  # per operation and generation mode: bounded so the suite stays fast


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("model"))
    # A short context keeps every generated request short; a small queue refuses big batches.
    with ThreadServer(model, engine={"max_model_len": 64}, max_queue_requests=8) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())
        assert s.ctx.engine.alive


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


WITH_BODY = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
OPERATIONS = [("POST", path, mode) for path in WITH_BODY for mode in GenerationMode] + [
    ("GET", path, GenerationMode.POSITIVE)
    for path in ("/v1/models", "/health", "/ready", "/metrics")
]  # a route without parameters has no invalid input


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_no_request_breaks_the_server(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case):
        response = case.call(timeout=60)
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            assert isinstance(body["error"]["message"], str) and body["error"]["message"]

    check()


def test_the_document_names_the_routes(fuzz_server):
    import httpx

    paths = httpx.get(f"{fuzz_server.url}/openapi.json").json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/tokenize",
        "/detokenize",
    ):
        assert path in paths
    assert "422" not in paths["/v1/completions"]["post"]["responses"]
    assert "400" in paths["/v1/completions"]["post"]["responses"]
