"""Pages moving between the device, the host tier and the file tier: a newer page group of a key replaces the
one a tier holds, pages leave the device only once their writes have landed, a restore frees an idle codebook
slot as a chunk that completes does, and `install_pages` refuses keys its token ids do not produce.

Each test failed before its fix (an adversarial review's reproducers); none of these served wrong values, they
lost cached prefixes or leaked host slots."""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.prefetch import TieredCache

GEOM = Geometry(2, 2, 64, torch.bfloat16)


def make(codec="qvg", packed_pages=16, host_groups=None, file_dir=None):
    cache = KVCache(GEOM, CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=32,
                                      packed_pages=packed_pages, device="cpu"))
    host = None if host_groups is None else HostTier(host_groups * cache.blob_bytes, cache.blob_bytes, pin=False)
    file = None if file_dir is None else FileTier(str(file_dir), 1 << 30, "0123456789abcdef", fsync=False)
    return cache, TieredCache(cache, host, file, background=False)


def serve(tiered, tokens, gen, free=True):
    """Admit ``tokens`` (K/V drawn from ``gen`` for the part not hit), free the request; returns the hit."""
    rid, hit = tiered.add_request(tokens)
    n = len(tokens) - hit
    for layer in range(GEOM.num_layers):
        tiered.append(rid, layer, torch.randn(n, 2, 64, generator=gen).bfloat16(),
                      torch.randn(n, 2, 64, generator=gen).bfloat16())
    if free:
        tiered.free(rid)
    return hit


@pytest.mark.parametrize("lower", ["host", "file"])
def test_a_page_group_encoded_again_replaces_the_copy_a_tier_holds(lower, tmp_path):
    """The tier held a page of a chunk whose codebook carrier it had lost; the prompt was recomputed (a new chunk,
    a new codebook) and offloaded again: the tier kept its stale copy as "held", the device dropped the new one,
    and that part of the prefix could never be restored (hit 16 of 32)."""
    cache, t = make(host_groups=3 if lower == "host" else None, file_dir=tmp_path if lower == "file" else None)
    tier = t.host if lower == "host" else t.file
    gen = torch.Generator().manual_seed(0)
    prompt = list(range(40))  # two packed pages: one chunk, its first page carries the codebook
    keys = cache.prefix_keys(prompt)
    serve(t, prompt, gen)
    assert t.offload(max_pages=100) == 2
    if lower == "host":  # the carrier leaves the tier alone (an LRU eviction of the host tier)
        tier.discard([keys[0]])
    else:  # (a file tier drops one blob of a file when its reader refuses it)
        carrier = torch.zeros(cache.blob_bytes, dtype=torch.uint8)
        assert tier.get([keys[0]], [carrier]).result() == [True] and tier.refuse(keys[0], carrier, "test")
    assert tier.contains(keys[1:]) == 1 and tier.contains(keys) == 0  # the carrier is gone, page 1 stays
    assert serve(t, prompt, gen) == 0  # recomputed: a new chunk
    assert t.offload(max_pages=100) == 2
    t.flush()
    rid, hit = t.add_request(prompt)
    assert hit == 32
    t.close()


def test_a_key_whose_bytes_are_held_already_is_not_written_again(tmp_path):
    tier = FileTier(str(tmp_path), 1 << 20, "0123456789abcdef", fsync=False)
    blob = torch.arange(300, dtype=torch.int32).to(torch.uint8)
    assert tier.put([7], [blob]).result() == [True]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert tier.put([7], [blob.clone()]).result() == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # same bytes: no second file
    newer = blob.flip(0).contiguous()
    assert tier.put([7], [newer]).result() == [True]
    out = torch.zeros(300, dtype=torch.uint8)
    assert tier.get([7], [out]).result() == [True] and torch.equal(out, newer)
    assert len(list(tmp_path.iterdir())) == 1  # the old file went with its last blob
    assert tier.stats().bytes_used == sum(p.stat().st_size for p in tmp_path.iterdir())
    tier.close()
    again = FileTier(str(tmp_path), 1 << 20, "0123456789abcdef", fsync=False)  # a restart serves the newest too
    assert again.get([7], [out.zero_()]).result() == [True] and torch.equal(out, newer)
    again.close()


def test_a_host_blob_being_read_is_not_replaced_and_the_new_one_is_not_claimed_stored():
    host = HostTier(4 * 1000, 1000, pin=False)
    assert host.put([1], [torch.full((1000,), 1, dtype=torch.uint8)]).result() == [True]
    read = host.read_layered([1], torch.empty(1, 1000, dtype=torch.uint8), [0])
    handle = host.put([1], [torch.full((1000,), 2, dtype=torch.uint8)])
    assert handle.accepted == [False] and handle.result() == [False]  # the caller keeps its copy
    read.copy_range(0, 1000)
    read.close()
    assert host.put([1], [torch.full((1000,), 2, dtype=torch.uint8)]).result() == [True]  # idle now: replaced
    out = torch.zeros(1000, dtype=torch.uint8)
    assert host.get([1], [out]).result() == [True] and int(out[0]) == 2
    host.check()
    assert host.stats().blobs == 1


def test_closing_a_layered_read_twice_releases_its_blobs_once():
    """A second close drove the readers' count negative: those blobs could never be evicted again."""
    host = HostTier(2 * 1000, 1000, pin=False)
    assert host.put([1, 2], [torch.full((1000,), k, dtype=torch.uint8) for k in (1, 2)]).result() == [True, True]
    read = host.read_layered([1, 2], torch.empty(2, 1000, dtype=torch.uint8), [0, 1])
    read.copy_range(0, 1000)
    assert read.close().result() == [True, True]
    assert read.close().result() == [True, True]
    assert host.evict(10) == 2
    assert host.put([3], [torch.full((1000,), 3, dtype=torch.uint8)]).result() == [True]
    host.check()


def test_pages_whose_write_fails_stay_on_the_device():
    """Offload dropped the device pages as soon as the host tier accepted them; a copy that failed afterwards
    left them nowhere (hit 0 of 64)."""
    cache, t = make(codec="identity", host_groups=50)
    gen = torch.Generator().manual_seed(0)
    prompt = list(range(70))
    serve(t, prompt, gen)

    def failing(blob, entry, non_blocking=False):
        raise RuntimeError("injected copy failure")

    t.host._scatter = failing
    assert t.offload(max_pages=100) == 0
    del t.host._scatter
    assert t.host.stats().blobs == 0 and cache.device_prefix(cache.prefix_keys(prompt)) == 4
    rid, hit = t.add_request(prompt)
    assert hit == 64
    t.free(rid)
    assert t.offload(max_pages=100) == 4  # the next offload moves them
    t.close()


def test_pages_a_request_takes_while_their_write_lands_stay_on_the_device():
    cache, t = make(codec="identity", host_groups=50)
    gen = torch.Generator().manual_seed(0)
    prompt = list(range(70))
    serve(t, prompt, gen)
    put = t.host.put

    def put_then_admit(keys, blobs):  # the request arrives between the write's issue and its landing
        handle = put(keys, blobs)
        handle.wait()
        taken.append(cache.add_request(prompt))
        return handle

    taken = []
    t.host.put = put_then_admit
    assert t.offload(max_pages=100) == 0  # every page was in use when the writes landed
    rid, hit = taken[0]
    assert hit == 64 and cache.device_prefix(cache.prefix_keys(prompt)) == 4
    t.close()


def test_a_restore_frees_an_idle_codebook_slot_as_a_completing_chunk_does():
    """Every codebook slot was held by a chunk reduced to cached pages: the restore refused to open a slot (hit 0),
    where recomputing the prompt evicted such a chunk at once."""
    cache, t = make(codec="kivi:bits=2,group=16", packed_pages=8, host_groups=50)  # 8 pages, 5 slots
    gen = torch.Generator().manual_seed(0)
    prompt = list(range(40))
    serve(t, prompt, gen)
    assert t.offload(max_pages=100) == 2
    for i in range(5):  # five other chunks, each reduced to its first page (its tail written down)
        other = list(range(1000 * (i + 1), 1000 * (i + 1) + 40))
        serve(t, other, gen)
        tail = cache.prefix_keys(other)[1]
        page = next(p for p, k in cache.evictable_pages() if k == tail)
        assert t.host.put([tail], [cache.export_page(page)]).result() == [True]
        cache.drop_cached(page)
    assert not cache.packed.slots.can_allocate(1)
    report = t.restore(prompt)
    assert report.restored_from_host == 2 and report.failed == 0
    rid, hit = t.add_request(prompt)
    assert hit == 32
    cache.check()
    t.close()


def test_install_pages_refuses_keys_its_token_ids_do_not_give():
    """Keys installed with too few or other token ids were keyed yet never matched a prompt, and stood in for the
    real pages in every later restore (hit 16 of 64 with the host tier holding all four)."""
    cache, t = make(codec="kivi:bits=2,group=16", host_groups=50)
    gen = torch.Generator().manual_seed(0)
    prompt = list(range(70))
    rid, _ = t.add_request(prompt)
    for layer in range(GEOM.num_layers):
        t.append(rid, layer, torch.randn(70, 2, 64, generator=gen).bfloat16(),
                 torch.randn(70, 2, 64, generator=gen).bfloat16())
    keys = cache.prefix_keys(prompt)
    blobs = torch.zeros(4, cache.blob_bytes, dtype=torch.uint8)
    for i, page in enumerate(cache.page_table(rid).packed):
        blob = cache.export_page(page)
        blobs[i, : blob.numel()] = blob
    t.free(rid)
    assert t.offload(max_pages=100) == 4
    with pytest.raises(ValueError, match="20 token ids do not fill 4 pages"):
        cache.install_pages(keys, prompt[:20], blobs, 0)
    with pytest.raises(ValueError, match=r"keys\[0\] is not the key of page 0"):
        cache.install_pages(keys, [t + 1 for t in prompt], blobs, 0)
    with pytest.raises(ValueError, match="resident has 3 entries for 4 keys"):
        cache.install_pages(keys, prompt, blobs, 0, resident=[False] * 3)
    with pytest.raises(ValueError, match="first_page"):
        cache.install_pages(keys, prompt, blobs, -1)
    assert cache.device_prefix(keys) == 0
    assert cache.install_pages(keys[1:], prompt, blobs[1:], 1) == 3  # keys of later pages check against theirs
    assert cache.install_pages(keys, prompt, blobs, 0) == 4
    rid, hit = t.add_request(prompt)
    assert hit == 64
    t.close()


# -- the file tier's copies of a key, and offloads in flight (a second review's reproducers; each failed before) ----
FP = "0123456789abcdef"


def _byte(tier, key, n=4000):
    out = torch.zeros(n, dtype=torch.uint8)
    return int(out[0]) if tier.get([key], [out]).result()[0] else None


def test_a_replaced_copy_never_comes_back_after_a_restart(tmp_path):
    """The older file listed the replaced key while it stayed for its other blobs; once the newer file was evicted,
    a restart served the replaced bytes. The entry is marked replaced in the older file's table now."""
    tier = FileTier(str(tmp_path), 10**8, FP, fsync=False, workers=2)
    assert tier.put([1, 2], [torch.full((4000,), 1, dtype=torch.uint8),
                             torch.full((4000,), 9, dtype=torch.uint8)]).result() == [True, True]
    assert tier.put([1], [torch.full((4000,), 2, dtype=torch.uint8)]).result() == [True]
    assert _byte(tier, 1) == 2 and _byte(tier, 2) == 9  # the older file stays for its other blob
    assert tier.evict(1) == 1 and _byte(tier, 1) is None  # the newer file (least recently used) goes
    tier.close()
    again = FileTier(str(tmp_path), 10**8, FP, fsync=False, workers=2)
    assert _byte(again, 1) is None and _byte(again, 2) == 9
    assert again.stats().bytes_used == sum(p.stat().st_size for p in tmp_path.iterdir())
    again.close()


def test_a_key_replaced_in_each_of_an_older_files_blobs_removes_that_file(tmp_path):
    tier = FileTier(str(tmp_path), 10**8, FP, fsync=False)
    assert tier.put([1, 2], [torch.full((4000,), 1, dtype=torch.uint8),
                             torch.full((4000,), 9, dtype=torch.uint8)]).result() == [True, True]
    assert tier.put([1], [torch.full((4000,), 2, dtype=torch.uint8)]).result() == [True]
    assert tier.put([2], [torch.full((4000,), 8, dtype=torch.uint8)]).result() == [True]
    assert len(list(tmp_path.iterdir())) == 2  # the first file went with its last blob
    assert tier.stats().bytes_used == sum(p.stat().st_size for p in tmp_path.iterdir())
    tier.close()
    again = FileTier(str(tmp_path), 10**8, FP, fsync=False)
    assert _byte(again, 1) == 2 and _byte(again, 2) == 8
    again.close()


def test_a_put_whose_write_fails_is_not_reported_stored_over_an_older_copy(tmp_path):
    tier = FileTier(str(tmp_path), 30000, FP, fsync=False, workers=2)
    assert tier.put([7], [torch.full((4000,), 1, dtype=torch.uint8)]).result() == [True]
    # a group larger than the budget: nothing written (the key keeps serving its older copy)
    assert tier.put([7, 8], [torch.full((4000,), 2, dtype=torch.uint8),
                             torch.zeros(40000, dtype=torch.uint8)]).result() == [False, False]
    assert _byte(tier, 7) == 1

    def full_disk(path, parts):
        raise OSError(28, "No space left on device")

    tier._write_file = full_disk
    assert tier.put([7], [torch.full((4000,), 2, dtype=torch.uint8)]).result() == [False]
    del tier._write_file
    assert _byte(tier, 7) == 1
    assert tier.put([7], [torch.full((4000,), 1, dtype=torch.uint8)]).result() == [True]  # the bytes it holds
    tier.close()


def test_two_puts_of_a_key_landing_out_of_order_serve_the_later_one_before_and_after_a_restart(tmp_path):
    import threading

    tier = FileTier(str(tmp_path), 10**8, FP, fsync=False, workers=2)
    gate, inside, real = threading.Event(), threading.Event(), tier._write_file

    def slow_disk(path, parts):  # the first put's file is slow to write
        if len(parts[-1]) == 3000:
            inside.set()
            gate.wait(30)
        return real(path, parts)

    tier._write_file = slow_disk
    first = tier.put([5, 6], [torch.full((4000,), 1, dtype=torch.uint8), torch.zeros(3000, dtype=torch.uint8)])
    assert inside.wait(30)
    assert tier.put([5, 7], [torch.full((4000,), 2, dtype=torch.uint8),
                             torch.zeros(5000, dtype=torch.uint8)]).result() == [True, True]
    gate.set()
    assert first.result() == [False, False]  # a later put of key 5 landed first: this file is not kept
    assert _byte(tier, 5) == 2
    tier.close()
    again = FileTier(str(tmp_path), 10**8, FP, fsync=False)
    assert _byte(again, 5) == 2
    assert again.stats().bytes_used == sum(p.stat().st_size for p in tmp_path.iterdir())
    again.close()


def test_pages_that_leave_the_device_while_their_host_write_lands_are_still_written_to_the_file_tier(tmp_path):
    import threading

    cache = KVCache(GEOM, CacheConfig(codec="qvg", page_size=16, chunk_pages=2, dense_pages=32, packed_pages=4,
                                      device="cpu"))
    host = HostTier(10**6, cache.blob_bytes, pin=False)
    file = FileTier(str(tmp_path), 10**8, cache.fingerprint, fsync=False)
    t = TieredCache(cache, host, file, background=False)
    gen = torch.Generator().manual_seed(0)
    tokens = list(range(70))
    serve(t, tokens, gen)  # four cached packed pages: the pool is full
    keys = cache.prefix_keys(tokens)
    gate, started, copy_in = threading.Event(), threading.Event(), host._copy_in

    def slow_copy_in(work, results):
        started.set()
        gate.wait(30)
        return copy_in(work, results)

    host._copy_in = slow_copy_in
    rid, _ = t.add_request([5])  # a running request
    moved = []
    worker = threading.Thread(target=lambda: moved.append(t.offload(max_pages=2)))
    worker.start()
    assert started.wait(30)
    for layer in range(GEOM.num_layers):  # its chunk completes meanwhile, evicting the two pages being written
        t.append(rid, layer, torch.randn(33, 2, 64, generator=gen).bfloat16(),
                 torch.randn(33, 2, 64, generator=gen).bfloat16())
    gate.set()
    worker.join(30)
    host._copy_in = copy_in
    t.flush()
    assert moved == [0]  # neither was on the device any more to drop
    host.evict(100)
    in_file = [file.contains([k]) for k in keys]
    assert sum(in_file) == 2  # the two pages written through all the same
    assert all(f or cache.device_prefix([k]) for k, f in zip(keys, in_file))  # each page is somewhere
    t.close()


def test_a_second_offload_does_not_drop_pages_whose_first_write_then_fails():
    import threading

    cache, t = make(host_groups=50)
    gen = torch.Generator().manual_seed(0)
    tokens = list(range(70))
    serve(t, tokens, gen)
    keys = cache.prefix_keys(tokens)
    host = t.host
    gate, started, copy_in, scatter = threading.Event(), threading.Event(), host._copy_in, host._scatter

    def slow_failing_copy_in(work, results):
        started.set()
        gate.wait(30)

        def fail(blob, entry, non_blocking=False):
            raise RuntimeError("injected copy failure")

        host._scatter = fail
        try:
            return copy_in(work, results)
        finally:
            host._scatter = scatter

    host._copy_in = slow_failing_copy_in
    first = []
    worker = threading.Thread(target=lambda: first.append(t.offload(max_pages=4)))
    worker.start()
    assert started.wait(30)
    host._copy_in = copy_in
    assert t.offload(max_pages=4) == 0  # the pages in flight are not picked again
    gate.set()
    worker.join(30)
    t.flush()
    assert first == [0] and cache.device_prefix(keys) == 4
    t.close()


def test_a_host_put_of_a_key_whose_earlier_put_is_landing_is_not_reported_stored():
    host = HostTier(4 * 1000, 1000, pin=False)
    import threading

    gate, copy_in = threading.Event(), host._copy_in

    def slow(work, results):
        gate.wait(30)
        return copy_in(work, results)

    host._copy_in = slow
    first = host.put([1], [torch.full((1000,), 1, dtype=torch.uint8)])
    host._copy_in = copy_in
    second = host.put([1], [torch.full((1000,), 2, dtype=torch.uint8)])
    assert second.accepted == [False] and second.result() == [False]
    gate.set()
    assert first.result() == [True]
    host.check()


def test_two_caches_of_other_codecs_share_one_host_tier():
    """Keys covered tokens and ``extra_keys`` only: the second cache's offload replaced the first one's page groups
    in a host tier both were handed (same tokens, same keys), and the first cache's restore then refused them by
    their trailer (hit 0 of 32). The cache's fingerprint is part of every key now."""
    a = KVCache(GEOM, CacheConfig(codec="qvg", page_size=16, chunk_pages=2, dense_pages=32, packed_pages=16,
                                  device="cpu"))
    b = KVCache(GEOM, CacheConfig(codec="rtn:bits=2", page_size=16, chunk_pages=2, dense_pages=32, packed_pages=16,
                                  device="cpu"))
    slot = max(a.blob_bytes, b.blob_bytes)
    host = HostTier(8 * slot, slot, pin=False)
    ta, tb = TieredCache(a, host, None, background=False), TieredCache(b, host, None, background=False)
    prompt = list(range(40))
    assert set(a.prefix_keys(prompt)).isdisjoint(b.prefix_keys(prompt))
    gen = torch.Generator().manual_seed(0)
    reads = {}
    for cache, t in ((a, ta), (b, tb)):
        rid, hit = t.add_request(prompt)
        assert hit == 0
        for layer in range(GEOM.num_layers):
            t.append(rid, layer, torch.randn(40, 2, 64, generator=gen).bfloat16(),
                     torch.randn(40, 2, 64, generator=gen).bfloat16())
        reads[id(cache)] = [cache.read(rid, layer)[0][:32].clone() for layer in range(GEOM.num_layers)]
        t.free(rid)
    assert ta.offload(max_pages=100) == 2 and tb.offload(max_pages=100) == 2
    assert host.contains(a.prefix_keys(prompt)) == 2 and host.contains(b.prefix_keys(prompt)) == 2
    for cache, t in ((a, ta), (b, tb)):
        rid, hit = t.add_request(prompt)
        assert hit == 32
        for layer in range(GEOM.num_layers):  # the restored pages decode to what this cache stored
            assert torch.equal(cache.read(rid, layer)[0][:32], reads[id(cache)][layer])
        t.free(rid)
    ta.close()
    tb.close()
