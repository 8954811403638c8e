"""Schema fuzzing of the server's own OpenAPI document, bounded for the suite (api_fuzz holds
the checks; benches/fuzz_api.py runs them for minutes): every operation, valid and invalid
inputs and steered generation requests, streamed or not; no 5xx but a deliberate 503, responses
conform to the document, strict JSON everywhere; afterwards the engine is alive, its pool whole.
The admin API (hot reload) is not in the document, so it is not fuzzed."""

import pytest
import schemathesis
from api_fuzz import STATS, check_stream, fuzz_operation, operations
from schemathesis import GenerationMode
from server_fixtures import ThreadServer, make_model_dir

MAX_EXAMPLES = 50  # per operation and generation mode: bounded so the suite stays fast
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
WITH_INPUT = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]
WITHOUT_BODY = ["/v1/models", "/v1/models/{model_id}", "/version", "/health", "/ready", "/metrics"]
OPERATIONS = [(m, p, mode) for m, p in WITH_INPUT for mode in (POSITIVE, NEGATIVE)]
OPERATIONS += [("GET", p, POSITIVE) for p in WITHOUT_BODY]


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


def test_every_operation_of_the_document_is_fuzzed(api_schema):
    assert sorted(operations(api_schema)) == sorted(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_no_request_breaks_the_server(api_schema, method, path, mode):
    before = sum(STATS.cases.values())
    fuzz_operation(api_schema, method, path, mode, max_examples=MAX_EXAMPLES, derandomize=True)
    assert sum(STATS.cases.values()) > before


def test_the_fuzzer_read_streams(api_schema):
    """Steered generation requests reached the engine, some of them streamed."""
    print(STATS.table())
    assert STATS.statuses[200] > 0 and STATS.streams > 0, STATS


def test_stream_events_must_be_strict_json():
    check_stream('data: {"a": 1}\n\ndata: [DONE]\n\n')
    with pytest.raises(ValueError, match="NaN"):
        check_stream('data: {"logprob": NaN}\n\ndata: [DONE]\n\n')
    with pytest.raises(ValueError, match="-Infinity"):
        check_stream('data: {"logprob": -Infinity}\n\ndata: [DONE]\n\n')
    with pytest.raises(AssertionError, match="DONE"):
        check_stream('data: {"a": 1}\n\n')
