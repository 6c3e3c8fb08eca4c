"""Property tests: random allocate / append / free sequences never break the pool's accounting."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kvcache import KVCacheManager

ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
    min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.sampled_from([8, 16]), ops=ops)
def test_random_allocate_append_free_keeps_invariants(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    sizes: dict[str, int] = {}
    for op, who, amount in ops:
        rid = f"r{who}"
        if op == "grow":
            target = sizes.get(rid, 0) + amount
            before = kv.num_free_blocks
            held = list(kv.tables[rid].block_ids) if rid in kv.tables else None
            needed = -(-target // block_size) - len(held or [])  # blocks this growth takes
            ok = kv.allocate_slots(rid, target)
            # it fails exactly when the blocks it needs exceed the free ones
            assert ok == (needed <= before), (needed, before)
            if ok:
                sizes[rid] = target
                assert len(kv.tables[rid].blocks) == -(-target // block_size)
                assert kv.tables[rid].block_ids[:len(held or [])] == (held or [])  # growth only appends
                assert kv.num_free_blocks == before - needed
            else:  # failure changes nothing
                assert kv.num_free_blocks == before
                assert (kv.tables[rid].block_ids if rid in kv.tables else None) == held
        else:
            kv.free(rid)
            sizes.pop(rid, None)
        kv.check_invariants()
        used = sum(len(t.blocks) for t in kv.tables.values())
        assert used + kv.num_free_blocks == num_blocks
    for rid in list(sizes):
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks
    kv.check_invariants()
