"""Attacks on the storage paths (SGLang backend, vLLM tier, file tier): budget pressure from several threads, odd
and reused keys, damaged or swapped files, failures injected mid-batch. None may serve wrong values, report a page
stored that is not held, leak budget, or raise into the engine."""

import os
import threading

import numpy as np
import pytest
import torch

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from test_sglang import HostPool, host_indices, make_backend  # noqa: E402
from test_vllm import keys as vkeys, make_tier, primary, run  # noqa: E402


def _one_file_bytes(tmp_path, codec, host):
    probe = make_backend(tmp_path / "probe", host, codec, device="cpu")
    assert probe.batch_set_v1(["x"], host_indices([0])) == [True]
    return probe.tier.stats().bytes_used


@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "identity", "alignpred:error=1x"])
def test_budget_pressure_threads_never_serve_wrong_bytes(tmp_path, codec):
    pages = 24
    host = HostPool("layer_first", pages=pages + 8)
    host.kv_buffer.normal_()
    ref = make_backend(tmp_path / "ref", host, codec, device="cpu")
    keys = [f"k{i}" for i in range(16)]
    assert ref.batch_set_v1(keys, host_indices(range(16))) == [True] * 16
    want = {}
    for i, k in enumerate(keys):
        assert ref.batch_get_v1([k], host_indices([16]))[0]
        want[k] = host.page(16 * 16)
    one = _one_file_bytes(tmp_path, codec, host)
    small = make_backend(tmp_path / "small", host, codec, device="cpu", budget_gb=3.5 * one / 2**30)
    errors = []

    def worker(t):
        g = torch.Generator().manual_seed(t)
        dest = 16 + 2 * t
        for _ in range(15):
            idx = [int(x) for x in torch.randint(0, 16, (3,), generator=g)]
            ks = [keys[i] for i in idx]
            res = small.batch_set_v1(ks, host_indices(idx))
            if not isinstance(res, list) or len(res) != 3:
                errors.append(("set result", res))
            got = small.batch_get_v1(ks[:2], host_indices([dest, dest + 1]))
            for j in range(2):
                if got[j] and not torch.equal(host.page(16 * (dest + j)), want[ks[j]]):
                    errors.append(("wrong bytes", ks[j]))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    st = small.tier.stats()
    assert st.bytes_used <= st.capacity_bytes
    assert small.tier._reserved == 0


@pytest.mark.parametrize("codec", ["kivi:bits=4,group=16", "alignpred:error=1x"])
def test_single_thread_tiny_budget_reported_pages_load(tmp_path, codec):
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    one = _one_file_bytes(tmp_path, codec, host)
    b = make_backend(tmp_path / "small", host, codec, device="cpu", budget_gb=2.5 * one / 2**30)
    keys = [f"k{i}" for i in range(6)]
    res = b.batch_set_v1(keys, host_indices(range(6)))
    for k, r in zip(keys, res):
        assert b.exists(k) == r
    held = [k for k, r in zip(keys, res) if r]
    assert held
    got = b.batch_get_v1(held, host_indices(range(8, 8 + len(held))))
    assert got == [True] * len(held)


ODD_KEYS = ["", "a/b/../c", "\x00nul", "ключ-🙂", "x" * 100_000, "tab\tnew\nline", "\ud800lone"]


def test_odd_keys_store_load_and_exists_never_raise(tmp_path):
    """Every str key is a key: one SGLang cannot encode as strict UTF-8 (a lone surrogate) must not fail its whole
    batch, nor raise out of batch_exists/exists into SGLang's threads."""
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    b = make_backend(tmp_path, host, "identity", device="cpu")
    n = len(ODD_KEYS)
    originals = [host.page(16 * i) for i in range(n)]
    assert b.batch_set_v1(ODD_KEYS, host_indices(range(n))) == [True] * n
    assert b.batch_exists(ODD_KEYS) == n and b.exists(ODD_KEYS[-1])
    assert b.batch_get_v1(ODD_KEYS, host_indices(range(n, 2 * n))) == [True] * n
    for i in range(n):
        assert torch.equal(host.page(16 * (n + i)), originals[i])
    # a plain key hashes as before the change (pages stored by earlier versions are still found)
    import hashlib
    want = int.from_bytes(hashlib.blake2b(f"{b.namespace}/abc".encode(), digest_size=8).digest(), "little") >> 1
    assert b._key("abc") == want


def test_duplicate_keys_in_one_call_and_reused_keys(tmp_path):
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    b = make_backend(tmp_path, host, "identity", device="cpu")
    first = host.page(0)
    assert b.batch_set_v1(["d", "d", "e"], host_indices([0, 1, 2])) == [True] * 3
    assert b.batch_get_v1(["d", "e", "d"], host_indices([8, 9, 10])) == [True] * 3
    assert torch.equal(host.page(16 * 8), first) and torch.equal(host.page(16 * 10), first)
    assert torch.equal(host.page(16 * 9), host.page(16 * 2))


# -- vLLM ------------------------------------------------------------------------------------------------------


def _one_file_per_chunk(tier, ks):
    for i, k in enumerate(ks):
        assert run(tier, 100 + i, [k], [i], promotion=False).success


@pytest.mark.parametrize("damage", ["remove", "truncate", "flip", "swap", "copy_over"])
def test_vllm_damaged_chunk_files_are_misses(tmp_path, damage):
    buf, view = primary(chunks=8)
    tier = make_tier(tmp_path, view, "rtn:bits=4,group=64", device="cpu")
    ks = vkeys(3)
    _one_file_per_chunk(tier, ks)
    assert run(tier, 1, ks, [4, 5, 6], promotion=True).success
    want = buf[4:7].copy()
    path = {i: tier.store._index[tier._key(k)].path for i, k in enumerate(ks)}
    if damage == "remove":
        os.remove(path[1])
    elif damage == "truncate":
        os.truncate(path[1], os.path.getsize(path[1]) - 10)
    elif damage == "flip":
        data = bytearray(open(path[1], "rb").read())
        data[200] ^= 1
        open(path[1], "wb").write(bytes(data))
    elif damage == "swap":
        tmp = path[1] + ".x"
        os.rename(path[1], tmp)
        os.rename(path[2], path[1])
        os.rename(tmp, path[2])
    else:  # chunk 2's file copied over chunk 1's
        open(path[1], "wb").write(open(path[2], "rb").read())
    buf[4:7] = 0x55
    res = run(tier, 2, ks, [4, 5, 6], promotion=True)
    assert not res.success and list(res.successful_keys) == ks[:1]
    assert np.array_equal(buf[4], want[0]) and np.all(buf[5] == 0x55)
    # after a restart the tables name their own keys: whatever loads is that key's chunk
    tier.shutdown()
    again = make_tier(tmp_path, view, "rtn:bits=4,group=64", device="cpu")
    buf[4:7] = 0x55
    for i, k in enumerate(ks):
        r = run(again, 10 + i, [k], [4 + i], promotion=True)
        if r.success:
            assert np.array_equal(buf[4 + i], want[i]), i
        else:
            assert np.all(buf[4 + i] == 0x55)
    again.shutdown()


def test_vllm_concurrent_jobs_under_budget_pressure_load_exact_chunks(tmp_path):
    import time
    buf, view = primary(chunks=24)
    probe = make_tier(tmp_path / "probe", view, "identity", device="cpu")
    assert run(probe, 1, vkeys(1, salt=7), [0], promotion=False).success
    one = probe.store.stats().bytes_used
    probe.shutdown()
    tier = make_tier(tmp_path / "t", view, "identity", device="cpu", budget_gb=3.5 * one / 2**30, n_threads=4)
    original = buf[:12].copy()
    ks = vkeys(12)
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    jid = 0
    expected = {}
    rng = np.random.default_rng(0)
    for rnd in range(10):
        jobs = []
        for _ in range(3):
            i = int(rng.integers(0, 12))
            jid += 1
            tier.submit_store(TransferJob(jid, [ks[i]], np.asarray([i]), False, ReqContext("r")))
        for slot in range(3):
            i = int(rng.integers(0, 12))
            jid += 1
            buf[12 + slot] = 0x55
            expected[jid] = (i, 12 + slot)
            tier.submit_load(TransferJob(jid, [ks[i]], np.asarray([12 + slot]), True, ReqContext("r")))
        tier.drain_jobs()
        for r in tier.get_finished_jobs():
            if r.job_id in expected:
                i, slot = expected.pop(r.job_id)
                if r.success:
                    assert np.array_equal(buf[slot], original[i]), (r.job_id, i)
                else:
                    assert np.all(buf[slot] == 0x55)
    st = tier.store.stats()
    assert st.bytes_used <= st.capacity_bytes and tier.store._reserved == 0
    tier.shutdown()


# -- file tier -------------------------------------------------------------------------------------------------
from kvbackend.tiers.file import FileTier  # noqa: E402


@pytest.mark.parametrize("key", [-1, 2**64])
def test_file_tier_bad_key_never_leaks_its_budget(tmp_path, key):
    """A key the file format cannot hold (not a u64) is refused by `put`, and a direct `write_group` fails before
    it reserves anything: otherwise the budget would shrink for good and later puts that fit would be refused."""
    import struct

    blob = torch.arange(1000, dtype=torch.int32).to(torch.uint8)
    one = 48 + 40 + 1000
    tier = FileTier(str(tmp_path), 3 * one, "0123456789abcdef", fsync=False)
    for _ in range(3):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            tier.put([key], [blob])
        with pytest.raises(struct.error):
            tier.write_group([key], [blob.numpy()])
    assert tier._reserved == 0 and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert tier.put([1], [blob]).result() == [True]
    tier.close()


def test_file_tier_writer_raising_midway_releases_its_reservation(tmp_path, monkeypatch):
    """A write that fails with something other than an OSError (here a MemoryError once the temp file exists) gives
    its reservation back, removes its temp file and raises to the caller; later writes that fit succeed."""
    blob = torch.arange(1000, dtype=torch.int32).to(torch.uint8)
    one = 48 + 40 + 1000
    tier = FileTier(str(tmp_path), 2 * one, "0123456789abcdef", fsync=False)
    real, calls = tier._write_file, []

    def flaky(path, parts):
        calls.append(path)
        real(path, parts)
        if len(calls) == 1:
            assert os.path.exists(path)  # the temp file is there when the failure comes
            raise MemoryError("after the temp file was written")

    monkeypatch.setattr(tier, "_write_file", flaky)
    with pytest.raises(MemoryError):
        tier.put([1], [blob]).result()
    assert tier.contains([1]) == 0
    assert tier._reserved == 0 and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert tier.put([2], [blob]).result() == [True]
    assert tier.put([3], [blob]).result() == [True]
    tier.close()


@pytest.mark.parametrize("fail", ["write_oserror", "write_memoryerror", "encode", "encode_batch"])
def test_sglang_failure_mid_batch_reports_exactly_what_is_held(tmp_path, monkeypatch, fail):
    import errno

    import kvbackend.integration.sglang as module

    monkeypatch.setattr(module, "CPU_BATCH_PAGES", {"encode": 2, "decode": 2})
    host = HostPool("layer_first", pages=16)
    host.kv_buffer.normal_()
    b = make_backend(tmp_path, host, "kivi:bits=4,group=16", device="cpu")
    calls = []
    if fail.startswith("write"):
        real = b.tier._write_file

        def flaky(path, parts):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(errno.EIO, "eio") if fail == "write_oserror" else MemoryError("no memory")
            return real(path, parts)

        monkeypatch.setattr(b.tier, "_write_file", flaky)
    else:
        codec = b.codec
        real = codec.encode

        def enc(*a, **kw):
            calls.append(1)
            if (fail == "encode" and len(calls) in (2, 3, 4, 5)) or (fail == "encode_batch" and len(calls) == 2):
                raise RuntimeError("boom")
            return real(*a, **kw)

        monkeypatch.setattr(codec, "encode", enc)
    keys = [f"p{i}" for i in range(6)]
    res = b.batch_set_v1(keys, host_indices(range(6)))
    assert [b.exists(k) for k in keys] == res, res
    assert False in res or fail == "encode_batch"
    held = [k for k, r in zip(keys, res) if r]
    got = b.batch_get_v1(held, host_indices(range(8, 8 + len(held))))
    assert got == [True] * len(held)
    assert b.tier._reserved == 0
    # the budget is whole again: every page can be stored now
    assert b.batch_set_v1(keys, host_indices(range(6))) == [True] * 6
