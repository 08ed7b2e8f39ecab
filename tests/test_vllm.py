"""kvbackend as a vLLM secondary offloading tier, created through vLLM's own factory."""

import copy
import logging
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
    with pytest.raises(ValueError, match="offloading config"):  # no spec: no token structure to read
        make_tier(tmp_path, view, "kivi:bits=2,group=32")
    with pytest.raises(SpecError, match="rank=0"):
        make_tier(tmp_path, view, "quantwm:rank=4")
    with pytest.raises(ValueError, match="head_dim"):
        tiering.SecondaryTierFactory.create_secondary_tier(
            {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "root_dir": str(tmp_path)}, view, None)


# -- restarts with another configuration, wrong-length blobs, unsafe directories ----------------------


def spec(blocks_per_chunk=1, tokens_per_block=16, kv_dtype="bfloat16", layout="NHD", engine_id="e0"):
    """A stand-in for the offloading spec vLLM hands a tier: its normalized ``config`` only."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("layers.0.attn", "layers.1.attn"), 0),),
        worker_kv_bytes_per_block=CHUNK_BYTES // blocks_per_chunk, enable_kv_cache_events=False, extra_config={},
        engine_id=engine_id, model=OffloadingModelConfig("org/model", kv_dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=parallel, kv_cache_layout=layout)
    return SimpleNamespace(config=config)


def make_tier_with(tmp_path, view, offloading_spec, **extra):
    config = {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "root_dir": str(tmp_path),
              "codec": "identity", "head_dim": 64, **extra}
    return tiering.SecondaryTierFactory.create_secondary_tier(config, view, offloading_spec)


def test_restart_with_smaller_chunks_is_a_miss_never_shifted_rows(tmp_path):
    """Chunks of 256 rows stored, then a restart with 128-row chunks: their row 64 must never be old row 128."""
    buf, view = primary(chunks=2)
    tier = make_tier(tmp_path, view, "identity")
    ks = keys(2)
    assert run(tier, 1, ks, [0, 1], promotion=False).success
    tier.shutdown()
    small = np.full((4, CHUNK_BYTES // 2 - 16), 0x55, dtype=np.uint8)  # 128 rows of 128 bytes plus a tail
    tier = make_tier(tmp_path, memoryview(small), "identity")
    assert tier.lookup(ks[0], ReqContext("req")) == LookupResult.MISS
    result = run(tier, 2, ks, [0, 1], promotion=True)
    assert not result.success and not result.successful_keys
    assert np.all(small == 0x55)  # nothing was written into the primary tier
    tier.shutdown()


def test_restart_with_another_primary_layout_is_a_miss(tmp_path):
    """Same chunk bytes, but another block count per chunk, tokens per block, KV layout or model: a miss."""
    buf, view = primary(chunks=2)
    ks = keys(1)
    tier = make_tier_with(tmp_path, view, spec())
    assert run(tier, 1, ks, [0], promotion=False).success
    tier.shutdown()
    tier = make_tier_with(tmp_path, view, spec(engine_id="e1"))  # the same configuration after a restart: a hit
    assert tier.lookup(ks[0], ReqContext("req")) == LookupResult.HIT
    tier.shutdown()
    for other in (spec(blocks_per_chunk=2), spec(tokens_per_block=32), spec(layout="HND")):
        tier = make_tier_with(tmp_path, view, other)
        assert tier.lookup(ks[0], ReqContext("req")) == LookupResult.MISS
        buf[1] = 0x55
        assert not run(tier, 2, ks, [1], promotion=True).success
        assert np.all(buf[1] == 0x55)
        tier.shutdown()


def test_blob_of_the_wrong_length_is_a_miss(tmp_path):
    buf, view = primary(chunks=2)
    tier = make_tier(tmp_path, view, "identity")
    ks = keys(2)
    longer = torch.from_numpy(np.concatenate([buf[0], buf[0][:128]]))
    shorter = torch.from_numpy(buf[0][: CHUNK_BYTES - 128].copy())
    assert tier.store.put([tier._key(ks[0]), tier._key(ks[1])], [longer, shorter]).result() == [True, True]
    buf[1] = 0x55
    for k in ks:
        assert not run(tier, 3, [k], [1], promotion=True).success
        assert np.all(buf[1] == 0x55)
    tier.shutdown()


def test_refuses_a_kv_dtype_other_than_the_engines(tmp_path):
    _, view = primary()
    with pytest.raises(ValueError, match="dtype"):
        make_tier_with(tmp_path, view, spec(kv_dtype="float16"), dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        make_tier_with(tmp_path, view, spec(kv_dtype="fp8_e4m3"))
    tier = make_tier_with(tmp_path, view, spec(kv_dtype="float16"))  # taken from the engine when not set
    assert tier.dtype == torch.float16
    tier.shutdown()


@pytest.mark.parametrize("option,value", [("budget_gb", float("nan")), ("budget_gb", float("inf")),
                                          ("budget_gb", "ten"), ("budget_gb", 0), ("budget_gb", -1.0),
                                          ("root_dir", None), ("root_dir", "")])
def test_refuses_bad_config(tmp_path, option, value):
    _, view = primary()
    config = {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "root_dir": str(tmp_path),
              "codec": "identity", "head_dim": 64, option: value}
    with pytest.raises(ValueError, match=option):
        tiering.SecondaryTierFactory.create_secondary_tier(config, view, None)


def test_refuses_a_root_dir_others_can_write_or_do_not_own(tmp_path, monkeypatch):
    _, view = primary()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="root_dir.*writable"):
        make_tier(shared, view)
    link = tmp_path / "link"
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link.symlink_to(mine)
    with pytest.raises(ValueError, match="root_dir.*symbolic link"):
        make_tier(link, view)
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(ValueError, match="root_dir.*owned"):
        make_tier(mine, view)
    monkeypatch.undo()
    fresh = tmp_path / "fresh"
    tier = make_tier(fresh, view)
    assert (fresh.stat().st_mode & 0o777) == 0o700
    assert (os.stat(tier.store.directory).st_mode & 0o777) == 0o700
    tier.shutdown()


def test_root_dir_removed_while_running_is_recreated(tmp_path):
    import shutil

    buf, view = primary(chunks=4)
    root = tmp_path / "root"
    tier = make_tier(root, view, "identity")
    assert run(tier, 1, keys(1), [0], promotion=False).success
    shutil.rmtree(root)
    ks = keys(1, salt=3)
    assert run(tier, 2, ks, [1], promotion=False).success
    assert (root.stat().st_mode & 0o777) == 0o700
    assert run(tier, 3, ks, [2], promotion=True).success and np.array_equal(buf[2], buf[1])
    tier.shutdown()


def test_levers_are_refused_never_dropped(tmp_path):
    """Rows carry no positions and no K/V split: a spec with levers is refused by name, not served without them."""
    from kvbackend.errors import SpecError

    _, view = primary()
    for spec in ("rtn:bits=4,group=64,sink=4", "fp8:prerope=true", "kivi:bits=2,group=32,sink=4"):
        with pytest.raises(SpecError, match="levers"):
            make_tier(tmp_path, view, codec=spec)
    with pytest.raises(ValueError, match="offloading config"):  # vrot needs K and V apart: the blocks mode
        make_tier(tmp_path, view, codec="rtn:bits=4,group=64,vrot=hadamard")


# -- the blocks mode: codecs over groups of tokens read the chunk's K/V structure ------------------------

LAYERS, HEADS, TPB, BPC, HD = 2, 2, 16, 4, 64
PAGE = HEADS * TPB * 2 * HD * 2
BLOCK_CHUNK = LAYERS * BPC * PAGE + 96  # the engine's K/V, then padding


def block_spec(layout="HND", per_block=LAYERS * PAGE, dcp=1, layers=LAYERS):
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=dcp,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(TPB, tuple(f"layers.{i}.attn" for i in range(layers)), 0),),
        worker_kv_bytes_per_block=per_block, enable_kv_cache_events=False, extra_config={}, engine_id="e0",
        model=OffloadingModelConfig("org/model", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TPB, blocks_per_chunk=BPC), parallel=parallel,
        kv_cache_layout=layout)
    return SimpleNamespace(config=config)


def block_primary(layout, chunks=4, seed=0):
    """Chunks whose K has strong per-channel offsets (what per-channel key steps are for), written through
    the engine's page order; returns (buffer, view, K, V) with K/V [chunks, layers, tokens, heads, D]."""
    gen = torch.Generator().manual_seed(seed)
    buf = np.zeros((chunks, BLOCK_CHUNK), dtype=np.uint8)
    k = (torch.randn(chunks, LAYERS, BPC * TPB, HEADS, HD, generator=gen)
         + 8 * torch.randn(1, LAYERS, 1, HEADS, HD, generator=gen)).bfloat16()
    v = torch.randn(chunks, LAYERS, BPC * TPB, HEADS, HD, generator=gen).bfloat16()
    cells = torch.stack([k, v], dim=-2).view(chunks, LAYERS, BPC, TPB, HEADS, 2, HD)  # [c, L, block, tok, head, 2, D]
    if layout == "HND":
        cells = cells.permute(0, 1, 2, 4, 3, 5, 6)  # [c, L, block, head, tok, 2, D]
    flat = cells.contiguous().view(chunks, -1).view(torch.uint8)
    buf[:, : flat.shape[1]] = flat.numpy()
    buf[:, flat.shape[1]:] = 7  # padding, carried raw
    return buf, memoryview(buf), k, v


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("layout", ["HND", "NHD", "LBHNC"])
def test_blocks_mode_encodes_each_layers_tokens_exactly_as_the_codec_would(tmp_path, layout, batched, monkeypatch):
    """kivi-2 (per-channel keys over token groups) through the tier gives, bit for bit, what the codec
    gives on each layer's [tokens, heads, head_dim] K and V: the chunk's structure is read right. Both
    paths: every layer in one codec call (a page-local codec), and layer by layer."""
    from kvbackend import Geometry, codecs

    buf, view, k, v = block_primary("HND" if layout == "LBHNC" else layout)
    tier = make_tier_with(tmp_path, view, block_spec(layout), codec="kivi:bits=2,group=32", kv_heads=HEADS,
                          page_tokens=32)
    assert tier._batched()  # kivi is page-local and 32-token pages tile the layer's tokens
    if not batched:
        monkeypatch.setattr(type(tier), "_batched", lambda self: False)
    assert tier.block is not None and tier.block.layers == LAYERS and tier.block.tokens == BPC * TPB
    original = buf.copy()
    ks = keys(2)
    assert run(tier, 1, ks, [0, 1], promotion=False).success
    buf[2:] = 0
    assert run(tier, 2, ks, [2, 3], promotion=True).success
    codec = codecs.get("kivi:bits=2,group=32")
    layout_ = codec.layout(Geometry(1, HEADS, HD, torch.bfloat16), 32)
    got = tier.block.kv(torch.from_numpy(buf[2]), torch.bfloat16)
    for layer in range(LAYERS):
        chunk = codec.encode(k[0, layer], v[0, layer], layout_)
        wk, wv = codec.decode_pages(layout_, chunk.pages, chunk.codebook)
        assert torch.equal(got[0, layer, 0].flatten(0, 1), wk[: BPC * TPB].bfloat16())
        assert torch.equal(got[0, layer, 1].flatten(0, 1), wv[: BPC * TPB].bfloat16())
    assert np.array_equal(buf[2, LAYERS * BPC * PAGE:], original[0, LAYERS * BPC * PAGE:])  # padding exact
    # per-channel key steps suit keys with channel offsets: half the error of per-token rows (rtn-2)
    err = float((got[0, :, 0].float() - k[0].view(LAYERS, BPC, TPB, HEADS, HD).float()).norm() / k[0].float().norm())
    rtn = codecs.get("rtn:bits=2,group=64")
    rtn_layout = rtn.layout(Geometry(1, HEADS, HD, torch.bfloat16), 32)
    rows = [rtn.decode_pages(rtn_layout, *(lambda c: (c.pages, c.codebook))(rtn.encode(k[0, i], k[0, i], rtn_layout)))[0]
            for i in range(LAYERS)]
    rtn_err = float((torch.stack(rows).float() - k[0].float()).norm() / k[0].float().norm())
    assert err < 0.5 * rtn_err, (err, rtn_err)
    assert tier.get_stats()["compression_ratio"] > 4
    tier.shutdown()


@pytest.mark.parametrize("codec", ["qvg:kchannel=32,vcluster=false,cdtype=fp8,centroids=8",
                                   "quantwm:kchannel=32,rank=0,centroids=8,clip=true,vcluster=false,vrot=hadamard,"
                                   "cdtype=fp8,outliers=8"])
def test_blocks_mode_with_centroid_codecs_decodes_as_the_codec(tmp_path, codec):
    """Codecs with a codebook per chunk (QVG, QuantWM) are decoded for every worker and layer in one pass
    (`Codec.decode_units`, each page reading its chunk's slot): bit for bit what the codec gives layer by layer
    on each layer's [tokens, heads, head_dim] K and V."""
    from kvbackend import Geometry, codecs
    from kvbackend.codecs.base import CodecState
    from kvbackend.levers import rotate_values

    buf, view, k, v = block_primary("NHD", seed=4)
    tier = make_tier_with(tmp_path, view, block_spec("NHD"), codec=codec, kv_heads=HEADS, page_tokens=32,
                          device="cpu")  # the CPU's k-means (a GPU's picks may differ in the last bits)
    assert not tier._batched() and tier.codec.per_page_codebooks  # a codebook per chunk: the one-pass path
    encode_units, calls = tier.codec.encode_units, []
    tier.codec.encode_units = lambda *a: calls.append(a[0].shape[0]) or encode_units(*a)  # encoded in one pass too
    ks = keys(2)
    assert run(tier, 1, ks, [0, 1], promotion=False).success
    assert calls == [LAYERS * tier.block.workers] * 2, calls  # on the CPU: one chunk's units per call
    buf[2:] = 0
    assert run(tier, 2, ks, [2, 3], promotion=True).success
    plain = codecs.get(codec.replace(",vrot=hadamard", ""))  # the tier applies the value rotation itself
    layout_ = plain.layout(Geometry(1, HEADS, HD, torch.bfloat16), 32)
    rotate = "vrot=hadamard" in codec
    for chunk_index in range(2):
        got = tier.block.kv(torch.from_numpy(buf[2 + chunk_index]), torch.bfloat16)
        for layer in range(LAYERS):
            vin = rotate_values(v[chunk_index, layer]) if rotate else v[chunk_index, layer]
            chunk = plain.encode(k[chunk_index, layer], vin, layout_, CodecState())
            wk, wv = plain.decode_pages(layout_, chunk.pages, chunk.codebook)
            if rotate:
                wv = rotate_values(wv)
            assert torch.equal(got[0, layer, 0].flatten(0, 1), wk[: BPC * TPB].bfloat16()), (chunk_index, layer)
            assert torch.equal(got[0, layer, 1].flatten(0, 1), wv[: BPC * TPB].bfloat16()), (chunk_index, layer)
    tier.shutdown()


def test_blocks_mode_value_rotation_round_trips(tmp_path):
    buf, view, k, v = block_primary("NHD")
    tier = make_tier_with(tmp_path, view, block_spec("NHD"), codec="kivi:bits=4,group=32,vrot=hadamard",
                          kv_heads=HEADS, page_tokens=64)
    original = buf.copy()
    assert run(tier, 1, keys(1), [0], promotion=False).success
    buf[1] = 0
    assert run(tier, 2, keys(1), [1], promotion=True).success
    got = tier.block.kv(torch.from_numpy(buf[1]), torch.bfloat16)[0, :, 1].float()
    want = tier.block.kv(torch.from_numpy(original[0]), torch.bfloat16)[0, :, 1].float()
    assert float((got - want).norm() / want.norm()) < 0.12  # 4-bit values, rotated back
    tier.shutdown()


@pytest.mark.parametrize("spec_kw,extra,match", [
    (dict(), dict(), "kv_heads"),
    (dict(), dict(kv_heads=3), "whole number of K/V pages"),
    (dict(layout="BLHNC"), dict(kv_heads=HEADS), "kv_cache_layout"),
    (dict(dcp=2), dict(kv_heads=HEADS), "dcp_size"),
    (dict(layers=3), dict(kv_heads=HEADS), "group names"),
    (dict(), dict(kv_heads=HEADS, page_tokens=0), "page_tokens"),
])
def test_blocks_mode_refuses_chunks_it_cannot_read(tmp_path, spec_kw, extra, match):
    _, view, _, _ = block_primary("HND")
    with pytest.raises(ValueError, match=match):
        make_tier_with(tmp_path, view, block_spec(**spec_kw), codec="kivi:bits=2,group=32", **extra)


@pytest.mark.parametrize("value", ["gpu", "cuda:x", 3])
def test_refuses_a_bad_device(tmp_path, value):
    _, view = primary()
    with pytest.raises(ValueError, match="device must be"):
        make_tier(tmp_path, view, device=value)


def _blocks_round_trip(tmp_path, device, codec="kivi:bits=2,group=32,vrot=hadamard"):
    buf, view, k, v = block_primary("NHD")
    tier = make_tier_with(tmp_path, view, block_spec("NHD"), codec=codec, kv_heads=HEADS, page_tokens=32,
                          device=device)
    assert tier._batched()
    stored = tier._encode(tier._chunk(0)).clone()
    assert run(tier, 1, keys(1), [0], promotion=False).success
    buf[1] = 0
    assert run(tier, 2, keys(1), [1], promotion=True).success
    tier.shutdown()
    return tier, stored, buf[1].copy()


def test_blocks_mode_falls_back_to_the_cpu_where_the_device_fails(tmp_path, monkeypatch):
    """A chunk the device cannot encode or decode (out of memory, a lost context) runs on the CPU: the bytes
    stored and the rows restored are those of the CPU path."""
    from kvbackend.integration.storage_options import DeviceCodec

    _, want_blob, want_rows = _blocks_round_trip(tmp_path / "cpu", "cpu")
    calls = []

    def broken(self, fn, *tensors, into=None, sink=None, defer=False):
        calls.append(fn)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(DeviceCodec, "run", broken)
    real = DeviceCodec.__init__

    def on_cuda(self, device, log=None):  # the device the tier would use on a GPU machine
        real(self, torch.device("cuda", 0), log)

    monkeypatch.setattr(DeviceCodec, "__init__", on_cuda)
    _, blob, rows = _blocks_round_trip(tmp_path / "dev", "cpu")
    assert len(calls) >= 2  # the store's encode and the load's decode each tried the device first
    assert torch.equal(blob, want_blob) and np.array_equal(rows, want_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["kivi:bits=2,group=32", "kivi:bits=4,group=32"])
def test_blocks_mode_on_the_gpu_stores_and_restores_the_bytes_of_the_cpu(tmp_path, codec):
    _, want_blob, want_rows = _blocks_round_trip(tmp_path / "cpu", "cpu", codec)
    tier, blob, rows = _blocks_round_trip(tmp_path / "gpu", "cuda", codec)
    assert tier.device.device.type == "cuda"
    assert torch.equal(blob, want_blob) and np.array_equal(rows, want_rows)


def _working_device(monkeypatch):
    """DeviceCodec as on a GPU machine whose device runs every batch (on the CPU here): the batched job paths."""
    from kvbackend.integration.storage_options import DeviceCodec

    calls = []
    real, real_run = DeviceCodec.__init__, DeviceCodec.run

    def on_cuda(self, device, log=None):
        real(self, torch.device("cuda", 0), log)

    def direct(self, fn, *tensors, into=None, defer=False):
        calls.append(len(tensors) if fn.__name__ == "_encode_chunks" else len(tensors[0]))  # chunks per call
        cpu = copy.copy(self)
        cpu.device = torch.device("cpu")
        return real_run(cpu, fn, *tensors, into=into, defer=defer)

    monkeypatch.setattr(DeviceCodec, "__init__", on_cuda)
    monkeypatch.setattr(DeviceCodec, "run", direct)
    return calls


def _one_chunk_at_a_time(tier, buf, n):
    """(keys, rows restored, blobs) of chunks 0..n-1 stored, then loaded into n..2n-1, by a CPU ``tier`` (one chunk
    per codec call); the tier is shut down."""
    ks = keys(n)
    assert run(tier, 1, ks, list(range(n)), promotion=False).success
    assert run(tier, 2, ks, list(range(n, 2 * n)), promotion=True).success
    rows, blobs = buf[n : 2 * n].copy(), [stored_blob(tier, i, ks[i]) for i in range(n)]
    tier.shutdown()
    return ks, rows, blobs


def stored_blob(tier, chunk_id, key) -> torch.Tensor:
    """The bytes a tier stores for a chunk: what its codec writes, then the chunk's key (8 bytes, little-endian)."""
    named = torch.tensor([tier._key(key)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([tier._encode(tier._chunk(chunk_id)), named])


@pytest.mark.parametrize("head_dim", [64, 96])  # a chunk's halves tile whole pages (one codec call), or not
@pytest.mark.parametrize("codec", ["identity", "rtn:bits=2,group=32,scale=fp8"])
def test_batched_jobs_store_and_load_the_bytes_of_the_one_chunk_path(tmp_path, monkeypatch, codec, head_dim):
    """Stores and loads in batches of 3 chunks and read windows of 4 blobs (the GPU's paths): the blobs written and
    the rows restored are those of one chunk at a time on the CPU."""
    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=20)
    cpu = make_tier(tmp_path / "cpu", view, codec, device="cpu", head_dim=head_dim)
    assert cpu._rows_tile() == (head_dim == 64)
    ks, want, blobs = _one_chunk_at_a_time(cpu, buf, 10)
    calls = _working_device(monkeypatch)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 3 * CHUNK_BYTES)
    gpu = make_tier(tmp_path / "gpu", view, codec, head_dim=head_dim)
    monkeypatch.setattr(tier_module, "WINDOW_BYTES", 4 * gpu.blob_bytes)
    assert gpu._batch_chunks() == 3
    assert run(gpu, 1, ks, list(range(10)), promotion=False).success
    assert calls == [3, 3, 3, 1]  # encode batches
    for i, k in enumerate(ks):
        got = torch.empty(gpu.blob_bytes, dtype=torch.uint8)
        assert gpu.store.get([gpu._key(k)], [got]).result() == [True]
        assert torch.equal(got, blobs[i])
    buf[10:] = 0
    calls.clear()
    assert run(gpu, 2, ks, list(range(10, 20)), promotion=True).success
    assert calls == [3, 3, 3, 1]  # windows of 4 blobs capped at one decode batch: 3, 3, 3 and 1
    assert np.array_equal(buf[10:], want)
    assert gpu.get_stats()["chunks_loaded"] == 10
    monkeypatch.setattr(tier_module, "WINDOW_BYTES", 2 * gpu.blob_bytes)  # windows smaller than a decode batch
    buf[10:] = 0
    calls.clear()
    assert run(gpu, 3, ks, list(range(10, 20)), promotion=True).success
    assert calls == [2, 2, 2, 2, 2]  # decode batches inside windows of 2 blobs
    assert np.array_equal(buf[10:], want)
    assert gpu.get_stats()["chunks_loaded"] == 20
    gpu.shutdown()


@pytest.mark.parametrize("bad", [1, 5, 8])
def test_batched_load_stops_at_the_first_bad_chunk_and_keeps_the_ones_before(tmp_path, monkeypatch, bad):
    """A blob that reads back corrupt, or one the codec cannot decode, inside a batch or a later window: the job
    reports exactly the chunks before it, those hold their rows, and the bad one's slot is never written."""
    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=20)
    _working_device(monkeypatch)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 3 * CHUNK_BYTES)
    tier = make_tier(tmp_path, view, "rtn:bits=4,group=64")
    monkeypatch.setattr(tier_module, "WINDOW_BYTES", 4 * tier.blob_bytes)
    ks = keys(10)
    for i, k in enumerate(ks):  # one file per chunk
        assert run(tier, 10 + i, [k], [i], promotion=False).success
    want = buf[:10].copy()
    assert run(tier, 30, ks, list(range(10, 20)), promotion=True).success
    want = buf[10:].copy()  # what a clean load restores
    # corrupt the bad chunk's file: a checksum failure at read
    victim = tier.store._index[tier._key(ks[bad])].path
    data = bytearray(open(victim, "rb").read())
    data[-5] ^= 0x10
    open(victim, "wb").write(bytes(data))
    buf[10:] = 0x55
    result = run(tier, 40, ks, list(range(10, 20)), promotion=True)
    assert not result.success and list(result.successful_keys or ()) == ks[:bad]
    assert np.array_equal(buf[10 : 10 + bad], want[:bad]) and np.all(buf[10 + bad] == 0x55)
    # the same chunk stored again, then made undecodable (valid checksum, a decode error)
    assert run(tier, 50, [ks[bad]], [bad], promotion=False).success
    real = tier._decode_chunks
    bad_blob = tier._encode(tier._chunk(bad)).clone()

    def decode(blobs):  # a batch holding the bad chunk fails (then chunk by chunk: only that one fails)
        if any(torch.equal(blob[: tier.body_bytes], bad_blob) for blob in blobs):
            raise ValueError("damaged page")
        return real(blobs)

    monkeypatch.setattr(tier, "_decode_chunks", decode)
    buf[10:] = 0x55
    result = run(tier, 60, ks, list(range(10, 20)), promotion=True)
    assert not result.success and list(result.successful_keys or ()) == ks[:bad]
    assert np.array_equal(buf[10 : 10 + bad], want[:bad]) and np.all(buf[10 + bad] == 0x55)
    tier.shutdown()


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=32,vrot=hadamard",
                                   "quantwm:kchannel=32,rank=0,centroids=8,clip=true,vcluster=false,vrot=hadamard,"
                                   "cdtype=fp8,outliers=8"])
def test_blocks_mode_batches_of_chunks_give_the_bytes_of_one_chunk_at_a_time(tmp_path, monkeypatch, codec):
    """Blocks mode with the GPU's batches (3 chunks per codec call, every chunk's units in one call): the blobs
    written and the chunks restored are bit for bit those of the CPU's one chunk at a time."""
    from kvbackend.integration import vllm as tier_module

    buf, view, _, _ = block_primary("HND", chunks=10, seed=5)
    cpu = make_tier_with(tmp_path / "cpu", view, block_spec("HND"), codec=codec, kv_heads=HEADS, page_tokens=32,
                         device="cpu")
    ks, want_rows, want_blobs = _one_chunk_at_a_time(cpu, buf, 5)
    calls = _working_device(monkeypatch)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 3 * BLOCK_CHUNK)
    gpu = make_tier_with(tmp_path / "gpu", view, block_spec("HND"), codec=codec, kv_heads=HEADS, page_tokens=32)
    assert run(gpu, 1, ks, list(range(5)), promotion=False).success
    for i, k in enumerate(ks):
        got = torch.empty(gpu.blob_bytes, dtype=torch.uint8)
        assert gpu.store.get([gpu._key(k)], [got]).result() == [True]
        assert torch.equal(got, want_blobs[i]), i
    buf[5:] = 0
    assert run(gpu, 2, ks, list(range(5, 10)), promotion=True).success
    assert calls == [3, 2, 3, 2]  # two encode calls, two decode calls
    assert np.array_equal(buf[5:], want_rows)
    gpu.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_mode_centroid_codec_on_the_gpu_round_trips_as_well_as_the_cpu(tmp_path):
    """The recipe's page codec (k-means per chunk) encoded and decoded on the GPU in batches of chunks: every chunk
    comes back with the CPU path's error (within 5%), and a blob the GPU wrote decodes on a CPU tier to the GPU's
    rows within rounding."""
    codec = "quantwm:kchannel=32,rank=0,centroids=8,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=8"
    buf, view, _, _ = block_primary("HND", chunks=12, seed=6)
    original = torch.from_numpy(buf[:4].copy()).view(torch.bfloat16).float()

    def error(rows):
        got = torch.from_numpy(rows).view(torch.bfloat16).float()
        return float((got - original).norm() / original.norm())

    errors, rows = {}, {}
    for device in ("cpu", "cuda"):
        tier = make_tier_with(tmp_path / device, view, block_spec("HND"), codec=codec, kv_heads=HEADS,
                              page_tokens=32, device=device)
        assert run(tier, 1, keys(4), [0, 1, 2, 3], promotion=False).success
        slots = [4, 5, 6, 7] if device == "cpu" else [8, 9, 10, 11]
        assert run(tier, 2, keys(4), slots, promotion=True).success
        rows[device], errors[device] = buf[slots].copy(), error(buf[slots].copy())
        tier.shutdown()
    assert 0 < errors["cuda"] < 1.05 * errors["cpu"] and errors["cpu"] < 0.3, errors
    # the GPU's blobs read by a CPU tier of the same configuration (the same directory)
    reader = make_tier_with(tmp_path / "cuda", view, block_spec("HND"), codec=codec, kv_heads=HEADS, page_tokens=32,
                            device="cpu")
    assert run(reader, 3, keys(4), [4, 5, 6, 7], promotion=True).success
    on_cpu = torch.from_numpy(buf[4:8].copy()).view(torch.bfloat16).float()
    on_gpu = torch.from_numpy(rows["cuda"]).view(torch.bfloat16).float()
    assert float((on_cpu - on_gpu).abs().max()) <= 0.02 * float(on_gpu.abs().max())
    reader.shutdown()


def test_a_store_that_fails_partway_counts_exactly_what_it_wrote(tmp_path, monkeypatch):
    """Batches of 2 chunks: the second batch's encoding raises after the first was handed to the file tier. The
    job fails, the first batch is stored and counted (hits and stats agree), nothing after it is stored."""
    from vllm.v1.kv_offload.base import LookupResult

    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=6)
    _working_device(monkeypatch)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 2 * CHUNK_BYTES)
    tier = make_tier(tmp_path, view, "identity")
    real, calls = tier._encode_chunks, []

    def encode(*raws):
        calls.append(len(raws))
        if len(calls) == 2:
            raise ValueError("non-finite values")
        return real(*raws)

    monkeypatch.setattr(tier, "_encode_chunks", encode)
    ks = keys(6)
    assert not run(tier, 1, ks, list(range(6)), promotion=False).success
    hits = [tier.lookup(k, ReqContext("r")) == LookupResult.HIT for k in ks]
    assert hits == [True, True, False, False, False, False]
    stats = tier.get_stats()
    assert stats["chunks_stored"] == 2 and stats["raw_bytes_stored"] == 2 * CHUNK_BYTES and stats["failed_jobs"] == 1
    tier.shutdown()


def test_a_store_waits_for_every_write_even_after_one_raised(tmp_path, monkeypatch):
    """The first group's write raises, the second is slow: the job ends only after the second landed, fails, and
    counts only what was written."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvbackend.integration import vllm as tier_module
    from kvbackend.tiers.base import Handle

    buf, view = primary(chunks=4)
    _working_device(monkeypatch)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 2 * CHUNK_BYTES)
    tier = make_tier(tmp_path, view, "identity")
    pool, real_put, calls, landed = ThreadPoolExecutor(2), tier.store.put, [], threading.Event()

    def put(ks, blobs):
        calls.append(len(ks))
        if len(calls) == 1:
            return Handle(pool.submit(lambda: (_ for _ in ()).throw(MemoryError("copying the blobs"))))

        def slow():
            time.sleep(0.3)
            result = real_put(ks, blobs).result()
            landed.set()
            return result
        return Handle(pool.submit(slow))

    monkeypatch.setattr(tier.store, "put", put)
    assert not run(tier, 1, keys(4), [0, 1, 2, 3], promotion=False).success
    assert landed.is_set() and calls == [2, 2]
    assert tier.get_stats()["chunks_stored"] == 2
    tier.shutdown()
    pool.shutdown()


@pytest.mark.parametrize("batched", [False, True])
def test_a_load_that_fails_partway_reports_the_chunks_it_delivered(tmp_path, monkeypatch, batched):
    """Windows of 2 blobs; the third window's buffers cannot be allocated (no memory): the job reports the first
    four chunks as loaded (they are in the primary tier, and counted), and writes nothing after them."""
    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=16)
    if batched:
        _working_device(monkeypatch)
        monkeypatch.setattr(tier_module, "BATCH_BYTES", 2 * CHUNK_BYTES)
    tier = make_tier(tmp_path, view, "rtn:bits=4,group=64", **({} if batched else {"device": "cpu"}))
    monkeypatch.setattr(tier_module, "WINDOW_BYTES", 2 * tier.blob_bytes)
    ks = keys(8)
    assert run(tier, 1, ks, list(range(8)), promotion=False).success
    assert run(tier, 2, ks, list(range(8, 16)), promotion=True).success
    want = buf[8:].copy()
    real, calls = tier.device.staging, []

    def staging(shape, dtype):
        calls.append(shape)
        if len(calls) == 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(shape, dtype)

    monkeypatch.setattr(tier.device, "staging", staging)
    buf[8:] = 0x55
    before = tier.get_stats()["chunks_loaded"]
    result = run(tier, 3, ks, list(range(8, 16)), promotion=True)
    assert not result.success and list(result.successful_keys) == ks[:4]
    assert np.array_equal(buf[8:12], want[:4]) and np.all(buf[12:] == 0x55)
    assert tier.get_stats()["chunks_loaded"] - before == 4
    tier.shutdown()


@pytest.mark.parametrize("promotion", [False, True])
@pytest.mark.parametrize("bad", [4, -1])
def test_chunk_ids_outside_the_primary_buffer_are_refused(tmp_path, bad, promotion):
    """A chunk id past the buffer (an empty slice: nothing written, yet "loaded") or below zero (a chunk counted
    from the end): a clear error when the job is submitted, before anything moves."""
    buf, view = primary(chunks=4)
    tier = make_tier(tmp_path, view, "identity", device="cpu")
    job = TransferJob(1, keys(2), np.asarray([2, bad]), promotion, ReqContext("req"))
    with pytest.raises(ValueError, match="outside the primary tier's 4 chunks"):
        (tier.submit_load if promotion else tier.submit_store)(job)
    assert not tier.has_pending_work()
    tier.shutdown()


def test_a_store_on_the_cpu_writes_groups_of_chunks_not_a_file_each(tmp_path, monkeypatch):
    """One chunk per codec call on the CPU, but the blobs go to the file tier in groups of about BATCH_BYTES of
    raw KV: 10 chunks in groups of 4 are three files (each with its own fsyncs), all loadable."""
    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=20)
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 4 * CHUNK_BYTES)
    tier = make_tier(tmp_path, view, "rtn:bits=4,group=64", device="cpu")
    puts, real_put = [], tier.store.put
    monkeypatch.setattr(tier.store, "put", lambda ks, blobs: puts.append(len(ks)) or real_put(ks, blobs))
    ks = keys(10)
    assert run(tier, 1, ks, list(range(10)), promotion=False).success
    assert puts == [4, 4, 2] and len(tier.store._files) == 3
    assert run(tier, 2, ks, list(range(10, 20)), promotion=True).success
    assert tier.get_stats()["chunks_stored"] == 10 and tier.get_stats()["chunks_loaded"] == 10
    tier.shutdown()


def test_the_compression_ratio_is_that_of_the_chunks_held(tmp_path):
    """identity holds about 1x however often a chunk is stored again; rtn-4 its own ratio of the files held."""
    buf, view = primary(chunks=4)
    tier = make_tier(tmp_path / "raw", view, "identity", device="cpu")
    for job in range(4):
        assert run(tier, job, keys(1), [0], promotion=False).success
    assert 0.95 < tier.get_stats()["compression_ratio"] <= 1.0
    tier.shutdown()
    packed = make_tier(tmp_path / "rtn", view, "rtn:bits=4,group=64", device="cpu")
    assert run(packed, 1, keys(2), [0, 1], promotion=False).success
    assert run(packed, 2, keys(2), [0, 1], promotion=False).success
    held = packed.store.stats()
    assert packed.get_stats()["compression_ratio"] == 2 * CHUNK_BYTES / held.bytes_used > 3
    packed.shutdown()


def test_a_store_whose_later_groups_evict_its_earlier_ones_is_not_reported_stored(tmp_path, monkeypatch):
    """Groups of 2 chunks (the GPU's batched path, run here on the CPU) under a budget of about two groups: the
    job's later writes evict its first group before it finishes, so the job fails and counts only what is held."""
    from kvbackend.integration import vllm as tier_module

    buf, view = primary(chunks=8)
    _working_device(monkeypatch)
    probe = make_tier(tmp_path / "probe", view, "identity")
    monkeypatch.setattr(tier_module, "BATCH_BYTES", 2 * CHUNK_BYTES)
    assert run(probe, 1, keys(2), [0, 1], promotion=False).success
    group = probe.store.stats().bytes_used
    probe.shutdown()
    tier = make_tier(tmp_path / "small", view, "identity", budget_gb=2.5 * group / 2**30)
    assert not run(tier, 2, keys(8, salt=1), list(range(8)), promotion=False).success
    held = sum(tier.lookup(k, ReqContext("req")) != LookupResult.MISS for k in keys(8, salt=1))
    assert held == 4 and tier.get_stats()["chunks_stored"] == held
    tier.shutdown()


def test_codebooks_that_outweigh_a_chunk_are_named_at_start_up(tmp_path, caplog):
    """A vLLM chunk carries its own codebooks: 32 centroids per chunk of a few dozen tokens cost more than its codes.
    The tier says so once, with the bits per value it will store; page-local codecs start without a word."""
    _, view, _, _ = block_primary("NHD", seed=5)
    with caplog.at_level(logging.WARNING, logger="kvbackend.integration.vllm"):
        make_tier_with(tmp_path / "a", view, block_spec("NHD"), codec="kivi:bits=2,group=32", kv_heads=HEADS,
                       page_tokens=32, device="cpu").shutdown()
        make_tier_with(tmp_path / "b", view, block_spec("NHD"), codec="quantwm:kchannel=32,rank=0,centroids=1,"
                       "vcluster=false,cdtype=fp8", kv_heads=HEADS, page_tokens=32, device="cpu").shutdown()
        assert not [r for r in caplog.records if r.name == "kvbackend.integration.vllm"]
        tier = make_tier_with(tmp_path / "c", view, block_spec("NHD"), codec="quantwm:kchannel=32,rank=0,"
                              "centroids=32,vcluster=false,cdtype=fp8", kv_heads=HEADS, page_tokens=32, device="cpu")
    (record,) = [r for r in caplog.records if r.name == "kvbackend.integration.vllm"]
    bpv = 8 * tier.blob_bytes / (tier.chunk_bytes / 2)
    assert bpv > 4 and f"{bpv:.2f} bits per value" in record.getMessage(), record.getMessage()
    tier.shutdown()


@pytest.mark.parametrize("codec", ["rtn:bits=4,group=64", "identity"])
def test_a_blob_filed_under_another_key_is_refused_not_loaded(tmp_path, codec):
    """Blobs carried no key: key a's blob filed under key b (a valid checksum) was loaded as b's chunk. Each blob
    ends in its key now; a blob of another key is a miss, refused in the tier, and b's chunk is not written."""
    buf, view = primary(8)
    tier = make_tier(tmp_path, view, codec)
    ka, kb = keys(2)
    assert run(tier, 1, [ka], [0], promotion=False).success
    blob = torch.empty(tier.blob_bytes, dtype=torch.uint8)
    assert tier.store.get([tier._key(ka)], [blob]).result() == [True]
    assert torch.equal(blob, stored_blob(tier, 0, ka))
    assert tier.store.put([tier._key(kb)], [blob]).result() == [True]  # key b's entry holds key a's bytes
    buf[5] = 0x55
    assert not run(tier, 2, [kb], [5], promotion=True).success
    assert np.all(buf[5] == 0x55) and tier.store.blob_size(tier._key(kb)) is None  # refused in the tier
    assert tier.store.stats().failures == 1
    want = torch.empty(tier.chunk_bytes, dtype=torch.uint8)
    tier._decode_into(blob[: tier.body_bytes], want)  # what a's blob decodes to (the codec's lossy rows)
    assert run(tier, 3, [ka], [6], promotion=True).success and np.array_equal(buf[6], want.numpy())
    tier.shutdown()
