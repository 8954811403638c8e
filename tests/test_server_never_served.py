"""Requests that can never be served are refused at the door with a 400 naming the field (the
library raises a ValueError naming it), never a 500; every numeric option is bounded; no
response shows the server's folders."""

import json

import httpx
import pytest
from server_fixtures import ThreadServer, make_model_dir

from aieng.config.speculative import SpeculativeConfig
from aieng.errors import InvalidArgumentError, error_field
from aieng.sampling import SamplingParams

EOS = 2  # the tiny model's


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model, engine={"max_model_len": 128}) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())
        assert s.ctx.engine.alive


# ---------------------------------------------------------------------------- the library


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 2**63),
        ("min_tokens", 2**31),
        ("n", 2**40),
        ("seed", 2**70),
        ("seed", -(2**63) - 1),
    ],
)
def test_integers_too_large_are_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(
            **{field: value, **({"max_tokens": 2**31 - 1} if field == "min_tokens" else {})}
        )


def test_the_largest_values_are_accepted():
    SamplingParams(max_tokens=2**31 - 1, min_tokens=2**31 - 1, seed=2**63 - 1, n=1024)


def test_only_ending_tokens_allowed_before_min_tokens_is_refused():
    params = SamplingParams(
        min_tokens=15, max_tokens=20, allowed_token_ids=[0, 5], stop_token_ids=[5]
    )
    with pytest.raises(InvalidArgumentError, match="min_tokens") as caught:
        params.check_satisfiable(eos_token_ids=[0])
    assert error_field(caught.value) == "min_tokens"
    assert "allowed_token_ids" in str(caught.value) and "stop_token_ids" in str(caught.value)
    params.check_satisfiable(eos_token_ids=[1])  # token 0 may be drawn: fine
    SamplingParams(min_tokens=2, allowed_token_ids=[0], ignore_eos=True).check_satisfiable([0])
    SamplingParams(allowed_token_ids=[0]).check_satisfiable([0])  # it ends at once: fine
    with pytest.raises(InvalidArgumentError, match="bad word") as caught:
        SamplingParams(allowed_token_ids=[3]).check_satisfiable([0], banned_ids=[3])
    assert error_field(caught.value) == "allowed_token_ids"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 10**9},
            "prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2**62},
            "disable_by_batch_size",
        ),
        ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens"),
    ],
)
def test_speculative_options_are_bounded(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(config)


# ---------------------------------------------------------------------------- the server


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _chat(body: dict) -> dict:
    return {"messages": [{"role": "user", "content": "0"}], **body}


@pytest.mark.parametrize(
    "body",
    [
        {"min_tokens": 15, "allowed_token_ids": [EOS]},
        {"min_tokens": 2, "allowed_token_ids": [5], "stop_token_ids": [5]},
        {"min_tokens": 2, "allowed_token_ids": [5, EOS], "stop_token_ids": [5], "n": 3},
        {"min_tokens": 2, "allowed_token_ids": [5], "stop_token_ids": [5], "stream": True},
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_that_can_never_draw_a_token_is_a_400_at_the_door(server, path, body):
    before = server.metrics().get("aieng_request_success_total", 0.0)
    request = {"max_tokens": 20, **body}
    request = _chat(request) if "chat" in path else {"prompt": "0", **request}
    response = _post(server, path, request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens" and "allowed_token_ids" in error["message"]
    assert server.ctx.admission.num_in_flight == 0  # never admitted
    assert server.metrics().get("aieng_request_success_total", 0.0) == before


def _one_token_word(server) -> tuple[int, str]:
    """A token whose text alone and after a space are each that one token (a one-token bad
    word)."""

    def find(engine):
        tokenizer = engine.tokenizer
        for token in range(3, engine.vocab_size):
            word = tokenizer.decode([token], False).strip()
            if not word.isalpha():
                continue
            alone = tokenizer.encode(word, False)
            spaced = tokenizer.encode(" " + word, False)
            if alone == spaced == [token] or (alone == [token] and len(spaced) == 1):
                return token, word, spaced[0]
        raise AssertionError("no one-token word in the vocabulary")

    token, word, spaced = server.in_engine(find)
    return sorted({token, spaced}), word


def test_allowed_tokens_that_are_all_bad_words_are_a_400(server):
    allowed, word = _one_token_word(server)
    response = _post(
        server,
        "/v1/completions",
        {"prompt": "0", "max_tokens": 3, "allowed_token_ids": allowed, "bad_words": [word]},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "allowed_token_ids"


def test_no_valid_token_at_run_time_is_a_400_of_its_own_code(server):
    """A grammar that needs "ab", and allowed_token_ids with "a" but without "b": the first
    step passes the door's check (its mask allows "a"); the second is known only when the masks
    meet, in the step; the answer is a 4xx with its own code, not a 500."""
    [a_id], b_ids = server.in_engine(
        lambda engine: [engine.tokenizer.encode(t, False) for t in ("a", "b")]
    )
    allowed = [a_id, *[t for t in range(3, 40) if t not in (a_id, *b_ids)][:2]]
    body = {
        "prompt": "0",
        "max_tokens": 3,
        "allowed_token_ids": allowed,
        "structured_outputs": {"regex": "ab"},
    }
    for stream in (False, True):
        response = _post(server, "/v1/completions", {**body, "stream": stream})
        if not stream:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
        else:
            assert response.status_code in (200, 400), response.text
            events = [
                json.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")
            ]
            error = (response.json() if response.status_code == 400 else events[-1])["error"]
        assert error["code"] == "no_valid_token", error
    assert server.ctx.engine.alive


# ---------------------------------------------------------------------------- no paths


def test_models_show_names_not_folders(server, model):
    for path in ("/v1/models", "/v1/models/tiny-llama", f"/v1/models/{model}"):
        response = httpx.get(f"{server.url}{path}", timeout=10)
        assert response.status_code == 200, response.text
        assert str(model) not in response.text and str(model.parent) not in response.text
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert listed["id"] == listed["root"] == "tiny-llama"


def test_more_inputs_than_the_queue_holds_is_a_400_naming_input(server):
    """docs/embedding.md: each input is a queued engine request, so at most
    --max-queue-requests (256 by default) inputs fit one request."""
    limit = server.ctx.config.max_queue_requests
    response = _post(server, "/v1/embeddings", {"input": [[5, 6]] * (limit + 1), "pooling": "mean"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and error["code"] == "exceeds_queue_limits"
    assert str(limit) in error["message"]
    prompts = {"prompt": [[5, 6]] * (limit + 1), "max_tokens": 1}
    assert _post(server, "/v1/completions", prompts).json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------------------- the document


def test_the_document_states_the_served_models_bounds(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    schemas, paths = doc["components"]["schemas"], doc["paths"]
    vocab = server.ctx.engine.model_info.vocab_size
    token = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token["exclusiveMaximum"] == vocab and token["minimum"] == 0
    assert "pooling" in schemas["EmbeddingRequest"]["required"]  # the tiny model declares none
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
    assert "422" not in json.dumps(paths)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/detokenize", {"tokens": [3, 4.0]}, 200),
        ("/v1/completions", {"prompt": [3, 4], "n": 1.0, "max_tokens": 2.0}, 200),
        ("/v1/completions", {"prompt": "x", "n": 1.5}, 400),
        ("/tokenize", {"messages": []}, 400),
        ("/tokenize", {"prompt": None, "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": None}]}, 400),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "top_p": 1.401298464324817e-45}, 200),
        ("/v1/completions", {"prompt": "x", "top_p": 5e-324}, 400),
    ],
)
def test_the_server_accepts_what_the_document_allows_and_no_more(server, path, body, status):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
