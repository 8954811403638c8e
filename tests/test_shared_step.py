"""A time-bounded step while clients share the engine (issue 37): while several clients have
requests in the core, a step's token budget is capped so that its duration, predicted by a cost
model the core learns from its own measured steps, stays under `shared_step_ms`; one client alone
always gets the full budget. The rule's arithmetic is tested in Rust (rust/src/shared_step.rs and
scheduler_shared_step_tests.rs); here the core measures real steps."""

import time

import numpy as np
import pytest
from server_fixtures import make_model_dir

from aieng.config.engine_args import EngineArgs
from aieng.core import EngineCore
from aieng.engine.llm_engine import LLMEngine
from aieng.sampling import SamplingParams

FULL = 2048
FIXED_S, PER_TOKEN_S = 0.002, 20e-6  # a step here lasts 2 ms plus 20 us a token, or more


def _core(target_ms: float) -> EngineCore:
    return EngineCore(
        num_blocks=4096,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=FULL,
        max_model_len=8192,
        enable_prefix_caching=False,
        shared_step_ms=target_ms,
    )


def _step(core: EngineCore) -> tuple[int, int]:
    """Runs a step that takes its tokens' time (sleep is never short; a loaded machine makes it
    longer, and the core then fits a higher cost). -> its tokens and its budget."""
    plan = core.schedule()
    time.sleep(FIXED_S + PER_TOKEN_S * plan.num_tokens)
    core.update(np.full(len(plan.logits_indices), 9, np.int64))
    return plan.num_tokens, core.step_token_budget


def _add(core: EngineCore, rid: str, length: int, client: str | None, max_tokens: int = 4) -> None:
    core.add_request(rid, [7 + i % 50 for i in range(length)], max_tokens=max_tokens,
                     ignore_eos=True, client=client)  # fmt: skip


def test_two_clients_sharing_get_steps_under_the_target_one_alone_the_full_budget():
    target_ms = 20.0  # 2 ms fixed: at most 900 tokens at 20 us
    core = _core(target_ms)
    _add(core, "alone", 8000, "heavy")
    assert [_step(core) for _ in range(2)] == [(FULL, FULL)] * 2
    for i in range(4):
        _add(core, f"heavy{i}", 8000, "heavy")
    _add(core, "light", 60, "light", max_tokens=40)
    steps = [_step(core) for _ in range(12)]
    assert len(core.request_token_ids("light")) < 100, "the light client still decodes"
    assert steps[0] == (FULL, FULL), "no step measured while one client was alone"
    for tokens, budget in steps[4:]:  # the model has seen a few steps
        assert tokens <= budget <= 1.1 * (target_ms / 1000 - FIXED_S) / PER_TOKEN_S
    assert core.stats()["step_token_budget"] == steps[-1][1]


def test_no_target_no_cap():
    core = _core(0.0)
    _add(core, "heavy", 8000, "heavy")
    _add(core, "light", 60, "light", max_tokens=40)
    assert [_step(core)[1] for _ in range(4)] == [FULL] * 4


def test_a_bad_target_is_refused():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="shared_step_ms"):
            _core(bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="shared_step_ms"):
            EngineArgs(shared_step_ms=bad)


def test_the_engine_caps_shared_steps_and_leaves_one_client_alone(tmp_path):
    """Through LLMEngine and a real model, with a target far below any step: a shared step
    takes the floor (each prefilling client the smallest one's whole prompt, else 16 tokens),
    beside its decodes; one client alone takes the full budget again after the hold-off."""
    folder = make_model_dir(tmp_path, max_positions=4096)
    engine = LLMEngine(
        EngineArgs(
            str(folder), kv_cache_memory=1 << 24, max_num_batched_tokens=256, shared_step_ms=1e-3
        )
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def step() -> int:
        engine.step()
        budget = engine.stats().step_token_budget
        assert engine.last_step_num_tokens <= budget
        return budget

    engine.add_request("alone", [5 + i % 300 for i in range(600)], params, client="heavy")
    while engine.has_unfinished():
        assert step() == 256
    engine.add_request("heavy", [5 + (7 * i) % 300 for i in range(1200)], params, client="heavy")
    engine.add_request("light1", list(range(5, 25)), params, client="light")
    assert step() == 256, "the first shared step is measured, not yet predicted"
    engine.add_request("light2", list(range(30, 50)), params, client="light")
    assert step() == 1 + 2 * 20, "light1's decode, light2's prompt and as much of heavy's"
    assert step() == 1 + 16, "light2's decode and the least prefill"
    assert "light2" not in engine.requests
    assert step() == 16, "heavy alone, within the hold-off"
    time.sleep(1.05)
    assert step() == 256, "heavy alone after the hold-off"
