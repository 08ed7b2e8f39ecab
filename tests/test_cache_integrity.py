"""Regressions: the cache never serves another chunk's, request's or model's values, and never
changes state on a call that fails.

Each test reproduces a defect found by adversarial testing; the comment above it says what went wrong."""

import random

import pytest
import torch

from kvbackend import CacheConfig, Geometry, InvalidKV, KVCache
from kvbackend.page_group import TRAILER_BYTES
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.prefetch import TieredCache

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
CODEC = "qvg:centroids=4,group=16"  # a codec with a codebook per chunk


def make(codec=CODEC, geometry=GEOM, **kw):
    cfg = dict(codec=codec, page_size=4, chunk_pages=2, dense_pages=16, packed_pages=16)
    cfg.update(kw)
    return KVCache(geometry, CacheConfig(**cfg))


def fill(cache, tokens, seed, geometry=GEOM):
    """Admit ``tokens`` and append K/V for them in every layer; returns the request id."""
    gen = torch.Generator().manual_seed(seed)
    rid, cached = cache.add_request(tokens)
    n = len(tokens) - cached
    for layer in range(geometry.num_layers):
        shape = (n, geometry.num_kv_heads, geometry.head_dim)
        cache.append(rid, layer, torch.randn(*shape, generator=gen).to(geometry.dtype),
                     torch.randn(*shape, generator=gen).to(geometry.dtype))
    return rid


def packed_reads(cache, rid):
    return [cache.read_packed(rid, layer) for layer in range(cache.geometry.num_layers)]


def assert_same_reads(a, b):
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


# Defect: chunk ids came from Python's global `random`, which engines seed. After a restart with the
# same seed, a page restored from the file tier joined a resident, unrelated chunk that drew the same
# id and was decoded with that chunk's codebook (relative error 1.75, no error raised).
def test_seeded_restart_never_joins_another_chunks_codebook(tmp_path):
    prompt_a, prompt_b = list(range(100, 117)), list(range(500, 517))  # 4 full pages: 2 chunks each
    first = make()
    tiered = TieredCache(first, None, FileTier(str(tmp_path), 10**8, first.fingerprint), background=False)
    random.seed(1234)
    rid = fill(first, prompt_a, seed=1)
    expected = packed_reads(first, rid)
    first.free(rid)
    assert tiered.offload(max_pages=100) == 4
    tiered.flush()
    tiered.close()

    second = make()  # "the restarted process": same seed, an unrelated prompt stays resident
    tiered = TieredCache(second, None, FileTier(str(tmp_path), 10**8, second.fingerprint), background=False)
    random.seed(1234)
    other = fill(second, prompt_b, seed=2)
    rid, hit = tiered.add_request(prompt_a)
    assert hit == 16
    assert_same_reads(packed_reads(second, rid), expected)
    assert second.stats().codebook_slots_used == 4  # two chunks of each prompt, none shared
    second.check()
    tiered.free(other)
    tiered.close()


# Defect: the fingerprint left out the layer count, so a 4-layer and a 2-layer cache shared a
# file-tier directory and the 4-layer cache reported hits whose layers 2-3 were staging garbage.
@pytest.mark.parametrize("key", ["cache", "layout"])
def test_caches_of_other_shapes_never_share_pages(tmp_path, key):
    tokens = list(range(17))
    small = make("identity")
    fingerprint = small.fingerprint if key == "cache" else small.layout.fingerprint
    tiered = TieredCache(small, None, FileTier(str(tmp_path), 10**8, fingerprint), background=False)
    small.free(fill(small, tokens, seed=3))
    assert tiered.offload(max_pages=100) == 4
    tiered.flush()
    tiered.close()
    wide = Geometry(4, GEOM.num_kv_heads, GEOM.head_dim, GEOM.dtype)
    others = [make("identity", geometry=wide)]
    if key == "cache":  # chunk pages are no property of a page's layout; the cache fingerprint covers them
        others.append(make("identity", chunk_pages=1))
    for other in others:
        fingerprint = other.fingerprint if key == "cache" else other.layout.fingerprint
        tiered = TieredCache(other, None, FileTier(str(tmp_path), 10**8, fingerprint), background=False)
        rid, hit = tiered.add_request(tokens)
        assert hit == 0
        tiered.close()


def test_page_groups_of_another_cache_or_length_are_misses():
    """Bytes under a known key but written for another cache, or of a length their trailer does not
    imply, are never installed (the trailer carries the cache's fingerprint)."""
    tokens = list(range(17))
    cache = make()
    host = HostTier(10**6, cache.blob_bytes, pin=False)
    tiered = TieredCache(cache, host, None, background=False)
    rid = fill(cache, tokens, seed=4)
    expected = packed_reads(cache, rid)
    cache.free(rid)
    keys = cache.prefix_keys(tokens)
    groups = {key: cache.export_page(page) for page, key in cache.evictable_pages()}
    for page, _ in cache.evictable_pages():
        cache.drop_cached(page)
    foreign = make(geometry=Geometry(2, GEOM.num_kv_heads, GEOM.head_dim, torch.float16))  # same bytes per page
    assert foreign.blob_bytes != cache.blob_bytes or foreign.fingerprint != cache.fingerprint
    trailer = cache.group.unpack_trailer(bytes(groups[keys[0]][cache.group.pages_bytes : cache.group.books_offset]))
    assert trailer.key == keys[0] and trailer.carries_codebook
    bad = groups[keys[0]].clone()
    bad[cache.group.pages_bytes : cache.group.books_offset] = torch.frombuffer(
        bytearray(foreign.group.pack_trailer(keys[0], trailer.chunk_id, True)), dtype=torch.uint8)
    host.put([keys[0]], [bad]).wait()
    assert tiered.restore(tokens).restored_from_host == 0 and cache.device_prefix(keys) == 0
    host.discard([keys[0]])
    host.put(keys[:2], [groups[keys[1]], groups[keys[0]]]).wait()  # each page group filed under the other's key
    assert tiered.restore(tokens).restored_from_host == 0
    host.discard(keys[:2])
    host.put([keys[0]], [groups[keys[0]][: cache.group.books_offset]]).wait()  # a carrier without its codebooks
    assert tiered.restore(tokens).restored_from_host == 0
    host.discard([keys[0]])
    host.put(keys, [groups[k] for k in keys]).wait()
    assert tiered.restore(tokens).restored_from_host == 4
    rid, hit = cache.add_request(tokens)
    assert hit == 16
    assert_same_reads(packed_reads(cache, rid), expected)
    cache.check()
    tiered.close()


# Defect: `_can_pack` counted cached pages as codebook slots that eviction could free, but allocation
# takes free pages first and evicts nothing, so the slot allocation failed inside chunk completion
# after the pages were allocated (they leaked) and `append` raised CacheFull after writing. (Since then
# such a chunk is packed: the least recently used slot whose pages are all cached is freed first.)
def test_append_never_fails_after_writing_when_slots_are_held_by_cached_pages():
    cache = make("identity", packed_pages=12, codebook_slots=3)
    for i in range(3):  # each request leaves one hashed (cached) page per chunk, holding that chunk's slot
        rid = fill(cache, [1000 * i + t for t in range(5)], seed=i)  # 5 known tokens: only page 0 is hashed
        extra = torch.randn(3, 2, 4, 2, 16)
        for layer in range(2):
            cache.append(rid, layer, extra[layer, 0], extra[layer, 1])  # completes the 8-token chunk
        cache.free(rid)
    stats = cache.stats()
    assert stats.packed_pages_cached == 3 and stats.codebook_slots_used == 3
    assert cache.packed.allocator.num_free - cache.packed.allocator.num_cached == 9  # free pages aplenty
    rid = fill(cache, list(range(9000, 9008)), seed=9)  # a full chunk: no slot is free; one is made free
    cache.check()
    stats = cache.stats()
    assert stats.deferred_chunks == 0 and stats.packed_pages_used == 2  # packed, nothing leaked
    assert stats.packed_pages_cached == 2 and stats.codebook_slots_used == 3  # one remnant and its slot went
    k, v = cache.read(rid, 1)
    assert k.shape[0] == 8
    cache.free(rid)
    cache.check()
    assert cache.stats().dense_pages_used == 0


# Defect: a restore looked up its chunk's resident slot, then allocated a page; with the free list
# empty that evicted the slot's last cached page, freeing the slot, and `bind` failed with an
# AssertionError out of `TieredCache.add_request`, leaking the page.
def test_restore_never_evicts_the_slot_it_joins():
    cache = make(packed_pages=3, codebook_slots=4)
    host = HostTier(10**6, cache.blob_bytes, pin=False)
    tiered = TieredCache(cache, host, None, background=False)
    tokens = list(range(9))  # 2 full pages: one chunk
    rid = fill(cache, tokens, seed=5)
    expected = packed_reads(cache, rid)
    cache.free(rid)
    keys = cache.prefix_keys(tokens)
    pages = {key: page for page, key in cache.evictable_pages()}
    # Offload the second page only: its chunk's slot stays resident, held by the cached first page.
    assert host.put([keys[1]], [cache.export_page(pages[keys[1]])]).result() == [True]
    cache.drop_cached(pages[keys[1]])
    # A live request takes the free pages, so the restore's allocation could only evict a cached page:
    # the first page, which holds the slot being joined and is the prefix being extended.
    live = fill(cache, list(range(50, 59)), seed=6)
    allocator = cache.packed.allocator
    assert allocator.num_free == 1 and allocator.cached_pages() == [pages[keys[0]]]
    report = tiered.restore(tokens)
    cache.check()
    assert report.device_hits == 1 and report.restored_from_host == 0 and report.failed == 1
    rid, hit = tiered.add_request(tokens)  # the first page stayed
    assert hit == 4
    assert_same_reads(packed_reads(cache, rid), [(k[:4], v[:4]) for k, v in expected])
    tiered.free(rid)
    tiered.free(live)  # room now: the second page comes back and joins the resident slot
    rid, hit = tiered.add_request(tokens)
    assert hit == 8
    assert_same_reads(packed_reads(cache, rid), expected)
    assert cache.stats().codebook_slots_used == 2  # the chunk's slot, and the live request's chunk (cached)
    cache.check()
    tiered.close()


def test_layer_out_of_range_is_refused_on_every_path():
    cache = make("identity")
    rid = fill(cache, list(range(5)), seed=7)
    plan = cache.plan([rid])
    q = torch.randn(1, 2, 16)
    for call in (lambda: cache.read(rid, -1), lambda: cache.read_packed(rid, 2), lambda: cache.read_dense(rid, -1),
                 lambda: cache.gather(plan, -1), lambda: cache.decode(plan, 2, q), lambda: cache.plan([rid], -1),
                 lambda: cache.append(rid, -1, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))):
        with pytest.raises(InvalidKV, match="out of range"):
            call()


# Defects found by a second adversarial pass.
def test_bad_token_ids_change_nothing():
    cache = make("identity")
    with pytest.raises(InvalidKV, match="token ids"):
        cache.add_request([1, 2, 2**63])
    rid = fill(cache, list(range(5)), seed=8)
    before = list(cache.page_table(rid).token_ids)
    for bad in ([11, "12?"], [11, 2**64], [11, 1.5], [True]):
        with pytest.raises(InvalidKV, match="token ids"):
            cache.extend_tokens(rid, bad)
        assert cache.page_table(rid).token_ids == before  # nothing of a bad list is recorded
    with pytest.raises(InvalidKV, match="first_page"):
        cache.read_packed(rid, 0, first_page=-1)


def test_inputs_are_checked_in_the_cache_dtype_and_detached():
    half = make("identity", geometry=Geometry(2, 2, 16, torch.float16))
    rid, _ = half.add_request(list(range(3)))
    big = torch.full((3, 2, 16), 1e6)  # finite in float32, inf in fp16
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        half.append(rid, 0, big, big)
    assert half.num_tokens(rid) == 0
    half.check()
    quantwm = make("quantwm:centroids=4,group=16")
    rid, _ = quantwm.add_request(list(range(3)))
    k = torch.randn(3, 2, 16, requires_grad=True)
    with pytest.raises(InvalidKV, match="queries"):
        quantwm.append(rid, 0, k, k, queries=torch.full((3, 4, 16), float("nan")))
    quantwm.append(rid, 0, k * 2, k * 2)  # part of an autograd graph: stored detached
    assert quantwm.dense.data.grad_fn is None and not quantwm.dense.data.requires_grad


def test_a_failed_install_leaves_nothing_keyed(monkeypatch):
    from kvbackend.install import PageGroups

    cache = make("identity")
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes, pin=False), None, background=False)
    tokens = list(range(9))
    rid = fill(cache, tokens, seed=9)
    expected = packed_reads(cache, rid)
    tiered.free(rid)
    assert tiered.offload(max_pages=4) == 2
    original = PageGroups.copy_layer

    def flaky(self, plan, blobs, layer):
        if layer == 1 and plan.new_pages:
            raise RuntimeError("simulated: out of memory while copying a layer")
        return original(self, plan, blobs, layer)

    monkeypatch.setattr(PageGroups, "copy_layer", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        tiered.add_request(tokens)
    cache.check()
    assert cache.device_prefix(cache.prefix_keys(tokens)) == 0  # no page keyed without its bytes
    monkeypatch.setattr(PageGroups, "copy_layer", original)
    rid, hit = tiered.add_request(tokens)  # the retry restores for real
    assert hit == 8
    assert_same_reads(packed_reads(cache, rid), expected)
    tiered.close()


def test_a_chunks_codebook_survives_its_first_page_moving_down_and_back():
    """The carrier page goes down while the chunk's slot stays resident, comes back and joins the slot;
    when every copy below is gone and the chunk is offloaded again, some page group still carries the
    codebook and the prefix restores."""
    cache = make(packed_pages=4)
    host = HostTier(cache.blob_bytes * 8, cache.blob_bytes, pin=False)
    tiered = TieredCache(cache, host, None, background=False)
    tokens = list(range(9))
    rid = fill(cache, tokens, seed=10)
    expected = packed_reads(cache, rid)
    tiered.free(rid)
    tiered.offload(max_pages=2)
    tiered.flush()
    assert tiered.restore(tokens).restored_from_host == 2
    first = cache.packed.allocator.lookup(cache.prefix_keys(tokens)[0])
    assert cache.evictable_pages()[0][0] == first
    tiered.offload(max_pages=1)  # the carrier (least recently used) goes down; the second page keeps the slot
    tiered.flush()
    assert tiered.restore(tokens).restored_from_host == 1
    host.evict(10)  # every copy below ages out
    assert tiered.offload(max_pages=2) == 2
    tiered.flush()
    assert tiered.restore(tokens).restored_from_host == 2
    rid, hit = tiered.add_request(tokens)
    assert hit == 8
    assert_same_reads(packed_reads(cache, rid), expected)
    cache.check()
    tiered.close()


def test_host_tier_checks_every_buffer_before_registering_anything():
    host = HostTier(10 * 100, 100, pin=False)
    with pytest.raises(ValueError, match="1-D uint8"):
        host.put([1, 2, 3], [torch.zeros(50, dtype=torch.uint8), torch.zeros(5, 5), torch.zeros(50, dtype=torch.uint8)])
    assert host.contains([1]) == 0 and host.stats().blobs == 0
    host.check()
    assert host.put([1], [torch.arange(50, dtype=torch.uint8)]).result() == [True]
    with pytest.raises(ValueError, match="1-D uint8"):
        host.get([1], [torch.empty(5, 20, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="1-D uint8"):
        host.get([1], [torch.empty(50)])
    out = torch.empty(50, dtype=torch.uint8)
    assert host.get([1], [out]).result() == [True] and torch.equal(out, torch.arange(50, dtype=torch.uint8))
    assert host.evict(1) == 1  # nothing stuck in a reading state
    host.check()


def test_alignpred_pages_of_large_fp16_values_come_back_finite(tmp_path):
    pytest.importorskip("constriction")
    from kvbackend.tiers.persist import AlignPredFormat

    g = Geometry(1, 1, 8, torch.float16)
    cache = KVCache(g, CacheConfig(codec="identity", page_size=4, chunk_pages=1, dense_pages=4, packed_pages=4))
    fmt = AlignPredFormat("alignpred:error=0.03", cache.layout)
    tiered = TieredCache(cache, None, FileTier(str(tmp_path), 1 << 20, cache.fingerprint, fmt=fmt, fsync=False),
                         background=False)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 1, 8, generator=gen).half()
    k[:, :, :4] = 65504 * torch.sign(torch.randn(4, 1, 4, generator=gen)).half()  # fp16's largest finite values
    rid, _ = tiered.add_request([1, 2, 3, 4, 5])
    tiered.append(rid, 0, k, k)
    tiered.free(rid)
    assert tiered.offload(max_pages=10) == 1
    tiered.flush()
    rid, hit = tiered.add_request([1, 2, 3, 4, 5])
    assert hit == 4
    back = tiered.read(rid, 0)[0]
    assert torch.isfinite(back).all()
    assert (back.float() - k.float()).norm() <= 0.03 * k.float().norm() * 1.01
    tiered.close()


def test_decode_refuses_queries_that_do_not_match_the_plan():
    cache = make("identity")
    rids = [fill(cache, list(range(5)), seed=s) for s in (11, 12)]
    plan = cache.plan(rids)
    for q in (torch.randn(1, 2, 16), torch.randn(3, 2, 16), torch.randn(2, 3, 16), torch.randn(2, 2, 8),
              torch.randint(0, 5, (2, 2, 16))):
        with pytest.raises(InvalidKV, match="decode queries"):
            cache.decode(plan, 0, q)
    out, lse = cache.decode(plan, 0, torch.randn(2, 4, 16))
    assert out.shape == (2, 4, 16) and lse.shape == (2, 4)


# Every codebook slot held by chunks reduced to one cached page each (their tails offloaded or dropped) left no
# slot for a new chunk although the packed pool had free pages: the chunk stayed dense and the next append raised
# CacheFull("dense") with room to spare. Now the least recently used such chunk's cached pages go, and its slot.
def test_slots_held_by_cached_remnants_never_stop_packing():
    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache = KVCache(geometry, CacheConfig(codec="identity", page_size=4, chunk_pages=2, dense_pages=3,
                                          packed_pages=12))  # 7 codebook slots
    for i in range(7):
        rid = fill(cache, list(range(100 * i, 100 * i + 9)), i, geometry)
        tail = cache.page_table(rid).packed[-1]
        cache.free(rid)
        cache.drop_cached(tail)  # its bytes moved to a lower tier, as an offload of that page does
    assert cache.packed.slots.num_free == 0 and cache.packed.allocator.num_cached == 7
    rid, _ = cache.add_request()
    gen = torch.Generator().manual_seed(99)
    k, v = torch.randn(16, 2, 16, generator=gen), torch.randn(16, 2, 16, generator=gen)
    for layer in range(2):
        cache.append(rid, layer, k[:8], v[:8])
    assert len(cache.page_table(rid).packed) == 2  # packed at once, not deferred
    assert cache.packed.allocator.num_cached == 6  # one remnant (the least recently used) made room
    for layer in range(2):
        cache.append(rid, layer, k[8:], v[8:])  # needs the dense pages the packed chunk gave back
    for layer in range(2):
        got = cache.read(rid, layer)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert len(cache.page_table(rid).packed) == 4 and cache.packed.allocator.num_cached == 5
    cache.check()


# A chunk whose encode failed (a device out of memory at its second layer) made `append` raise after its tokens were
# written: a caller that retried the call held them twice. Now the call returns, the chunk stays dense (exact), the
# error is logged, and the encode is tried again a page later, to the bytes of a cache that never failed.
def test_a_failed_chunk_encode_keeps_the_tokens_once_and_packs_later(caplog):
    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 16, 2, 16, generator=gen), torch.randn(2, 16, 2, 16, generator=gen)
    ref = make(geometry=geometry)
    r, _ = ref.add_request()
    for layer in range(2):
        ref.append(r, layer, k[layer], v[layer])
    cache = make(geometry=geometry)
    # layer by layer, the first chunk fails at its second layer; in one pass for every layer
    # (`KVCache._encode_layers`), that pass fails
    if cache._encode_group(0) is None:
        owner, name, failing_call = cache.backends[1], "encode_chunk", 2  # layers share one backend object per spec
    else:
        owner, name, failing_call = cache.codecs[0], "encode_units", 1
    original, calls = getattr(owner, name), []

    def encode(*args):
        calls.append(1)
        if len(calls) == failing_call:
            raise torch.OutOfMemoryError("simulated")
        return original(*args)

    setattr(owner, name, encode)
    rid, _ = cache.add_request()
    cache.append(rid, 0, k[0, :8], v[0, :8])
    with caplog.at_level("ERROR", logger="kvbackend.manager"):
        cache.append(rid, 1, k[1, :8], v[1, :8])  # returns: the tokens are in, once
    assert "stays in the dense pool" in caplog.text
    table = cache.page_table(rid)
    assert table.lengths == [8, 8] and not table.packed and cache.stats().deferred_chunks == 1
    for layer in range(2):
        got = cache.read(rid, layer)
        assert torch.equal(got[0], k[layer, :8]) and torch.equal(got[1], v[layer, :8])  # exact while dense
    cache.append(rid, 0, k[0, 8:12], v[0, 8:12])
    cache.append(rid, 1, k[1, 8:12], v[1, 8:12])  # a page later: encoded again, now packed
    cache.append(rid, 0, k[0, 12:], v[0, 12:])
    cache.append(rid, 1, k[1, 12:], v[1, 12:])
    assert len(cache.page_table(rid).packed) == 4
    for layer in range(2):
        a, b = cache.read(rid, layer), ref.read(r, layer)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    cache.check()
