"""Tool calling on /v1/chat/completions (issue 13, item 4): the bundled template renders tools
as transformers does, the hermes parser reads calls whole and streamed alike, `required` and
named tool choices constrain the bundled model's output to calls that parse and validate,
`auto` reads free output with the parser the server was started with, tool histories are
accepted, bad requests are 400s, and LangChain's and LiteLLM's requests work, reproduced with
the official `openai` client."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import transformers
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

from aieng._core import Tokenizer
from aieng.config.default_model import default_model_path
from aieng.server.cli import add_serve_arguments, server_config
from aieng.server.config import ServerConfig
from aieng.server.tool_calls import (
    DEFAULT_STRING_MAX_LENGTH,
    closed_objects,
    forced_call_schema,
)
from aieng.server.tool_parsers import FunctionSpec, HermesToolParser, ParsedCall, tool_parser

# The bundled model's context is 512 tokens and its small vocabulary spends many on JSON:
# tools stay small, and every string and number is bounded so that an output always ends.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def server():
    with ThreadServer(
        default_model_path(), engine={"kv_cache_memory": 1 << 24}, tool_call_parser="hermes"
    ) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


def assert_valid_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def hf_prompt_tokens(hf_tokenizer, messages: list[dict], tools: list[dict]) -> int:
    text = hf_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def collect_stream(stream) -> tuple[str, list[dict], list[dict], str | None]:
    """Content, the first delta of each call, each call joined, and the last finish_reason."""
    content, firsts, calls, finish = "", [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                if part.index not in calls:
                    firsts.append(part.model_dump())
                    calls[part.index] = {"name": part.function.name, "arguments": ""}
                calls[part.index]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, firsts, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------- the bundled chat template


def test_bundled_template_renders_tools_as_transformers_does(hf_tokenizer):
    ours = Tokenizer.from_dir(str(default_model_path()))
    history_with_dict_arguments = [
        *HISTORY[:2],
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Rome"}},
                },
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
            ],
        },
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "Rain in Rome."},
    ]
    histories = [ASK, HISTORY, history_with_dict_arguments, [{"role": "developer", "content": "x"}]]
    for tools in (None, TOOLS):
        for conversation in histories:
            for add_generation_prompt in (True, False):
                expected = hf_tokenizer.apply_chat_template(
                    conversation,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                )
                extra = {} if tools is None else {"tools": tools}
                got = ours.apply_chat_template(conversation, add_generation_prompt, **extra)
                assert got == expected
    rendered = ours.apply_chat_template(history_with_dict_arguments, False, tools=TOOLS)
    calls = '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "weather", "arguments": '
    calls += '{"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}'
    calls += "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response>"
    assert calls + "\n<tool_response>\n1\n</tool_response><|im_end|>\n" in rendered


def test_template_without_tools_is_plain_chatml():
    ours = Tokenizer.from_dir(str(default_model_path()))
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    expected = "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
    expected += "<|im_start|>assistant\na<|im_end|>\n<|im_start|>assistant\n"
    assert ours.apply_chat_template(conversation, True) == expected


# ---------------------------------------------------------------- the hermes parser

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
PARIS = ParsedCall("weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, "", [PARIS]),
        (f"{CALL}\n{CALL2}\n", "", [PARIS, ParsedCall("add", '{"a": 2}')]),
        (f"Let me look.\n{CALL}", "Let me look.", [PARIS]),
        (f"{CALL}\nDone.", "Done.", [PARIS]),
        ('<tool_call>\n{"name": "weather", "arguments": {"city": }\n</tool_call>', None, []),
        ('<tool_call>\n{"name": "weather", "arguments": "Paris"}\n</tool_call>', None, []),
        ("<tool_call>[1, 2]</tool_call> and <tool_call", None, []),
        (f"a < b <tool_ x {CALL2[:-12]}", "a < b <tool_ x", [ParsedCall("add", '{"a": 2}')]),
        (f"{CALL2[:-3]}", None, []),
        ("Plain text, no calls.\n\n", None, []),
        (f"{CALL}\n<tool_call>\n{{bad\n</tool_call>", "<tool_call>\n{bad\n</tool_call>", [PARIS]),
        ('<tool_call>{"name": "f"}</tool_call>', "", [ParsedCall("f", "{}")]),
    ],
)
def test_hermes_parser_reads_calls_and_leaves_the_rest_as_content(text, content, calls):
    """content None: all the text is content, as written (a malformed call included)."""
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == calls
    assert parsed.content == (text if content is None else content)


@pytest.mark.parametrize(
    "text",
    [
        f"Let me look.  \n{CALL}\n\n{CALL2}\nThat is all. ",
        f"x <tool_call>\n{{oops}}\n</tool_call> y {CALL}",
        f"{CALL}\n<tool_call>\n" + '{"name": "add", "arguments": {"a": 1}}',
        "<tool_cal <tool_call <tool_call>",
    ],
)
def test_hermes_stream_split_anywhere_gives_the_whole_parse(text):
    parser = HermesToolParser()
    whole = parser.parse(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = parser.stream()
        outs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(o.content for o in outs) == whole.content, pieces
        assert [c for o in outs for c in o.calls] == whole.calls, pieces
        # markup is never handed out as content while a call may still be open
        for out in outs[:-1]:
            assert '<tool_call>\n{"name": "weather"' not in out.content


def test_hermes_grammar_and_the_registry():
    grammar = HermesToolParser().grammar(
        [FunctionSpec("add", ADD["function"]["parameters"])], False
    )
    assert grammar.startswith("start: call\n") and '"\\"add\\", \\"arguments\\": "' in grammar
    parallel = HermesToolParser().grammar([FunctionSpec("a", {}), FunctionSpec("b", {})], True)
    assert 'start: call ("\\n" call)*' in parallel and "(fn_0 | fn_1)" in parallel
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'llama9'.*hermes"):
        tool_parser("llama9")


def test_the_serve_flag_names_a_registered_parser(capsys):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--tool-call-parser", "hermes"])
    assert server_config(args, Path("model")).tool_call_parser == "hermes"
    assert server_config(parser.parse_args([]), Path("model")).tool_call_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "llama9"])
    assert "invalid choice: 'llama9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tool-call parser 'llama9'"):
        ServerConfig(served_model_name="m", tool_call_parser="llama9")


# ---------------------------------------------------------------- required and named


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.7, 1), (1.0, 2), (1.3, 3)])
def test_required_calls_parse_and_validate(client, temperature, seed):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        seed=seed,
        max_tokens=100,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message, {"weather", "add"})


def test_parallel_required_calls_each_validate(client):
    """With `parallel_tool_calls: true` the bundled model rarely stops calling: each complete
    call validates, and the call the token budget cut is dropped."""
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[ADD],
        tool_choice="required",
        parallel_tool_calls=True,
        temperature=1.0,
        seed=4,
        max_tokens=150,
    )
    choice = reply.choices[0]
    assert len(choice.message.tool_calls) >= 2
    assert_valid_calls(choice.message, {"add"})
    assert choice.finish_reason in ("length", "tool_calls") and choice.message.content is None


# LangChain's tool of a plain `def weather(city: str)` (convert_to_openai_tool): no bound on the
# string; and of a pydantic model with `city: str = Field(max_length=20)`.
PLAIN_FUNCTION = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "type": "object",
        },
    },
}
PYDANTIC_MODEL = {
    "type": "function",
    "function": {
        "name": "Weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"maxLength": 20, "type": "string"}},
            "required": ["city"],
            "type": "object",
        },
    },
}
FORCED_CHOICES = [
    {"type": "function", "function": {"name": "weather"}},  # bind_tools(tool_choice="weather")
    "required",  # bind_tools(tool_choice="any")
]


@pytest.mark.parametrize("tool_choice", FORCED_CHOICES, ids=["named", "required"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_with_an_unbounded_string_closes(client, tool_choice, stream):
    """No max_tokens, so only the context ends an output: the default bound of 128 characters
    closes the string, and the one call ends the output."""
    request = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=[PLAIN_FUNCTION],
        tool_choice=tool_choice,
        temperature=1.3,
        seed=3,
    )
    if stream:
        content, _, calls, finish = collect_stream(
            client.chat.completions.create(**request, stream=True)
        )
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
    assert finish == "tool_calls" and content == "" and len(calls) == 1, (finish, calls)
    arguments = json.loads(calls[0]["arguments"])
    assert calls[0]["name"] == "weather" and set(arguments) == {"city"}
    assert len(arguments["city"]) <= DEFAULT_STRING_MAX_LENGTH == 128


def test_a_pydantic_model_tool_keeps_its_own_bound(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[PYDANTIC_MODEL],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        temperature=1.3,
        seed=3,
    )
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(
        json.loads(call.function.arguments), PYDANTIC_MODEL["function"]["parameters"]
    )


@pytest.mark.parametrize("seed", [4, 5])
def test_required_makes_one_call_and_stops_unless_parallel_calls_are_asked(client, seed):
    """The request the parallel test sends, without `parallel_tool_calls`: one call, then the
    output ends (the bundled model would call again until the budget runs out)."""
    choice = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[ADD],
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_tokens=150,
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message, {"add"})


@pytest.mark.parametrize("tool_choice", FORCED_CHOICES, ids=["named", "required"])
def test_a_call_the_budget_cuts_is_dropped_and_the_answer_says_length(client, tool_choice):
    """docs/server.md: finish_reason "length", no tool_calls, content "" (no call closed);
    the stream sends nothing of the cut call and joins to the whole answer."""
    request = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=[PLAIN_FUNCTION],
        tool_choice=tool_choice,
        max_tokens=6,
    )
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.tool_calls is None and whole.message.content == ""
    content, firsts, calls, finish = collect_stream(
        client.chat.completions.create(**request, stream=True)
    )
    assert (content, firsts, calls, finish) == ("", [], [], "length")


def test_forced_call_schemas_bound_strings_that_set_no_bound():
    bound = {"maxLength": DEFAULT_STRING_MAX_LENGTH}
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "short": {"type": "string", "maxLength": 5},
            "named": {"type": "string", "enum": ["a", "b"]},
            "shaped": {"type": "string", "pattern": "^[a-z]+$"},
            "maybe": {"type": ["string", "null"]},
            "many": {"type": "array", "items": {"type": "string"}},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "ref": {"$ref": "#/$defs/Name"},
        },
        "$defs": {"Name": {"type": "string"}},
    }
    out = forced_call_schema(schema)
    props = out["properties"]
    assert props["free"] == {"type": "string", **bound}
    assert props["short"]["maxLength"] == 5
    assert "maxLength" not in props["named"] and "maxLength" not in props["shaped"]
    assert props["maybe"] == {"type": ["string", "null"], **bound}
    assert props["many"]["items"] == {"type": "string", **bound}
    assert props["either"]["anyOf"] == [{"type": "string", **bound}, {"type": "integer"}]
    assert out["$defs"]["Name"] == {"type": "string", **bound}
    assert out["additionalProperties"] is False  # and objects closed, as closed_objects does
    assert schema["properties"]["free"] == {"type": "string"}  # the request's own is unchanged


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_choice_calls_that_function(client, seed):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
        seed=seed,
        max_tokens=100,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    assert_valid_calls(choice.message, {"add"})


def test_streamed_calls_have_openai_deltas_and_join_to_the_whole(client):
    request = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=7,
        max_tokens=100,
    )
    whole = client.chat.completions.create(**request).choices[0]
    content, firsts, calls, finish = collect_stream(
        client.chat.completions.create(**request, stream=True)
    )
    assert content == "" and finish == "tool_calls"
    assert [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ] == calls
    first = firsts[0]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["id"].startswith("call_") and first["function"]["name"] == calls[0]["name"]


# ---------------------------------------------------------------- auto


def forced(text_regex: str) -> dict:
    """vLLM's structured_outputs forcing the free output into a shape, so `auto` parsing is
    tested on what a tool-calling model writes."""
    return {"structured_outputs": {"regex": text_regex}}


CALL_REGEX = r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9]\}\}\n</tool_call>'


def test_auto_reads_calls_out_of_free_text(client):
    request = dict(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=100, extra_body=forced(CALL_REGEX)
    )
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert_valid_calls(choice.message, {"add"})
    content, firsts, calls, finish = collect_stream(
        client.chat.completions.create(**request, tool_choice="auto", stream=True)
    )
    assert content == "Sure." and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["add"] and firsts[0]["id"].startswith("call_")


def test_auto_leaves_malformed_calls_and_plain_text_as_content(client):
    bad = r'<tool_call>\n\{"name": "add", "arguments": \{"a": \}\n</tool_call>'
    for stream in (False, True):
        request = dict(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=100, extra_body=forced(bad)
        )
        if stream:
            content, _, calls, finish = collect_stream(
                client.chat.completions.create(**request, stream=True)
            )
        else:
            choice = client.chat.completions.create(**request).choices[0]
            content, calls, finish = (
                choice.message.content,
                choice.message.tool_calls,
                choice.finish_reason,
            )
        assert content == '<tool_call>\n{"name": "add", "arguments": {"a": }\n</tool_call>'
        assert not calls and finish == "stop"
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    ).choices[0]
    assert plain.message.content and plain.message.tool_calls is None


def test_tool_choice_none_renders_tools_but_reads_no_calls(client, hf_tokenizer):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=100,
        extra_body=forced(CALL_REGEX),
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("Sure.\n<tool_call>")
    assert reply.usage.prompt_tokens == hf_prompt_tokens(hf_tokenizer, ASK, TOOLS)


# ---------------------------------------------------------------- histories and errors


def test_closed_objects_close_what_declares_its_properties():
    person = {"type": "object", "properties": {"name": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "who": person,
            "many": {"type": "array", "items": person},
            "properties": {"type": "object", "properties": {"x": {}}},
            "either": {"anyOf": [person, {"type": "null"}]},
            "free": {"type": "object", "additionalProperties": {"type": "integer"}},
            "joined": {"allOf": [person, {"properties": {"age": {}}}]},
        },
        "$defs": {"P": person},
    }
    closed = closed_objects(schema)
    props = closed["properties"]
    assert (
        closed["additionalProperties"] is False
        and closed["$defs"]["P"]["additionalProperties"] is False
    )
    assert props["who"]["additionalProperties"] is False
    assert props["many"]["items"]["additionalProperties"] is False
    assert props["properties"] == {
        "type": "object",
        "properties": {"x": {}},
        "additionalProperties": False,
    }
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["free"] == schema["properties"]["free"]
    assert "additionalProperties" not in props["joined"]["allOf"][0]
    assert "additionalProperties" not in person  # the request's schema is left as it came


def test_openai_round_trip_of_a_call_and_its_answer(client):
    """docs/server.md's flow: a schema that does not close its object (the constraint does), the
    reply's message sent back as the openai client dumps it (no content key), then the answer."""
    open_weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
    messages = list(ASK)
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[open_weather],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=9,
        max_tokens=100,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(message.tool_calls[0].function.arguments)) == {"city"}
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[open_weather], tool_choice="none", max_tokens=4
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_tool_history_is_accepted_and_rendered_as_transformers_does(client, hf_tokenizer):
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, tools=[WEATHER], max_tokens=4, temperature=0
    )
    hf_history = [dict(m) for m in HISTORY]
    hf_history[2] = {
        **HISTORY[2],
        "tool_calls": [
            {
                **HISTORY[2]["tool_calls"][0],
                "function": {"name": "weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert reply.usage.prompt_tokens == hf_prompt_tokens(hf_tokenizer, hf_history, [WEATHER])
    parts = [
        {**HISTORY[3], "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]}
    ]
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[:3] + parts, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert again.usage.prompt_tokens == reply.usage.prompt_tokens


def assert_400(server, body: dict, param: str, *words: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_bad_tool_requests_are_400(server):
    legacy = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "tools": [ADD]})
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "tools"
    assert "/v1/chat/completions" in legacy.json()["error"]["message"]
    named = {"type": "function", "function": {"name": "divide"}}
    assert_400(server, {"tools": TOOLS, "tool_choice": named}, "tool_choice", "'divide'", "weather")
    assert_400(server, {"tool_choice": "required"}, "tool_choice", "needs tools")
    assert_400(server, {"tools": [WEATHER, WEATHER]}, "tools", "'weather'", "twice")
    many = [{**ADD, "function": {**ADD["function"], "name": f"f{i}"}} for i in range(129)]
    assert_400(server, {"tools": many}, "tools", "128")
    assert_400(server, {"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice")
    bad_name = {"type": "function", "function": {"name": "no spaces"}}
    assert_400(server, {"tools": [bad_name]}, "tools.0.function.name")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
    assert_400(server, {"tools": [bad_schema], "tool_choice": "required"}, "tools", "schema")
    assert_400(
        server,
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "response_format",
    )
    for message, param, words in [
        ({"role": "tool", "content": "x"}, "tool_call_id", ["tool message needs"]),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id", ["only tool"]),
        ({"role": "user", "content": None}, "content", ["user message needs content"]),
        ({"role": "tool", "tool_call_id": "c"}, "content", ["missing"]),
        (
            {"role": "user", "content": "x", "tool_calls": HISTORY[2]["tool_calls"]},
            "tool_calls",
            ["only assistant"],
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
            "tool_calls.0.function",
            [],
        ),
    ]:
        assert_400(server, {"messages": [message]}, f"messages.0.{param}", *words)


def test_tools_the_template_could_not_read_are_400(server):
    head = '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
    for tail, param, word in [
        ('"function": {"name": "f"}, "x": "\\ud800"}]}', "tools.0", "surrogate"),
        ('"function": {"name": "f", "y": NaN}}]}', "tools.0", "JSON"),
        (
            '"function": {"name": "f", "parameters": {"a": NaN}}}]}',
            "tools.0.function.parameters",
            "JSON",
        ),
        (
            '"function": {"name": "f", "parameters": {"\\ud800": 1}}}]}',
            "tools.0.function.parameters",
            "surrogate",
        ),
    ]:
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=(head + tail).encode(),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and word in error["message"], error


def test_deeply_nested_tool_schemas_are_400(server):
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert_400(server, {"tools": [tool]}, "tools.0.function.parameters", "more than 64")
    depth = 5000  # past Python's recursion limit, in a body parsed off the event loop
    nested = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    raw = '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
    raw += f'"function": {{"name": "f", "parameters": {nested}}}}}]}}'
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=raw.encode(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    for arguments in ("[" * 100_000 + "]" * 100_000, json.dumps(schema)):  # history: text as is
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        history = [*ASK, {"role": "assistant", "tool_calls": [call]}]
        body = {"messages": history, "tools": [ADD], "tool_choice": "none", "max_tokens": 1}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:  # past the context: the arguments went in as text
            assert response.json()["error"]["code"] == "context_length_exceeded"


def test_tools_without_a_parser_need_the_flag_unless_constrained(tmp_path):
    with ThreadServer(make_model_dir(tmp_path)) as bare:
        for choice in (None, "auto"):
            body = {"tools": [ADD]} if choice is None else {"tools": [ADD], "tool_choice": choice}
            assert_400(bare, body, "tool_choice", "--tool-call-parser")
        with openai.OpenAI(base_url=f"{bare.url}/v1", api_key="unused", max_retries=0) as c:
            choice = c.chat.completions.create(
                model=MODEL_NAME,
                messages=ASK,
                tools=[ADD],
                tool_choice="required",
                max_tokens=200,
                parallel_tool_calls=False,
                temperature=0,
            ).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message, {"add"})


# ---------------------------------------------------------------- what clients send


def test_langchain_bind_tools_and_structured_output_requests(client):
    """LangChain's ChatOpenAI: `bind_tools` sends the tools with no tool_choice (auto), then
    the history with the assistant's calls (content null) and the tool's answer;
    `with_structured_output(method="function_calling")` names its one tool and turns parallel
    calls off."""
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert first.choices[0].finish_reason in ("stop", "length")
    follow = client.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert follow.choices[0].message.role == "assistant"
    person = {
        "type": "function",
        "function": {
            "name": "Person",
            "description": "A person",
            "parameters": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        },
    }
    structured = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Who is Moses?"}],
        tools=[person],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0.7,
        seed=11,
    ).choices[0]
    (call,) = structured.message.tool_calls
    assert call.function.name == "Person"
    jsonschema.validate(json.loads(call.function.arguments), person["function"]["parameters"])
    # method="json_schema" (the default of langchain-openai 0.3): a response_format
    spec = {k: v for k, v in person["function"].items() if k != "parameters"}
    response_format = {
        "type": "json_schema",
        "json_schema": {**spec, "schema": person["function"]["parameters"]},
    }
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Who is Moses?"}],
        response_format=response_format,
        max_tokens=100,
        temperature=0.7,
        seed=11,
    ).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    jsonschema.validate(json.loads(answer.message.content), person["function"]["parameters"])


def test_litellm_tool_request(client):
    """litellm.completion(model="openai/<name>", api_base=..., tools=..., tool_choice=...)
    sends the OpenAI body as given, streaming too."""
    _, _, calls, finish = collect_stream(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=100,
            temperature=0.8,
            seed=5,
        )
    )
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["weather"])
