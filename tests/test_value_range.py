"""K/V beyond what a cache stores and reads faithfully are refused, never saturated.

Before: the fp8 codec clamped values past 448, fp8 and fp16 scales and zeros (`scale=fp8`, qvg's residuals)
saturated, the sinks of a float32 cache were clamped to fp16, and the Triton attention read float32/bf16 K/V as
float16 (past 65504: inf, then NaN logits), all without a word. Now:
- a value no chunk can store (the fp8/fp16 codecs' values; K/V past 65504 for the Triton attention) is refused at
  `append` with an InvalidKV naming the bound, and nothing is written;
- a chunk whose encode saturated a float field (a group's scale or zero, a centroid scale: it depends on the chunk)
  is refused once encoded (`kvbackend.saturation`), on every encode path (torch, fused CPU loops, the kernels): in
  a `KVCache` the chunk stays dense (exact) and the failure is logged; `Codec.encode` raises."""

import logging

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.errors import InvalidKV
from kvbackend.saturation import saturated_fields

GEOM = Geometry(1, 2, 64, torch.bfloat16)


def cache(codec, dtype=torch.bfloat16, backend="auto", check_finite=True):
    # the Triton backend on the GPU where there is one (else in Triton's interpreter on the CPU)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return KVCache(Geometry(1, 2, 64, dtype), CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=8,
                                                          packed_pages=8, device=device, backend=backend,
                                                          check_finite=check_finite))


def fill(codec, peak, dtype=torch.bfloat16, backend="auto", check_finite=True, offset=0.0):
    """Append 40 tokens whose keys and values reach ``peak`` (plus ``offset`` on key channel 3), one layer, so a
    chunk of 32 completes. Returns (the cache, the relative error of the chunk's keys and values, K, V)."""
    c = cache(codec, dtype, backend, check_finite)
    rid, _ = c.add_request()
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 40, 2, 64, generator=gen) * 0.3).clamp(-1, 1)  # within [-1, 1]
    k[0, 0], v[0, 0] = 1.0, -1.0
    k, v = (k * peak), (v * peak)
    k[:, :, 3] += offset
    k, v = k.to(dtype), v.to(dtype)
    device = c.dense.data.device
    c.append(rid, 0, k.to(device), v.to(device))
    rk, rv = (x.cpu().float() for x in c.read(rid, 0))
    error = max(((rk[:32] - k[:32].float()).norm() / k[:32].float().norm()).item(),
                ((rv[:32] - v[:32].float()).norm() / v[:32].float().norm()).item())
    return c, error, k, v


@pytest.mark.parametrize("spec,bound", [("fp8", 432.0), ("fp16", 65488.0)])
def test_float_codecs_refuse_values_they_cannot_store_at_append(spec, bound):
    """Below the midpoint of the dtype's two largest values a value rounds below the largest; past it, refused."""
    assert codecs.get(spec).stored_max_abs(GEOM) == (bound, bound)
    c, error, _, _ = fill(spec, bound * 0.99)
    assert c.page_table(0).packed and error < 0.05  # stored: fp8 rounding only
    c = cache(spec)
    rid, _ = c.add_request()
    big = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    big[1, 1, 5] = bound * 1.05
    for k, v, name in ((big, torch.zeros_like(big), "K"), (torch.zeros_like(big), -big, "V")):
        with pytest.raises(InvalidKV, match=f"{name} holds values up to .* beyond the"):
            c.append(rid, 0, k, v)
    assert c.num_tokens(rid) == 0
    c.check()


def test_the_fp8_codec_clamped_before():
    """The case that was served: values of 600 came back as 448, silently."""
    with pytest.raises(InvalidKV, match="432"):
        fill("fp8", 600.0)


@pytest.mark.parametrize("spec", ["rtn:bits=2,scale=fp8", "rtn:bits=4,symmetric=true,scale=fp8",
                                  "kivi:bits=2,group=16,scale=fp8", "qvg", "qvg:cdtype=fp8,scale=fp16",
                                  "quantwm:vcluster=false,outliers=4", "rtn:bits=2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_chunk_that_saturates_a_field_stays_dense_and_exact(spec, backend, caplog):
    """Scales and zeros saturated past their dtype (fp8: 448; fp16: 65504) on every encode path, the Triton encode
    kernels' too. Now the chunk stays dense (exact reads) and the failure is logged."""
    if backend == "triton":
        pytest.importorskip("triton")
        if not codecs.get(spec).kernel_encodes and "rtn:bits=2" != spec:
            pytest.skip("the reference encodes this spec on the Triton backend too")
    peak = 1.0e5 if spec == "rtn:bits=2" or "scale=fp16" in spec else 3.0e3  # fp16 parameters: past 65504; fp8: 448
    try:
        c, error, k, v = fill(spec, peak, backend=backend)
    except InvalidKV as exc:  # the Triton attention's float16 range refuses it first
        assert backend == "triton" and "float16" in str(exc)
        return
    assert "saturated" in caplog.text
    assert c.page_table(0).packed == [] and error == 0.0  # dense: the values as appended
    c.check()


def test_positive_peaks_of_asymmetric_groups_are_no_reason_to_refuse():
    """An asymmetric group's zero is its minimum: a large positive offset (a key channel's bias) fits fp8
    parameters as long as the group's range does."""
    c, error, _, _ = fill("rtn:bits=4,scale=fp8", 1.0, offset=1500.0)
    assert c.page_table(0).packed  # encoded: nothing saturated
    _, unit, _, _ = fill("rtn:bits=4,scale=fp8", 1.0)
    assert error < 0.05 + unit


def test_check_finite_off_still_refuses_saturated_chunks(caplog):
    c, error, _, _ = fill("rtn:bits=2,scale=fp8", 3.0e3, check_finite=False)
    assert "saturated" in caplog.text and c.page_table(0).packed == [] and error == 0.0


def test_sinks_of_a_float32_cache_past_fp16_stay_dense(caplog):
    """A float32 cache keeps its sinks in fp16 fields: values past 65504 were clamped to it."""
    c = cache("identity:sink=4", torch.float32)
    rid, _ = c.add_request()
    k, v = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    k[1, 1, 3], v[2, 0, 0] = 1.0e5, -2.0e5
    with caplog.at_level(logging.ERROR):
        c.append(rid, 0, k, v)
    assert "sink tokens hold values past the 65504" in caplog.text
    rk, rv = c.read(rid, 0)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_codec_encode_names_the_saturated_fields():
    codec = codecs.get("kivi:bits=2,group=16,scale=fp8")
    layout = codec.layout(GEOM, 16)
    k = torch.zeros(16, 2, 64)
    k[3, 0, 7] = -500.0
    with pytest.raises(InvalidKV, match=r"saturated k_zeros \(float8_e4m3fn\)"):
        codec.encode(k, torch.zeros_like(k), layout)
    with pytest.raises(InvalidKV, match=r"saturated v_zeros"):
        codec.encode_units(torch.zeros_like(k)[None], k[None], layout)
    chunk = codec.encode(k / 2, torch.zeros_like(k), layout)  # -250 fits
    assert saturated_fields(layout, chunk.pages, chunk.codebook) == []


def test_the_triton_backend_reads_at_most_float16s_range():
    """The Triton attention reads K/V as float16: a bf16 or float32 cache on it refuses values past 65504 (they
    became NaN logits), the torch backend (float32 reads) takes them."""
    pytest.importorskip("triton")
    peak = 1.0e5
    for dtype in (torch.bfloat16, torch.float32):
        assert fill("identity", peak, dtype, backend="torch")[1] == 0
        c = cache("identity", dtype, backend="triton")
        assert c.kv_limits[0][:2] == (65504.0, 65504.0)
        assert "float16" in c.kv_limits[0][2]
        with pytest.raises(InvalidKV, match="65504"):
            fill("identity", peak, dtype, backend="triton")
    assert cache("identity", torch.float16, backend="triton").kv_limits[0][:2] == (65504.0, 65504.0)  # its own range


def test_nan_is_still_named_as_nan():
    c = cache("fp8")
    rid, _ = c.add_request()
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    k[0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        c.append(rid, 0, k, torch.zeros_like(k))
    q = torch.zeros(3, 4, 64)
    q[2, 3, 1] = float("inf")
    with pytest.raises(InvalidKV, match="queries contain NaN or Inf"):  # in the same read as K/V's bound
        c.append(rid, 0, torch.zeros_like(k), torch.zeros_like(k), queries=q)
    c.append(rid, 0, torch.zeros_like(k), torch.full_like(k, 400.0), queries=q.nan_to_num(posinf=1e30))  # finite
    assert c.num_tokens(rid) == 3


def test_the_fp8_codec_past_its_bound_is_refused_by_the_encode_itself():
    """`Codec.encode` leaves value bounds to the saturation read: a value between 432 and 448 rounds to 448 and one
    past 448 is clamped to it; both are refused once encoded (only `KVCache.append` refuses them before)."""
    codec = codecs.get("fp8")
    layout = codec.layout(GEOM, 16)
    for peak in (440.0, 600.0, -1.0e4):
        k = torch.zeros(16, 2, 64)
        k[3, 1, 9] = peak
        with pytest.raises(InvalidKV, match=r"saturated k \(float8_e4m3fn\)"):
            codec.encode(k, torch.zeros_like(k), layout)
        with pytest.raises(InvalidKV, match=r"saturated v \(float8_e4m3fn\)"):
            codec.encode_units(torch.zeros_like(k)[None], k[None], layout)
    chunk = codec.encode(torch.full((16, 2, 64), 416.0), torch.zeros(16, 2, 64), layout)  # 416: fp8's next below
    assert torch.equal(codec.decode_pages(layout, chunk.pages, chunk.codebook)[0], torch.full((16, 2, 64), 416.0))


@pytest.mark.parametrize("spec,field", [("heads:base=kivi:group=16;scale=fp8,kbits=2-3", "h1.k_zeros"),
                                        ("heads:base=kivi:group=16;scale=fp8;bits=2,vbits=2-4", "h0.v_zeros"),
                                        ("heads:base=qvg:centroids=2;cdtype=fp8;scale=fp8,stages=1-2", "h1.")])
def test_heads_specs_refuse_saturated_fields_of_each_head(spec, field):
    """A heads: spec stores each head's page as opaque bytes: its heads' fp8 fields were never read, so a
    saturated scale or zero of one head was served (before: no error)."""
    codec = codecs.get(spec)
    layout = codec.layout(GEOM, 16)
    k, v = torch.randn(16, 2, 64) * 0.1, torch.randn(16, 2, 64) * 0.1
    chunk = codec.encode(k, v, layout)
    assert codec.decode_pages(layout, chunk.pages, chunk.codebook)[0].isfinite().all()
    x = v if "v_" in field else k
    x[:, int(field[1])] *= 3.0e4  # that head's K or V: its fp8 scales or zeros past 448
    with pytest.raises(InvalidKV, match=f"saturated .*{field}"):
        codec.encode(k, v, layout)
    with pytest.raises(InvalidKV, match=f"saturated .*{field}"):
        codec.encode_units(k[None], v[None], layout)


def test_rows_read_only_the_chunks_pages_of_a_pool():
    """`TritonBackend.encode_chunk` reads the float fields of the chunk's pages in place in the pool (``rows``),
    not a copy of whole pages: the same answer as reading the gathered pages, and a saturated page outside the
    rows is not the chunk's."""
    from kvbackend.saturation import codec_saturated_fields

    codec = codecs.get("kivi:bits=2,group=16,scale=fp8")
    layout = codec.layout(GEOM, 16)
    good = codec.encode(torch.randn(32, 2, 64), torch.randn(32, 2, 64), layout)
    pool = torch.zeros(6, layout.page_bytes, dtype=torch.uint8)
    pool[[4, 1]] = good.pages
    big = good.pages[0].clone()
    layout.page.view(big, "v_zeros").fill_(448.0)  # a page saturated by hand: fp8's largest value
    pool[2] = big
    for rows, expect in ((torch.tensor([4, 1]), []), (torch.tensor([1, 2]), ["v_zeros"]), (None, ["v_zeros"])):
        assert codec_saturated_fields(codec, layout, pool, good.codebook, rows) == expect
        gathered = pool if rows is None else pool[rows]
        assert saturated_fields(layout, gathered, good.codebook) == expect
