"""EngineCore from Python: the step plan arrays, update, errors."""

import numpy as np
import pytest
import torch

import aieng
from aieng.core import EngineCore
from aieng.worker.input_buffers import InputBuffers


def test_plan_arrays_are_int32_numpy_and_consistent():
    core = EngineCore(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core.add_request("a", [5, 6, 7, 8, 9], max_tokens=3, ignore_eos=True)
    core.add_request("b", np.array([1, 2], dtype=np.int32), max_tokens=1)
    plan = core.schedule()
    assert plan.request_ids == ["a", "b"]
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert getattr(plan, name).dtype == np.int32
    np.testing.assert_array_equal(plan.input_ids, [5, 6, 7, 8, 9, 1, 2])
    np.testing.assert_array_equal(plan.query_start_loc, [0, 5, 7])
    np.testing.assert_array_equal(plan.logits_indices, [4, 6])
    np.testing.assert_array_equal(plan.sample_request_rows, [0, 1])
    # The runner's block tables (the one copy), kept from the plan's new blocks.
    inputs = InputBuffers(64, 8, torch.device("cpu"))
    inputs.apply_new_blocks(plan.new_block_slots, plan.new_block_indices, plan.new_block_ids)
    tables = inputs.block_tables(np.asarray(plan.slots, np.int64), 2)
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


def test_token_ids_beyond_int32_come_back_whole():
    core = EngineCore(num_blocks=8, block_size=4)
    core.add_request("a", [1, 2], max_tokens=3, ignore_eos=True)
    core.schedule()
    out = core.update(np.array([2**31 + 5], dtype=np.int64))
    assert out.token_ids.dtype == np.int64
    assert out.token_ids.tolist() == [2**31 + 5]
    assert core.request_token_ids("a") == [1, 2, 2**31 + 5]
    core.schedule()
    with pytest.raises(aieng.InvalidArgumentError, match="out of range"):
        core.update([2**32])


def test_update_takes_several_tokens_per_row():
    core = EngineCore(num_blocks=16, block_size=4, max_num_seqs=4)
    core.add_request("a", [1, 2, 3], max_tokens=10, ignore_eos=True)
    core.add_request("b", [4, 5], max_tokens=2, ignore_eos=True)
    core.schedule()
    out = core.update([7, 8, 9, 10, 11, 12], num_sampled=np.array([3, 3]))
    assert out.rows.tolist() == [0, 0, 0, 1, 1]
    assert out.token_ids.tolist() == [7, 8, 9, 10, 11], "b ends at max_tokens: 12 is dropped"
    assert out.texts == [""] * 5
    assert [(f.request_id, f.finish_reason) for f in out.finished] == [("b", "length")]
    plan = core.schedule()
    np.testing.assert_array_equal(plan.input_ids, [7, 8, 9])
    np.testing.assert_array_equal(plan.positions, [3, 4, 5])
    np.testing.assert_array_equal(plan.logits_indices, [2])
    np.testing.assert_array_equal(plan.new_block_indices, [1], "position 4 opens a's block 1")
    with pytest.raises(aieng.InvalidArgumentError, match=r"num_sampled\[0\] is 0"):
        core.update([1], num_sampled=[0])
    with pytest.raises(aieng.InvalidArgumentError, match="adds up to 2 tokens but sampled has 1"):
        core.update([1], num_sampled=[2])
    with pytest.raises(aieng.InvalidArgumentError, match="2 entries but the step has 1"):
        core.update([1, 2], num_sampled=[1, 1])
    with pytest.raises(aieng.InvalidArgumentError, match="num_sampled must be"):
        core.update([1], num_sampled="x")
    out = core.update([13], num_sampled=[1])  # the step stayed in flight
    assert core.request_token_ids("a") == [1, 2, 3, 7, 8, 9, 13]


def test_new_blocks_keep_a_runner_table_equal_to_block_tables():
    """A runner's persistent table, kept only from each plan's new blocks, holds every
    scheduled row's blocks over a long run with preemptions, prefix hits, aborts, slot reuse
    and several tokens per row; a plan's block_tables and request_ids read after later steps
    are still its own."""
    rng = np.random.default_rng(0)
    block_size, max_model_len = 4, 48
    core = EngineCore(
        num_blocks=14,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=20,
        max_model_len=max_model_len,
    )
    table = np.full((64, max_model_len // block_size), -1, dtype=np.int32)
    ids_of_slot: dict[int, str] = {}
    shared = rng.integers(3, 1000, size=12).tolist()
    held = None  # a plan read again after the next step: (plan, its rows as the runner saw them)
    for i in range(800):
        if len(ids_of_slot) < 10 and rng.random() < 0.6:
            prompt = shared[: rng.integers(0, 12)] + rng.integers(3, 1000, size=3).tolist()
            rid = f"r{i}"
            ids_of_slot[core.add_request(rid, prompt, max_tokens=int(rng.integers(1, 30)))] = rid
        plan = core.schedule()
        if len(plan.new_block_slots):
            table[plan.new_block_slots, plan.new_block_indices] = plan.new_block_ids
        used = -(-plan.seq_lens // block_size)
        rows = [table[slot, :n].copy() for slot, n in zip(plan.slots, used, strict=True)]
        ids = [ids_of_slot[slot] for slot in plan.slots.tolist()]
        for rid, blocks in zip(ids, rows, strict=True):
            assert blocks.tolist() == core.block_ids(rid)[: len(blocks)], rid
        if held is not None:
            check_plan(*held, block_size)
        held = (plan, rows, ids) if i % 2 else None
        if not held:
            check_plan(plan, rows, ids, block_size)
        if len(plan.slots) and rng.random() < 0.05:
            ids_of_slot.pop(core.abort(ids[0]).slot)
        counts = rng.integers(1, 4, size=len(plan.logits_indices))
        sampled = rng.integers(3, 1000, size=int(counts.sum()))
        out = core.update(sampled, num_sampled=counts)
        for done in out.finished:
            ids_of_slot.pop(done.slot)
            table[done.slot] = -1  # a runner may forget it: a new table is reported whole
    assert core.stats()["num_preemptions"] > 0
    assert core.stats()["pool"]["prefix_cache_hits"] > 0


def check_plan(plan, rows, ids, block_size):
    """The plan's rows, read now or after the next step, still name their requests."""
    assert plan.num_requests == len(rows)
    assert plan.request_ids == ids


def test_plan_columns_are_views_of_one_buffer_that_outlive_the_plan():
    core = EngineCore(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core.add_request("a", [5, 6, 7, 8, 9], max_tokens=3, min_tokens=2, stop_token_ids=[2])
    core.add_request("b", [1, 2], max_tokens=1)
    plan = core.schedule()
    names = ("input_ids", "positions", "slot_mapping", "query_start_loc", "num_computed_tokens",
             "seq_lens", "logits_indices", "sample_request_rows", "slots", "new_block_slots",
             "new_block_indices", "new_block_ids", "banned_rows", "banned_ids")  # fmt: skip
    columns = {name: getattr(plan, name) for name in names}
    # One buffer under every column; a column read twice is the same object.
    assert len({id(c.base) for c in columns.values()}) == 1
    assert all(getattr(plan, name) is columns[name] for name in names)
    expected = {name: column.copy() for name, column in columns.items()}
    np.testing.assert_array_equal(expected["input_ids"], [5, 6, 7, 8, 9, 1, 2])
    np.testing.assert_array_equal(expected["banned_rows"], [0])
    np.testing.assert_array_equal(expected["banned_ids"], [2])
    # Columns do not overlap: writing one leaves the others as they were.
    columns["positions"][:] = -1
    for name in names:
        if name != "positions":
            np.testing.assert_array_equal(columns[name], expected[name], err_msg=name)
    # A column keeps its memory alive once the plan and the other columns are gone.
    ids = columns.pop("input_ids")
    del plan, columns
    core.update(np.array([11, 12], dtype=np.int64))
    core.schedule()
    np.testing.assert_array_equal(ids, [5, 6, 7, 8, 9, 1, 2])


def test_update_reads_strided_and_other_integer_arrays():
    core = EngineCore(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core.add_request("a", [5, 6], max_tokens=4, ignore_eos=True)
    core.add_request("b", [1, 2], max_tokens=4, ignore_eos=True)
    sampled = {
        "strided int64": np.array([11, 0, 12, 0], dtype=np.int64)[::2],
        "int32": np.array([13, 14], dtype=np.int32),
        "list": [15, 16],
    }
    for tokens in sampled.values():
        core.schedule()
        out = core.update(tokens)
        np.testing.assert_array_equal(out.token_ids, list(tokens))
    assert core.request_token_ids("a") == [5, 6, 11, 13, 15]
    core.schedule()
    with pytest.raises(ValueError, match="out of range"):
        core.update(np.array([-1, 3], dtype=np.int64))
