"""K/V beyond what a cache stores and reads faithfully are refused, never saturated.

Before: the fp8 codec clamped values past 448, fp8 scales and zeros (`scale=fp8`, qvg's residuals) saturated past
a few hundred, and the Triton attention read float32/bf16 K/V as float16 (past 65504: inf, then NaN logits), all
without a word. Each of these is now an InvalidKV naming the bound and what sets it, at `append` (nothing written)
and at `Codec.encode` (the storage adapters' path). qvg's residual groups are checked where their parameters are
computed: their residuals, not the values, are what saturates."""

import math

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.errors import InvalidKV

GEOM = Geometry(1, 2, 64, torch.bfloat16)


def cache(codec, dtype=torch.bfloat16, backend="auto"):
    # the Triton backend on the GPU where there is one (else in Triton's interpreter on the CPU)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return KVCache(Geometry(1, 2, 64, dtype), CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=8,
                                                          packed_pages=8, device=device, backend=backend))


def relative_error(codec, peak, dtype=torch.bfloat16, backend="auto"):
    """Write 40 tokens whose keys and values reach ``peak`` (one chunk of 32 completes and is encoded), read the
    chunk back: the relative error of keys and values."""
    c = cache(codec, dtype, backend)
    rid, _ = c.add_request()
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 40, 2, 64, generator=gen) * 0.3).clamp(-1, 1).to(dtype)  # within [-1, 1]
    k[0, 0, 0], v[0, 0, 0] = 1.0, -1.0
    k, v = (k.float() * peak).to(dtype), (v.float() * peak).to(dtype)
    c.append(rid, 0, k.to(c.dense.data.device), v.to(c.dense.data.device))
    rk, rv = (x.cpu() for x in c.read(rid, 0))
    return max(((rk[:32].float() - k[:32].float()).norm() / k[:32].float().norm()).item(),
               ((rv[:32].float() - v[:32].float()).norm() / v[:32].float().norm()).item())


# (spec, the bound of keys and values)
BOUNDS = [
    ("fp8", 448.0),
    ("fp16", 65504.0),
    ("rtn:bits=2,scale=fp8", 448.0),
    ("rtn:bits=4,symmetric=true,scale=fp8", 7 * 448.0),
    ("kivi:bits=2,group=16,scale=fp8", 448.0),
]


@pytest.mark.parametrize("spec,bound", BOUNDS)
def test_codec_bounds(spec, bound):
    assert codecs.get(spec).stored_max_abs(GEOM) == (bound, bound)


@pytest.mark.parametrize("spec,bound", BOUNDS)
def test_values_past_the_bound_are_refused_and_nothing_is_written(spec, bound):
    within = relative_error(spec, bound * 0.98)
    assert within < 3 * relative_error(spec, 1.0) + 0.01  # as faithful as at unit scale: nothing saturated
    c = cache(spec)
    rid, _ = c.add_request()
    big = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    big[1, 1, 5] = bound * 1.05
    for k, v, name in ((big, torch.zeros_like(big), "K"), (torch.zeros_like(big), -big, "V")):
        with pytest.raises(InvalidKV, match=f"{name} holds values up to .* beyond the"):
            c.append(rid, 0, k, v)
    assert c.num_tokens(rid) == 0
    c.check()


def test_the_fp8_codec_saturated_before():
    """The case that was served: values of 600 came back as 448, silently."""
    with pytest.raises(InvalidKV, match="448"):
        relative_error("fp8", 600.0)


@pytest.mark.parametrize("spec", ["identity", "bf16", "fp16"])
def test_float_codecs_that_hold_the_cache_dtype(spec):
    assert relative_error(spec, 3e4) < 1e-2


def test_levers_shrink_the_bound_by_their_rotations():
    plain = codecs.get("rtn:bits=2,scale=fp8").max_abs(GEOM)
    assert codecs.get("rtn:bits=2,scale=fp8,prerope=true").max_abs(GEOM) == (plain[0] / math.sqrt(2), plain[1])
    assert codecs.get("rtn:bits=2,scale=fp8,vrot=hadamard").max_abs(GEOM) == (plain[0], plain[1] / 8)  # sqrt(64)
    # a Hadamard rotation can gather a token's channels into one: all at 448/8 * 1.02 would overflow after it
    with pytest.raises(InvalidKV, match="V holds"):
        relative_error("rtn:bits=2,scale=fp8,vrot=hadamard", 448 / 8 * 1.05)


def test_codec_encode_refuses_values_past_the_bound():
    """The storage adapters encode pages with `Codec.encode` / `encode_units`: the same bound, before any byte."""
    codec = codecs.get("kivi:bits=2,group=16,scale=fp8")
    layout = codec.layout(GEOM, 16)
    k = torch.zeros(16, 2, 64)
    k[3, 0, 7] = 500.0
    with pytest.raises(InvalidKV, match="K holds values up to 500"):
        codec.encode(k, torch.zeros_like(k), layout)
    with pytest.raises(InvalidKV, match="V holds values up to 500"):
        codec.encode_units(torch.zeros_like(k)[None], k[None], layout)
    codec.encode(k / 2, torch.zeros_like(k), layout)  # 250 fits


def test_the_triton_backend_reads_at_most_float16s_range():
    """The Triton attention reads K/V as float16: a bf16 or float32 cache on it refuses values past 65504 (they
    became NaN logits), the torch backend (float32 reads) takes them."""
    pytest.importorskip("triton")
    peak = 1.0e5
    for dtype in (torch.bfloat16, torch.float32):
        assert relative_error("identity", peak, dtype, backend="torch") == 0
        c = cache("identity", dtype, backend="triton")
        assert c.kv_limits[0][:2] == (65504.0, 65504.0)
        assert "float16" in c.kv_limits[0][2]
        with pytest.raises(InvalidKV, match="65504"):
            relative_error("identity", peak, dtype, backend="triton")
    assert cache("identity", torch.float16, backend="triton").kv_limits[0][:2] == (math.inf, math.inf)


def test_nan_is_still_named_as_nan():
    c = cache("rtn:bits=2,scale=fp8")
    rid, _ = c.add_request()
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    k[0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        c.append(rid, 0, k, torch.zeros_like(k))
    codec = codecs.get("rtn:bits=2,scale=fp8")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        codec.encode(k.float()[:1].expand(16, 2, 64), torch.zeros(16, 2, 64), codec.layout(GEOM, 16))


def test_qvg_refuses_residuals_past_its_fp8_parameters_not_large_values():
    """qvg's residual scales and zeros are fp8 by default: a residual past 448 saturated them. A large value is no
    reason to refuse (a key channel's constant offset goes into the centroids); a large residual is."""
    codec = codecs.get("qvg")
    assert codec.stored_max_abs(GEOM) == (math.inf, math.inf)
    layout = codec.layout(GEOM, 16)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(32, 2, 64, generator=gen)
    k[:, :, 3] += 3000.0  # an offset: the centroids take it
    kh, _ = codec.decode(codec.encode(k, torch.randn(32, 2, 64, generator=gen), layout))
    assert (kh - k).abs().max() < 16.0  # bf16 centroids step by 16 near 3000: residuals of a few units
    wild = torch.randn(32, 2, 64, generator=gen) * 3000.0  # residuals of thousands
    with pytest.raises(InvalidKV, match="the largest its float8_e4m3fn parameters hold"):
        codec.encode(wild, torch.randn(32, 2, 64, generator=gen), layout)
    wide = codecs.get("qvg:scale=fp16")
    kh, _ = wide.decode(wide.encode(wild, torch.randn(32, 2, 64, generator=gen), wide.layout(GEOM, 16)))
    assert ((kh - wild).norm() / wild.norm()).item() < 0.5


def test_a_kvcache_chunk_whose_residuals_would_saturate_stays_dense_and_exact(caplog):
    c = cache("qvg")
    rid, _ = c.add_request()
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 40, 2, 64, generator=gen) * 3000.0).bfloat16()
    c.append(rid, 0, k, v)  # the chunk's encode fails at its completion: logged, the chunk stays dense
    assert "parameters hold: it would saturate" in caplog.text
    rk, rv = c.read(rid, 0)  # exact, never saturated
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert c.page_table(rid).packed == []
    c.check()
