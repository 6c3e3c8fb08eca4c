"""``/dashboard/state`` and its block states without a browser: each block's state follows its ref
count and prefix-cache hash (paged and contiguous managers), the counts agree with ``/metrics`` on
an idle server, and the page and its assets are served from the package."""

from __future__ import annotations

from pagedllm.kvcache.block_map import CACHED, FREE, SHARED, STATE_NAMES, USED, state_counts
from pagedllm.kvcache.block_map import block_map as block_states
from pagedllm.kvcache.contiguous import ContiguousKVCacheManager
from pagedllm.kvcache.manager import KVCacheManager
from tests.server.test_metrics import samples


def test_block_states_follow_ref_counts_and_hashes():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    prompt = list(range(10))
    assert kv.allocate_slots("a", 10)                      # 3 blocks, 2 of them full
    kv.cache_full_blocks("a", prompt, 10)
    kv.fork("a", "a-1", 10)                                # a's 3 blocks: ref 2
    assert kv.allocate_slots("b", 6)                       # 2 blocks of b's own
    assert kv.allocate_slots("c", 8)
    kv.cache_full_blocks("c", [99] * 8, 8)
    kv.free("c")                                           # 2 cached blocks, ref 0
    kv.check_invariants()
    codes, tables = block_states(kv)
    a, b = kv.block_ids("a"), kv.block_ids("b")
    assert tables == {"a": a, "a-1": a, "b": b}
    assert [codes[i] for i in a] == [SHARED] * 3
    assert [codes[i] for i in b] == [USED] * 2
    assert_counts_are_the_stats(kv)
    cached = [i for i, c in enumerate(codes) if c == CACHED]
    assert len(cached) == 2 and all(kv.allocator.blocks[i].ref_count == 0 for i in cached)
    assert codes.count(FREE) == 12 - 3 - 2 - 2 == kv.num_free_blocks - 2
    # a cached block that is hit again is in use, not cached
    hit = kv.cached_prefix("d", [99] * 4 + [1])            # c's first block
    assert len(hit) == 1 and kv.allocate_slots("d", 5, cached=hit)
    codes, _ = block_states(kv)
    assert codes.count(CACHED) == 1 and codes[hit[0].block_id] == USED
    assert_counts_are_the_stats(kv)


def assert_counts_are_the_stats(kv) -> None:
    """The dashboard's counts come from ``stats()``: they equal the block map's, state by state."""
    codes, _ = block_states(kv)
    assert state_counts(kv.stats()) == {name: codes.count(code) for code, name in enumerate(STATE_NAMES)}


def test_block_states_of_the_contiguous_layout():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, max_model_len=16)
    assert kv.allocate_slots("a", 5)
    assert kv.fork("a", "a-1", 5)                          # a copy in a run of its own: nothing shared
    codes, tables = block_states(kv)
    assert tables == {"a": [0, 1, 2, 3], "a-1": [4, 5, 6, 7]}
    assert list(codes) == [USED] * 8 + [FREE] * 8
    assert_counts_are_the_stats(kv)


def test_state_route_page_and_assets(tiny_app):
    client, ctx = tiny_app
    r = client.post("/v1/completions", json={"prompt": list(range(5, 30)), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    state = client.get("/dashboard/state").json()
    metrics = samples(client.get("/metrics").text)
    assert state["step"] == metrics["pagedllm:engine_steps_total"] > 0  # idle: no step between the two reads
    assert state["layout"] == "paged" and len(state["states"]) == state["num_blocks"] == 64
    counts = state["counts"]
    assert counts["free"] + counts["cached"] == metrics["pagedllm:num_free_blocks"] == 64
    assert counts["cached"] == counts["hashed"] == metrics["pagedllm:num_cached_blocks"] == 3  # 27 tokens: 3 full
    assert state["states"].count("1") == 3 and state["tables"] == {}
    assert state["running"] == state["waiting"] == []
    assert state["generation_tokens"] == metrics["pagedllm:generation_tokens_total"]
    assert state["prefix_cache_queries"] == metrics["pagedllm:prefix_cache_queries_total"]

    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        assert f'"dashboard/static/{asset}"' in page.text
        r = client.get(f"/dashboard/static/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 500
    assert 'id="count-free"' in page.text and 'id="step"' in page.text and "http" not in page.text.split("<body>")[1]
    assert client.get("/dashboard/static/../app.py").status_code == 404
    assert client.get("/dashboard/static/missing.js").status_code == 404


def test_state_of_a_contiguous_server(tiny_folder):
    from starlette.testclient import TestClient

    from pagedllm.engine.sampling_params import SamplingParams
    from pagedllm.server.app import build_app
    from pagedllm.server.dashboard_state import dashboard_state
    from tests.server.conftest import tiny_context

    ctx = tiny_context(tiny_folder, kv_layout="contiguous", num_kv_blocks=128, max_model_len=64)
    engine = ctx.engine.engine
    try:
        with TestClient(build_app(ctx)) as client:
            assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
            idle = client.get("/dashboard/state").json()
            assert idle["layout"] == "contiguous" and idle["counts"]["free"] == 128 and idle["tables"] == {}

            def one_step_in():  # on the engine thread: a request after its first step, holding its reservation
                engine.add_request("held", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=5))
                engine.step()
                return dashboard_state(engine, ctx.metrics)

            state = ctx.engine.call(one_step_in).result(30)
            assert state["tables"] == {"held": list(range(8))}  # max_model_len 64 / block size 8: one run of 8
            assert state["counts"] == {"free": 120, "cached": 0, "used": 8, "shared": 0, "hashed": 0}
            assert [r["id"] for r in state["running"]] == ["held"] and state["running"][0]["computed"] == 4
    finally:
        ctx.engine.shutdown()
