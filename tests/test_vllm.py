"""kvbackend as a vLLM secondary offloading tier, created through vLLM's own factory."""

import os

import numpy as np
import pytest
import torch

tiering = pytest.importorskip("vllm.v1.kv_offload.tiering.factory")
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

CHUNK_BYTES = 32 * 1024 + 96  # chunks carry alignment padding that is not a whole row


def primary(chunks=8, seed=0):
    """A primary-tier buffer [chunks, chunk_bytes] of bf16 KV-like rows, as a memoryview."""
    gen = torch.Generator().manual_seed(seed)
    buf = np.zeros((chunks, CHUNK_BYTES), dtype=np.uint8)
    values = torch.randn(chunks, CHUNK_BYTES // 2, generator=gen).bfloat16()
    buf[:] = values.view(torch.uint8).numpy().reshape(chunks, -1)
    return buf, memoryview(buf)


def make_tier(tmp_path, view, codec="rtn:bits=4,group=64", **extra):
    config = {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "root_dir": str(tmp_path),
              "codec": codec, "head_dim": 64, **extra}
    return tiering.SecondaryTierFactory.create_secondary_tier(config, view, None)


def keys(n, salt=0):
    return [make_offload_key(bytes([salt, i]) * 8, 0) for i in range(n)]


def run(tier, job_id, job_keys, chunk_ids, promotion):
    job = TransferJob(job_id, job_keys, np.asarray(chunk_ids), promotion, ReqContext("req"))
    (tier.submit_load if promotion else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert result.job_id == job_id
    return result


@pytest.mark.parametrize("codec", ["identity", "fp16", "rtn:bits=4,group=64", "rtn:bits=2,group=64,scale=fp8"])
def test_store_and_load_many_chunks(tmp_path, codec):
    buf, view = primary()
    tier = make_tier(tmp_path, view, codec)
    original = buf[:4].copy()
    ks = keys(4)
    assert run(tier, 1, ks, [0, 1, 2, 3], promotion=False).success
    assert all(tier.lookup(k, ReqContext("req")) == LookupResult.HIT for k in ks)
    assert tier.lookup(keys(1, salt=9)[0], ReqContext("req")) == LookupResult.MISS
    buf[4:] = 0
    assert run(tier, 2, ks, [4, 5, 6, 7], promotion=True).success
    got = torch.from_numpy(buf[4:].copy()).view(torch.bfloat16).float()
    want = torch.from_numpy(original).view(torch.bfloat16).float()
    if codec in ("identity", "fp16"):  # bf16 of N(0,1) values survives fp16 exactly away from its subnormals
        assert np.array_equal(buf[4:], original) if codec == "identity" else float((got - want).abs().max()) < 1e-4
    else:
        err = float((got - want).norm() / want.norm())
        assert err < (0.12 if "bits=4" in codec else 0.6)
    stats = tier.get_stats()
    assert stats["chunks_stored"] == 4 and stats["chunks_loaded"] == 4 and stats["bytes_stored"] > 0
    tier.shutdown()


def test_corrupt_chunk_is_a_failed_job_never_wrong_data(tmp_path):
    buf, view = primary()
    tier = make_tier(tmp_path, view, "identity")
    ks = keys(3)
    for i, k in enumerate(ks):  # one file per chunk
        assert run(tier, 10 + i, [k], [i], promotion=False).success
    directory = tier.store.directory
    victim = tier.store._index[tier._key(ks[1])].path
    data = bytearray(open(victim, "rb").read())
    data[-7] ^= 0x40
    open(victim, "wb").write(bytes(data))
    buf[4:] = 0x55
    result = run(tier, 20, ks, [4, 5, 6], promotion=True)
    assert not result.success and list(result.successful_keys) == ks[:1]
    assert np.array_equal(buf[4], buf[0]) and np.all(buf[5] == 0x55)  # the corrupt chunk was never written
    assert tier.get_stats()["failed_jobs"] == 1 and os.path.isdir(directory)
    tier.shutdown()


def test_bytes_vs_vllm_fs_tier_writer(tmp_path):
    """The fs tier's own writer stores a chunk as its raw bytes; an INT2 codec stores ~7x fewer."""
    from vllm.v1.kv_offload.tiering.fs.io import batch_store_block

    buf, view = primary()
    tier = make_tier(tmp_path / "ours", view, "rtn:bits=2,group=64,scale=fp8")
    assert run(tier, 1, keys(8), list(range(8)), promotion=False).success
    ours = tier.store.stats().bytes_used
    fs_dir = tmp_path / "fs"
    fs_dir.mkdir()
    paths = [str(fs_dir / f"block{i}.bin") for i in range(8)]
    batch_store_block(paths, view, [i * CHUNK_BYTES for i in range(8)], CHUNK_BYTES, False)
    theirs = sum(os.path.getsize(p) for p in paths)
    assert theirs / ours > 5, (theirs, ours)
    tier.shutdown()


def test_refuses_codecs_that_need_token_structure(tmp_path):
    from kvbackend import SpecError

    _, view = primary()
    with pytest.raises(SpecError, match="per-row codec"):
        make_tier(tmp_path, view, "kivi:bits=2,group=32")
    with pytest.raises(ValueError, match="head_dim"):
        tiering.SecondaryTierFactory.create_secondary_tier(
            {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "root_dir": str(tmp_path)}, view, None)
