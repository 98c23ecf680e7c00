import pytest

from services.decoder.engine.block_pool import BlockPool


def test_allocate_returns_none_without_room_and_changes_nothing():
    pool = BlockPool(3)
    got = pool.allocate(2)
    assert [b.ref_cnt for b in got] == [1, 1]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(2 / 3)
    pool.release(got)
    pool.check_idle()


def test_double_free_is_caught():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_cached_free_block_can_be_taken_back():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    assert pool.cache(b, b"h1")
    pool.release([b])
    assert pool.num_free_blocks == 2           # cached but free still counts as free
    assert pool.lookup(b"h1") is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([b])                            # a second holder of the same block
    assert b.ref_cnt == 2
    pool.release([b, b])
    pool.check_idle()
    assert pool.lookup(b"h1") is b


def test_lru_eviction_takes_least_recently_freed_and_forgets_its_hash():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(blk, h)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    (x,) = pool.allocate(1)
    assert x is b and x.block_hash is None and pool.lookup(b"b") is None
    assert pool.lookup(b"a") is a and pool.lookup(b"c") is c
    (y,) = pool.allocate(1)
    assert y is a


def test_duplicate_hash_is_not_overwritten():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h")
    assert not pool.cache(b, b"h")
    assert not pool.cache(a, b"other")
    assert pool.lookup(b"h") is a and b.block_hash is None
