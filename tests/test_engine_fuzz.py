"""The engine state machine of engine_fuzz_machine, bounded for the suite (derandomized, so a
run is reproducible; benches/fuzz_engine.py runs it for minutes with fresh randomness)."""

import pytest
from engine_fuzz_machine import STATS, EngineMachine, Engines, drain, may_find_no_token
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from aieng.sampling import SamplingParams
from aieng.structured_outputs import StructuredOutputsParams

BOUNDED = settings(
    max_examples=20,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return Engines(tmp_path_factory.mktemp("model"))


def test_random_requests_aborts_and_steps_keep_the_engine_sound(engines):
    EngineMachine.engines = engines
    before = STATS.requests
    run_state_machine_as_test(EngineMachine, settings=BOUNDED)
    assert STATS.requests > before


def test_abort_before_the_first_step_leaves_no_prompt_scoring_behind(engines):
    """Found by the fuzzer: the aborted request's prompt-scoring row reached the runner after
    its removal and scored the slot's next sequence (a sibling of "a")."""
    engine = engines.fresh()
    engine.add_request(
        "a", [42], SamplingParams(n=2, temperature=0, max_tokens=2, prompt_logprobs=0)
    )
    engine.add_request("b", [17, 42, 99, 130], SamplingParams(max_tokens=0, prompt_logprobs=0))
    engine.abort("b")
    [out] = drain(engine)
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    engine.check_pool_whole()


def test_a_grammar_whose_only_token_min_tokens_bans_ends_with_an_error(engines):
    """The grammar needs 'b' next (token 71), which min_tokens bans as a stop token: no token is
    valid, and the request ends with "error" (what may_find_no_token allows) while others go on."""
    engine = engines.fresh()
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        min_tokens=2,
        stop_token_ids=[71],
        structured_outputs=StructuredOutputsParams(regex="(ab|cd)+x"),
    )
    assert may_find_no_token(params)
    engine.add_request("banned", [42], params)
    engine.add_request("free", [42], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs = {o.request_id: o.outputs[0] for o in drain(engine)}
    assert outputs["banned"].finish_reason == "error"
    assert outputs["free"].finish_reason == "length" and len(outputs["free"].token_ids) == 4
    assert engine.dead_reason is None
    engine.check_pool_whole()
