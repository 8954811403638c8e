"""One request's failure ends that request only: n > 1 requests whose first sequence ends at
once, values that would break the sampler, a row whose sampling raises, and logprobs of
forbidden tokens (-inf) in JSON (issue 22, items 1-3)."""

import json
import math

import httpx
import pytest
from server_fixtures import ENGINE_DEFAULTS, MODEL_NAME, VOCAB, ThreadServer, make_model_dir

from aieng import LLM, SamplingParams
from aieng.errors import InvalidArgumentError
from aieng.server.logprob_json import LOGPROB_FLOOR

FIRST_TOKEN_ENDS = [
    SamplingParams(max_tokens=1, n=2),
    SamplingParams(max_tokens=0, n=2),
    SamplingParams(max_tokens=1, n=4, temperature=0.9, seed=3),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def llm(model):
    engine = LLM(str(model), **ENGINE_DEFAULTS)
    yield engine
    engine.engine.check_pool_whole()


@pytest.fixture(scope="module")
def server(model):
    with ThreadServer(model) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())
        assert s.ctx.engine.alive


def greedy(max_tokens=4, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------- 1: n > 1, first sequence ends


@pytest.mark.parametrize("params", FIRST_TOKEN_ENDS, ids=["max1", "max0", "n4"])
def test_n_siblings_join_after_the_first_sequence_finished_on_its_first_token(llm, params):
    outs = llm.generate(["The", "The sea", "And"], params, use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == params.n
        for choice in out.outputs:
            assert choice.finish_reason == "length"
            assert len(choice.token_ids) == params.max_tokens
    [after] = llm.generate(["The"], greedy(), use_tqdm=False)  # the engine still serves
    assert len(after.outputs[0].token_ids) == 4
    llm.engine.check_pool_whole()


def test_n_siblings_with_a_stop_string_that_ends_the_first_sequence(llm):
    [probe] = llm.generate(["The"], greedy(1), use_tqdm=False)
    stop = probe.outputs[0].text.strip() or probe.outputs[0].text  # the first text it writes
    params = SamplingParams(temperature=0, max_tokens=5, n=3, stop=[stop])
    [out] = llm.generate(["The"], params, use_tqdm=False)
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
    llm.engine.check_pool_whole()


@pytest.mark.parametrize(
    ("route", "max_tokens"), [("completions", 0), ("completions", 1), ("chat", 1)]
)
def test_server_answers_n2_requests_that_end_on_their_first_token(server, route, max_tokens):
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "n": 2}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "And God said"}]
    else:
        body["prompt"] = "And God said"
    response = httpx.post(f"{server.url}/v1/{route.replace('chat', 'chat/completions')}", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------- 2: values that broke the step


def test_top_k_past_int32_is_refused_and_past_the_vocabulary_means_all(llm):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    wide = SamplingParams(top_k=2**31 - 1, temperature=0.8, max_tokens=3, ignore_eos=True)
    outs = llm.generate(["The", "The sea"], [wide, greedy(3)], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, VOCAB + 1, 2**31])
def test_logprobs_past_max_logprobs_are_refused_at_the_door(llm, field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        llm.generate(["The", "The sea"], [greedy(), greedy(**{field: value})], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    [ok] = llm.generate(["The"], greedy(**{field: 20}), use_tqdm=False)
    assert ok.outputs[0].finish_reason == "length"


def test_max_logprobs_minus_one_allows_the_whole_vocabulary(model):
    llm = LLM(str(model), max_logprobs=-1, **ENGINE_DEFAULTS)
    [out] = llm.generate(["The sea"], greedy(2, logprobs=VOCAB, prompt_logprobs=VOCAB))
    assert all(len(top) == VOCAB for top in out.outputs[0].logprobs)
    assert all(len(top) == VOCAB for top in out.prompt_logprobs[1:])
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        llm.generate(["The"], greedy(logprobs=VOCAB + 1))


def test_server_refuses_logprobs_past_the_limit_with_400(server):
    body = {"prompt": "The", "max_tokens": 2, "logprobs": 21}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logprobs"


# ---------------------------------------------------------------- per-row isolation


def test_a_row_whose_sampling_state_fails_ends_alone(llm, monkeypatch):
    table = llm.engine.runner.sampling
    real = table.add_request

    def failing(slot, params, *args, **kw):
        if params.seed == 666:
            raise OverflowError("injected: this row's sampling state cannot be built")
        return real(slot, params, *args, **kw)

    monkeypatch.setattr(table, "add_request", failing)
    params = [greedy(), SamplingParams(seed=666, max_tokens=4), greedy()]
    outs = llm.generate(["The", "The sea", "And"], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "injected" in outs[1].outputs[0].stop_reason
    monkeypatch.undo()
    llm.engine.check_pool_whole()


def test_a_row_whose_sampling_raises_ends_alone_and_the_others_match_their_solo_run(
    llm, monkeypatch
):
    prompts = ["The", "The sea", "And", "In"]
    # Rows through the sampler (asked-for logprobs): a plain greedy row only takes its argmax.
    params = greedy(5, logprobs=1)
    solo = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sampler = llm.engine.runner.sampler
    real = type(sampler).__call__

    def failing(self, logits, batch):
        if any(s in poisoned for s in batch.slots.tolist()):
            raise RuntimeError("injected: this row's sampling raises")
        return real(self, logits, batch)

    poisoned: set[int] = set()
    engine = llm.engine
    original_add = engine._add_sequence

    def mark(request, seq, priority):  # poisons the slot the third prompt takes
        original_add(request, seq, priority)
        if request.prompt == "And":
            poisoned.add(seq.slot)

    monkeypatch.setattr(engine, "_add_sequence", mark)
    monkeypatch.setattr(type(sampler), "__call__", failing)
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "length", "error", "length"]
    assert "injected" in outs[2].outputs[0].stop_reason
    for i in (0, 1, 3):
        assert outs[i].outputs[0].token_ids == solo[i]
    llm.engine.check_pool_whole()


# ---------------------------------------------------------------- 3: -inf logprobs in JSON


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def all_numbers(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from all_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from all_numbers(v)


CONSTRAINED = [
    ("completions", {"prompt": "The", "max_tokens": 3, "logprobs": 5, "allowed_token_ids": [5, 6]}),
    (
        "completions",
        {
            "prompt": "Yea or nay?",
            "max_tokens": 5,
            "logprobs": 2,
            "structured_outputs": {"choice": ["yea", "nay"]},
        },
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "Yea or nay?"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 5,
            "structured_outputs": {"choice": ["yea", "nay"]},
        },
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "body"), CONSTRAINED, ids=["allowed", "choice", "chat"])
def test_logprobs_of_forbidden_tokens_are_finite_json(server, route, body, stream):
    body = {**body, "stream": stream}
    with httpx.stream("POST", f"{server.url}/v1/{route}", json=body, timeout=60) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [strict_json(e) for e in events[:-1]]
    else:
        payloads = [strict_json(text)]
    numbers = [n for p in payloads for c in p["choices"] for n in all_numbers(c.get("logprobs"))]
    assert numbers and all(math.isfinite(n) for n in numbers)
    assert LOGPROB_FLOOR in numbers  # the forbidden tokens are there, at the floor


def test_the_server_allows_what_the_engines_max_logprobs_allows(model):
    """One limit: a server whose engine allows 30 logprobs serves 25 and refuses 31 (the
    engine's SamplingParams.verify), on completions and chat alike."""
    with ThreadServer(model, engine={"max_logprobs": 30}) as s:
        body = {"prompt": "The", "max_tokens": 1, "logprobs": 25}
        ok = httpx.post(f"{s.url}/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ok = httpx.post(
            f"{s.url}/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 25}
        )
        assert ok.status_code == 200, ok.text
        [entry] = ok.json()["choices"][0]["logprobs"]["content"]
        assert len(entry["top_logprobs"]) == 25
        refused = httpx.post(
            f"{s.url}/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 31}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "top_logprobs"
