from services.decoder.engine.kv_cache_manager import KVCacheManager
from services.decoder.engine.request import Request
from services.decoder.engine.step import SamplingParams


def _req(rid, tokens, extra=()):
    return Request(rid, tokens, SamplingParams(), arrival_seq=0, extra_keys=extra)


def _compute_all(kv, req):
    """Allocate and 'compute' the whole prompt the way the scheduler does."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return num_hit


def test_allocate_grows_the_table_and_frees_everything():
    kv = KVCacheManager(block_size=4, num_blocks=4, enable_prefix_caching=False)
    r = _req("a", list(range(1, 6)))
    assert len(kv.allocate_slots(r, 5)) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) == []          # positions 5..7 fit the second block
    assert len(kv.allocate_slots(r, 4)) == 1
    assert len(r.block_ids) == 3
    assert kv.allocate_slots(r, 12) is None        # 17 positions need 2 more, 1 free: nothing changes
    assert len(r.block_ids) == 3 and kv.num_free_blocks == 1
    kv.free(r)
    assert r.block_ids == []
    kv.check_idle()


def test_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(block_size=4, num_blocks=8, enable_prefix_caching=True)
    prompt = list(range(1, 9))                     # exactly two full blocks
    _compute_all(kv, _req("a", prompt))
    b = _req("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and len(hits) == 1         # the last block is recomputed for logits
    c = _req("c", prompt + [9])
    assert kv.get_computed_blocks(c)[1] == 8


def test_shared_blocks_are_ref_counted_and_return_to_idle():
    kv = KVCacheManager(block_size=2, num_blocks=6, enable_prefix_caching=True)
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [1, 2, 3, 4, 6])
    assert _compute_all(kv, a) == 0
    assert _compute_all(kv, b) == 4
    assert a.block_ids[:2] == b.block_ids[:2] and a.block_ids[2] != b.block_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a.block_ids[:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    kv.check_idle()


def test_different_extra_keys_never_share():
    kv = KVCacheManager(block_size=2, num_blocks=8, enable_prefix_caching=True)
    _compute_all(kv, _req("a", [1, 2, 3, 4, 5], extra=("lora", "A")))
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5], extra=("lora", "B")))[1] == 0
    assert kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 5], extra=("lora", "A")))[1] == 4


def test_blocks_are_registered_only_once_computed():
    kv = KVCacheManager(block_size=2, num_blocks=8, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5]))[1] == 0   # allocated, not computed
    a.num_computed_tokens = 2
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 5]))[1] == 2


def test_free_hits_count_against_room():
    kv = KVCacheManager(block_size=2, num_blocks=3, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])
    _compute_all(kv, a)
    kv.free(a)                                     # 3 free, 2 of them cached
    b = _req("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert kv.allocate_slots(b, 4, hits) is None   # 2 hits + 2 new > 3 free
    assert kv.num_free_blocks == 3 and b.block_ids == []
    assert kv.allocate_slots(b, 2, hits) is not None
