"""Schema fuzzing of a live server from the OpenAPI document it publishes (schemathesis): every
operation, schema-valid and schema-invalid inputs, and for the generation routes also inputs
steered towards requests the engine runs (a short prompt, few tokens, streamed or not).

Each response: no 5xx but a deliberate 503; it conforms to the document (schemathesis' checks:
status code, content type, headers, body schema; invalid input refused); every error body is
`{"error": {message, type, param, code}}`; every JSON body and every `data:` event of a stream
is strict JSON (no NaN or Infinity), the stream ending with `data: [DONE]`.

Every check of `schemathesis run --checks all` holds (the document is the contract: content
types, bounds, required fields), with two replaced by stricter or more precise ones of ours:
`not_a_server_error` by the 5xx check above (a deliberate 503 is allowed), and
`positive_data_acceptance` by `check_positive_accepted`: schema-valid data may be refused only
by a rule the document cannot state (`CROSS_FIELD`: the prompt plus `max_tokens` within the
context, `top_logprobs` only with `logprobs`, ...), each named by the 400's `param`.

`tests/test_server_fuzz.py` runs a bounded number of cases; `benches/fuzz_api.py` runs for
minutes. Both count what they tried in `STATS`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, positive_data_acceptance

DELIBERATE_5XX = {503}  # overload, starting or stopping: the server says so on purpose
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_STREAM_EVENTS = 1000  # schemathesis reads 20 events of a stream by default
EXCLUDED_CHECKS = [not_a_server_error, positive_data_acceptance]  # replaced: see above
# The 400s that schema-valid data may get, by `param`: rules across fields or against the
# engine that JSON Schema cannot state.
CROSS_FIELD = {
    "prompt": "a prompt's tokens within the context (a text may have none)",
    "input": "an input's tokens within the context, and within the queue limits",
    "messages": "the rendered conversation within the context; the chat template may refuse it",
    "max_tokens": "the prompt plus max_tokens within the context",
    "max_completion_tokens": "the prompt plus max_completion_tokens within the context",
    "min_tokens": "at most max_tokens, and reachable with the allowed tokens",
    "logprobs": "at most the engine's max_logprobs",
    "top_logprobs": "only with logprobs, and at most the engine's max_logprobs",
    "best_of": "equal to n",
    "stream_options": "only with stream",
    "logit_bias": "token ids within the vocabulary",
    "allowed_token_ids": "not every one a bad word",
    "response_format": "a schema the grammar engine compiles and that matches something",
    "structured_outputs": "a constraint the grammar engine compiles and that matches something",
    "tools": "tool schemas the grammar engine compiles",
    "tool_choice": "a named tool among tools",
    "dimensions": "at most the model's hidden size",
}
CROSS_FIELD_CODES = {"exceeds_queue_limits", "no_valid_token", "unsupported_field"}


def check_positive_accepted(case, response) -> None:
    """Schema-valid data is answered, or refused by a rule the document cannot state."""
    generation = getattr(getattr(case, "meta", None), "generation", None)
    if generation is None or generation.mode != GenerationMode.POSITIVE:
        return
    if response.status_code != 400:
        return
    error = strict_json(response.text)["error"]
    top = (error["param"] or "").split(".")[0]
    assert top in CROSS_FIELD or error["code"] in CROSS_FIELD_CODES, (
        "schema-valid data refused by a rule the document does not state",
        case.as_curl_command(),
        response.text[:500],
    )


@dataclass
class ApiStats:
    cases: Counter = field(default_factory=Counter)  # per operation and mode
    statuses: Counter = field(default_factory=Counter)
    streams: int = 0
    stream_events: int = 0
    steered: int = 0

    def table(self) -> list[tuple[str, object]]:
        rows: list[tuple[str, object]] = [("cases", sum(self.cases.values()))]
        rows += [(f"  {k}", v) for k, v in sorted(self.cases.items())]
        rows += [("steered generation cases", self.steered)]
        rows += [(f"status {k}", v) for k, v in sorted(self.statuses.items())]
        rows += [("streams read", self.streams), ("stream events parsed", self.stream_events)]
        return rows


STATS = ApiStats()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def check_stream(text: str, cut_short: bool = False) -> int:
    """Every `data:` event is strict JSON but the last, `[DONE]` (unless the reader stopped
    early: `cut_short`); returns the events read."""
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events, "an empty stream"
    payloads = []
    for event in events:
        data = [
            line[len("data:") :].strip() for line in event.splitlines() if line.startswith("data:")
        ]
        assert data, f"an event without data: {event!r}"
        payloads.append("\n".join(data))
    if not cut_short:
        assert payloads[-1] == "[DONE]", f"the stream does not end with [DONE]: {payloads[-1]!r}"
    for payload in payloads[: len(payloads) if cut_short else -1]:
        body = strict_json(payload)
        assert isinstance(body, dict), payload
        if "error" in body:
            check_error_body(body)
    return len(payloads)


def check_error_body(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def check_case(case) -> None:
    response = case.call(timeout=60)
    status = response.status_code
    STATS.statuses[status] += 1
    assert status < 500 or status in DELIBERATE_5XX, (case.as_curl_command(), response.text[:500])
    media = (response.headers.get("content-type") or [""])[0].split(";")[0]  # header: values
    case.validate_response(response, excluded_checks=EXCLUDED_CHECKS)
    if media == "text/event-stream":
        assert status == 200, response.text[:500]
        STATS.streams += 1
        STATS.stream_events += check_stream(response.text, response.stream_cut_short)
    elif media == "application/json":
        body = strict_json(response.text)
        if status >= 400:
            check_error_body(body)
    check_positive_accepted(case, response)


@st.composite
def steered(draw, case):
    """The schema's case with the fields a request needs to run set to plausible values."""
    if not isinstance(case.body, dict) or not draw(st.booleans()):
        return case
    # Each field the schema drew is kept or not: random values, few enough to run together.
    body = {k: v for k, v in case.body.items() if draw(st.integers(0, 2)) == 0}
    words = st.sampled_from(["The", " quick", " fox", "日本", " 🙂", "\n", " STOP"])
    text = draw(st.lists(words, min_size=1, max_size=6).map("".join))
    if case.path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body["max_tokens"] = draw(st.integers(0, 8))
    body["stream"] = draw(st.booleans())
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    case.body = body
    STATS.steered += 1
    return case


def operations(schema) -> list[tuple[str, str, GenerationMode]]:
    """(method, path, mode) of every operation in the document; invalid input only where an
    operation has a body (a string path parameter has no invalid value)."""
    found = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.body:
            modes.append(GenerationMode.NEGATIVE)
        found += [(op.method.upper(), op.path, mode) for mode in modes]
    return found


def fuzz_operation(schema, method: str, path: str, mode: GenerationMode, **overrides) -> None:
    """Runs hypothesis over one operation; `overrides` go to hypothesis' settings."""
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    operation = schema[path][method]
    label = f"{method} {path} {mode.value}"
    strategy = operation.as_strategy(generation_mode=mode)
    if path in GENERATION_PATHS and mode == GenerationMode.POSITIVE:
        strategy = strategy.flatmap(steered)

    @given(case=strategy)
    @settings(
        **{
            "deadline": None,
            "suppress_health_check": list(HealthCheck),
            "database": None,
            **overrides,
        }
    )
    def check(case):
        STATS.cases[label] += 1
        check_case(case)

    check()
