"""Host and file tiers: round trips, crash safety, corruption, full disk, concurrency, restore."""

import errno
import os
import random
import signal
import threading
import time

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.page_group import TRAILER_BYTES
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.base import TierError
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.policy import OffloadPolicy
from kvbackend.tiers.prefetch import TieredCache

FINGERPRINT = "0123456789abcdef"


def blob_for(key: int, size: int = 3000) -> torch.Tensor:
    """Deterministic content per key, so any reader can verify what it got."""
    gen = torch.Generator().manual_seed(key)
    return torch.randint(0, 256, (size + key % 7,), dtype=torch.uint8, generator=gen)


def test_host_round_trip_lru_and_states():
    host = HostTier(capacity_bytes=10 * 1024, slot_bytes=1024)
    keys = [1, 2, 3]
    assert host.put(keys, [blob_for(k, 3000) for k in keys]).result() == [True, True, True]  # 3 slots each
    assert host.contains([1, 2, 3, 4]) == 3
    out = [torch.empty(3100, dtype=torch.uint8) for _ in keys]
    assert host.get(keys, out).result() == [True] * 3
    for k, o in zip(keys, out):
        b = blob_for(k, 3000)
        assert torch.equal(o[: b.numel()], b)
    host.get([1], [torch.empty(3100, dtype=torch.uint8)]).wait()  # 1 is now most recent
    host.put([4, 5], [blob_for(4, 3000), blob_for(5, 3000)]).wait()  # 1 slot free: evicts 2, then 3
    assert host.contains([1]) == 1 and host.contains([2]) == 0 and host.contains([3]) == 0
    assert host.stats().evictions == 2
    host.check()
    assert host.put([9], [torch.zeros(20 * 1024, dtype=torch.uint8)]).result() == [False]  # larger than the tier
    assert host.get([42], [torch.empty(10, dtype=torch.uint8)]).result() == [False]
    with pytest.raises(ValueError, match="1-D uint8"):
        host.put([7], [torch.zeros(4, 4)])


def test_file_round_trip_restart_and_permissions(tmp_path):
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    keys = list(range(10, 20))
    assert all(tier.put(keys[:5], [blob_for(k) for k in keys[:5]]).result())
    assert all(tier.put(keys[5:], [blob_for(k) for k in keys[5:]]).result())
    files = [f for f in os.listdir(tmp_path)]
    assert len(files) == 2 and all(f.endswith(".kvb") for f in files)
    assert all(oct(os.stat(tmp_path / f).st_mode & 0o777) == "0o600" for f in files)
    reopened = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert reopened.contains(keys) == 10
    out = [torch.empty(4000, dtype=torch.uint8) for _ in keys]
    assert all(reopened.get(keys, out).result())
    for k, o in zip(keys, out):
        assert torch.equal(o[: blob_for(k).numel()], blob_for(k))
    other = FileTier(str(tmp_path), 10**7, "fedcba9876543210")  # another layout: not served, not deleted
    assert other.contains(keys) == 0 and len(os.listdir(tmp_path)) == 2


def test_a_large_get_is_read_in_parts_with_results_in_order(tmp_path):
    """A get of many blobs is split over the tier's readers; results (hits, misses, a corrupt blob, a wrong
    expected length) come back in the caller's order, each blob in its own buffer."""
    tier = FileTier(str(tmp_path), 10**8, FINGERPRINT, workers=3)
    keys = list(range(40))
    for k in keys:  # one file per blob: a flip in one file spoils one blob
        assert tier.put([k], [blob_for(k)]).result() == [True]
    corrupt = 17
    path = next(p for p in tmp_path.iterdir() if tier.contains([corrupt]) and _holds(tier, p, corrupt))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    asked = keys[:25] + [999] + keys[25:]  # 999 was never stored
    lengths = [blob_for(k).numel() if k != 33 else 5 for k in keys[:25]] + [None] + [
        blob_for(k).numel() if k != 33 else 5 for k in keys[25:]]
    out = [torch.full((4000,), 7, dtype=torch.uint8) for _ in asked]
    handle = tier.get(asked, out, expected_len=lengths)
    assert len(getattr(handle, "_parts", [handle])) == 3
    got = handle.result()
    for k, o, good in zip(asked, out, got):
        assert good == (k not in (999, corrupt, 33)), k
        if good:
            assert torch.equal(o[: blob_for(k).numel()], blob_for(k))


def test_split_reads_beside_evicting_writes_never_serve_wrong_bytes(tmp_path):
    """Gets of many blobs (read in parts by several workers) while other threads write new blobs into a budget
    that evicts the oldest files: every blob served is exactly its own; evicted ones are misses."""
    tier = FileTier(str(tmp_path), 60 * 3100, FINGERPRINT, fsync=False, workers=3)
    written = list(range(40))
    for k in written:
        assert tier.put([k], [blob_for(k)]).result() == [True]
    lock, errors, served, stop = threading.Lock(), [], [0], threading.Event()

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            with lock:
                known = list(written)
            asked = rng.sample(known, min(len(known), rng.randint(8, 24)))
            out = [torch.full((3100,), 7, dtype=torch.uint8) for _ in asked]
            for k, o, good in zip(asked, out, tier.get(asked, out).result()):
                if good:
                    with lock:
                        served[0] += 1
                    if not torch.equal(o[: blob_for(k).numel()], blob_for(k)):
                        errors.append(k)

    def writer(start):
        for k in range(start, start + 120, 2):
            tier.put([k], [blob_for(k)]).result()
            with lock:
                written.append(k)

    readers = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    writers = [threading.Thread(target=writer, args=(s,)) for s in (1000, 1001)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:5]
    assert served[0] > 100 and tier.stats().evictions > 50  # reads hit while files were being evicted


def _holds(tier, path, key) -> bool:
    with tier._lock:
        return tier._index[key].path == str(path)


def test_budget_evicts_lru_files(tmp_path):
    tier = FileTier(str(tmp_path), 8000, FINGERPRINT)
    tier.put([1], [blob_for(1)]).wait()
    tier.put([2], [blob_for(2)]).wait()
    tier.get([1], [torch.empty(4000, dtype=torch.uint8)]).wait()  # 1 is now most recent
    tier.put([3], [blob_for(3)]).wait()
    assert tier.contains([1]) == 1 and tier.contains([2]) == 0 and tier.contains([3]) == 1
    assert tier.put([4], [torch.zeros(9000, dtype=torch.uint8)]).result() == [False]  # over the whole budget
    assert tier.stats().bytes_used <= 8000


@pytest.mark.parametrize("trial", range(20))
def test_bit_flips_never_serve_wrong_data(tmp_path, trial):
    rng = random.Random(trial)
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    keys = [100 + trial * 10 + i for i in range(3)]
    tier.put(keys, [blob_for(k) for k in keys]).wait()
    (name,) = os.listdir(tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    position = rng.randrange(len(data))
    data[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    for reader in (tier, FileTier(str(tmp_path), 10**7, FINGERPRINT)):  # running, and restarted
        out = [torch.full((4000,), 7, dtype=torch.uint8) for _ in keys]
        ok = reader.get(keys, out).result() if reader.contains(keys[:1]) else [False] * 3
        for k, o, good in zip(keys, out, ok):
            if good:  # served only when the bytes are exactly the original
                assert torch.equal(o[: blob_for(k).numel()], blob_for(k))
        assert not all(ok) or position < 48  # a flip in the blobs is always caught (header flips: caught at start-up)


def test_full_disk_fails_cleanly(tmp_path, monkeypatch):
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)

    def no_space(path, parts):
        with open(path, "wb") as f:
            f.write(parts[0][:10])  # a partial temp file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier, "_write_file", no_space)
    assert tier.put([1, 2], [blob_for(1), blob_for(2)]).result() == [False, False]
    assert tier.contains([1]) == 0 and os.listdir(tmp_path) == [] and tier.stats().failures == 1


def test_sigkill_during_writes_leaves_only_complete_files(tmp_path):
    """Kill a writer at random points 100 times; a restart serves only complete, correct blobs."""
    rng = random.Random(0)
    deadline = time.time() + 60
    seen_partial = False
    for attempt in range(100):
        pid = os.fork()
        if pid == 0:  # child: write groups until killed (synchronously, no threads)
            try:
                tier = FileTier(str(tmp_path), 10**9, FINGERPRINT, workers=1)
                base = 1000 * (attempt + 1)
                for i in range(10**6):
                    keys = [base + 3 * i + j for j in range(3)]
                    tier.write_group(keys, [blob_for(k, 20000).numpy().tobytes() for k in keys])
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0005, 0.02))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        partial_seen = [f for f in os.listdir(tmp_path) if ".tmp" in f]
        if partial_seen:
            seen_partial = True
        assert time.time() < deadline
    assert seen_partial, "no kill landed mid-write: the test exercised nothing"
    tier = FileTier(str(tmp_path), 10**9, FINGERPRINT)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # partial writes were cleaned up
    indexed = [k for k in tier._index]
    assert indexed, "no write completed in 100 attempts"
    out = [torch.empty(20010, dtype=torch.uint8) for _ in indexed]
    assert all(tier.get(indexed, out).result())
    for k, o in zip(indexed, out):
        assert torch.equal(o[: blob_for(k, 20000).numel()], blob_for(k, 20000))


@pytest.mark.timeout(120)
def test_many_threads_random_operations(tmp_path):
    host = HostTier(64 * 4096, 4096)
    file = FileTier(str(tmp_path), 400 * 4096, FINGERPRINT)
    stop = time.time() + 3
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            while time.time() < stop:
                tier = host if rng.random() < 0.5 else file
                key = rng.randrange(200)
                op = rng.random()
                if op < 0.4:
                    tier.put([key], [blob_for(key, 3000)]).wait()
                elif op < 0.8:
                    out = torch.empty(4000, dtype=torch.uint8)
                    if tier.get([key], [out]).result()[0]:
                        expected = blob_for(key, 3000)
                        if not torch.equal(out[: expected.numel()], expected):
                            errors.append(f"corrupt blob {key} from {tier.name}")
                elif op < 0.95:
                    tier.contains([key, key + 1])
                else:
                    tier.evict(1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    host.check()
    stats = host.stats()
    assert stats.bytes_used <= stats.capacity_bytes and stats.blobs <= 64
    assert file.stats().bytes_used <= 400 * 4096


MIXED = ("qvg", "kivi:bits=2,group=16")  # a per-layer plan: pages and codebooks of two sizes
# a chw: plan (a key width per channel, chunk means in the codebook slot), with exact sinks and rotated values
CHW = ("chw:kw=" + "3201" * 32 + ",vbits=2,sink=4,vrot=hadamard", "chw:kbits=3,vbits=3,order=lane")  # the second in lane order


def filled(codec="qvg", packed_pages=16, device="cpu"):
    """A two-layer cache; ``codec`` is one spec, or a tuple of one spec per layer."""
    which = {"layer_codecs": codec} if isinstance(codec, tuple) else {"codec": codec}
    cache = KVCache(Geometry(2, 2, 64, torch.bfloat16),
                    CacheConfig(**which, page_size=16, chunk_pages=2, dense_pages=32, packed_pages=packed_pages,
                                device=device))
    return cache


def fill(tiered, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rid, _ = tiered.add_request(tokens)
    device = tiered.cache.dense.data.device
    for layer in range(2):
        tiered.append(rid, layer, torch.randn(len(tokens), 2, 64, generator=gen).bfloat16().to(device),
                      torch.randn(len(tokens), 2, 64, generator=gen).bfloat16().to(device))
    return rid


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("codec", ["qvg", "kivi:bits=2,group=16", MIXED, CHW])
def test_round_trip_device_host_file_host_device(tmp_path, codec, device):
    cache = filled(codec, device=device)
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), FileTier(str(tmp_path), 10**8, cache.fingerprint),
                         background=False)
    tokens = list(range(70))
    rid = fill(tiered, tokens)
    before_bytes = [cache.export_page(p) for p in cache.page_table(rid).packed]
    before = [tiered.read(rid, layer) for layer in range(2)]
    slots_before = cache.stats().codebook_slots_used  # 2 chunks
    tiered.free(rid)
    assert tiered.offload(max_pages=100) == 4
    tiered.flush()
    assert cache.stats().packed_pages_cached == 0
    tiered.host.evict(100)  # force the file path: file -> host -> device
    rid2, hit = tiered.add_request(tokens)
    assert hit == 64
    after_bytes = [cache.export_page(p) for p in cache.page_table(rid2).packed]
    assert all(torch.equal(a, b) for a, b in zip(before_bytes, after_bytes))  # chunk ids and carriers too
    if codec != "kivi:bits=2,group=16":  # only each chunk's first page carries the codebooks
        books = sum(lay.codebook_bytes for lay in cache.layouts)
        assert books > 0 and [b.numel() for b in before_bytes] == [cache.blob_bytes, cache.blob_bytes - books] * 2
    for layer in range(2):
        k, v = tiered.read(rid2, layer)
        assert torch.equal(k, before[layer][0][:64]) and torch.equal(v, before[layer][1][:64])
    assert cache.stats().codebook_slots_used == slots_before  # pages of a chunk share its slot again
    tiered.flush()  # the warm copy to the host runs behind admission
    assert tiered.host.contains(cache.prefix_keys(tokens)) == 4  # the file hit was copied up to the host
    cache.check()
    tiered.close()


def test_offload_survives_full_disk_and_background_worker(tmp_path, monkeypatch):
    cache = filled(packed_pages=8)
    file = FileTier(str(tmp_path), 10**8, cache.layout.fingerprint)
    monkeypatch.setattr(file, "_write_file", lambda path, parts: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), file,
                         OffloadPolicy(high_water=0.4, low_water=0.25, interval_s=0.01))
    tokens = list(range(70))
    tiered.free(fill(tiered, tokens))  # 4 cached packed pages of 8: above the high-water mark
    deadline = time.time() + 10
    while tiered.offloaded_pages < 2 and time.time() < deadline:  # counted once the pages were stored below
        time.sleep(0.01)
    assert cache.stats().packed_pages_cached <= 2
    tiered.flush()
    assert file.stats().failures >= 1 and file.contains(cache.prefix_keys(tokens)) == 0
    _, hit = tiered.add_request(tokens)  # the pages came back from the host tier
    assert hit == 64
    tiered.close()


def test_prefetch_and_cancel(tmp_path):
    cache = filled()
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), None, background=False)
    tokens = list(range(70))
    tiered.free(fill(tiered, tokens))
    tiered.offload(max_pages=100)
    tiered.flush()
    report = tiered.prefetch(tokens).wait(timeout=30)
    assert report.restored_from_host == 4 and report.failed == 0
    tiered.offload(max_pages=100)
    tiered.flush()
    keys = cache.prefix_keys(tokens)
    gate = threading.Event()
    tiered._pool.submit(gate.wait)  # the prefetch queues behind this
    rid, _ = tiered.add_request(tokens[:5])
    queued = tiered.prefetch(tokens, request_id=rid)
    tiered.free(rid)  # freed before its prefetch ran: cancelled, nothing installed
    gate.set()
    assert queued.cancelled() and queued.wait(timeout=30) is None
    assert cache.device_prefix(keys) == 0
    started = threading.Event()
    original = tiered.host.read_layered

    def slow_read(*args):  # cancel while the restore is copying from the host
        started.set()
        time.sleep(0.2)
        return original(*args)

    tiered.host.read_layered = slow_read
    rid, _ = tiered.add_request(tokens[:5])
    running = tiered.prefetch(tokens, request_id=rid)
    assert started.wait(timeout=30)
    tiered.free(rid)
    report = running.wait(timeout=30)
    assert report is not None and report.restored_from_host == 0 and cache.device_prefix(keys) == 0
    assert tiered.host.contains(keys) == 4  # the blobs stay below, ready for the next request
    tiered.close()


def test_adjacent_blobs_coalesce_into_one_copy():
    """Rows adjacent in one buffer and in host slots move as one transfer (the CUDA path's copies)."""
    from kvbackend.tiers.host import SlotState, _Entry

    host = HostTier(10 * 100, 100, pin=False)
    staged = torch.zeros(4, 100, dtype=torch.uint8)
    entries = [_Entry([i], 100, SlotState.READY) for i in (3, 4, 5, 7)]
    runs = list(host._runs(list(zip(list(staged), entries))))
    assert [len(e) for _, e in runs] == [3, 1] and [t.numel() for t, _ in runs] == [300, 100]
    assert host._host_run(runs[0][1]).data_ptr() == host.buffer[300:].data_ptr()
    separate = [torch.zeros(100, dtype=torch.uint8) for _ in range(2)]  # other storages never merge
    assert len(list(host._runs(list(zip(separate, entries[:2]))))) == 2


def test_restore_joins_the_resident_codebook_and_stops_without_one():
    cache = filled("qvg")
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), None, background=False)
    tokens = list(range(70))
    tiered.free(fill(tiered, tokens))
    keys = cache.prefix_keys(tokens)
    pages = {key: page for page, key in cache.evictable_pages()}
    # Offload only the second page of each chunk: their chunks' codebooks stay resident on the device.
    for key in (keys[1], keys[3]):
        assert tiered.host.put([key], [cache.export_page(pages[key])]).result() == [True]
        cache.drop_cached(pages[key])
    slots = cache.stats().codebook_slots_used
    assert tiered.restore(tokens).restored_from_host == 2
    assert cache.stats().codebook_slots_used == slots  # joined, no codebook copied
    # Now drop a chunk's carrier everywhere: its second page cannot be restored, and the prefix stops.
    for page, key in cache.evictable_pages():
        tiered.host.put([key], [cache.export_page(page)]).wait()
        cache.drop_cached(page)
    tiered.host.discard([keys[2]])  # the carrier of the second chunk
    report = tiered.restore(tokens)
    assert report.restored_from_host == 2 and cache.device_prefix(keys) == 2
    cache.check()


def test_file_tier_stores_dense_pages_as_alignpred(tmp_path):
    """A bf16 cache's file tier in AlignPred: fewer bytes on disk, every restored value within the
    stored bound (plus bf16 rounding), damaged files count as misses, other formats are not served."""
    from kvbackend.alignpred import AlignPredCodec, fp8_nrmse
    from kvbackend.errors import UnsupportedLayout
    from kvbackend.tiers.persist import AlignPredFormat

    cache = KVCache(Geometry(2, 2, 64, torch.bfloat16),
                    CacheConfig(codec="bf16", page_size=16, chunk_pages=2, dense_pages=32, packed_pages=16))
    fmt = AlignPredFormat("alignpred:error=1x", cache.layout)
    file = FileTier(str(tmp_path), 10**8, cache.layout.fingerprint, fmt=fmt)
    tiered = TieredCache(cache, None, file, background=False)
    tokens = list(range(70))
    rid = fill(tiered, tokens)
    before = [tiered.read(rid, layer) for layer in range(2)]
    exported = [cache.export_page(p) for p in cache.page_table(rid).packed]
    tiered.free(rid)
    assert tiered.offload(max_pages=100) == 4
    tiered.flush()
    stored = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path))
    assert stored < 0.5 * sum(b.numel() for b in exported)  # bf16 pages at FP8-level error: well under half
    rid2, hit = tiered.add_request(tokens)
    assert hit == 64
    codec = AlignPredCodec("alignpred:error=1x")
    restored = [cache.export_page(p) for p in cache.page_table(rid2).packed]
    for old, new in zip(exported, restored):
        stream = fmt.encode(old.numpy().tobytes())[TRAILER_BYTES:]  # deterministic: the very stream the tier wrote
        bounds = codec.max_errors(stream)
        assert torch.equal(old[-TRAILER_BYTES:], new[-TRAILER_BYTES:])  # the trailer comes back verbatim
        for x, y, bound in zip(fmt._views(old), fmt._views(new), bounds):
            x, y = x.float(), y.float()
            nrmse = float((x - y).square().sum().sqrt() / x.square().sum().sqrt())
            assert 0 < nrmse <= 1.01 * fp8_nrmse(x.numpy())  # FP8-level; bf16 storage adds its own rounding
            assert bool(((y - x).abs() <= bound + y.abs() * 2.0**-8).all())  # bound + bf16 half-ulp
    for layer in range(2):
        k, _ = tiered.read(rid2, layer)
        assert not torch.equal(k, before[layer][0][:64]) and torch.allclose(k, before[layer][0][:64], atol=0.5)
    reopened = FileTier(str(tmp_path), 10**8, cache.layout.fingerprint, fmt=fmt)
    assert reopened.contains(cache.prefix_keys(tokens)) == 4
    raw = FileTier(str(tmp_path), 10**8, cache.layout.fingerprint)  # the raw format does not serve them
    assert raw.contains(cache.prefix_keys(tokens)) == 0
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    data = bytearray(path.read_bytes())
    at = len(data) - 100  # inside the stream of the file's last page group
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    keys = cache.prefix_keys(tokens)
    hit = [not (w.offset <= at < w.offset + w.length) for w in (reopened._index[k] for k in keys)]
    assert hit.count(False) == 1
    outs = [torch.empty(fmt.blob_bytes, dtype=torch.uint8) for _ in range(4)]
    assert reopened.get(keys, outs).result() == hit  # that group a miss, never wrong values; the others served
    for out, good, new in zip(outs, hit, restored):
        if good:  # the same decoded page group as the restore above
            assert torch.equal(out, new)
    tiered.close()
    with pytest.raises(UnsupportedLayout, match="dense float pages"):
        AlignPredFormat("alignpred:error=1x", filled("qvg").layout)


def test_copy_2d_rows_at_their_pitches():
    from kvbackend.tiers.copy2d import copy_2d

    src = torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8)
    dst = torch.zeros(900, dtype=torch.uint8)
    copy_2d(dst, 5, 97, src, 11, 123, 40, 7)  # 7 rows of 40 bytes
    for r in range(7):
        assert torch.equal(dst[5 + r * 97 : 45 + r * 97], src[11 + r * 123 : 51 + r * 123])
    assert int(dst[:5].sum()) == 0 and int(dst[45:102].sum()) == 0  # nothing between the rows
    with pytest.raises(AssertionError, match="outside"):
        copy_2d(dst, 0, 200, src, 0, 123, 40, 7)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("codec", ["qvg", "rtn:bits=2,group=16", MIXED])
def test_layered_restore_from_host_is_bit_identical(codec, device, monkeypatch):
    """Host -> device restore range by range (trailers, then each layer) over slots that are not all
    adjacent: the installed pages equal the exported ones, byte for byte. On CUDA each layer is
    installed on a side stream once its copy's event fired, and reads wait for their layer's event."""
    from kvbackend.tiers import transfer
    from kvbackend.tiers.host import LayeredRead

    monkeypatch.setattr(transfer, "MIN_ROW_BYTES", 1)  # one copy per layer (real pages group small layers)
    cache = filled(codec, device=device)
    host = HostTier(10**6, cache.blob_bytes)
    host.put([999], [torch.zeros(cache.blob_bytes, dtype=torch.uint8)]).wait()  # takes slot 0
    tiered = TieredCache(cache, host, None, background=False)
    tokens = list(range(70))
    rid = fill(tiered, tokens)
    before = [cache.export_page(p) for p in cache.page_table(rid).packed]
    reads = [tiered.read(rid, layer) for layer in range(2)]
    tiered.free(rid)
    keys = cache.prefix_keys(tokens)
    host.put(keys[2:], [before[2], before[3]]).wait()  # slots 1, 2
    host.put([998], [torch.zeros(cache.blob_bytes, dtype=torch.uint8)]).wait()  # slot 3: a gap
    host.put(keys[:2], [before[0], before[1]]).wait()  # slots 4, 5: two runs of rows and slots
    for page, _ in cache.evictable_pages():
        cache.drop_cached(page)
    calls = []
    original = LayeredRead.copy_range
    LayeredRead.copy_range = lambda self, off, width: (calls.append((off, width)), original(self, off, width))[1]
    try:
        report = tiered.restore(tokens)
    finally:
        LayeredRead.copy_range = original
    assert report.restored_from_host == 4 and report.failed == 0
    (_, pb0), (start1, pb1) = cache.page_span(0), cache.page_span(1)
    assert start1 == pb0  # trailers and codebooks first, then layer 0, layer 1
    assert calls[0][0] == pb0 + pb1 and calls[1:] == [(0, pb0), (pb0, pb1)]
    rid2, hit = tiered.add_request(tokens)
    assert hit == 64
    after = [cache.export_page(p) for p in cache.page_table(rid2).packed]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    for layer in range(2):
        k, v = tiered.read(rid2, layer)
        assert torch.equal(k, reads[layer][0][:64]) and torch.equal(v, reads[layer][1][:64])
    host.check()
    assert host.stats().blobs == 6
    tiered.close()


def test_layered_read_refuses_multi_slot_blobs():
    host = HostTier(10**5, 1000)
    host.put([1], [blob_for(1, 2500)]).wait()  # three slots
    assert host.read_layered([1], torch.empty(1, 3000, dtype=torch.uint8), [0]) is None
    host.check()


def test_host_batches_keep_results_in_order():
    """put/get of more blobs than one batch: one handle, one result per key, in order."""
    from kvbackend.tiers.host import BATCH

    host = HostTier(10**6, 4096)
    n = 2 * BATCH + 5
    keys = list(range(100, 100 + n))
    blobs = [blob_for(k, 2000) for k in keys]
    assert host.put(keys[:3], blobs[:3]).result() == [True] * 3
    assert host.put(keys, blobs).result() == [True] * n  # the first three were held already
    outs = [torch.empty(2100, dtype=torch.uint8) for _ in keys]
    handle = host.get(keys + [7], outs + [torch.empty(2100, dtype=torch.uint8)])
    assert handle.result() == [True] * n + [False] and handle.done()
    assert all(torch.equal(o[: b.numel()], b) for o, b in zip(outs, blobs))
    host.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the race is between CUDA streams")
def test_offload_right_after_a_layered_restore_exports_the_restored_bytes(tmp_path):
    """A host restore installs layers on a side stream; an offload soon after must export the bytes
    that restore copied, not what the pages held before (once seen on an H200: 15-19 of 32 layers of a
    6144-token prefix came back wrong from the file tier)."""
    layers, heads, dim, page, chunk, pages = 32, 8, 128, 64, 4, 96
    geometry = Geometry(layers, heads, dim, torch.bfloat16)
    config = CacheConfig(codec="identity", page_size=page, chunk_pages=chunk, dense_pages=2 * chunk + 2,
                         packed_pages=pages, device="cuda")
    cache = KVCache(geometry, config)
    host = HostTier(cache.blob_bytes * (pages + 8), cache.blob_bytes)
    prompt = list(range(pages * page + 1))
    xs = [torch.randn(pages * page, heads, dim, device="cuda").bfloat16() for _ in range(layers)]
    rid, _ = cache.add_request(prompt)
    for start in range(0, pages * page, chunk * page):
        for layer in range(layers):
            cache.append(rid, layer, xs[layer][start : start + chunk * page], -xs[layer][start : start + chunk * page])
    cache.free(rid)
    first = TieredCache(cache, host, None, background=False)
    first.offload(max_pages=pages)
    first.flush()  # the pages live in the host tier only
    tiered = TieredCache(cache, host, FileTier(str(tmp_path), 1 << 40, cache.fingerprint, fsync=False),
                         background=False)
    assert tiered.restore(prompt).restored_from_host == pages
    tiered.offload(max_pages=pages)  # at once: the restored pages go down again, to the file tier too
    tiered.flush()
    restarted = KVCache(geometry, config)  # a restarted engine restores from the file tier alone
    again = TieredCache(restarted, None, FileTier(str(tmp_path), 1 << 40, restarted.fingerprint, fsync=False),
                        background=False)
    rid, hit = again.add_request(prompt)
    assert hit == pages * page
    for layer in range(layers):
        k, v = again.read(rid, layer)
        assert torch.equal(k, xs[layer]) and torch.equal(v, -xs[layer]), f"layer {layer}"
    for t in (first, tiered, again):
        t.close()


def test_decode_steps_through_the_tiered_cache_while_the_worker_offloads(tmp_path):
    """`TieredCache.append_step` takes the lock the offload worker takes: decode steps of a batch, with
    chunks completing and cached pages moving down meanwhile, leave a consistent cache whose reads are
    what was appended."""
    cache = filled("kivi:bits=2,group=16", packed_pages=12)
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), None,
                         policy=OffloadPolicy(high_water=0.3, low_water=0.1, interval_s=0.001))
    try:
        for i in range(3):  # cached pages for the worker to move down
            tiered.free(fill(tiered, list(range(100 * i, 100 * i + 40)), seed=i))
        rids = [fill(tiered, list(range(1000 + 100 * i, 1000 + 100 * i + 20)), seed=10 + i) for i in range(2)]
        gen = torch.Generator().manual_seed(5)
        steps = [torch.randn(2, 2, 2, 64, generator=gen).bfloat16() for _ in range(30)]  # [layer, B, H, D]
        for kv in steps:
            for layer in range(2):
                tiered.append_step(rids, layer, kv[layer], -kv[layer])
        tiered.flush()
        with tiered.lock:
            cache.check()
            for i, rid in enumerate(rids):
                assert cache.page_table(rid).lengths == [50, 50] and cache.page_table(rid).packed  # chunks packed
                k, v = cache.read_dense(rid, 0)
                tail = torch.stack([kv[0, i] for kv in steps])[-k.shape[0]:]
                assert torch.equal(k, tail) and torch.equal(v, -tail)  # the dense tail is what was appended
        # the worker runs on its own clock: under a loaded machine it may not have moved a page yet; give it time
        # rather than fail on scheduling (the checks above are what the race must never break)
        deadline = time.monotonic() + 10.0
        while tiered.offloaded_pages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tiered.offloaded_pages > 0, "the offload worker never moved a page in 10 s"
        with tiered.lock:
            cache.check()
    finally:
        tiered.close()


# -- the host tier's failure paths: nothing stays locked, nothing is evicted for a put that cannot succeed --------

def _host(slots=3, slot=1000):
    return HostTier(capacity_bytes=slots * slot, slot_bytes=slot, pin=False)


def _blob(n, fill):
    return torch.full((n,), fill, dtype=torch.uint8)


def test_a_put_that_cannot_fit_evicts_nothing():
    host = _host()
    assert host.put([1, 2, 3], [_blob(1000, i) for i in (1, 2, 3)]).result() == [True] * 3
    assert host.put([9], [_blob(4000, 9)]).result() == [False]  # larger than the tier
    reading = host.read_layered([1], torch.empty(1, 1000, dtype=torch.uint8), [0])  # one blob busy
    assert host.put([8], [_blob(3000, 8)]).result() == [False]  # fits the tier, not beside the busy blob
    reading.close()
    stats = host.stats()
    assert (stats.blobs, stats.evictions, stats.failures) == (3, 0, 2)
    for key in (1, 2, 3):
        out = torch.empty(1000, dtype=torch.uint8)
        assert host.get([key], [out]).result() == [True] and torch.equal(out, _blob(1000, key))
    host.check()


def test_a_copy_that_fails_in_the_worker_leaves_no_entry_behind(monkeypatch):
    host = _host()
    scatter, calls = host._scatter, []

    def failing(blob, entry, non_blocking=False):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        scatter(blob, entry, non_blocking)

    monkeypatch.setattr(host, "_scatter", failing)
    handle = host.put([1, 2, 3], [_blob(1000, i) for i in (1, 2, 3)])
    assert handle.accepted == [True] * 3  # admitted at once ...
    assert handle.result() == [True, False, False]  # ... the failed copy and those after it are not stored
    assert host.contains([1]) == 1 and host.stats().blobs == 1 and host.stats().failures == 2
    monkeypatch.setattr(host, "_scatter", scatter)
    assert host.put([2], [_blob(1000, 2)]).result() == [True]  # the key is writable again, and readable
    out = torch.empty(1000, dtype=torch.uint8)
    assert host.get([2], [out]).result() == [True] and torch.equal(out, _blob(1000, 2))
    # a get whose copy fails (a buffer torch refuses to write) misses and releases its entry
    assert host.get([2], [torch.zeros(1, dtype=torch.uint8).expand(1000)]).result() == [False]
    assert host.evict(10) == 2
    host.check()


def test_cancelled_operations_release_what_they_registered():
    host = _host()
    assert host.put([1], [_blob(1000, 1)]).result() == [True]
    gate = threading.Event()
    blockers = [host._pool.submit(gate.wait) for _ in range(2)]  # both copy workers busy: the next calls queue
    put = host.put([2], [_blob(1000, 2)])
    get = host.get([1], [torch.empty(1000, dtype=torch.uint8)])
    put.cancel()
    get.cancel()
    gate.set()
    for b in blockers:
        b.result()
    assert put.wait() and get.wait()  # a cancelled operation is finished
    assert host.contains([2]) == 0 and host.evict(10) == 1  # key 2 never held; key 1 idle again
    host.check()


def test_calls_after_close_and_bad_inputs_raise_clearly():
    host = _host()
    with pytest.raises(ValueError, match="keys are integers"):
        host.put([torch.tensor(1)], [_blob(10, 1)])
    with pytest.raises(ValueError, match="keys are integers"):
        host.get([None], [torch.empty(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="must hold bytes"):
        host.put([1], [_blob(0, 0)])
    with pytest.raises(ValueError, match="capacity_bytes must be an int"):
        HostTier(capacity_bytes=3000.0, slot_bytes=1000, pin=False)
    assert host.put([1], [_blob(10, 1)]).result() == [True]
    layered = host.read_layered([1], torch.zeros(2, 10, dtype=torch.uint8), [1])
    with pytest.raises(ValueError, match="outside rows"):
        layered.copy_range(-5, 10)
    layered.close()
    host.close()
    with pytest.raises(TierError, match="closed"):
        host.put([2], [_blob(10, 2)])
    with pytest.raises(TierError, match="closed"):
        host.get([1], [torch.empty(10, dtype=torch.uint8)])
    assert host.stats().blobs == 1


def test_a_combined_wait_keeps_one_deadline():
    from concurrent.futures import Future

    from kvbackend.tiers.base import Handle

    never = [Handle(Future()) for _ in range(4)]
    start = time.monotonic()
    assert Handle.combine(never).wait(timeout=0.2) is False
    assert time.monotonic() - start < 0.6  # not 4 x 0.2 s


def _tiered_prompt(host, file=None, n=70):
    cache = KVCache(Geometry(2, 2, 64, torch.bfloat16),
                    CacheConfig(codec="qvg", page_size=16, chunk_pages=2, dense_pages=32, packed_pages=16, device="cpu"))
    host = host(cache) if callable(host) else host
    tiered = TieredCache(cache, host, file(cache) if callable(file) else file, background=False)
    tokens = list(range(n))
    gen = torch.Generator().manual_seed(0)
    rid, _ = tiered.add_request(tokens)
    for layer in range(2):
        tiered.append(rid, layer, torch.randn(n, 2, 64, generator=gen).bfloat16(),
                      torch.randn(n, 2, 64, generator=gen).bfloat16())
    tiered.free(rid)
    return cache, tiered, tokens


def test_offload_keeps_on_the_device_the_pages_the_host_refused():
    """A host tier with room for 2 of 4 page groups: the 2 it refused stay cached on the device, and only the
    pages stored below are counted as moved."""
    cache, tiered, tokens = _tiered_prompt(lambda c: HostTier(2 * c.blob_bytes, c.blob_bytes, pin=False))
    keys = cache.prefix_keys(tokens)
    moved = tiered.offload(max_pages=100)
    tiered.flush()
    assert moved == tiered.offloaded_pages == tiered.host.stats().blobs == 2
    assert all(tiered.host.contains([k]) or cache.device_prefix([k]) for k in keys)
    tiered.close()


def test_a_restore_that_fails_while_staging_releases_the_host_blobs(tmp_path):
    cache, tiered, tokens = _tiered_prompt(lambda c: HostTier(10 * c.blob_bytes, c.blob_bytes, pin=False),
                                           lambda c: FileTier(str(tmp_path), 10**8, c.fingerprint, fsync=False))
    keys = cache.prefix_keys(tokens)
    assert tiered.offload(max_pages=100) == 4
    tiered.flush()
    tiered.host.discard(keys[2:])  # pages 0-1 on the host, 2-3 in the file tier only

    def failing_get(*args, **kwargs):
        raise RuntimeError("simulated read failure")

    tiered.file.get = failing_get
    with pytest.raises(RuntimeError, match="simulated"):
        tiered.prefetch(tokens).wait(timeout=30)
    assert tiered.host.evict(10) == 2  # released, not held READING for good
    tiered.close()


# -- file reads through reused windows (`kvbackend.tiers.bounce`) ------------------------------------------
def test_a_bounce_ring_reuses_its_windows_and_never_hands_one_out_twice():
    from kvbackend.tiers.bounce import BounceRing

    ring = BounceRing(window_bytes=1000, windows=2, pinned=False)
    a, b = ring.take(10), ring.take(1000)
    assert a.data.data_ptr() != b.data.data_ptr() and ring.allocated == 2
    assert ring.take(10, block=False) is None  # both out: a non-blocking take goes without
    waited = []

    class Reading:  # a tier operation still reading the window
        def wait(self, timeout=None):
            waited.append(True)
            return True

    ring.give(a, handles=[Reading()])
    again = ring.take(500)
    assert again is a and waited == [True] and ring.allocated == 2  # the same memory, once its reader finished
    big = ring.take(5000)  # a run larger than a window: a buffer of its own, not kept
    assert big.data.numel() == 5000 and big.owned and ring.allocated == 2
    ring.give(big)
    assert ring.take(1, block=False) is None
    with pytest.raises(ValueError, match="positive"):
        BounceRing(window_bytes=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("window_blobs", [0.5, 1, 1.5, 3, 100])
def test_file_restores_through_small_windows_give_the_same_pages(tmp_path, device, window_blobs):
    """A restore from the file tier reads its rows in runs of at most one window (reused, READ_AHEAD runs
    ahead): every page comes back with the bytes it left with, whatever the window, with a host tier
    warmed behind it; a second restore through the same ring allocates no new window."""
    from kvbackend.tiers.bounce import BounceRing

    cache = filled(MIXED, packed_pages=24, device=device)
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes), FileTier(str(tmp_path), 10**8, cache.fingerprint),
                         background=False)
    tiered._bounce = BounceRing(window_bytes=max(1, int(window_blobs * cache.blob_bytes)), windows=3,
                                pinned=device == "cuda")
    tokens = list(range(200))  # 12 packed pages of 16 tokens (6 chunks)
    rid = fill(tiered, tokens)
    before_bytes = [cache.export_page(p) for p in cache.page_table(rid).packed]
    before = [tiered.read(rid, layer) for layer in range(2)]
    tiered.free(rid)
    assert tiered.offload(max_pages=100) == 12
    tiered.flush()
    tiered.host.evict(100)
    rid2, hit = tiered.add_request(tokens)
    assert hit == 192
    assert all(torch.equal(a, b) for a, b in zip(before_bytes, [cache.export_page(p) for p in cache.page_table(rid2).packed]))
    for layer in range(2):
        k, v = tiered.read(rid2, layer)
        assert torch.equal(k, before[layer][0][:192]) and torch.equal(v, before[layer][1][:192])
    tiered.flush()
    assert tiered.host.contains(cache.prefix_keys(tokens)) == 12  # warm copies of every run
    allocated = tiered._bounce.allocated
    assert 1 <= allocated <= 3
    tiered.free(rid2)
    assert tiered.offload(max_pages=100) == 12
    tiered.flush()
    tiered.host.evict(100)
    _, hit = tiered.add_request(tokens)
    assert hit == 192 and tiered._bounce.allocated == allocated
    cache.check()
    tiered.close()


def _on_file(tmp_path, window_blobs=None, windows=3):
    """A two-layer kivi-2 cache whose 200-token prompt's 12 packed pages went to a file tier only (no host
    tier); with ``window_blobs``, restores read through a ring of ``windows`` windows of that many page groups.
    Returns (tiered cache, file tier, prompt)."""
    from kvbackend.tiers.bounce import BounceRing

    cache = filled("kivi:bits=2,group=16", packed_pages=24)
    file = FileTier(str(tmp_path), 10**8, cache.fingerprint)
    tiered = TieredCache(cache, None, file, background=False)
    if window_blobs is not None:
        tiered._bounce = BounceRing(window_bytes=window_blobs * cache.blob_bytes, windows=windows, pinned=False)
    tokens = list(range(200))
    tiered.free(fill(tiered, tokens))
    assert tiered.offload(max_pages=100) == 12
    tiered.flush()
    return tiered, file, tokens


def test_a_corrupt_file_row_stops_the_restore_there_whatever_the_window(tmp_path):
    """A run whose middle blob is damaged: the pages before it are restored, none from it on (a prefix), and
    no window is left held."""
    tiered, file, tokens = _on_file(tmp_path, window_blobs=2, windows=2)
    keys = tiered.cache.prefix_keys(tokens)
    where = file._index[keys[5]]
    data = bytearray(open(where.path, "rb").read())
    data[where.offset + where.length // 2] ^= 0x01
    open(where.path, "wb").write(bytes(data))
    _, hit = tiered.add_request(tokens)
    assert hit == 5 * 16
    assert [tiered._bounce.take(1, block=False) is not None for _ in range(2)] == [True, True]  # both given back
    tiered.close()


def test_concurrent_restores_share_one_window_without_deadlock(tmp_path):
    """Restores of two prompts at once through a ring of a single window: both complete with their pages."""
    from kvbackend.tiers.bounce import BounceRing

    cache = filled("kivi:bits=2,group=16", packed_pages=48)
    tiered = TieredCache(cache, None, FileTier(str(tmp_path), 10**8, cache.fingerprint), background=False)
    tiered._bounce = BounceRing(window_bytes=cache.blob_bytes, windows=1, pinned=False)
    prompts = [list(range(200)), list(range(1000, 1200))]
    for seed, prompt in enumerate(prompts):
        tiered.free(fill(tiered, prompt, seed=seed))
    assert tiered.offload(max_pages=100) == 24
    tiered.flush()
    reports = [None, None]

    def restore(i):
        reports[i] = tiered.restore(prompts[i])

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert [r.restored_from_file for r in reports] == [12, 12]
    tiered.close()


def test_a_read_that_fails_to_start_loses_no_window(tmp_path):
    """`file.get` raising for one run (its executor refusing work, say): that restore raises, its window goes back
    to the ring, and the next restore completes (a lost window would block every later restore forever)."""
    tiered, file, tokens = _on_file(tmp_path, window_blobs=4, windows=1)
    real_get, calls = file.get, []

    def flaky_get(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cannot schedule new futures")
        return real_get(*args, **kwargs)

    file.get = flaky_get
    with pytest.raises(RuntimeError, match="cannot schedule"):
        tiered.restore(tokens)
    done = []
    thread = threading.Thread(target=lambda: done.append(tiered.restore(tokens)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and done[0].restored_from_file == 12
    tiered.close()


def test_a_file_blob_longer_than_a_page_group_is_a_miss(tmp_path):
    """A blob of the cache's fingerprint longer than its page groups (a foreign or crafted file) under a prompt's
    key: the pages before it are restored, none from it on, and nothing raises."""
    cache = filled("kivi:bits=2,group=16", packed_pages=24)
    file = FileTier(str(tmp_path), 10**8, cache.fingerprint)
    tiered = TieredCache(cache, None, file, background=False)
    tokens = list(range(200))
    rid = fill(tiered, tokens)
    keys = cache.prefix_keys(tokens)
    blob = cache.export_page(cache.page_table(rid).packed[5]).clone()
    longer = torch.cat([blob, torch.zeros(cache.blob_bytes + 100 - blob.numel(), dtype=torch.uint8)])
    tiered.free(rid)
    assert tiered.offload(max_pages=100) == 12
    tiered.flush()
    assert file.put([keys[5]], [longer]).result() == [True]  # filed last: it replaces the page the offload wrote
    assert file.blob_size(keys[5]) == cache.blob_bytes + 100
    _, hit = tiered.add_request(tokens)
    assert hit == 5 * 16
    cache.check()
    tiered.close()


def test_a_cancel_stops_the_file_reads_not_yet_issued(tmp_path):
    """A restore cancelled while its first run is read issues no further reads and installs nothing."""
    tiered, file, tokens = _on_file(tmp_path, window_blobs=1, windows=3)  # a run per page
    cancel, calls, real_get = threading.Event(), [], file.get

    def get(*args, **kwargs):
        calls.append(1)
        cancel.set()  # cancelled as soon as the first run is asked for
        return real_get(*args, **kwargs)

    file.get = get
    report = tiered.restore(tokens, cancel)
    assert len(calls) == 1 and report.restored_from_file == 0
    assert [tiered._bounce.take(1, block=False) is not None for _ in range(3)] == [True] * 3  # none held
    tiered.close()
