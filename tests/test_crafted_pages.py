"""Packed pages crafted with a valid checksum: whoever can write the file tier or an engine's storage directory can
recompute a crc32c, so the index fields of a page (centroid ids, sparse PSAC row tokens, key outlier positions) are
checked where pages enter. A page with an index out of range is refused as a miss, counted and its file removed,
like one that fails its checksum; it is never installed, decoded or served."""

import logging
import os

import numpy as np
import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.page_check import PageCheck, index_fields
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.prefetch import TieredCache

P, D, H = 16, 32, 2
QUANTWM = "quantwm:centroids=4,group=16,keep=0.5,outliers=4,rank=4"
HEADS = "heads:base=quantwm:centroids=4;group=16;keep=0.5;rank=2,outliers=2-4"  # each head its own page bytes
WHOLE = "quantwm:centroids=4,group=16,rank=0,whole=2"

# (codec, field, a value out of range, the same field's largest value in range); C = 4 centroids of QUANTWM
CRAFTED = [
    (QUANTWM, "k_assign", 4, 3),
    (QUANTWM, "v_assign", 255, 3),
    (QUANTWM, "k_psac_token", P, P - 1),
    (QUANTWM, "k_psac_token", 255, P - 1),
    (QUANTWM, "k_out_index", P * D, P * D - 1),
    (QUANTWM, "k_out_index", -1, P * D - 1),
    (QUANTWM, "k_out_index", -32768, 0),
    (HEADS, "h1.k_assign", 8, 3),
    (HEADS, "h1.k_out_index", -2, P * D - 1),
    (WHOLE, "k_whole_token", P, P - 1),
    (WHOLE, "k_whole_token", 200, 0),
]


def cache_of(codec: str | tuple[str, ...], layers: int = 2) -> KVCache:
    """``codec``: one spec, or a per-layer plan."""
    which = {"layer_codecs": codec} if isinstance(codec, tuple) else {"codec": codec}
    return KVCache(Geometry(len(codec) if isinstance(codec, tuple) else layers, H, D, torch.bfloat16),
                   CacheConfig(**which, page_size=P, chunk_pages=2, dense_pages=16, packed_pages=16, backend="torch"))


def exported(codec, tokens: list[int], layers: int = 2) -> tuple[KVCache, list[int], torch.Tensor]:
    """A cache that encoded ``tokens`` (whole chunks), the keys of its pages and their page groups [pages, blob_bytes]."""
    cache = cache_of(codec, layers)
    gen = torch.Generator().manual_seed(0)
    rid, _ = cache.add_request(tokens)
    for layer in range(layers):
        cache.append(rid, layer, torch.randn(len(tokens), H, D, generator=gen).bfloat16(),
                     torch.randn(len(tokens), H, D, generator=gen).bfloat16())
    keys = cache.prefix_keys(tokens)
    blobs = torch.zeros(len(keys), cache.blob_bytes, dtype=torch.uint8)
    for i, key in enumerate(keys):
        blob = cache.export_page(cache.packed.allocator.lookup(key))
        blobs[i, : blob.numel()] = blob
    return cache, keys, blobs


def set_index(cache: KVCache, blob: torch.Tensor, layer: int, name: str, value: int) -> None:
    """Write ``value`` into element 0 and 5 of index field ``name`` of ``layer``'s page inside page group ``blob``."""
    field = next(f for f in index_fields(cache.codecs[layer], cache.layouts[layer]) if f.name == name)
    at = cache.group.page_offsets[layer] + field.offset
    for element in (0, 5):
        raw = np.array([value], dtype=np.int16 if field.width == 2 else np.uint8).view(np.uint8)
        blob[at + element * field.width : at + (element + 1) * field.width] = torch.from_numpy(raw.copy())


def test_index_fields_of_each_codec():
    layout = cache_of(QUANTWM).layout
    fields = {f.name: f for f in index_fields(cache_of(QUANTWM).codec, layout)}
    assert {n: (f.width, f.limit) for n, f in fields.items()} == {
        "k_assign": (1, 4), "v_assign": (1, 4), "k_psac_token": (1, P), "k_out_index": (2, P * D)}
    assert fields["k_out_index"].count == 4 * H and fields["k_psac_token"].count == 8 * H
    whole = cache_of(WHOLE)
    fields = {f.name: f for f in index_fields(whole.codec, whole.layout)}
    assert (fields["k_whole_token"].width, fields["k_whole_token"].limit, fields["k_whole_token"].count) == (1, P, 2 * H)
    heads = cache_of(HEADS)
    assert [f.name for f in index_fields(heads.codec, heads.layout)] == [
        f"h{i}.{name}" for i in range(2) for name in ("k_assign", "v_assign", "k_psac_token", "k_out_index")]
    for plain in ("kivi:bits=2,group=16", "rtn:bits=4,group=16", "bf16", "qvg:centroids=4,group=16,vcluster=false"):
        cache = cache_of(plain)
        names = [f.name for f in index_fields(cache.codec, cache.layout)]
        assert names == (["k_assign"] if plain.startswith("qvg") else []), plain
    assert cache_of("kivi:bits=2,group=16").page_check is None  # nothing to check: no cost on install


@pytest.mark.parametrize("codec,field,bad,good", CRAFTED)
def test_install_pages_refuses_an_index_out_of_range(codec, field, bad, good, caplog):
    tokens = list(range(100, 133))  # one chunk of two pages packed; the last token dense
    source, keys, blobs = exported(codec, tokens)
    layer = 1
    crafted = blobs.clone()
    set_index(source, crafted[1], layer, field, bad)
    target = cache_of(codec)
    with caplog.at_level(logging.WARNING, logger="kvbackend.install"):
        assert target.install_pages(keys, tokens, crafted, 0) == 1  # the page before it, not the crafted one
    assert target.groups.refused == 1 and target.stats().refused_page_groups == 1
    assert f"layer {layer} {field} holds an index out of range" in caplog.text
    rid, hit = target.add_request(tokens)
    assert hit == P
    k, v = target.read_packed(rid, layer)  # what is installed decodes (the torch reference raised on the crafted page)
    assert k.shape[0] == P and torch.isfinite(k.float()).all()
    target.free(rid)
    target.check()
    # the same field at the largest value in range is a page like any other
    fine = blobs.clone()
    set_index(source, fine[1], layer, field, good)
    other = cache_of(codec)
    assert other.install_pages(keys, tokens, fine, 0) == 2 and other.groups.refused == 0
    rid, hit = other.add_request(tokens)
    assert hit == 2 * P
    other.read_packed(rid, layer)


def test_page_check_reads_only_index_bytes_and_refuses_short_blobs():
    cache, _, blobs = exported(QUANTWM, list(range(33)))
    check = cache.page_check
    assert check.bad_rows(blobs) == [False, False]
    everything_else = blobs.clone()
    mask = torch.ones(blobs.shape[1], dtype=torch.bool)
    for layer in range(2):
        for f in index_fields(cache.codecs[layer], cache.layouts[layer]):
            at = cache.group.page_offsets[layer] + f.offset
            mask[at : at + f.count * f.width] = False
    everything_else[:, mask] = 0xFF  # codes, scales, trailer, codebooks: no index, nothing refused
    assert check.bad_rows(everything_else) == [False, False]
    crafted = blobs.clone()
    set_index(cache, crafted[1], 1, "k_out_index", -1)
    assert check.bad_rows(crafted.t().contiguous().t()) == [False, True]  # rows that are not contiguous too
    assert "short of" in check.reason(blobs[0, :100])
    with pytest.raises(ValueError):
        check.bad_rows(blobs[:, :100])


@pytest.mark.parametrize("codec", [QUANTWM, HEADS, WHOLE])
def test_host_and_device_readings_of_the_index_fields_agree(codec):
    """Host blobs are checked by numpy, device blobs by torch: both readings, field by field, on crafted rows (each
    codec's every field at its bound, one past it, and at random values) and on rows whose bytes are not contiguous."""
    cache, _, blobs = exported(codec, list(range(33)))
    check, rng = cache.page_check, np.random.default_rng(0)
    rows = [blobs[0].clone()]
    for layer in range(2):
        for f in index_fields(cache.codecs[layer], cache.layouts[layer]):
            for value in (f.limit - 1, f.limit, *rng.integers(-300, 600, 3)):
                if f.width == 1 and not 0 <= value < 256:
                    continue
                row = blobs[1].clone()
                set_index(cache, row, layer, f.name, int(value))
                rows.append(row)
    crafted = torch.stack(rows)
    for view in (crafted, crafted.t().contiguous().t(), crafted[1::2]):
        host, device = check._out_of_range_numpy(view.contiguous()), check._out_of_range_torch(view.contiguous())
        assert len(host) == len(device) == len(check.blocks)
        for a, b in zip(host, device):
            assert a.dtype == b.dtype == torch.bool and torch.equal(a, b)
        bad = check.bad_rows(view)
        assert any(bad) and not all(bad)  # a test that sees both answers
        assert bad == [bool(torch.stack([f.any(1) for f in device]).any(0)[i]) for i in range(view.shape[0])]


def test_a_per_layer_plan_checks_each_layer_with_its_own_bounds(caplog):
    plan = (QUANTWM, "kivi:bits=2,group=16", "qvg:centroids=8,group=16", QUANTWM)
    tokens = list(range(300, 333))
    source, keys, blobs = exported(plan, tokens, layers=4)
    assert source.page_check.bad_rows(blobs) == [False, False]
    for layer, value, refused in [(2, 7, False), (2, 8, True), (3, 4, True), (0, 3, False)]:
        crafted = blobs.clone()
        set_index(source, crafted[0], layer, "k_assign", value)
        target = cache_of(plan)
        with caplog.at_level(logging.WARNING, logger="kvbackend.install"):
            assert target.install_pages(keys, tokens, crafted, 0) == (0 if refused else 2), (layer, value)
        assert (f"layer {layer} k_assign holds an index out of range" in caplog.text) == refused
        caplog.clear()


def put_all(file: FileTier, keys: list[int], blobs: list[torch.Tensor]) -> None:
    for key, blob in zip(keys, blobs):  # one file per page group; the tier computes each checksum
        assert file.put([key], [blob]).result() == [True]


@pytest.mark.parametrize("crafted_page,hit", [(0, 0), (2, 2 * P), (3, 3 * P)])
def test_restore_from_the_file_tier_refuses_a_crafted_page_with_a_valid_checksum(tmp_path, crafted_page, hit, caplog):
    tokens = list(range(200, 265))  # two chunks of two pages
    source, keys, blobs = exported(QUANTWM, tokens)
    sizes = [source.export_page(source.packed.allocator.lookup(key)).numel() for key in keys]
    groups = [blobs[i, : sizes[i]].clone() for i in range(len(keys))]
    set_index(source, groups[crafted_page], 0, "k_assign", 200)
    put_all(FileTier(str(tmp_path), 10**8, source.fingerprint), keys, groups)
    target = cache_of(QUANTWM)
    file = FileTier(str(tmp_path), 10**8, target.fingerprint)  # a restart: the index is rebuilt from the files
    tiered = TieredCache(target, None, file, background=False)
    with caplog.at_level(logging.WARNING, logger="kvbackend.tiers.file"):
        rid, got = tiered.add_request(tokens)
    assert got == hit  # the pages before the crafted one, never it or what follows
    stats = file.stats()
    assert stats.failures >= 1 and "layer 0 k_assign holds an index out of range" in caplog.text
    assert file.contains([keys[crafted_page]]) == 0  # its file removed, as a checksum failure's
    assert len(os.listdir(tmp_path)) == len(keys) - 1
    for layer in range(2):
        k, _ = tiered.read(rid, layer)
        assert torch.isfinite(k.float()).all()
    tiered.close()


def test_file_tier_check_refuses_before_a_byte_reaches_the_buffer(tmp_path):
    file = FileTier(str(tmp_path), 10**8, "0123456789abcdef")
    blob = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert file.put([7], [blob]).result() == [True]
    out = torch.full((256,), 0x55, dtype=torch.uint8)
    assert file.get([7], [out], check=lambda b: None).result() == [True] and torch.equal(out, blob)
    out.fill_(0x55)
    assert file.get([7], [out], check=lambda b: "crafted" if b[3] == 3 else None).result() == [False]
    stats = file.stats()
    assert stats.failures == 1 and file.contains([7]) == 0 and not os.listdir(tmp_path)



def test_file_tier_refuse_drops_the_blob_it_delivered_and_spares_one_written_since(tmp_path, caplog):
    file = FileTier(str(tmp_path), 10**8, "0123456789abcdef")
    blobs = [torch.full((256,), i, dtype=torch.uint8) for i in range(3)]
    assert file.write_group([1, 2], [b.numpy() for b in blobs[:2]])  # one file, two blobs
    assert file.put([3], [blobs[2]]).result() == [True]
    outs = [torch.empty(256, dtype=torch.uint8) for _ in range(3)]
    assert file.get([1, 2, 3], outs).result() == [True, True, True]
    with caplog.at_level(logging.WARNING, logger="kvbackend.tiers.file"):
        assert file.refuse(1, outs[0], "crafted")
    stats = file.stats()
    assert (stats.hits, stats.misses, stats.failures) == (2, 1, 1) and "crafted" in caplog.text
    assert file.contains([1]) == 0 and file.contains([2]) == 1  # the file stays for its other blob
    assert file.get([2], [outs[1]]).result() == [True] and torch.equal(outs[1], blobs[1])
    assert file.refuse(2, outs[1], "crafted")
    assert len(os.listdir(tmp_path)) == 1  # its last blob gone: the file goes
    # key 3 written again between the read and the refusal: the fresh blob (another checksum) stays
    assert file.write_group([3], [torch.full((256,), 9, dtype=torch.uint8).numpy()])
    assert not file.refuse(3, outs[2], "crafted")
    assert file.contains([3]) == 1 and file.stats().failures == 3
    fresh = torch.empty(256, dtype=torch.uint8)
    assert file.get([3], [fresh]).result() == [True] and int(fresh[0]) == 9
    assert not file.refuse(99, fresh, "crafted")  # a key never stored: nothing to drop
    padded = torch.cat([fresh, torch.full((64,), 7, dtype=torch.uint8)])  # a row longer than the blob read into it
    assert file.refuse(3, padded, "crafted") and file.contains([3]) == 0


def test_a_batch_whose_check_fails_serves_none_of_its_rows_and_drops_nothing(tmp_path, caplog):
    from kvbackend.page_check import refuse_crafted

    class Failing:
        def bad_rows(self, blobs):
            raise RuntimeError("no memory")

    file = FileTier(str(tmp_path), 10**8, "0123456789abcdef")
    blobs = torch.zeros(2, 64, dtype=torch.uint8)
    assert file.put([1, 2], list(blobs)).result() == [True, True]
    with caplog.at_level(logging.ERROR, logger="kvbackend.page_check"):
        assert refuse_crafted(Failing(), file, blobs, [0, 1], [1, 2]) == []
    assert "all of them miss" in caplog.text and file.contains([1]) == 1 and file.contains([2]) == 1

SGLANG_CODEC = "quantwm:centroids=4,group=16,keep=0.5,outliers=4,rank=4"


@pytest.mark.parametrize("field,bad", [("k_assign", 4), ("k_psac_token", 16), ("k_out_index", -1)])
@pytest.mark.parametrize("direct", [True, False])
def test_sglang_load_refuses_a_crafted_page(tmp_path, field, bad, direct):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from test_sglang import HostPool, host_indices, make_backend

    host = HostPool("layer_first", pages=8)
    host.kv_buffer.normal_()
    a = make_backend(tmp_path / "a", host, SGLANG_CODEC, device="cpu")
    assert a.batch_set_v1(["x", "y"], host_indices([0, 1])) == [True, True]
    key = a._key("x")
    blob = torch.empty(a.blob_bytes, dtype=torch.uint8)
    assert a.tier.get([key], [blob]).result() == [True]
    f = next(f for f in index_fields(a.codec, a.layout) if f.name == field)
    at = a.group.page_offsets[1] + f.offset
    raw = np.array([bad], dtype=np.int16 if f.width == 2 else np.uint8).view(np.uint8)
    blob[at : at + f.width] = torch.from_numpy(raw.copy())
    b = make_backend(tmp_path / "b", host, SGLANG_CODEC, device="cpu")
    if not direct:
        b.writer = None  # the page-by-page path (`_load`)
    assert b.tier.put([key], [blob]).result() == [True]  # a valid checksum over crafted bytes
    y = torch.empty(a.blob_bytes, dtype=torch.uint8)
    assert a.tier.get([a._key("y")], [y]).result() == [True]
    assert b.tier.put([b._key("y")], [y]).result() == [True]
    before = host.page(5 * 16).clone()
    assert b.batch_get_v1(["x", "y"], host_indices([5, 6])) == [False, True]
    assert torch.equal(host.page(5 * 16), before)  # the refused page's slot is not written
    assert b.tier.stats().failures == 1 and b.batch_exists(["x"]) == 0



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_sglang_batched_load_refuses_only_the_crafted_pages_of_a_batch(tmp_path, monkeypatch, device):
    """Pages checked a decode batch at a time (`refuse_crafted`): crafted pages in the middle of batches miss
    alone, every other page of their batches arrives exact, as a backend that never met the crafted ones gives it.
    On a GPU the batches decode through the gather kernel, which would drop an out-of-range term silently: the
    check must come first there."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    import kvbackend.integration.sglang as module
    from test_sglang import HostPool, host_indices, make_backend

    monkeypatch.setitem(module.CPU_BATCH_PAGES, "decode", 3)  # 7 pages: batches of 3, 3 and 1
    monkeypatch.setattr(module, "BATCH_PAGES", 3)  # on a GPU too
    host = HostPool("layer_first", pages=24)
    if device == "cuda":  # page-locked, as SGLang allocates it: the GPU decodes straight into the pool
        host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    names = [f"p{i}" for i in range(7)]
    a = make_backend(tmp_path / "a", host, SGLANG_CODEC, device=device)
    assert all(a.batch_set_v1(names, host_indices(range(7))))
    assert all(a.batch_get_v1(names, host_indices(range(8, 15))))  # the reference: every page, nothing crafted
    b = make_backend(tmp_path / "b", host, SGLANG_CODEC, device=device)
    assert b.writer is not None and (device == "cpu" or (b.writer.direct and b.units is not None))
    crafted = {1: ("k_assign", 4), 4: ("k_out_index", -1), 6: ("k_psac_token", P)}
    for i, name in enumerate(names):
        key = a._key(name)
        blob = torch.empty(a.blob_bytes, dtype=torch.uint8)
        assert a.tier.get([key], [blob]).result() == [True]
        if i in crafted:
            field, bad = crafted[i]
            f = next(f for f in index_fields(a.codec, a.layout) if f.name == field)
            at = a.group.page_offsets[2] + f.offset
            blob[at : at + f.width] = torch.from_numpy(np.array([bad], dtype=np.int16 if f.width == 2 else np.uint8)
                                                       .view(np.uint8).copy())
        assert b.tier.put([key], [blob]).result() == [True]
    before = host.kv_buffer.clone()
    got = b.batch_get_v1(names, host_indices(range(16, 23)))
    assert got == [i not in crafted for i in range(7)]
    for i in range(7):
        slot = (16 + i) * 16
        if i in crafted:  # never written
            assert torch.equal(host.kv_buffer[:, :, slot : slot + 16], before[:, :, slot : slot + 16])
        else:  # as the reference backend decoded it
            assert torch.equal(host.kv_buffer[:, :, slot : slot + 16], host.kv_buffer[:, :, (8 + i) * 16 : (9 + i) * 16])
    assert b.tier.stats().failures == len(crafted)
    for i, name in enumerate(names):  # each crafted blob dropped, every other one kept
        assert b.tier.contains([b._key(name)]) == (i not in crafted), i

@pytest.mark.parametrize("field,bad", [("k_assign", 8), ("k_out_index", -1)])
def test_vllm_load_refuses_a_crafted_chunk(tmp_path, field, bad):
    pytest.importorskip("vllm.v1.kv_offload.tiering.factory")
    from test_vllm import HEADS as VHEADS, block_primary, block_spec, keys as vkeys, make_tier_with, run

    codec = "quantwm:kchannel=32,rank=0,centroids=8,vcluster=false,outliers=8"

    def tier_at(where):
        return make_tier_with(tmp_path / where, view, block_spec("NHD"), codec=codec, kv_heads=VHEADS, page_tokens=32,
                              device="cpu")

    buf, view, _, _ = block_primary("NHD")
    tier = tier_at("a")
    ks = vkeys(2)
    for i, k in enumerate(ks):
        assert run(tier, 1 + i, [k], [i], promotion=False).success
    blobs = []
    for k in ks:
        blob = torch.empty(tier.blob_bytes, dtype=torch.uint8)
        assert tier.store.get([tier._key(k)], [blob]).result() == [True]
        blobs.append(blob)
    f = next(f for f in index_fields(tier.codec, tier.layout) if f.name == field)
    pages = -(-tier.block.tokens // tier.layout.page_size)  # the last unit's (worker's and layer's) last page
    unit = pages * tier.layout.page_bytes + tier.layout.codebook_bytes
    at = (tier.block.workers * tier.block.layers - 1) * unit + (pages - 1) * tier.layout.page_bytes + f.offset
    raw = np.array([bad], dtype=np.int16 if f.width == 2 else np.uint8).view(np.uint8)
    blobs[1][at : at + f.width] = torch.from_numpy(raw.copy())
    other = tier_at("b")
    for k, blob in zip(ks, blobs):  # valid checksums over the bytes, crafted ones included
        assert other.store.put([other._key(k)], [blob]).result() == [True]
    buf[2:4] = 0x55
    res = run(other, 9, ks, [2, 3], promotion=True)
    assert not res.success and list(res.successful_keys) == ks[:1]
    assert np.all(buf[3] == 0x55)  # never decoded into the primary tier
    assert other.store.stats().failures == 1 and other.store.contains([other._key(ks[1])]) == 0
    tier.shutdown()
    other.shutdown()


def test_install_pages_refuses_rows_of_another_shape_or_type_with_a_clear_error():
    """Rows narrower than this cache's page groups (exported by a cache of another codec) raised struct.error from
    the trailer's unpacking; fewer rows than keys an IndexError; float rows a struct.error."""
    source, keys, blobs = exported(QUANTWM, list(range(33)))
    other = cache_of("identity")
    assert blobs.shape[1] < other.blob_bytes
    for rows in (blobs, blobs.float(), torch.zeros(1, other.blob_bytes, dtype=torch.uint8), blobs.flatten()):
        with pytest.raises(ValueError, match="page groups are uint8 rows"):
            other.install_pages(other.prefix_keys(list(range(33))), list(range(33)), rows, 0)
    with pytest.raises(ValueError, match="not the key of page 0"):  # keys carry the cache's fingerprint
        other.install_pages(keys, list(range(33)), torch.zeros(2, other.blob_bytes, dtype=torch.uint8), 0)
    other.check()
    target = cache_of(QUANTWM)
    assert target.install_pages(keys, list(range(33)), blobs, 0) == 2  # rows of this cache's shape install


def test_a_restore_checks_each_run_of_blobs_together_and_refuses_exactly_the_crafted_ones(tmp_path, caplog):
    """`tiers.transfer` checks the blobs of a window in stretches of one length (a chunk's pages between the longer
    ones carrying its codebook), one pass each, instead of blob by blob in the reader threads; the same blobs are
    refused as a check of each alone refuses, wherever they fall in a stretch."""
    from kvbackend.tiers.transfer import _checked

    tokens = list(range(300, 300 + 8 * P + 1))  # four chunks of two pages: carriers at 0, 2, 4, 6
    source, keys, blobs = exported(QUANTWM, tokens)
    sizes = [source.export_page(source.packed.allocator.lookup(key)).numel() for key in keys]
    assert len(set(sizes)) == 2
    window = torch.cat([blobs[i, : sizes[i]] for i in range(len(keys))])
    views, at = [], 0
    for size in sizes:
        views.append(window[at : at + size])
        at += size
    for crafted in ((), (1,), (0, 5), (6, 7), tuple(range(len(keys)))):
        file = FileTier(str(tmp_path / f"t{len(crafted)}_{sum(crafted)}"), 10**8, source.fingerprint)
        data = window.clone()
        views = [data[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(keys))]
        for i in crafted:
            set_index(source, views[i], i % 2, "k_assign", 4)
        put_all(file, keys, [v.clone() for v in views])
        got = file.get(keys, [torch.empty(s, dtype=torch.uint8) for s in sizes]).result()
        assert all(got)
        missed = [True] * len(keys)
        missed[3] = False  # a miss stays a miss, checked or not
        with caplog.at_level(logging.WARNING, logger="kvbackend.tiers.file"):
            passed = _checked(source.page_check, file, keys, views, missed)
        alone = [source.page_check.reason(v) is None for v in views]
        assert passed == [m and a for m, a in zip(missed, alone)], crafted
        assert passed == [i != 3 and i not in crafted for i in range(len(keys))]
        assert file.contains([keys[i] for i in crafted if i != 3]) == 0  # refused: dropped as corrupt
        file.close()
