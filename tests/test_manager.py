"""KVCache: admission, chunk completion, prefix reuse, fork/free, capacity and bad input."""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbackend import CacheConfig, CacheFull, Geometry, InvalidKV, KVCache, UnknownRequest

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def make(codec="identity", **kw):
    cfg = dict(codec=codec, page_size=4, chunk_pages=2, dense_pages=12, packed_pages=12)
    cfg.update(kw)
    return KVCache(GEOM, CacheConfig(**cfg))


def append_all(cache, rid, k, v):
    for layer in range(GEOM.num_layers):
        cache.append(rid, layer, k[layer], v[layer])


def rand_kv(n):
    return torch.randn(GEOM.num_layers, n, 2, 16), torch.randn(GEOM.num_layers, n, 2, 16)


def test_chunk_completes_and_reads_back():
    cache = make()
    rid, cached = cache.add_request(list(range(11)))
    assert cached == 0
    k, v = rand_kv(11)
    append_all(cache, rid, k, v)
    table = cache.page_table(rid)
    assert len(table.packed) == 2 and len(table.dense) == 1  # one chunk of 8 encoded, 3 tokens dense
    for layer in range(2):
        kh, vh = cache.read(rid, layer)
        assert torch.equal(kh, k[layer]) and torch.equal(vh, v[layer])
    stats = cache.stats()
    assert stats.packed_pages_used == 2 and stats.dense_pages_used == 1 and stats.codebook_slots_used == 1
    cache.check()


def test_chunk_waits_for_every_layer():
    cache = make()
    rid, _ = cache.add_request()
    k, v = rand_kv(8)
    cache.append(rid, 0, k[0], v[0])
    assert cache.page_table(rid).packed == []
    cache.append(rid, 1, k[1], v[1])
    assert len(cache.page_table(rid).packed) == 2


def test_stats_bpv_matches_layout_accounting():
    cache = make("qvg:centroids=4,group=16", page_size=8, chunk_pages=2)
    rid, _ = cache.add_request()
    k, v = rand_kv(40)  # two chunks of 16 + 8 dense
    append_all(cache, rid, k, v)
    stats = cache.stats()
    expected = GEOM.num_layers * cache.layout.stored_bytes(num_pages=4, num_chunks=2)
    assert stats.packed_bytes == expected
    assert stats.bits_per_value == pytest.approx(8 * expected / (32 * GEOM.num_layers * GEOM.values_per_token))
    kh, _ = cache.read(rid, 1)
    assert ((kh - k[1]).norm() / k[1].norm()) < 0.8


def test_prefix_reuse_shares_pages_and_verifies_tokens():
    cache = make()
    tokens = list(range(100, 109))
    a, _ = cache.add_request(tokens)
    k, v = rand_kv(9)
    append_all(cache, a, k, v)
    b, cached = cache.add_request(tokens + [1, 2])
    assert cached == 8
    assert cache.page_table(b).packed == cache.page_table(a).packed
    kb, _ = cache.read(b, 0)
    assert torch.equal(kb, k[0, :8])
    # Same tokens at a different position (other parent) is no hit.
    _, cached = cache.add_request([7] + tokens)
    assert cached == 0
    # Never reports the whole prompt cached: the last token's logits must be computed.
    _, cached = cache.add_request(tokens[:8])
    assert cached == 4
    cache.check()


def test_extra_keys_separate_caches():
    a = make(extra_keys=("lora-1",))
    b = make(extra_keys=("lora-2",))
    from kvbackend.hashing import hash_page
    assert hash_page(None, [1, 2], ("lora-1",)) != hash_page(None, [1, 2], ("lora-2",))
    assert a.config.extra_keys != b.config.extra_keys


def test_free_keeps_hashed_pages_cached_then_evicts_tail_first():
    cache = make(packed_pages=4)
    a, _ = cache.add_request(list(range(9)))
    append_all(cache, a, *rand_kv(9))
    cache.free(a)
    stats = cache.stats()
    assert stats.packed_pages_cached == 2 and stats.packed_pages_used == 0
    b, cached = cache.add_request(list(range(9)))
    assert cached == 8
    cache.free(b)
    c, _ = cache.add_request(list(range(50, 59)))
    append_all(cache, c, *rand_kv(9))  # takes the 2 free pages
    d, _ = cache.add_request(list(range(70, 79)))
    append_all(cache, d, *rand_kv(9))  # must evict both cached pages
    _, cached = cache.add_request(list(range(9)))
    assert cached == 0
    cache.check()


def test_fork_copies_active_chunk():
    cache = make()
    a, _ = cache.add_request()
    k, v = rand_kv(10)
    append_all(cache, a, k, v)
    b = cache.fork(a)
    extra_k, extra_v = rand_kv(1)
    append_all(cache, b, extra_k, extra_v)
    ka, _ = cache.read(a, 0)
    kb, _ = cache.read(b, 0)
    assert ka.shape[0] == 10 and kb.shape[0] == 11
    assert torch.equal(kb[:10], ka) and torch.equal(kb[10], extra_k[0, 0])
    cache.free(a)
    kb2, _ = cache.read(b, 0)
    assert torch.equal(kb2, kb)
    cache.check()


def test_cache_full_leaves_state_intact():
    cache = make(dense_pages=3)
    rid, _ = cache.add_request()
    k, v = rand_kv(14)
    cache.append(rid, 0, k[0, :6], v[0, :6])  # 2 pages of 4
    with pytest.raises(CacheFull) as err:
        cache.append(rid, 0, k[0, 6:], v[0, 6:])  # 14 tokens need 4 pages: 2 more, 1 free
    assert "dense pool is full: requested 2 pages, 1 free" in str(err.value)
    assert cache.page_table(rid).lengths == [6, 0] and len(cache.page_table(rid).dense) == 2
    cache.check()
    kh, _ = cache.read(rid, 0)
    assert torch.equal(kh, k[0, :6])


def test_full_packed_pool_defers_the_chunk():
    """A chunk completing while the packed pool is full stays dense: no step fails at its last layer."""
    cache = make(packed_pages=2)
    a, _ = cache.add_request()
    append_all(cache, a, *rand_kv(8))
    b, _ = cache.add_request()
    k, v = rand_kv(10)
    append_all(cache, b, k[:, :8], v[:, :8])  # every layer is appended although no chunk can be packed
    table = cache.page_table(b)
    assert table.lengths == [8, 8] and table.packed == [] and len(table.dense) == 2
    assert cache.stats().deferred_chunks == 1
    cache.check()
    cache.free(a)
    append_all(cache, b, k[:, 8:], v[:, 8:])  # room again: the deferred chunk is packed now
    assert len(table.packed) == 2 and table.dense_tokens(0) == 2 and cache.stats().deferred_chunks == 0
    for layer in range(2):
        kb, vb = cache.read(b, layer)
        assert torch.equal(kb, k[layer]) and torch.equal(vb, v[layer])
    cache.check()


def test_bad_input():
    cache = make()
    rid, _ = cache.add_request()
    ok = torch.randn(2, 2, 16)
    with pytest.raises(InvalidKV, match="shape"):
        cache.append(rid, 0, torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    with pytest.raises(InvalidKV, match="bf16, fp16 or fp32"):
        cache.append(rid, 0, ok.long(), ok.long())
    with pytest.raises(InvalidKV, match="out of range"):
        cache.append(rid, 5, ok, ok)
    with pytest.raises(InvalidKV, match="devices|cache on"):
        cache.append(rid, 0, ok.to("meta"), ok.to("meta"))
    bad = ok.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        cache.append(rid, 0, bad, ok)
    assert cache.page_table(rid).lengths == [0, 0]
    cache.append(rid, 0, ok.transpose(0, 1).contiguous().transpose(0, 1), ok)  # non-contiguous input is fine: it is copied
    cache.free(rid)
    with pytest.raises(UnknownRequest, match="already freed"):
        cache.free(rid)
    with pytest.raises(UnknownRequest):
        cache.append(rid, 0, ok, ok)
    with pytest.raises(UnknownRequest):
        cache.read(rid, 0)
    cache.check()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 9), st.integers(1, 12)),
                min_size=20, max_size=80))
def test_random_operations_against_model(ops):
    """Thousands of operations over the examples: no leak, no double free, ref counts match, reads exact."""
    cache = make(dense_pages=40, packed_pages=40)
    model: dict[int, list[torch.Tensor]] = {}  # request -> [k0, v0, k1, v1] as appended
    page_content: dict[int, list[torch.Tensor]] = {}  # packed page -> the model's K/V for its tokens
    for op, pick, n in ops:
        live = sorted(model)
        if op == "add" or not live:
            tokens = [pick % 2] * (n + 6)  # overlapping prompts exercise prefix hits
            rid, cached = cache.add_request(tokens)
            if cached:
                event("prefix hit")
                pages = cache.page_table(rid).packed
                assert len(pages) * 4 == cached
                model[rid] = [torch.cat([page_content[p][j] for p in pages]) for j in range(4)]
            else:
                model[rid] = [torch.zeros(0, 2, 16) for _ in range(4)]
            continue
        rid = live[pick % len(live)]
        if op == "append":
            k, v = rand_kv(n)
            try:
                append_all(cache, rid, k, v)
            except CacheFull:
                continue
            for layer in range(2):
                model[rid][2 * layer] = torch.cat([model[rid][2 * layer], k[layer]])
                model[rid][2 * layer + 1] = torch.cat([model[rid][2 * layer + 1], v[layer]])
            for i, page in enumerate(cache.page_table(rid).packed):
                page_content[page] = [x[4 * i : 4 * i + 4] for x in model[rid]]
        elif op == "fork":
            try:
                new = cache.fork(rid)
            except CacheFull:
                continue
            model[new] = [x.clone() for x in model[rid]]
        else:
            cache.free(rid)
            del model[rid]
        cache.check()
    for rid, expected in model.items():
        for layer in range(2):
            k, v = cache.read(rid, layer)
            assert torch.equal(k, expected[2 * layer]) and torch.equal(v, expected[2 * layer + 1])
    for rid in list(model):
        cache.free(rid)
    cache.check()
    stats = cache.stats()
    assert stats.dense_pages_used == 0 and stats.packed_pages_used == 0


@pytest.mark.parametrize("codec", ["qvg:centroids=4,group=16", "qvg:centroids=4,group=16,vcluster=false",
                                   "heads:base=qvg:centroids=4;group=16,kbits=2-3"])
def test_prefix_hit_warm_starts_only_clustered_tensors(codec):
    """A prefix hit seeds k-means from the reused codebook, for the tensors that have centroids."""
    cache = make(codec, page_size=8, chunk_pages=2)
    tokens = list(range(200, 218))
    a, _ = cache.add_request(tokens)
    k, v = rand_kv(18)
    append_all(cache, a, k, v)
    b, cached = cache.add_request(tokens + [1])
    assert cached == 16
    state = cache.page_table(b).states[0]
    expected = ["k", "v"] if "vcluster" not in codec else ["k"]
    if codec.startswith("heads:"):  # each head's own, under its tag, as the codec keeps them between chunks
        expected = [f"h{i}:{name}" for i in range(2) for name in expected]
        assert sorted(state.centroids) == sorted(cache.page_table(a).states[0].centroids)
    assert sorted(state.centroids) == expected
    k2, v2 = rand_kv(16)
    append_all(cache, b, k2, v2)  # the next chunk encodes from the warm start
    assert len(cache.page_table(b).packed) == 4
    kb, vb = cache.read(b, 1)
    assert ((vb[16:] - v2[1]).norm() / v2[1].norm()) < 0.8
    cache.check()


def _step_caches(codec, **kw):
    from kvbackend.rope import Rotary

    rotary = Rotary.default(16, 10000.0)
    cfg = dict(codec=codec, page_size=4, chunk_pages=2, dense_pages=12, packed_pages=24)
    cfg.update(kw)
    return [KVCache(GEOM, CacheConfig(**cfg), rotary=rotary) for _ in range(2)]


@pytest.mark.parametrize("codec", ["identity", "kivi:bits=2,group=4,sink=2,pagerope=true",
                                   "quantwm:group=16,rank=2,centroids=2,vbits=2,pagerope=true",
                                   "quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true"])
def test_append_step_is_append_per_request(codec):
    """A decode step's batched append writes, books and packs exactly what one append per request does
    (requests of different lengths: pages opened mid-batch, chunks completed by the step)."""
    one, batched = _step_caches(codec)
    gen = torch.Generator().manual_seed(0)
    ids = []
    for n in (3, 7, 4):  # prompts ending mid-page, mid-chunk, on a page boundary
        k, v = torch.randn(2, n, 2, 16, generator=gen), torch.randn(2, n, 2, 16, generator=gen)
        q = torch.randn(2, n, 4, 16, generator=gen)
        for cache in (one, batched):
            rid, _ = cache.add_request()
            for layer in range(2):
                cache.append(rid, layer, k[layer], v[layer], queries=q[layer])
        ids.append(rid)
    reused = 0  # steps whose statistics went in place on the last step's partition (`add_step_moments`' memo)
    for _ in range(14):  # each request completes chunks twice, the memo is reused and dropped between
        k, v = torch.randn(2, 3, 2, 16, generator=gen), torch.randn(2, 3, 2, 16, generator=gen)
        q = torch.randn(2, 3, 4, 16, generator=gen)
        for layer in range(2):
            for i, rid in enumerate(ids):
                one.append(rid, layer, k[layer, i : i + 1], v[layer, i : i + 1], queries=q[layer, i : i + 1])
            reused += batched._step_memos[layer].get("step") is not None
            batched.append_step(ids, layer, k[layer], v[layer], queries=q[layer])
    assert reused > 0 or not batched.codecs[0].uses_queries
    packed = 0
    for rid in ids:
        a, b = one.page_table(rid), batched.page_table(rid)
        assert a.lengths == b.lengths and len(a.packed) == len(b.packed) and len(a.dense) == len(b.dense)
        packed += len(a.packed)
        for layer in range(2):
            ka, va = one.read(rid, layer)
            kb, vb = batched.read(rid, layer)
            assert torch.equal(ka, kb) and torch.equal(va, vb)
            for pa, pb in zip(a.packed, b.packed):  # the same bytes were encoded
                assert torch.equal(one.packed.pages[layer][pa], batched.packed.pages[layer][pb])
            sa, sb = a.states[layer], b.states[layer]  # the same query statistics (query-aware codecs)
            assert sa.query_parts.keys() == sb.query_parts.keys()
            for chunk, (total, count) in sa.query_parts.items():
                assert count == sb.query_parts[chunk][1] and torch.equal(total, sb.query_parts[chunk][0])
                kept = sb.query_parts[chunk][0]  # its own storage, not a view keeping the step's batch alive
                assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
            assert (sa.query_moment is None) == (sb.query_moment is None)
            assert sa.query_moment is None or torch.equal(sa.query_moment, sb.query_moment)
            assert sa.query_sums.keys() == sb.query_sums.keys() == sa.query_parts.keys()  # the mean query too
            for chunk, total in sa.query_sums.items():
                assert torch.allclose(total, sb.query_sums[chunk], rtol=1e-6, atol=1e-6)
            assert (sa.query_mean is None) == (sb.query_mean is None)
            assert sa.query_mean is None or torch.allclose(sa.query_mean, sb.query_mean, rtol=1e-6, atol=1e-6)
    assert packed >= 6  # the step completed chunks
    batched.check()


def test_append_step_refuses_bad_batches_and_writes_nothing_when_full():
    cache = make(dense_pages=3)
    a, _ = cache.add_request()
    b, _ = cache.add_request()
    append_all(cache, a, *rand_kv(4))  # a's only page is full: its next token needs a page
    append_all(cache, b, *rand_kv(3))
    k = torch.randn(2, 2, 16)
    with pytest.raises(InvalidKV, match="repeat"):
        cache.append_step([a, a], 0, k, k)
    with pytest.raises(InvalidKV, match=r"\[2, H, D\]"):
        cache.append_step([a, b], 0, k[:1], k[:1])
    with pytest.raises(UnknownRequest):
        cache.append_step([a, 999], 0, k, k)
    with pytest.raises(InvalidKV):
        cache.append_step([a, b], 0, torch.full_like(k, float("nan")), k)
    c, _ = cache.add_request()
    append_all(cache, c, *rand_kv(4))  # the last free page: now a and c both need one, none is free
    before = [list(cache.page_table(r).lengths) for r in (a, b, c)]
    data = cache.dense.data.clone()
    with pytest.raises(CacheFull):
        cache.append_step([b, a, c], 0, torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    assert [cache.page_table(r).lengths for r in (a, b, c)] == before and torch.equal(cache.dense.data, data)
    cache.append_step([b], 0, k[:1], k[:1])  # b's page has room
    assert cache.page_table(b).lengths == [4, 3]
    cache.check()


def test_append_step_takes_ids_as_a_tensor_and_an_empty_batch():
    cache = make()
    a, _ = cache.add_request()
    append_all(cache, a, *rand_kv(3))
    cache.append_step(torch.tensor([a]), 0, torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    assert cache.page_table(a).lengths == [4, 3]
    cache.append_step([], 1, torch.ones(0, 2, 16), torch.ones(0, 2, 16))  # nothing to append
    assert cache.page_table(a).lengths == [4, 3]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_one_finite_check_names_what_failed(device):
    """Keys, values and queries are checked together (one device read on a GPU); a failure still names the tensor
    at fault, and nothing is written."""
    from kvbackend.codecs.base import all_finite_many

    ok = torch.randn(3, 2, 16, device=device)
    assert all_finite_many(ok, ok.bfloat16(), torch.empty(0, device=device))
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = ok.clone()
        bad[2, 1, 15] = value
        assert not all_finite_many(ok, bad) and not all_finite_many(bad.bfloat16(), ok)
    cache = KVCache(Geometry(2, 2, 16, torch.float32), CacheConfig(codec="identity", page_size=4, chunk_pages=2,
                                                                   dense_pages=8, packed_pages=8, device=device))
    rid, _ = cache.add_request()
    q = torch.randn(3, 4, 16, device=device)
    bad_q = q.clone()
    bad_q[0, 3, 0] = float("nan")
    with pytest.raises(InvalidKV, match="queries contain NaN"):
        cache.append(rid, 0, ok, ok, queries=bad_q)
    bad = ok.clone()
    bad[1, 0, 0] = float("inf")
    with pytest.raises(InvalidKV, match="K/V contain NaN or Inf"):
        cache.append(rid, 0, ok, bad, queries=q)
    with pytest.raises(InvalidKV, match="K/V contain NaN or Inf"):
        cache.append_step([rid], 0, bad[1:2], ok[:1], queries=q[:1])
    assert cache.page_table(rid).lengths == [0, 0]
    cache.append(rid, 0, ok, ok, queries=q)
    assert cache.page_table(rid).lengths == [3, 0]


def test_append_step_takes_rows_read_from_its_own_pool():
    """K/V rows that are views of the cache's dense pool (another request's stored token, as an engine copying a
    token might pass them) are appended as `append` appends them: `index_copy_` refuses a source that overlaps the
    pool, so the step copies them first (it raised after allocating the page)."""
    geometry = Geometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    caches = [KVCache(geometry, CacheConfig(codec="identity", page_size=4, chunk_pages=2, dense_pages=8,
                                            packed_pages=8)) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    for i, cache in enumerate(caches):
        src, _ = cache.add_request()
        dst, _ = cache.add_request()
        cache.append(src, 0, k0, v0)
        page = cache.page_table(src).dense[0]
        k, v = cache.dense.data[0, page, 0, 2:3], cache.dense.data[0, page, 1, 2:3]  # views of src's last token
        if i:
            cache.append_step([dst], 0, k, v)
        else:
            cache.append(dst, 0, k, v)
        assert torch.equal(cache.read(dst, 0)[0], k0[2:3]) and torch.equal(cache.read(dst, 0)[1], v0[2:3])
        assert torch.equal(cache.read(src, 0)[0], k0)
        cache.check()
    assert caches[0].page_table(dst).lengths == caches[1].page_table(dst).lengths == [1]


def test_two_threads_appending_to_other_layers_take_turns():
    """A cache's calls take its lock: a step of layer 0 that has read its tables when another thread's step of layer
    1 completes and packs the chunk (pages move in every layer) used to append at stale offsets (an IndexError, the
    layer a token short, reads unlike the same steps in one thread). The second thread now waits for the first."""
    import threading

    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    caches = [KVCache(geometry, CacheConfig(codec="identity", page_size=4, chunk_pages=2, dense_pages=16,
                                            packed_pages=8)) for _ in range(2)]
    alone, threaded = caches
    ids = [alone.add_request()[0] for _ in range(2)]
    assert [threaded.add_request()[0] for _ in range(2)] == ids
    ks = torch.randn(9, 2, 2, 2, 16, generator=torch.Generator().manual_seed(0))  # [step, layer, B, H, D]
    for cache in caches:  # 7 tokens in both layers, then layer 0 one token ahead
        for s in range(7):
            for layer in range(2):
                cache.append_step(ids, layer, ks[s, layer], ks[s, layer])
        cache.append_step(ids, 0, ks[7, 0], ks[7, 0])
    alone.append_step(ids, 0, ks[8, 0], ks[8, 0])
    alone.append_step(ids, 1, ks[7, 1], ks[7, 1])  # completes the chunk: packed
    inside, released = threading.Event(), threading.Event()
    allocate = threaded.dense.allocator.can_allocate

    def held_open(n):  # layer 0's step stops after reading its tables, until layer 1's step is done or waits
        if threading.current_thread().name == "layer 0":
            inside.set()
            released.wait(timeout=0.5)
        return allocate(n)

    threaded.dense.allocator.can_allocate = held_open
    errors = []

    def step(layer, s):
        try:
            threaded.append_step(ids, layer, ks[s, layer], ks[s, layer])
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(repr(e))

    first = threading.Thread(target=step, args=(0, 8), name="layer 0")
    first.start()
    assert inside.wait(timeout=5)
    second = threading.Thread(target=step, args=(1, 7), name="layer 1")
    second.start()
    second.join(timeout=0.2)  # (without the lock it finishes here, packing under layer 0's feet)
    released.set()
    first.join()
    second.join()
    threaded.dense.allocator.can_allocate = allocate
    assert not errors, errors
    threaded.check()
    for rid in ids:
        assert threaded.page_table(rid).lengths == alone.page_table(rid).lengths == [9, 8]
        assert threaded.page_table(rid).packed  # the chunk was packed
        for layer in range(2):
            assert all(torch.equal(a, b) for a, b in zip(alone.read(rid, layer), threaded.read(rid, layer)))


def test_a_copied_or_pickled_cache_has_its_own_lock():
    import copy
    import pickle

    cache = KVCache(Geometry(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32),
                    CacheConfig(codec="identity", page_size=4, chunk_pages=1, dense_pages=4, packed_pages=4))
    rid, _ = cache.add_request()
    cache.append(rid, 0, torch.ones(3, 1, 16), torch.ones(3, 1, 16))
    with cache._lock:  # held here: the copies must not wait for it
        for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
            assert other._lock is not cache._lock
            other.append(rid, 0, torch.ones(1, 1, 16), torch.ones(1, 1, 16))
            assert other.page_table(rid).lengths == [4]
