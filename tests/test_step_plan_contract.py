"""One plan contract (`aieng.worker.step_plan`): every producer of a plan has every field of it —
the Rust core's StepPlan, the snapshot a tensor-parallel rank receives, the one-off forwards —
and the Rust plan has no array the contract does not name (a field added on one side only fails
here)."""

import ast
import dataclasses
from pathlib import Path

import numpy as np

import aieng
from aieng._core import EngineCore
from aieng._core import StepPlan as RustStepPlan
from aieng.executor.messages import PlanSnapshot
from aieng.worker.runner import _chunk_of, _single_prompt_plan
from aieng.worker.step_plan import (
    FORWARD_ARRAYS,
    STEP_ARRAYS,
    STEP_FIELDS,
    ForwardArrays,
    ForwardPlan,
    StepPlan,
    missing_fields,
)

# Read on demand from the core's own tables, not part of a step's contract.
RUST_EXTRAS = {"request_ids"}


def rust_plan():
    core = EngineCore(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request("a", [1, 2, 3, 4, 5], max_tokens=2)
    return core, core.schedule()


def test_the_rust_plan_meets_the_contract():
    _core, plan = rust_plan()
    assert missing_fields(plan) == []
    assert isinstance(plan, StepPlan) and isinstance(plan, ForwardPlan)
    for name in STEP_ARRAYS:
        assert getattr(plan, name).dtype == np.int32, name


def test_the_rust_plan_has_no_field_outside_the_contract():
    public = {n for n in dir(RustStepPlan) if not n.startswith("_")}
    assert public - RUST_EXTRAS == {*STEP_FIELDS, "grammar_bitmask"}


def test_the_stub_declares_the_contract():
    stub = Path(aieng.__file__).with_name("_core.pyi")
    tree = ast.parse(stub.read_text())
    [klass] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepPlan"]
    declared = {n.name for n in klass.body if isinstance(n, ast.FunctionDef)}
    assert {*STEP_FIELDS, "grammar_bitmask"} <= declared


def test_a_ranks_snapshot_meets_the_contract():
    _core, plan = rust_plan()
    snapshot = PlanSnapshot.of(plan)
    assert missing_fields(snapshot) == []
    for name in STEP_ARRAYS:
        np.testing.assert_array_equal(getattr(snapshot, name), getattr(plan, name))
    assert (snapshot.num_tokens, snapshot.num_requests) == (plan.num_tokens, plan.num_requests)


def test_one_off_forwards_meet_the_forward_contract():
    assert tuple(f.name for f in dataclasses.fields(ForwardArrays)) == FORWARD_ARRAYS
    plan, tables = _single_prompt_plan(10, 3, 4)
    assert missing_fields(plan, ForwardPlan) == [] and tables.shape == (1, 3)
    chunk = _chunk_of(plan, 4, 8)
    assert missing_fields(chunk, ForwardPlan) == []
    assert chunk.num_computed_tokens.tolist() == [4] and chunk.seq_lens.tolist() == [8]


def test_a_producer_without_a_field_is_named():
    _core, plan = rust_plan()
    partial = {name: getattr(plan, name) for name in FORWARD_ARRAYS}
    assert missing_fields(ForwardArrays(**partial), ForwardPlan) == []
    missing = missing_fields(ForwardArrays(**partial))
    assert "slots" in missing and "grammar_bitmask()" in missing
