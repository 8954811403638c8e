"""A hypothesis state machine over the real engine (a tiny random Llama): it adds requests with
random sampling parameters (n, max_tokens 0-6, min_tokens, stop strings and ids, ignore_eos,
logprobs and prompt logprobs, seeds, penalties, structured outputs), aborts live ones and steps,
on a KV cache small enough that requests are preempted.

After every rule the engine is alive; every finished request has a valid finish reason and no
more tokens than it asked for; deterministic requests (greedy or seeded) give the tokens the same
request gives alone on an engine of its own; logprobs are numbers; drained, the pool is whole.

`tests/test_engine_fuzz.py` runs a bounded number of examples; `benches/fuzz_engine.py` runs it
for minutes. Both count what they tried in `STATS`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from server_fixtures import make_model_dir

from aieng.config.engine_args import EngineArgs
from aieng.engine.llm_engine import LLMEngine
from aieng.errors import InvalidArgumentError
from aieng.outputs import RequestOutput
from aieng.sampling import SamplingParams
from aieng.structured_outputs import StructuredOutputsParams

MAX_MODEL_LEN = 40
BLOCK_SIZE = 4
# 2 layers x 2 KV heads x 16 dims x (K, V) x 2 bytes (bfloat16: the CPU's default cache under the
# native decoder) x 4 tokens = 1 KiB a block: 20 blocks hold two full-length sequences, so a few
# requests with n > 1 preempt one another.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 2 * BLOCK_SIZE
ENGINE_ARGS = dict(
    max_model_len=MAX_MODEL_LEN,
    block_size=BLOCK_SIZE,
    kv_cache_memory=20 * BLOCK_BYTES,
    enable_prefix_caching=True,
    max_num_seqs=8,
)
MAX_DRAIN_STEPS = 2000

BASE = [17, 42, 99, 130, 7, 250, 311, 64, 5, 77, 200, 150, 33, 280, 90, 12]
PROMPTS: list[str | list[int]] = [
    [42],
    BASE[:4],
    BASE[:8],  # shares its first blocks with the next ones: prefix-cache hits
    [*BASE[:8], 9, 10, 11],
    BASE + BASE[:8],
    [*BASE, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311],  # 28 tokens
    "The",
    "The quick brown fox",
    "Stop strings end a request: STOP here",
]
TOO_LONG = BASE * 3  # 48 tokens > MAX_MODEL_LEN: refused when added
STOP_STRINGS = ["e", "th", " ", "\n", "the", "zz", "STOP"]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
    "required": ["a"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    StructuredOutputsParams(regex=r"[a-c]{1,3}"),
    StructuredOutputsParams(regex=r"(ab|cd)+x"),
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json={"enum": ["red", "green"]}),
    StructuredOutputsParams(json_object=True),
]
FINISH_REASONS = {"stop", "length", "abort"}


@dataclass
class FuzzStats:
    """What the fuzzer tried, summed over examples (printed by benches/fuzz_engine.py)."""

    examples: int = 0
    requests: int = 0
    refused: int = 0  # add_request raised, as it should (a prompt past max_model_len)
    steps: int = 0
    aborts: int = 0
    preemptions: int = 0
    solo_checks: int = 0  # deterministic requests compared with their solo run
    finish_reasons: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # features the requests used

    def table(self) -> list[tuple[str, object]]:
        rows: list[tuple[str, object]] = [
            ("examples", self.examples),
            ("requests added", self.requests),
            ("requests refused (too long)", self.refused),
            ("engine steps", self.steps),
            ("aborts", self.aborts),
            ("preemptions", self.preemptions),
            ("solo-run comparisons", self.solo_checks),
        ]
        rows += [(f"finish {k}", v) for k, v in sorted(self.finish_reasons.items())]
        rows += [(f"with {k}", v) for k, v in sorted(self.kinds.items())]
        return rows


STATS = FuzzStats()


class Engines:
    """Builds the engine under test, fresh for each example (a few milliseconds: the model is
    tiny), and runs requests alone on an engine of their own, caching what they gave."""

    def __init__(self, folder: Path):
        self.config = EngineArgs(model=str(make_model_dir(folder)), **ENGINE_ARGS)
        self.solo_results: dict[tuple, RequestOutput] = {}

    def fresh(self) -> LLMEngine:
        return LLMEngine(self.config)

    def run_alone(self, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
        key = (repr(prompt), repr(params))
        if key not in self.solo_results:
            engine = self.fresh()
            engine.add_request("alone", prompt, params)
            [out] = drain(engine)
            engine.check_pool_whole()
            self.solo_results[key] = out
        return self.solo_results[key]


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    for _ in range(MAX_DRAIN_STEPS):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"the engine did not finish its requests in {MAX_DRAIN_STEPS} steps")


@st.composite
def sampling_params(draw) -> SamplingParams:
    max_tokens = draw(st.integers(0, 6))
    params = dict(
        n=draw(st.integers(1, 4)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.5])),
        seed=draw(st.none() | st.integers(0, 2**31)),
    )
    if draw(st.booleans()):
        params["stop"] = draw(st.lists(st.sampled_from(STOP_STRINGS), min_size=1, max_size=3))
        params["include_stop_str_in_output"] = draw(st.booleans())
    if draw(st.booleans()):
        params["stop_token_ids"] = draw(st.lists(st.integers(0, 383), min_size=1, max_size=4))
    if draw(st.booleans()):
        params["logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        params["prompt_logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        params["repetition_penalty"] = draw(st.sampled_from([0.8, 1.2, 2.0]))
        params["presence_penalty"] = draw(st.sampled_from([-1.0, 0.0, 1.5]))
        params["frequency_penalty"] = draw(st.sampled_from([-0.5, 0.0, 2.0]))
    if params["temperature"] > 0 and draw(st.booleans()):
        params["top_k"] = draw(st.sampled_from([1, 5, 50]))
        params["top_p"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
    if draw(st.integers(0, 3)) == 0:
        params["structured_outputs"] = draw(st.sampled_from(CONSTRAINTS))
    return SamplingParams(**params)


def features(params: SamplingParams) -> list[str]:
    used = [f"n={params.n}"] if params.n > 1 else []
    used += [name for name in ("stop", "stop_token_ids", "seed") if getattr(params, name)]
    used += [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) is not None]
    if params.greedy:
        used.append("greedy")
    if params.max_tokens == 0:
        used.append("max_tokens=0")
    if params.min_tokens:
        used.append("min_tokens")
    if params.ignore_eos:
        used.append("ignore_eos")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        used.append("penalties")
    if params.structured_outputs is not None:
        used.append(f"structured {params.structured_outputs.kind}")
    return used


def deterministic(params: SamplingParams) -> bool:
    """Whether the request's tokens do not depend on what else the engine runs."""
    return params.greedy or params.seed is not None


@dataclass
class Live:
    prompt: str | list[int]
    params: SamplingParams


class EngineMachine(RuleBasedStateMachine):
    """Set `EngineMachine.engines` (an Engines) before running it."""

    engines: Engines

    def __init__(self):
        super().__init__()
        self.engine = self.engines.fresh()
        self.live: dict[str, Live] = {}
        self.finished: list[tuple[Live, RequestOutput]] = []
        STATS.examples += 1

    @rule(prompt=st.sampled_from([*PROMPTS, TOO_LONG]), params=sampling_params())
    def add(self, prompt, params):
        rid = self.engine.new_request_id()
        if prompt is TOO_LONG:
            with pytest.raises(InvalidArgumentError, match="max_model_len"):
                self.engine.add_request(rid, prompt, params)
            STATS.refused += 1
            return
        self.engine.add_request(rid, prompt, params)
        self.live[rid] = Live(prompt, params)
        STATS.requests += 1
        STATS.kinds.update(features(params))

    def abortable(self) -> list[str]:
        return sorted(self.live)

    @precondition(lambda self: self.abortable())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.abortable()))
        out = self.engine.abort(rid)
        assert out is not None, f"live request {rid} unknown to the engine"
        assert all(c.finish_reason is not None for c in out.outputs), out
        self.record(out)
        STATS.aborts += 1

    @rule(count=st.integers(1, 4))
    def step(self, count):
        for _ in range(count):
            for out in self.engine.step():
                self.record(out)
            STATS.steps += 1

    @invariant()
    def engine_alive(self):
        assert self.engine.dead_reason is None, self.engine.dead_reason

    def record(self, out: RequestOutput) -> None:
        assert out.finished, out
        live = self.live.pop(out.request_id)
        check_output(live, out)
        self.finished.append((live, out))

    def teardown(self):
        if self.engine.dead_reason is not None:
            return
        for out in drain(self.engine):
            self.record(out)
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        self.engine.check_pool_whole()
        STATS.preemptions += self.engine.core.stats()["num_preemptions"]
        for live, out in self.finished:
            if deterministic(live.params) and all(c.finish_reason != "abort" for c in out.outputs):
                self.check_solo(live, out)

    def check_solo(self, live: Live, out: RequestOutput) -> None:
        alone = self.engines.run_alone(live.prompt, live.params)
        STATS.solo_checks += 1
        got = [(c.token_ids, c.finish_reason) for c in out.outputs]
        want = [(c.token_ids, c.finish_reason) for c in alone.outputs]
        assert got == want, (
            f"prompt {live.prompt!r} with {live.params}: batched {got}, alone {want}"
        )


def may_find_no_token(params: SamplingParams) -> bool:
    """Whether a request can end with "error" (no valid token): min_tokens bans EOS and the stop
    token ids that its grammar may be left with as the only tokens allowed."""
    return params.structured_outputs is not None and params.min_tokens > 0


def check_output(live: Live, out: RequestOutput) -> None:
    params = live.params
    assert len(out.outputs) == params.n, out
    for completion in out.outputs:
        reason = completion.finish_reason
        STATS.finish_reasons[reason] += 1
        assert reason in FINISH_REASONS or (reason == "error" and may_find_no_token(params)), (
            f"finish {reason!r} ({completion.stop_reason!r}) for prompt {live.prompt!r} "
            f"with {params}"
        )
        n = len(completion.token_ids)
        assert n <= params.max_tokens, (n, params)
        if reason == "error":
            continue
        if reason == "length":
            assert n == params.max_tokens or len(out.prompt_token_ids) + n >= MAX_MODEL_LEN, (
                n,
                params,
            )
        if reason == "stop" and params.structured_outputs is None:
            assert n >= params.min_tokens, (completion, params)
        if params.logprobs is not None and reason != "abort":
            assert len(completion.logprobs) == n, completion
            for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
                assert token in top and math.isfinite(top[token]), (token, top, params)
                assert not any(math.isnan(v) for v in top.values()), (top, params)
    if params.prompt_logprobs is not None and out.outputs[0].finish_reason != "abort":
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(out.prompt_token_ids), out
        assert scored[0] is None
        for token, top in zip(out.prompt_token_ids[1:], scored[1:], strict=True):
            assert top is not None and token in top and math.isfinite(top[token]), (token, top)
            assert all(math.isfinite(v) for v in top.values()), top
