"""EngineCore from Python: the step plan arrays, update, errors."""

import numpy as np
import pytest

import aieng
from aieng.core import EngineCore


def test_plan_arrays_are_int32_numpy_and_consistent():
    core = EngineCore(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core.add_request("a", [5, 6, 7, 8, 9], max_tokens=3, ignore_eos=True)
    core.add_request("b", np.array([1, 2], dtype=np.int32), max_tokens=1)
    plan = core.schedule()
    assert plan.request_ids == ["a", "b"]
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert getattr(plan, name).dtype == np.int32
    assert plan.block_tables.shape == (2, 2)
    np.testing.assert_array_equal(plan.input_ids, [5, 6, 7, 8, 9, 1, 2])
    np.testing.assert_array_equal(plan.query_start_loc, [0, 5, 7])
    np.testing.assert_array_equal(plan.logits_indices, [4, 6])
    np.testing.assert_array_equal(plan.sample_request_rows, [0, 1])
    tables = plan.block_tables
    for tok, (pos, slot) in enumerate(zip(plan.positions, plan.slot_mapping, strict=True)):
        row = 0 if tok < 5 else 1
        assert slot == tables[row, pos // 4] * 4 + pos % 4
    out = core.update(np.array([11, 12], dtype=np.int64))
    np.testing.assert_array_equal(out.token_ids, [11, 12])
    [done] = out.finished
    assert (done.request_id, done.finish_reason, done.num_output_tokens) == ("b", "length", 1)
    assert core.request_token_ids("a") == [5, 6, 7, 8, 9, 11]
    assert core.num_running == 1


def test_errors_are_typed_and_name_the_problem():
    core = EngineCore(num_blocks=4, block_size=4, max_num_seqs=4, max_model_len=32)
    with pytest.raises(aieng.RequestTooLargeError, match="32 tokens but max_model_len is 32"):
        core.add_request("long", list(range(32)))
    with pytest.raises(aieng.RequestTooLargeError, match="pool has only 4"):
        core.add_request("big", [1, 2], max_tokens=30)
    with pytest.raises(ValueError, match="empty"):
        core.add_request("empty", [])
    with pytest.raises(ValueError, match="max_tokens"):
        core.add_request("zero", [1], max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        core.add_request("neg", [1], min_tokens=-1)
    with pytest.raises(aieng.UnknownRequestError):
        core.abort("nobody")
    with pytest.raises(aieng.EngineStateError, match="without a scheduled step"):
        core.update([])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineCore(num_blocks=4, max_num_seqs=8, max_num_batched_tokens=4)
    core.add_request("ok", [1, 2, 3], max_tokens=2)
    core.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled tokens, got 2"):
        core.update([1, 2])
    core.update([4])  # the step is still in flight after a refused update
    assert core.abort("ok").finish_reason == "abort"
    assert not core.has_unfinished()
    stats = core.stats()
    assert stats["pool"]["num_free_blocks"] == 4


def test_block_pool_view_shares_the_core_pool():
    core = EngineCore(num_blocks=16, block_size=4)
    core.add_request("a", list(range(10)), max_tokens=4)
    core.schedule()
    assert core.block_pool.num_free_blocks == 13
    core.abort("a")
    assert core.block_pool.num_free_blocks == 16
