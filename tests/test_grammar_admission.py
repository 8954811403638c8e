"""Grammars are compiled and checked before admission (issue 22, items 4, 5 and 7): a grammar
past the parser's limits or one that matches nothing is refused when the request is added
(InvalidArgumentError in the library, a 400 naming the field in the server), never an error
finish in the middle of a run; compiling runs in a bounded pool of its own with a time budget;
the boolean schemas `true` and `false` are schemas.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import httpx
import pytest
from server_fixtures import MODEL_NAME, ThreadServer

from aieng import LLM, InvalidArgumentError, SamplingParams, StructuredOutputsParams
from aieng.config.default_model import default_model_path
from aieng.server.errors import ApiError
from aieng.server.grammar_pool import GrammarPool


def words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {p: {"type": "integer"} for p in words(n)}}


def alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"{w}"' for w in words(n))


# (constraint, what the message must say); every one used to be admitted and then fail the
# request mid-run with "the model produced no valid token" or "Current row has N items".
REFUSED = {
    "choice_20000": ({"choice": words(20_000)}, "choice: 20000 strings is too many"),
    "choice_100000": ({"choice": words(100_000)}, "choice: 100000 strings is too many"),
    "json_10000_optional": (
        {"json": optional_properties(10_000)},
        "json: an object with 10000 optional properties",
    ),
    "json_499_optional": ({"json": optional_properties(499)}, "json: too many alternatives"),
    "lark_50000": (
        {"grammar": alternatives(50_000)},
        f"grammar: {len(alternatives(50_000))} bytes is too long: at most 262144",
    ),
    "lark_2000": ({"grammar": alternatives(2000)}, "grammar: too many alternatives at one point"),
    "ref_self": ({"json": {"$ref": "#"}}, "json: matches nothing"),
    "ref_loop": (
        {
            "json": {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            }
        },
        "json: matches nothing",
    ),
    "regex_empty": ({"regex": "[^\\s\\S]"}, "regex: matches nothing"),
    "lark_no_base_case": ({"grammar": 'start: x\nx: x "a"'}, "grammar: matches nothing"),
    "lark_dead_branch": (
        {"grammar": 'start: "a" | "b" loop\nloop: "c" loop'},
        'the rule "loop" can never be completed',
    ),
    "json_false": ({"json": False}, "json: the schema `false` matches nothing"),
}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_cache_memory=1 << 24)
    yield engine
    engine.engine.check_pool_whole()


def constrained(kind: dict, max_tokens: int = 16, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


@pytest.mark.parametrize("case", REFUSED)
def test_the_library_refuses_at_add_time(llm, case):
    kind, message = REFUSED[case]
    with pytest.raises(InvalidArgumentError) as caught:
        llm.generate(["And God said"], constrained(kind))
    text = str(caught.value)
    assert message in text, text
    assert "panic" not in text and "Parser Error" not in text, text
    assert not llm.engine.requests  # nothing was admitted
    llm.engine.check_pool_whole()


@pytest.mark.parametrize(
    "kind",
    [
        {"choice": words(1999)},
        {"json": optional_properties(498)},
        {"grammar": alternatives(1999)},
        {"grammar": 'start: x\nx: x "a" | "b"'},
    ],
    ids=["choice_1999", "json_498_optional", "lark_1999", "lark_left_recursive"],
)
def test_the_largest_admitted_grammars_run_without_an_error_finish(llm, kind):
    params = [constrained(kind, seed=seed) for seed in range(3)]
    for out in llm.generate(["And God said"] * 3, params):
        assert out.outputs[0].finish_reason in ("stop", "length"), out.outputs[0]


def test_the_schema_true_is_any_json(llm):
    params = [constrained({"json": True}, max_tokens=64, seed=seed) for seed in range(4)]
    for out in llm.generate(["And God said"] * 4, params):
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length"), completion
        if completion.finish_reason == "stop":
            json.loads(completion.text)


def one_token(llm_or_engine, text: str) -> int:
    [token] = llm_or_engine.tokenizer.encode(text, add_special_tokens=False)
    return token


def digits(allowed: list[int], min_tokens: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=4,
        min_tokens=min_tokens,
        allowed_token_ids=allowed,
        structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
    )


def test_allowed_ids_that_cannot_start_the_grammar_are_refused_at_add_time(llm):
    letter, digit = one_token(llm.engine, "a"), one_token(llm.engine, "7")
    eos = sorted(llm.engine.eos_token_ids)
    with pytest.raises(InvalidArgumentError) as caught:
        llm.generate(["And God said"], digits([letter, *eos]))
    assert caught.value.field == "allowed_token_ids"
    assert "structured_outputs" in str(caught.value) and "can start" in str(caught.value)
    assert not llm.engine.requests
    [out] = llm.generate(["And God said"], digits([letter, digit]))
    assert out.outputs[0].token_ids[0] == digit


def test_an_ending_id_counts_where_the_grammar_may_end_at_once(llm):
    letter = one_token(llm.engine, "a")
    eos = sorted(llm.engine.eos_token_ids)
    maybe_empty = StructuredOutputsParams(regex="[0-9]*")
    params = SamplingParams(max_tokens=4, allowed_token_ids=[letter, *eos])
    [out] = llm.generate(["And God"], replace(params, structured_outputs=maybe_empty))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == ""
    with pytest.raises(InvalidArgumentError) as caught:  # min_tokens masks the ending ids
        llm.generate(["And God"], replace(params, structured_outputs=maybe_empty, min_tokens=1))
    assert caught.value.field in ("allowed_token_ids", "min_tokens")


def test_json_false_is_a_given_schema_and_json_object_false_is_not():
    assert StructuredOutputsParams(json=False).kind == "json"
    assert StructuredOutputsParams(json=False).source() == "false"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=False, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


# The server: the same refusals are 400s naming the field the constraint came in.


@pytest.fixture(scope="module")
def server():
    with ThreadServer(default_model_path(), engine={"kv_cache_memory": 1 << 24}) as s:
        yield s


def completion(server: ThreadServer, body: dict) -> httpx.Response:
    request = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 8, **body}
    return httpx.post(f"{server.url}/v1/completions", json=request, timeout=60)


@pytest.mark.parametrize("case", REFUSED)
def test_the_server_refuses_with_400_naming_the_field(server, case):
    kind, message = REFUSED[case]
    reply = completion(server, {"structured_outputs": kind})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "structured_outputs", error
    assert error["message"].startswith("structured_outputs: ") and message in error["message"]
    assert "panic" not in error["message"], error


def test_response_format_false_is_400_matching_nothing_and_true_is_any_json(server):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}
    reply = completion(server, {"response_format": schema})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format" and "matches nothing" in error["message"], error
    schema["json_schema"]["schema"] = True
    reply = completion(server, {"response_format": schema, "max_tokens": 32})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_tool_whose_parameters_match_nothing_is_400_naming_tools(server):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
        "tool_choice": "required",
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools", error
    assert "matches nothing" in error["message"] or "never be completed" in error["message"]


@pytest.mark.parametrize("field", ["structured_outputs", "response_format"])
def test_allowed_ids_the_grammar_cannot_start_with_are_400_naming_the_fields(server, field):
    letter = server.in_engine(lambda engine: one_token(engine, "a"))
    constraint = (
        {"regex": "[0-9]+"}
        if field == "structured_outputs"
        else {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    )
    reply = completion(server, {field: constraint, "allowed_token_ids": [letter]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "allowed_token_ids", error
    assert "structured_outputs or response_format" in error["message"], error


def test_the_server_compiles_in_the_grammar_pool(server, monkeypatch):
    engine = server.ctx.engine.engine
    threads: list[str] = []
    compile_grammar = engine.compile_grammar

    def recording(params):
        threads.append(threading.current_thread().name)
        return compile_grammar(params)

    monkeypatch.setattr(engine, "compile_grammar", recording)
    reply = completion(server, {"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.status_code == 200, reply.text
    assert threads and threads[0].startswith("aieng-grammar"), threads


# The pool itself: bounded in threads and queue, and in time.


def test_the_pool_answers_503_when_full_and_400_past_the_budget():
    pool = GrammarPool(threads=1, queued=1, queue_wait_s=5.0, budget_s=0.2)
    release = threading.Event()

    def slow() -> str:
        release.wait(10)
        return "done"

    async def scenario() -> None:
        running = asyncio.create_task(pool.run("structured_outputs", slow))
        queued = asyncio.create_task(pool.run("structured_outputs", lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as full:  # one running, one waiting: no room
            await pool.run("structured_outputs", lambda: "refused")
        assert full.value.status == 503 and full.value.code == "grammar_pool_full"
        assert full.value.headers == {"Retry-After": "1"}
        with pytest.raises(ApiError) as slow_error:  # past the budget: the client's to fix
            await running
        assert slow_error.value.status == 400
        assert slow_error.value.param == "structured_outputs"
        assert "took more than 0.2 s" in slow_error.value.message
        release.set()  # the slow compile ends in its thread, then the queued one runs
        assert await queued == "queued"
        assert await pool.run("structured_outputs", lambda: "again") == "again"

    asyncio.run(scenario())


def test_the_pool_drops_a_compile_that_waits_too_long_to_start():
    pool = GrammarPool(threads=1, queued=4, queue_wait_s=0.1, budget_s=5.0)
    release = threading.Event()
    ran: list[str] = []

    async def scenario() -> None:
        running = asyncio.create_task(pool.run("tools", lambda: release.wait(10)))
        await asyncio.sleep(0.02)
        with pytest.raises(ApiError) as waited:
            await pool.run("tools", lambda: ran.append("late"))
        assert waited.value.status == 503
        release.set()
        assert await running is True
        assert await pool.run("tools", lambda: "free") == "free"

    asyncio.run(scenario())
    assert ran == []  # dropped before it started
