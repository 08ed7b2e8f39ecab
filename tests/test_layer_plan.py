"""A paged KVCache with one codec per layer (the plans `auto:...` chooses): each layer encodes,
stores and reads with its own layout; bytes, fingerprints and page groups follow the plan."""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.codecs.base import CodecState
from kvbackend.errors import SpecError
from kvbackend.page_group import TRAILER_BYTES

GEOM = Geometry(3, 2, 64, torch.float32)
PLAN = ("kivi:bits=2,group=16", "rtn:bits=4,group=32", "qvg:centroids=4")


def make(plan=PLAN, **kw):
    cfg = dict(page_size=16, chunk_pages=2, dense_pages=16, packed_pages=16)
    cfg.update(kw)
    return KVCache(GEOM, CacheConfig(layer_codecs=plan, **cfg))


def fill(cache, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rid, _ = cache.add_request(list(range(n)))
    kvs = []
    for layer in range(GEOM.num_layers):
        k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
        cache.append(rid, layer, k, v)
        kvs.append((k, v))
    return rid, kvs


def test_each_layer_uses_its_own_codec():
    cache = make()
    rid, kvs = fill(cache, 70)  # two chunks of 32 tokens packed, 6 tokens dense
    assert [lay.page_bytes for lay in cache.layouts] == [codecs.get(s).layout(GEOM, 16).page_bytes for s in PLAN]
    assert len({lay.page_bytes for lay in cache.layouts}) == 3
    for layer, spec in enumerate(PLAN):
        codec = codecs.get(spec)
        layout = codec.layout(GEOM, 16)
        state, expected = CodecState(), []
        for chunk in range(2):  # the reference codec, chunk by chunk, with the same warm start
            k, v = (x[32 * chunk : 32 * (chunk + 1)] for x in kvs[layer])
            encoded = codec.encode(k, v, layout, state)
            expected.append(codec.decode_pages(layout, encoded.pages, encoded.codebook))
        k, v = cache.read(rid, layer)
        assert torch.equal(k[:64], torch.cat([e[0] for e in expected]))
        assert torch.equal(v[:64], torch.cat([e[1] for e in expected]))
        assert torch.equal(k[64:], kvs[layer][0][64:]) and torch.equal(v[64:], kvs[layer][1][64:])
    cache.check()


def test_bytes_are_the_sum_of_each_layers_layout():
    cache = make()
    fill(cache, 70)
    stats = cache.stats()
    expected = sum(lay.stored_bytes(num_pages=4, num_chunks=2) for lay in cache.layouts)
    assert stats.packed_bytes == expected
    assert stats.bits_per_value == pytest.approx(8 * expected / (64 * GEOM.num_layers * GEOM.values_per_token))
    assert cache.blob_bytes == sum(lay.page_bytes + lay.codebook_bytes for lay in cache.layouts) + TRAILER_BYTES


def test_fingerprint_names_the_plan():
    uniform = KVCache(GEOM, CacheConfig(codec=PLAN[0], page_size=16, chunk_pages=2, dense_pages=4, packed_pages=4))
    # Everything that shapes the bytes names the cache: layers, chunk pages, dtype (issue: a 4-layer and a
    # 2-layer cache once shared a file-tier directory and served each other's pages).
    cfg = dict(codec=PLAN[0], page_size=16, chunk_pages=2, dense_pages=4, packed_pages=4)
    others = [KVCache(Geometry(GEOM.num_layers + 1, GEOM.num_kv_heads, GEOM.head_dim, GEOM.dtype), CacheConfig(**cfg)),
              KVCache(GEOM, CacheConfig(**{**cfg, "chunk_pages": 1})),
              KVCache(Geometry(GEOM.num_layers, GEOM.num_kv_heads, GEOM.head_dim, torch.float16), CacheConfig(**cfg))]
    assert len({uniform.fingerprint, *(c.fingerprint for c in others)}) == 4
    spelled = ["kivi:group=16", PLAN[0], "kivi:bits=2,group=16,scale=fp16"]  # one layout, three spellings
    same = KVCache(GEOM, CacheConfig(layer_codecs=spelled, page_size=16, chunk_pages=2, dense_pages=4, packed_pages=4))
    assert same.uniform and same.fingerprint == uniform.fingerprint
    mixed, swapped = make(), make(plan=(PLAN[1], PLAN[0], PLAN[2]))
    assert len({uniform.fingerprint, mixed.fingerprint, swapped.fingerprint}) == 3
    assert len(mixed.fingerprint) == 16


def test_page_groups_move_between_caches_of_one_plan():
    source = make()
    rid, _ = fill(source, 70)
    keys = source.prefix_keys(list(range(70)))
    blobs = torch.zeros(len(keys), source.blob_bytes, dtype=torch.uint8)
    for i, page in enumerate(source.page_table(rid).packed):
        group = source.export_page(page)
        blobs[i, : group.numel()] = group
    target = make()
    assert target.install_pages(keys, list(range(70)), blobs, 0) == 4
    rid2, hit = target.add_request(list(range(70)))
    assert hit == 64
    for layer in range(GEOM.num_layers):
        assert torch.equal(target.read(rid2, layer)[0], source.read(rid, layer)[0][:64])
        assert torch.equal(target.read(rid2, layer)[1], source.read(rid, layer)[1][:64])
    target.check()


def test_bad_plans_are_refused_clearly():
    with pytest.raises(SpecError, match="2 specs for 3 layers"):
        make(plan=PLAN[:2])
    # Levers are served per layer now; what the paged cache cannot serve as given is refused by name.
    with pytest.raises(SpecError, match="needs the model's RoPE"):
        make(plan=(PLAN[0], "kivi:bits=2,group=16,prerope=true", PLAN[2]))
    with pytest.raises(SpecError, match="psac= lever"):
        make(plan=(PLAN[0], "kivi:bits=2,group=16,psac=4", PLAN[2]))
    with pytest.raises(SpecError, match="exceeds the page size"):
        make(plan=(PLAN[0], "kivi:bits=2,group=16,sink=100", PLAN[2]))
    with pytest.raises(SpecError, match="kvbackend eval"):
        make(plan=("auto:bpv=2.6",) * 3)
    with pytest.raises(SpecError, match="unknown codec"):
        make(plan=(PLAN[0], "nope", PLAN[2]))
    with pytest.raises(ValueError, match="sequence of codec spec strings"):
        CacheConfig(layer_codecs="kivi")
    cache = make()
    with pytest.raises(SpecError, match=r"codecs\[layer\]"):
        cache.codec  # noqa: B018
    with pytest.raises(SpecError, match=r"layouts\[layer\]"):
        cache.layout  # noqa: B018


def test_a_codec_beside_layer_codecs_is_refused():
    """Before: CacheConfig(codec=..., layer_codecs=...) served layer_codecs and ignored the codec asked for."""
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(codec="kivi:bits=4,group=64", layer_codecs=("rtn", "rtn"))
    assert CacheConfig(layer_codecs=("rtn", "rtn")).layer_codecs == ("rtn", "rtn")
