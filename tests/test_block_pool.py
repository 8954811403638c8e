"""The block pool as a framework author embeds it: aieng.core.BlockPool."""

import gc

import numpy as np
import pytest

import aieng
from aieng.core import BlockPool


def test_allocate_release_with_and_gc_free_exactly_once():
    pool = BlockPool(num_blocks=8, block_size=4)
    table = pool.allocate([1, 2, 3, 4, 5])
    assert len(table.block_ids) == 2 and pool.num_free_blocks == 6
    table.release()
    table.release()  # a second release does nothing
    assert table.released and pool.num_free_blocks == 8
    with pytest.raises(aieng.EngineStateError, match="released"):
        _ = table.block_ids

    with pool.allocate(np.arange(9, dtype=np.int64)) as t:
        assert pool.num_free_blocks == 5
        assert t.num_tokens == 9
    assert pool.num_free_blocks == 8

    t = pool.allocate(range(16))
    assert pool.num_free_blocks == 4
    del t
    gc.collect()
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_out_of_blocks_is_all_or_nothing():
    pool = BlockPool(4, 4)
    held = pool.allocate(range(8))
    with pytest.raises(aieng.OutOfBlocksError, match="need 3 free blocks"):
        pool.allocate(range(100, 112))
    assert pool.num_free_blocks == 2
    with pytest.raises(aieng.OutOfBlocksError):
        held.append(range(9))
    assert held.num_tokens == 8
    pool.check_invariants()


def test_prefix_reuse_and_stats():
    pool = BlockPool(16, 4)
    first = pool.allocate(range(10))
    first.commit()
    second = pool.allocate([*range(8), 99, 98, 97])
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    stats = pool.stats()
    assert stats["prefix_cache_queries"] == 21
    assert stats["prefix_cache_hits"] == 8
    assert stats["num_cached_blocks"] == 2
    assert stats["usage"] == pytest.approx(1 - pool.num_free_blocks / 16)
    first.release()
    second.release()
    # Freed cached blocks stay reusable until evicted.
    third = pool.allocate(range(9))
    assert third.num_cached_tokens == 8


def test_prefix_caching_can_be_switched_off():
    pool = BlockPool(16, 4, enable_prefix_caching=False)
    pool.allocate(range(10)).commit()
    assert pool.allocate(range(10)).num_cached_tokens == 0
    assert not pool.enable_prefix_caching


@pytest.mark.parametrize(
    ("args", "match"),
    [((0, 16), "num_blocks"), ((4, 0), "block_size")],
)
def test_bad_sizes_raise_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        BlockPool(*args)


def test_bad_token_ids_raise_value_errors():
    pool = BlockPool(4, 4)
    with pytest.raises(aieng.InvalidArgumentError, match="out of range"):
        pool.allocate([1, -2])
    with pytest.raises(ValueError, match="sequence of ints"):
        pool.allocate("not tokens")
    assert pool.num_free_blocks == 4
