"""Structured outputs end to end on the bundled default model: every constrained output parses
and validates against its schema (hand-written and generated ones), regexes fullmatch, choices
are chosen, greedy and sampled, batched with unconstrained requests, through preemption and
aborts (the KV pool whole after each test), and through the server with the `openai` client.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import openai
import pytest
import torch
from server_fixtures import MODEL_NAME, ThreadServer

from aieng import LLM, InvalidArgumentError, SamplingParams, StructuredOutputsParams
from aieng.config.default_model import default_model_path
from aieng.worker.sampler import (
    Sampler,
    SamplingTable,
    apply_grammar_bitmask,
    unpack_bitmask,
    unpack_bitmask_numpy,
)

PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning", "Blessed are"]
MAX_TOKENS = 400  # far more than any schema here needs: a cut output is a failure

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tribe": {"enum": ["Judah", "Levi", "Benjamin"]},
    },
    "required": ["name", "age", "tribe"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_cache_memory=1 << 24)
    yield engine
    engine.engine.check_pool_whole()


@pytest.fixture(autouse=True)
def pool_is_whole_after(request):
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_pool_whole()


def constrained(greedy: bool = True, seed: int | None = None, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if greedy else 1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A seeded random schema of objects, arrays, enums, numbers, strings and booleans, each
    bounded so that an output always ends."""
    kinds = ["integer", "number", "string", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":  # a step, or a model may write digits forever
        return {"type": "number", "minimum": -1e4, "maximum": 1e4, "multipleOf": 0.25}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(3, 16)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool = ["Moses", "Aaron", 7, 3.5, True, None, "Egypt", "a b"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    names = rng.sample(["id", "name", "count", "tags", "ok", "score", "kind", "meta"], 3)
    properties = {n: random_schema(rng, depth + 1) for n in names}
    return {
        "type": "object",
        "properties": properties,
        "required": rng.sample(names, rng.randint(1, len(names))),
        "additionalProperties": False,
    }


def assert_valid_json(completion, schema: dict) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


# ------------------------------------------------------------------ the library


@pytest.mark.parametrize("greedy", [True, False])
def test_json_schema_outputs_validate(llm, greedy):
    params = [constrained(greedy, seed=i, json=PERSON) for i in range(len(PROMPTS))]
    for out in llm.generate(PROMPTS, params):
        assert_valid_json(out.outputs[0], PERSON)


def test_generated_schemas_validate_greedy_and_sampled(llm):
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(24)]
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        for greedy in (True, False):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(constrained(greedy, seed=i, json=json.dumps(schema)))
    outputs = llm.generate(prompts, params)
    for i, out in enumerate(outputs):
        assert_valid_json(out.outputs[0], schemas[i // 2])


def test_json_object_outputs_are_objects(llm):
    outputs = llm.generate(PROMPTS, constrained(json_object=True))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize("greedy", [True, False])
def test_regex_outputs_fullmatch(llm, greedy):
    patterns = [
        r"(Yea|Nay), [a-z]{2,8}\.",
        r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
        r"[A-Z][a-z]+( [a-z]+){0,3}",
    ]
    params = [constrained(greedy, seed=i, regex=p) for i, p in enumerate(patterns)]
    for pattern, out in zip(patterns, llm.generate(PROMPTS[: len(patterns)], params), strict=True):
        assert re.fullmatch(pattern, out.outputs[0].text), (pattern, out.outputs[0].text)


@pytest.mark.parametrize("greedy", [True, False])
def test_choice_outputs_are_one_of_the_choices(llm, greedy):
    choices = ["Moses", "Aaron", "Pharaoh's daughter", "the LORD"]
    params = [constrained(greedy, seed=i, choice=choices) for i in range(len(PROMPTS))]
    for out in llm.generate(PROMPTS, params):
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"


def test_lark_grammar_outputs_parse(llm):
    grammar = 'start: "The LORD is " adj ("," " " adj)* "."\nadj: "good" | "great" | "holy"\n'
    params = [constrained(False, seed=i, grammar=grammar) for i in range(len(PROMPTS))]
    for out in llm.generate(PROMPTS, params):
        text = out.outputs[0].text
        assert re.fullmatch(r"The LORD is (good|great|holy)(, (good|great|holy))*\.", text), text


def test_constrained_and_unconstrained_rows_in_one_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    mixed_params = [free, constrained(json=PERSON), free, constrained(regex=r"[0-9]{3}")]
    mixed = llm.generate(PROMPTS, mixed_params)
    assert mixed[0].outputs[0].token_ids == alone[0]
    assert mixed[2].outputs[0].token_ids == alone[2]
    assert_valid_json(mixed[1].outputs[0], PERSON)
    assert re.fullmatch(r"[0-9]{3}", mixed[3].outputs[0].text)


def test_n_sampled_completions_each_follow_the_grammar(llm):
    params = constrained(False, seed=7, json=PERSON)
    params.n = 4
    (out,) = llm.generate(PROMPTS[:1], params)
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert_valid_json(completion, PERSON)


def test_logprobs_see_only_allowed_tokens(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        logprobs=3,
        structured_outputs=StructuredOutputsParams(choice=["Moses", "Aaron"]),
    )
    (out,) = llm.generate(PROMPTS[:1], params)
    completion = out.outputs[0]
    assert completion.text in ("Moses", "Aaron")
    tokenizer = llm.get_tokenizer()
    for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
        assert np.isfinite(top[token])
        allowed = [t for t, lp in top.items() if np.isfinite(lp)]
        assert all(tokenizer.decode([t]) in "MosesAaron" for t in allowed), top


def test_stream_deltas_join_to_valid_json(llm):
    deltas = list(llm.stream(PROMPTS[0], constrained(json=PERSON)))
    text = "".join(d.outputs[0].text for d in deltas)
    assert deltas[-1].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_preemption_keeps_the_grammars_consistent():
    # 45 blocks of 4 tokens (6,144 bytes a token on the default model's bfloat16 cache, the
    # CPU's default): one request of 150 tokens fits, sixteen at once do not.
    small = LLM(kv_cache_memory=45 * 4 * 6144, block_size=4, max_num_seqs=16)
    try:
        rng = random.Random(99)
        schemas = [PERSON if i % 2 else random_schema(rng) for i in range(16)]
        params = [constrained(i % 4 < 2, seed=i, json=s) for i, s in enumerate(schemas)]
        for p in params:
            p.max_tokens = 150
        outputs = small.generate([PROMPTS[i % 4] for i in range(16)], params)
        assert small.engine.core.stats()["num_preemptions"] > 0, "the test must preempt"
        for schema, out in zip(schemas, outputs, strict=True):
            assert_valid_json(out.outputs[0], schema)
        small.engine.check_pool_whole()
    finally:
        del small


def test_aborts_free_blocks_and_grammars(llm):
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"abort-{i}", PROMPTS[i % 4], constrained(False, seed=i, json=PERSON))
    for _ in range(3):
        engine.step()
    for i in range(0, 6, 2):
        engine.abort(f"abort-{i}")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert_valid_json(out.outputs[0], PERSON)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ({"regex": "[a-"}, "regex"),
        ({"json": {"type": "frobnicate"}}, "json"),
        ({"json": {"$ref": "#/definitions/missing"}}, "json"),
        ({"grammar": "start: undefined_rule\n"}, "grammar"),
    ],
)
def test_invalid_constraints_are_typed_errors_naming_the_problem(llm, kind, named):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
    with pytest.raises(InvalidArgumentError, match=rf"^{named}: \S"):
        llm.generate(PROMPTS[:1], params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "choice must hold only strings"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": 3}, "must be a JSON schema"),
        ({"json": {"maximum": float("nan")}}, "which JSON cannot express"),
        ({"regex": "\ud800"}, "lone surrogate"),
    ],
)
def test_malformed_params_are_refused_when_built(kind, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kind)


def test_sampling_params_accepts_a_dict_and_refuses_other_types():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[0-9]+")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the sampler


def test_the_sampler_draws_only_allowed_tokens():
    vocab = 70
    table = SamplingTable(vocab)
    table.add_request(0, SamplingParams(temperature=0.0), [1])
    table.add_request(1, SamplingParams(temperature=1.0, seed=3), [1])
    table.add_request(2, SamplingParams(temperature=1.0), [1])
    logits = torch.randn(3, vocab)
    logits[:, 5] = 100.0  # the favourite, forbidden below
    bitmask = np.zeros((2, 3), np.int32)
    bitmask[0, 1] = 1 << (40 - 32)  # row 0: only token 40
    bitmask[1, 2] = -(1 << 31)  # row 1: token 95, beyond the vocab (never drawn) ...
    bitmask[1, 0] = -(1 << 31) | (1 << 7)  # ... and tokens 7 and 31
    batch = table.batch(np.array([0, 1, 2]))
    batch.grammar_bitmask = (np.array([0, 1]), bitmask)
    sampler = Sampler(seed=0)
    for _ in range(20):
        tokens = sampler(logits.clone(), batch).tokens.tolist()
        assert tokens[0] == 40 and tokens[1] in (7, 31) and tokens[2] == 5
    masked = apply_grammar_bitmask(logits.clone(), np.array([2]), np.zeros((1, 3), np.int32))
    assert torch.isinf(masked[2]).all() and torch.isfinite(masked[:2]).all()
    batch.grammar_bitmask = (np.array([2]), np.zeros((1, 3), np.int32))
    assert sampler(logits.clone(), batch).tokens.tolist()[2] == -1


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 4096])
def test_bitmask_unpacking_paths_agree_with_the_bit_rule(vocab):
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    expected = torch.tensor(
        [[(int(row[t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in bitmask]
    )
    assert torch.equal(unpack_bitmask(bitmask, vocab, torch.device("cpu")), expected)
    assert torch.equal(unpack_bitmask_numpy(bitmask, vocab), expected)


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server():
    with ThreadServer(default_model_path(), engine={"kv_cache_memory": 1 << 24}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def json_schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


def test_chat_response_format_json_schema(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Who led Israel out of Egypt?"}],
        response_format=json_schema_format(PERSON),
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=5,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_json_schema_streams(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a priest."}],
        response_format=json_schema_format(PERSON),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_completions_json_object_and_text(client):
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.text), dict)
    plain = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "text"}, "ignore_eos": True},
    )
    assert plain.usage.completion_tokens == 8


def test_completions_structured_outputs_extension_streams(client):
    choices = ["Moses", "Aaron"]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert "".join(c.choices[0].text for c in stream) in choices
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", reply.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs", "json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown key 'pattern'"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": json_schema_format({"type": "frobnicate"})},
            "response_format",
            "json",
        ),
        (
            {"response_format": json_schema_format({"type": "string", "pattern": "(("})},
            "response_format",
            "json",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_invalid_constraints_are_400_naming_the_problem(client, server, body, param, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=4, extra_body=body)
    error = caught.value.body
    assert error["param"] == param, error
    assert named in error["message"], error
    server.wait_idle()
    server.in_engine(lambda engine: engine.check_pool_whole())


def test_chat_invalid_schema_is_400(client):
    with pytest.raises(openai.BadRequestError, match="json"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            response_format=json_schema_format({"type": "object", "required": 5}),
        )


def test_openai_parse_with_a_pydantic_model(client):
    """What LangChain's with_structured_output and the openai client's parse() send: a strict
    json_schema built from a pydantic model, read back into the model."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=150)
        tribe: str = pydantic.Field(pattern="^(Judah|Levi)$")

    completion = client.beta.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Who was Aaron?"}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.tribe in ("Judah", "Levi")
