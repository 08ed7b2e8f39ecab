"""Sequence-level levers (sink, pre-RoPE keys, Hadamard-rotated values) and mixed-width KIVI."""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, SpecError, codecs
from kvbackend.frames import without_sinks
from kvbackend.levers import Levers, hadamard, rotate_values
from kvbackend.tools.reconstruct import reconstruct_sequence
from kvbackend.rope import Rotary

GEOM = Geometry(1, 2, 64, torch.float32)


def test_levers_parse_apart_and_round_trip():
    codec = codecs.get("kivi:bits=2,group=32,kbits=4,sink=4,prerope=true,vrot=hadamard")
    assert codec.levers == Levers(sink=4, prerope=True, vrot="hadamard")
    assert codec.spec.key_bits == 4 and codec.spec.value_bits == 2
    again = codecs.get(codec.spec_string)
    assert again.spec == codec.spec and again.levers == codec.levers
    assert codecs.get("fp8").levers == Levers() and codecs.get("fp8").spec_string == "fp8"
    with pytest.raises(SpecError, match="vrot"):
        codecs.get("fp8:vrot=fourier")
    with pytest.raises(SpecError, match="sink"):
        codecs.get("fp8:sink=-1")
    with pytest.raises(SpecError, match="kbits"):
        codecs.get("kivi:kbits=5").layout(GEOM, 32)


def test_hadamard_is_orthonormal():
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    with pytest.raises(SpecError, match="power-of-two"):
        hadamard(48)


def test_levers_with_a_lossless_codec_are_lossless_and_sinks_are_counted():
    rotary = Rotary.default(64, 10000.0)
    positions = torch.arange(100)
    k = rotary.rotate(torch.randn(2, 100, 64), positions).transpose(0, 1).contiguous()  # post-RoPE, [T, H, D]
    v = torch.randn(100, 2, 64)
    plain = codecs.get("identity")
    levered = codecs.get("identity:sink=4,prerope=true,vrot=hadamard")
    base = reconstruct_sequence(plain, k, v, GEOM, 32, 64)
    rec = reconstruct_sequence(levered, k, v, GEOM, 32, 64, rotary)
    # beyond the sinks: de-rotate, rotate back and the Hadamard round trip are exact to float32 rounding
    assert torch.allclose(rec.k[4:], k[4:], atol=1e-4) and torch.allclose(rec.v[4:], v[4:], atol=1e-5)
    assert torch.equal(rec.k[:4], k[:4].half().float())  # sinks stored as fp16
    # as in the paged cache: every token on the codec's pages, plus the 4 sinks in fp16 once per chunk
    chunks = -(-100 // 64)
    assert rec.stored_bytes == chunks * 4 * 2 * 64 * 2 * 2 + base.stored_bytes
    assert base.stored_bytes > 0
    with pytest.raises(ValueError, match="RoPE"):
        reconstruct_sequence(levered, k, v, GEOM, 32, 64)


def test_prerope_helps_per_channel_keys():
    """Post-RoPE keys rotate channel pairs with position, spreading each channel's range; quantizing
    before RoPE (per-channel groups over tokens) gives a smaller key error on structured keys."""
    rotary = Rotary.default(64, 10000.0)
    positions = torch.arange(128)
    pre = (torch.randn(2, 1, 64) * 3 + torch.randn(2, 128, 64) * 0.3)  # strong per-channel offsets
    k = rotary.rotate(pre, positions).transpose(0, 1).contiguous()
    v = torch.randn(128, 2, 64)
    err = {}
    for spec in ("kivi:bits=2,group=32", "kivi:bits=2,group=32,prerope=true"):
        rec = reconstruct_sequence(codecs.get(spec), k, v, GEOM, 32, 128, rotary)
        err[spec] = float((rec.k - k).norm() / k.norm())
    assert err["kivi:bits=2,group=32,prerope=true"] < 0.5 * err["kivi:bits=2,group=32"]


def test_mixed_width_kivi_bytes():
    codec = codecs.get("kivi:bits=2,group=32,kbits=4")
    layout = codec.layout(Geometry(1, 2, 64, torch.float32), 32)
    chunk = codec.encode(torch.randn(64, 2, 64), torch.randn(64, 2, 64), layout)
    # keys 4 + 2*16/32 (fp16 scale+min per channel per 32 tokens), values 2 + 2*16/32: (5 + 3) / 2
    assert chunk.bits_per_value == pytest.approx(4.0)


ROTARY = Rotary.default(64, 10000.0)
LEVERS = "sink=4,prerope=true,vrot=hadamard"


def lever_cache(codec, rotary=ROTARY, **kw):
    cfg = dict(codec=codec, page_size=16, chunk_pages=2, dense_pages=8, packed_pages=8)
    cfg.update(kw)
    return KVCache(Geometry(2, 2, 64, torch.float32), CacheConfig(**cfg), rotary=rotary)


def fill_levers(cache, n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, n, 2, 64, generator=gen), torch.randn(2, n, 2, 64, generator=gen)
    k[..., 0:4] += 20  # outlier channels before RoPE (fast frequencies), as real keys have ...
    k = ROTARY.rotate(k.transpose(1, 2), torch.arange(n)).transpose(1, 2).contiguous()  # ... then the model's RoPE
    v[..., 5] *= 30  # one outlier value channel
    rid, _ = cache.add_request(list(range(n)))
    for layer in range(2):
        cache.append(rid, layer, k[layer], v[layer])
    return rid, k, v


def test_paged_cache_serves_levers_through_its_pages():
    """sink, prerope and vrot in the paged cache: an exact codec reads back what was appended (the frame
    is orthonormal), a lossy one reads exactly what encoding its stored frame gives, and the first
    tokens are exact."""
    exact = lever_cache(f"identity:{LEVERS}")
    rid, k, v = fill_levers(exact)
    assert exact.page_table(rid).num_packed_tokens == 32
    for layer in range(2):
        rk, rv = exact.read(rid, layer)
        assert torch.allclose(rk[4:], k[layer, 4:], atol=1e-4) and torch.allclose(rv[4:], v[layer, 4:], atol=1e-5)
        assert torch.equal(rk[:4], k[layer, :4].half().float()) and torch.equal(rv[:4], v[layer, :4].half().float())
    half = KVCache(Geometry(1, 2, 64, torch.bfloat16), CacheConfig(codec="kivi:bits=2,group=16,sink=4", page_size=16,
                                                                  chunk_pages=2, dense_pages=4, packed_pages=4))
    kb, vb = torch.randn(32, 2, 64).bfloat16() * 50, torch.randn(32, 2, 64).bfloat16()
    rid = half.add_request(list(range(32)))[0]
    half.append(rid, 0, kb, vb)
    rk, rv = half.read_packed(rid, 0)
    assert torch.equal(rk[:4], kb[:4]) and torch.equal(rv[:4], vb[:4])  # a bf16 cache keeps its sinks exactly
    lossy = lever_cache(f"kivi:bits=2,group=16,{LEVERS}")
    rid, k, v = fill_levers(lossy)
    codec = codecs.get("kivi:bits=2,group=16")
    positions = torch.arange(32)
    for layer in range(2):
        stored_k = ROTARY.derotate(k[layer, :32].transpose(0, 1), positions).transpose(0, 1)
        stored_v = rotate_values(v[layer, :32])
        stored_k, stored_v = without_sinks(stored_k, stored_v, 4)  # the sinks' rows are not encoded
        chunk = codec.encode(stored_k, stored_v, codec.layout(lossy.geometry, 16))
        dk, dv = codec.decode(chunk)
        want_k = ROTARY.rotate(dk.transpose(0, 1), positions).transpose(0, 1)
        want_v = rotate_values(dv)
        sink_k, sink_v = k[layer, :4].half().float(), v[layer, :4].half().float()  # a float32 cache: fp16 sinks
        want_k[:4], want_v[:4] = sink_k, sink_v
        rk, rv = lossy.read_packed(rid, layer)
        assert torch.allclose(rk, want_k, atol=1e-4) and torch.allclose(rv, want_v, atol=1e-5)
        assert torch.equal(rk[:4], sink_k) and torch.equal(rv[:4], sink_v)
        rk, rv = lossy.read(rid, layer)
        assert torch.equal(rk[32:], k[layer, 32:])  # the active chunk is stored as appended
        # the levers pay: pre-RoPE keys and rotated values beat the plain codec on outlier channels
        plain = codec.decode(codec.encode(k[layer, :32], v[layer, :32], codec.layout(lossy.geometry, 16)))
        assert (rk[4:32] - k[layer, 4:32]).norm() < (plain[0][4:32] - k[layer, 4:32]).norm()
    sink_bytes = 2 * 4 * 2 * 64 * 2  # K and V of 4 tokens at 16 bits, per layer
    assert lossy.layouts[0].codebook_bytes == codec.layout(lossy.geometry, 16).codebook_bytes + sink_bytes
    # a prefix hit shares the sinks with the pages; a fork too
    rid2, hit = lossy.add_request(list(range(40)))
    assert hit == 32 and torch.equal(lossy.read_packed(rid2, 0)[0], lossy.read_packed(rid, 0)[0])
    lossy.check()


def test_levers_enter_the_fingerprint_and_are_refused_where_they_cannot_be_served():
    plain = lever_cache("kivi:bits=2,group=16")
    with_levers = lever_cache(f"kivi:bits=2,group=16,{LEVERS}")
    other_rope = lever_cache(f"kivi:bits=2,group=16,{LEVERS}", rotary=Rotary.default(64, 500000.0))
    only_vrot = lever_cache("kivi:bits=2,group=16,vrot=hadamard")
    assert len({c.fingerprint for c in (plain, with_levers, other_rope, only_vrot)}) == 4
    with pytest.raises(SpecError, match="needs the model's RoPE"):
        lever_cache("kivi:bits=2,group=16,prerope=true", rotary=None)
    from kvbackend.backends import kernels_can_serve
    from kvbackend.errors import UnsupportedLayout
    from kvbackend.scheme import kernel_schemes, lever_scheme

    codec = with_levers.codecs[0]
    assert kernels_can_serve(codec, with_levers.layouts[0])  # the kernels read sinks, pre-RoPE keys, rotated values
    lv = lever_scheme(codec, with_levers.layouts[0])
    assert (lv.sink, lv.prerope, lv.vrot, lv.psac_rank) == (4, True, True, 0)
    # a caller that does not pass the levers to the kernels cannot get schemes for these pages
    with pytest.raises(UnsupportedLayout, match="levers_read"):
        kernel_schemes(codec, with_levers.layouts[0])
    # the sequence-level psac= lever is refused by the cache itself, with the option to use
    with pytest.raises(SpecError, match="rank= option"):
        lever_cache("kivi:bits=2,group=16,psac=4")


def test_lever_pages_travel_through_tiers():
    from kvbackend.tiers.host import HostTier
    from kvbackend.tiers.prefetch import TieredCache

    cache = lever_cache(f"kivi:bits=2,group=16,{LEVERS}", packed_pages=8)
    tiered = TieredCache(cache, HostTier(10**6, cache.blob_bytes, pin=False), None, background=False)
    rid, k, v = fill_levers(cache, n=33)
    before = [cache.read(rid, layer) for layer in range(2)]
    tiered.free(rid)
    assert tiered.offload(max_pages=100) == 2
    rid, hit = tiered.add_request(list(range(33)))
    assert hit == 32
    for layer in range(2):
        assert torch.equal(cache.read_packed(rid, layer)[0], before[layer][0][:32])
        assert torch.equal(cache.read_packed(rid, layer)[1], before[layer][1][:32])
    cache.check()
    tiered.close()


def test_psac_full_rank_reproduces_keys_up_to_int8_rounding():
    from kvbackend.psac import correct_keys, query_second_moment

    keys = torch.randn(40, 2, 64)
    approx = keys + 0.3 * torch.randn(40, 2, 64)
    queries = torch.randn(6, 100, 64)
    fixed = correct_keys(keys, approx, query_second_moment(queries, 2), rank=64)
    error = (fixed.keys - keys).norm(dim=-1)  # per (token, head)
    coeff_max = (keys - approx).abs().amax() * 8  # |E U| <= ||E|| <= sqrt(64) * max|E|
    assert torch.all(error <= 8 * coeff_max / 127 / 2 * 1.01)  # sqrt(r) * half an INT8 step
    assert float((fixed.keys - keys).norm() / (approx - keys).norm()) < 0.02
    assert fixed.stored_bytes == 40 * 2 * 64 + 40 * 2 * 2 + 2 * 64 * 64 * 2  # int8 rows, fp16 scales, bf16 bases


def test_psac_lowers_query_weighted_error_and_is_causal():
    geometry = Geometry(1, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=gen)
    queries = torch.randn(6, 96, 64, generator=gen) * 0.2 + direction * 3  # queries look one way
    k, v = torch.randn(96, 2, 64, generator=gen), torch.randn(96, 2, 64, generator=gen)
    plain = reconstruct_sequence(codecs.get("kivi:bits=2,group=16"), k, v, geometry, 16, 32, queries=queries)
    psac = reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32, queries=queries)
    logit_error = lambda rec: float(((rec.k - k) @ direction).abs().mean())  # noqa: E731
    assert logit_error(psac) < 0.25 * logit_error(plain)
    assert psac.stored_bytes > plain.stored_bytes
    # Causality: queries after the first chunk's last token never change how that chunk is encoded.
    later = queries.clone()
    later[:, 32:] = torch.randn(6, 64, 64, generator=gen) * 5
    again = reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32, queries=later)
    assert torch.equal(again.k[:32], psac.k[:32])
    assert not torch.equal(again.k[32:], psac.k[32:])
    with pytest.raises(ValueError, match="queries"):
        reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32)


def test_page_relative_keys_are_stored_rotated_by_their_offset_in_the_page():
    """pagerope=true: a key at p0 + t is encoded as R(t) k (its pre-RoPE value rotated by its offset in
    the page), read back at its position, and the simulation of `kvbackend eval` uses the same frame."""
    with pytest.raises(SpecError, match="pick one"):
        codecs.get("kivi:bits=2,prerope=true,pagerope=true")
    codec = codecs.get("kivi:bits=2,group=16,sink=4,pagerope=true")
    assert codec.levers == Levers(sink=4, pagerope=True) and codecs.get(codec.spec_string).levers == codec.levers
    with pytest.raises(SpecError, match="pagerope=true stores keys before RoPE"):
        lever_cache("kivi:bits=2,group=16,pagerope=true", rotary=None)
    exact = lever_cache("identity:pagerope=true")
    rid, k, v = fill_levers(exact)
    for layer in range(2):
        assert torch.allclose(exact.read(rid, layer)[0], k[layer], atol=1e-4)  # the frame is orthonormal
    lossy = lever_cache("kivi:bits=2,group=16,pagerope=true")
    rid, k, v = fill_levers(lossy)
    plain = codecs.get("kivi:bits=2,group=16")
    starts = torch.arange(32) // 16 * 16  # each token's page start
    for layer in range(2):
        stored = ROTARY.derotate(k[layer, :32].transpose(0, 1), starts).transpose(0, 1)
        pre = ROTARY.derotate(k[layer, :32].transpose(0, 1), torch.arange(32)).transpose(0, 1)
        assert torch.allclose(stored, ROTARY.rotate(pre.transpose(0, 1), torch.arange(32) % 16).transpose(0, 1),
                              atol=1e-3)  # R(p0)^T R(p0 + t) k = R(t) k
        dk, _ = plain.decode(plain.encode(stored, v[layer, :32], plain.layout(lossy.geometry, 16)))
        want = ROTARY.rotate(dk.transpose(0, 1), starts).transpose(0, 1)
        assert torch.allclose(lossy.read_packed(rid, layer)[0], want, atol=1e-4)
        sim = reconstruct_sequence(lossy.codecs[layer], k[layer, :32], v[layer, :32], lossy.geometry, 16, 32, ROTARY)
        assert torch.allclose(sim.k, want, atol=1e-4)
    other = lever_cache("kivi:bits=2,group=16,prerope=true")
    assert other.fingerprint != lossy.fingerprint


@pytest.mark.parametrize("frame", ["", ",prerope=true", ",pagerope=true"])
def test_the_simulation_encodes_what_the_paged_cache_encodes_with_sinks(frame):
    """`kvbackend eval`'s simulation and the paged cache put tokens on the same pages and keep the sinks
    out of the codec alike, so their reconstructions agree (they differed by 10-30% with sinks before)."""
    spec = f"kivi:bits=2,group=16,sink=4,vrot=hadamard{frame}"
    cache = lever_cache(spec)
    rid, k, v = fill_levers(cache)
    for layer in range(2):
        rk, rv = cache.read_packed(rid, layer)
        sim = reconstruct_sequence(cache.codecs[layer], k[layer, :32], v[layer, :32], cache.geometry, 16, 32, ROTARY)
        assert torch.allclose(sim.k, rk, atol=1e-4) and torch.allclose(sim.v, rv, atol=1e-4)


def test_huge_sink_values_do_not_coarsen_the_rest_of_their_page():
    """Attention sinks often carry outsized keys; they are kept exact, and the codec never sees them, so
    the other tokens of page 0 decode as well as if the sinks were ordinary."""
    errors = []
    for boost in (1.0, 1000.0):
        cache = lever_cache("kivi:bits=2,group=16,sink=4")
        gen = torch.Generator().manual_seed(3)
        k, v = torch.randn(2, 40, 2, 64, generator=gen), torch.randn(2, 40, 2, 64, generator=gen)
        k[:, :4] *= boost
        v[:, :4] *= boost
        rid, _ = cache.add_request()
        for layer in range(2):
            cache.append(rid, layer, k[layer], v[layer])
        rk, rv = cache.read_packed(rid, 0)
        assert torch.equal(rk[:4], k[0, :4].half().float())  # the sinks themselves: exact
        errors.append(float((rk[4:16] - k[0, 4:16]).norm() + (rv[4:16] - v[0, 4:16]).norm()))
    assert errors[1] == pytest.approx(errors[0], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_simulation_matches_a_16_bit_cache_with_rope_frames(dtype):
    """The frame is computed in float32 on both sides, so a bf16/fp16 cache and the simulation encode
    the same codes (the simulation once de-rotated in the input's dtype: 20-60% of codes differed)."""
    for frame in ("prerope=true", "pagerope=true"):
        cache = KVCache(Geometry(1, 2, 64, dtype), CacheConfig(codec=f"kivi:bits=2,group=16,sink=4,{frame}",
                                                               page_size=16, chunk_pages=2, dense_pages=8,
                                                               packed_pages=8), rotary=ROTARY)
        gen = torch.Generator().manual_seed(1)
        k = ROTARY.rotate(torch.randn(2, 32, 64, generator=gen) * 3, torch.arange(32)).transpose(0, 1).to(dtype)
        v = torch.randn(32, 2, 64, generator=gen).to(dtype)
        rid, _ = cache.add_request()
        cache.append(rid, 0, k, v)
        rk, rv = cache.read_packed(rid, 0)
        sim = reconstruct_sequence(cache.codecs[0], k, v, cache.geometry, 16, 32, ROTARY)
        assert torch.equal(sim.k, rk) and torch.equal(sim.v, rv), frame


@pytest.mark.parametrize("rows,dim", [(1, 8), (2048, 8), (256, 64), (700, 128), (64, 256), (9000, 4), (3000, 16),
                                      (1500, 32)])
def test_value_rotation_is_the_hadamard_product_and_its_own_inverse(rows, dim, monkeypatch):
    """`rotate_values` is ``v @ hadamard(D)`` (to float32 rounding), undoes itself, and its torch butterflies and
    the fused CPU loop give the same bits (no sum reordered). Every shape but the first is large enough for the
    fused loop, which the test checks ran (where numba is installed)."""
    from kvbackend import fastquant

    gen = torch.Generator().manual_seed(rows)
    v = torch.randn(2, rows, dim, generator=gen) * torch.logspace(-3, 3, dim)
    if fastquant.numba is not None and rows > 1:
        assert fastquant.hadamard_rows(v.reshape(-1, dim), torch.tensor(0.5)) is not None
        # bfloat16 rows are widened inside the loop: the bits of widening them first
        half = v.bfloat16().reshape(-1, dim)
        widened = fastquant.hadamard_rows(half, torch.tensor(0.5))
        assert widened is not None and torch.equal(widened, fastquant.hadamard_rows(half.float(), torch.tensor(0.5)))
    fused = rotate_values(v.bfloat16())
    assert fused.dtype == torch.float32 and fused.shape == v.shape
    want = v.bfloat16().float() @ hadamard(dim)
    assert float((fused - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.allclose(rotate_values(fused), v.bfloat16().float(), rtol=1e-5, atol=1e-5 * float(v.abs().max()))
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    assert torch.equal(rotate_values(v.bfloat16()), fused)
    with pytest.raises(SpecError, match="power-of-two"):
        rotate_values(torch.zeros(3, 48))


@pytest.mark.parametrize("levers", ["vrot=hadamard", "sink=2", "prerope=true,vrot=hadamard"])
def test_the_stored_frame_into_callers_buffers_gives_the_same_bits(levers):
    """`LeverFrame.to_stored(..., out=)` writes the float32 frame into buffers the caller reuses (the value
    rotation's fused loop too) and returns the bits of the call without them; garbage left in the buffers changes
    nothing, and a buffer of another shape is refused."""
    from kvbackend import codecs, fastquant
    from kvbackend.frames import LeverFrame

    frame = LeverFrame(codecs.get(f"kivi:bits=2,group=16,{levers}").levers, ROTARY, 16)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(4, 256, 2, 64, generator=gen).bfloat16() for _ in range(2))  # 131072 values: the fused loop
    want = frame.to_stored(k, v, 0)
    out = (torch.full(k.shape, float("nan")), torch.full(v.shape, float("nan")))
    got = frame.to_stored(k, v, 0, out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if "vrot" in levers and fastquant.numba is not None:
        assert got[1].data_ptr() == out[1].data_ptr()  # written in place, no fresh tensor
    if "prerope" not in levers:
        assert got[0].data_ptr() == out[0].data_ptr()
    if fastquant.numba is not None:
        with pytest.raises(ValueError, match="out must be"):
            fastquant.hadamard_rows(v.reshape(-1, 64), torch.tensor(0.125), torch.empty(3, 64))


@pytest.mark.parametrize("levers", ["vrot=hadamard", "sink=2,vrot=hadamard", "prerope=true,vrot=hadamard"])
@pytest.mark.parametrize("spec", ["kivi:bits=2,group=16,kbits=4", "rtn:bits=2,group=32"])
def test_keys_as_given_encode_to_the_same_bytes(levers, spec):
    """`to_stored(..., keys_as_given=True)` leaves keys without a RoPE lever as given (bf16, no float32 copy) for
    codecs that read bf16 themselves (`any_float_input`); the pages are the bytes of the widened keys'. With
    pre-RoPE keys the rotation needs float32 and the flag changes nothing."""
    from kvbackend import codecs
    from kvbackend.frames import LeverFrame

    codec = codecs.get(f"{spec},{levers}")
    assert codec.any_float_input
    layout = codec.layout(Geometry(1, 2, 64, torch.bfloat16), 16)
    frame = LeverFrame(codec.levers, ROTARY, 16)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1024, 2, 64, generator=gen).bfloat16() for _ in range(2))  # 131072 values: the fused loops
    k[5, 1, 7] = 300.0  # a loud key channel: its group's step
    widened, given = frame.to_stored(k, v, 0), frame.to_stored(k, v, 0, keys_as_given=True)
    assert widened[0].dtype == torch.float32
    assert given[0].dtype == (torch.float32 if codec.levers.rope else torch.bfloat16)
    assert torch.equal(given[0].float(), widened[0]) and torch.equal(given[1], widened[1])
    assert torch.equal(codec.encode(*given, layout).pages, codec.encode(*widened, layout).pages)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_value_rotation_gives_the_same_bits_on_the_gpu():
    v = torch.randn(5000, 128)
    assert torch.equal(rotate_values(v.cuda()).cpu(), rotate_values(v))


def test_value_rotation_overflows_no_sooner_than_the_matrix_product():
    v = torch.full((3, 64), 3e37)  # the matrix product's largest entry is 8 x 3e37: finite; sums first would not be
    assert torch.isfinite(rotate_values(v)).all() and torch.isfinite(v @ hadamard(64)).all()


@pytest.mark.parametrize("levers", ["sink=4,vrot=hadamard,prerope=true", "pagerope=true", "vrot=hadamard", "sink=2"])
def test_a_chunk_of_several_layers_goes_to_the_stored_frame_as_each_layer_alone(levers):
    """`LeverFrame.to_stored` and `without_sinks` of ``[L, T, H, D]`` (one chunk of several layers, converted in one
    pass when the cache completes a chunk) give each layer's ``[T, H, D]`` conversion bit for bit, and the sink rows
    hold copies of the first token after them."""
    from kvbackend.frames import LeverFrame
    from kvbackend.levers import split_levers
    from kvbackend.rope import Rotary

    _, parsed = split_levers(dict(item.split("=") for item in levers.split(",")), "test")
    frame = LeverFrame(parsed, Rotary.default(64, 10000.0), 16)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(3, 32, 2, 64, generator=gen).bfloat16() for _ in range(2))
    for first in (0, 32, 96):
        ks, vs = frame.to_stored(k, v, first)
        for layer in range(3):
            one_k, one_v = frame.to_stored(k[layer], v[layer], first)
            assert torch.equal(ks[layer], one_k) and torch.equal(vs[layer], one_v), (layer, first)
    ks, vs = without_sinks(*frame.to_stored(k, v, 0), 4)
    for layer in range(3):
        one_k, one_v = without_sinks(*frame.to_stored(k[layer], v[layer], 0), 4)
        assert torch.equal(ks[layer], one_k) and torch.equal(vs[layer], one_v), layer
        assert torch.equal(one_k[:4], one_k[4:5].expand(4, -1, -1)) and torch.equal(one_k[4:], frame.to_stored(
            k[layer], v[layer], 0)[0][4:])
