"""A dropped plan's buffer and views are refilled by a later step, only while no one else
holds them: an array anyone still holds never changes, and every plan reads the same as a
plan of fresh arrays."""

import gc
import weakref

import numpy as np
import torch

from aieng.core import EngineCore

NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "num_computed_tokens",
         "seq_lens", "logits_indices", "sample_request_rows", "slots", "new_block_slots",
         "new_block_indices", "new_block_ids", "banned_rows", "banned_ids")  # fmt: skip


def make_core() -> EngineCore:
    core = EngineCore(num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    rng = np.random.default_rng(3)
    for i in range(10):
        prompt = rng.integers(3, 500, size=int(rng.integers(1, 30))).tolist()
        core.add_request(f"r{i}", prompt, max_tokens=int(rng.integers(1, 25)), min_tokens=1,
                         eos_token_ids=[2], stop_token_ids=[7])  # fmt: skip
    return core


def read(obj) -> np.ndarray:
    return obj.numpy() if isinstance(obj, torch.Tensor) else np.asarray(obj)


def sampled(step: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 31 + step * 7) % 300 + 3


def fresh_plans() -> list[dict[str, np.ndarray]]:
    """The columns of every step of a core whose plans and columns are all held to the end
    (so no step can reuse a buffer)."""
    core, held, steps = make_core(), [], []
    while core.has_unfinished():
        plan = core.schedule()
        columns = {name: getattr(plan, name) for name in NAMES}
        held.append((plan, columns))
        steps.append({name: column.copy() for name, column in columns.items()})
        core.update(sampled(len(steps), len(columns["logits_indices"])))
    return steps


def test_reused_arrays_read_as_fresh_ones_and_held_ones_never_change():
    expected = fresh_plans()
    assert len(expected) > 10
    core, rng, held, step = make_core(), np.random.default_rng(5), [], 0
    while core.has_unfinished():
        plan = core.schedule()
        columns = {name: getattr(plan, name) for name in NAMES}
        for name in NAMES:
            np.testing.assert_array_equal(columns[name], expected[step][name], err_msg=name)
            assert columns[name].dtype == np.int32 and columns[name].flags.writeable
        # Hold a few of this step's arrays (a column, a slice, a memoryview, a tensor) for a
        # few steps; drop the rest with the plan.
        for name in rng.choice(NAMES, size=3, replace=False):
            kind = rng.integers(4)
            column = columns[name]
            obj = (column, column[1:], memoryview(column), torch.from_numpy(column))[kind]
            held.append((obj, read(obj).copy(), step + int(rng.integers(1, 4))))
        step += 1
        core.update(sampled(step, len(columns["logits_indices"])))
        del plan, columns
        for obj, copy, _ in held:
            np.testing.assert_array_equal(read(obj), copy)
        held = [h for h in held if h[2] > step]
    assert step == len(expected)


def test_a_view_its_user_changed_is_not_reused():
    expected = fresh_plans()
    core = make_core()
    plan = core.schedule()
    views = {name: getattr(plan, name) for name in NAMES}
    views["input_ids"].flags.writeable = False
    views["positions"].shape = (1, -1)
    views["slot_mapping"].dtype = np.uint32
    watched = weakref.ref(views["seq_lens"])
    del plan, views
    gc.collect()
    for step in range(1, 4):
        core.update(sampled(step, len(expected[step - 1]["logits_indices"])))
        plan = core.schedule()
        for name in NAMES:
            column = getattr(plan, name)
            assert column.dtype == np.int32 and column.ndim == 1 and column.flags.writeable
            np.testing.assert_array_equal(column, expected[step][name], err_msg=name)
        # The weakly referenced view was dropped, not refilled for a later plan.
        assert watched() is None
        del plan, column
