"""The fused CPU quantizer (`kvbackend.fastquant`, numba) writes the bytes the torch path writes."""

import pytest
import torch

from kvbackend import codecs, fastquant, quant
from kvbackend.codecs.base import CodecState
from kvbackend.geometry import Geometry

pytestmark = pytest.mark.skipif(fastquant.numba is None, reason="numba not installed (the fused path is optional)")

STORES = [torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32]


def _both(monkeypatch, fn):
    """fn() with the fused path off, then on."""
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    off = fn()
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "1")
    return off, fn()


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _data(kind: str, shape, gen) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    if kind == "wide":  # groups of very different scales, some tiny, some large (up to about 400: within fp8
        # parameters' range; past it encodes refuse the values, `tests/test_value_range.py`)
        x = x * torch.logspace(-6, 1.9, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
        x = x.clamp(-440.0, 440.0)
    elif kind == "huge":  # scales up to 1e5: fp8 and fp16 parameters saturate (alike on both paths)
        x = x * torch.logspace(-6, 5, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    elif kind == "flat":  # constant groups (the smallest step), exact zeros, repeated values, signed zeros
        x = torch.where(torch.rand(*shape, generator=gen) < 0.5, torch.zeros(()), x.round())
        x[::3] = 1.5
        x[1::7] = -0.0
    elif kind == "ties":  # values on rounding ties of the step (round half to even must agree)
        x = (torch.randint(-40, 40, shape, generator=gen).float() + 0.5) / 8
    return x


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", ["normal", "wide", "huge", "flat", "ties"])
def test_quantize_is_byte_identical(monkeypatch, store, kind):
    gen = torch.Generator().manual_seed(hash((str(store), kind)) % 1000)
    x = _data(kind, (1024, 4, 2, 32), gen)
    assert x.numel() >= fastquant.MIN_VALUES and fastquant.enabled(x)
    for bits in (2, 3, 4, 8):
        for symmetric in (False, True):
            off, on = _both(monkeypatch, lambda: quant.quantize(x, bits, symmetric, store))
            assert torch.equal(off.codes, on.codes), (bits, symmetric)
            assert torch.equal(_bits_of(off.scale), _bits_of(on.scale))
            assert (off.zero is None) == (on.zero is None)
            if off.zero is not None:
                assert torch.equal(_bits_of(off.zero), _bits_of(on.zero))


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", ["normal", "wide", "huge", "flat", "ties"])
def test_clipped_quantize_is_byte_identical(monkeypatch, store, kind):
    """Clipped steps (parameters from torch's mean and deviation, codes from the fused loop): the same bytes."""
    gen = torch.Generator().manual_seed(hash((str(store), kind, "clip")) % 1000)
    x = _data(kind, (1024, 4, 2, 32), gen)
    x[5, 1] = 3e38  # a group whose mean and deviation overflow: min/max steps there
    for bits in (2, 3, 4, 8):
        for widen in (1.0, 1.15):
            off, on = _both(monkeypatch, lambda: quant.quantize(x, bits, False, store, clip=True, widen=widen))
            assert torch.equal(off.codes, on.codes), (bits, widen)
            assert torch.equal(_bits_of(off.scale), _bits_of(on.scale))
            assert torch.equal(_bits_of(off.zero), _bits_of(on.zero))
    codes = []
    monkeypatch.setattr(fastquant, "codes", lambda *args: codes.append(1) or None)  # the loop was asked (and fell back)
    quant.quantize(x, 2, False, store, clip=True)
    assert codes


@pytest.mark.parametrize("spec", ["rtn:bits=2,group=64,scale=fp8", "rtn:bits=4,group=32", "rtn:bits=2,group=128,symmetric=true",
                                  "kivi:bits=2,group=16", "kivi:bits=4,group=32", "rtn:bits=8,group=64,scale=bf16",
                                  "kivi:bits=2,group=32,kbits=4,scale=fp8", "kivi:bits=3,group=8",
                                  "qvg:bits=2,group=32,centroids=8,clip=true,vstep=1.15",
                                  "quantwm:kchannel=32,rank=0,centroids=8,clip=true,vcluster=false,outliers=4"])
def test_codec_pages_are_byte_identical(monkeypatch, spec):
    gen = torch.Generator().manual_seed(7)
    geometry = Geometry(1, 8, 128, torch.bfloat16)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 32)
    k = (torch.randn(509, 8, 128, generator=gen) * 3).bfloat16()  # a partial last page: padding copies
    k[:64] = _data("flat", (64, 8, 128), gen).bfloat16()  # constant groups, exact and signed zeros
    v = torch.randn(509, 8, 128, generator=gen).bfloat16()
    off, on = _both(monkeypatch, lambda: codec.encode(k, v, layout, CodecState()))
    assert torch.equal(off.pages, on.pages) and torch.equal(off.codebook, on.codebook)
    # the same values given as float32 (the float path of the loop) give the same bytes again
    wide = codec.encode(k.float(), v.float(), layout, CodecState())
    assert torch.equal(wide.pages, on.pages)


def test_small_inputs_take_the_torch_path():
    assert not fastquant.enabled(torch.randn(16, 64))  # below MIN_VALUES
    assert not fastquant.enabled(torch.randn(1024, 64).half())
    assert fastquant.enabled(torch.randn(1024, 64))
    assert fastquant.enabled(torch.randn(1024, 64).bfloat16())  # read as bits, no float32 copy


def test_non_finite_inputs_fall_back_to_torch(monkeypatch):
    x = torch.randn(1024, 64)
    x[100, 3] = float("nan")
    x[7, 0] = float("inf")
    assert fastquant.group_range(x) is None
    off, on = _both(monkeypatch, lambda: quant.quantize(x, 2, False, torch.float16))
    assert torch.equal(off.codes, on.codes)  # both the torch path (NaN codes are whatever torch makes)


def test_packed_matches_bitpack():
    from kvbackend import bitpack

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 128, generator=gen)
    for bits in fastquant.PACK_BITS:
        for symmetric in (False, True):
            lo, hi = fastquant.group_range(x.reshape(2048, 2, 64))
            scale, zero = quant.group_params(lo, hi, bits, symmetric, torch.float16)
            codes = fastquant.codes(x.reshape(2048, 2, 64), scale, zero, bits, symmetric).reshape(2048, 128)
            assert torch.equal(fastquant.packed(x, scale, zero, bits, 64, symmetric), bitpack.pack(codes, bits))


@pytest.mark.parametrize("spec", ["rtn:bits=2,group=64,scale=fp8", "rtn:bits=4,group=32", "rtn:bits=2,group=128,symmetric=true",
                                  "rtn:bits=8,group=64,scale=bf16", "rtn:bits=4,group=64,symmetric=true,scale=fp16",
                                  "kivi:bits=2,group=16", "kivi:bits=4,group=32,scale=fp8", "kivi:bits=2,group=32,kbits=4"])
@pytest.mark.parametrize("kind", ["normal", "wide", "flat"])
def test_decoded_pages_are_bit_identical(monkeypatch, spec, kind):
    """Decoding straight into bf16 gives the float32 reconstruction rounded by torch, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    geometry = Geometry(1, 8, 128, torch.bfloat16)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 32)
    k = _data(kind, (512, 8, 128), gen).bfloat16()
    v = _data("normal", (512, 8, 128), gen).bfloat16()
    chunk = codec.encode(k, v, layout, CodecState())
    off, on = _both(monkeypatch, lambda: codec.decode_pages(layout, chunk.pages, chunk.codebook))
    for a, b in zip(off, on):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert fastquant.decode_enabled(layout.page.view(chunk.pages, "k_codes"), codec.spec.bits, torch.bfloat16)


@pytest.mark.parametrize("spec", ["rtn:bits=2,group=2", "rtn:bits=2,group=6,symmetric=true", "rtn:bits=4,group=1",
                                  "rtn:bits=4,group=3", "rtn:bits=2,group=10", "kivi:bits=2,group=16,vbits=4"])
def test_groups_smaller_than_a_byte_or_straddling_bytes(monkeypatch, spec):
    """Groups need not fill whole bytes: the fused loop packs whole rows, as `bitpack.pack` does."""
    gen = torch.Generator().manual_seed(5)
    dim = 120 if spec.endswith("group=10") or spec.endswith("group=3") or "group=6" in spec else 128
    geometry = Geometry(1, 4, dim, torch.bfloat16)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 16)
    k = (torch.randn(256, 4, dim, generator=gen) * 2).bfloat16()
    v = torch.randn(256, 4, dim, generator=gen).bfloat16()
    off, on = _both(monkeypatch, lambda: codec.encode(k, v, layout, CodecState()))
    again = codec.encode(k, v, layout, CodecState())
    assert torch.equal(off.pages, on.pages) and torch.equal(on.pages, again.pages)


def test_flushed_subnormal_scales_do_not_raise(monkeypatch):
    """Constant groups get the smallest step; with denormals flushed it reads as zero, as in torch (no error)."""
    gen = torch.Generator().manual_seed(6)
    geometry = Geometry(1, 4, 128, torch.bfloat16)
    k = torch.randn(256, 4, 128, generator=gen).bfloat16()
    k[:16] = 0.0  # constant groups
    v = k.clone()
    monkeypatch.setattr(fastquant, "_broken", [])
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for spec in ("rtn:bits=4,group=32,scale=bf16", "rtn:bits=2,group=64,scale=fp32,symmetric=true"):
            codec = codecs.get(spec)
            layout = codec.layout(geometry, 16)
            off, on = _both(monkeypatch, lambda: codec.encode(k, v, layout, CodecState()))
            assert torch.equal(off.pages, on.pages)
        assert not fastquant._broken  # served by the compiled loops, not by a fallback after an error
    finally:
        torch.set_flush_denormal(False)  # torch's default


def test_switch_values_and_a_failing_loop_fall_back(monkeypatch):
    x = torch.randn(1024, 64)
    for value in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("KVBACKEND_FASTQUANT", value)
        assert not fastquant.enabled(x)
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "1")
    want = quant.quantize(x, 2, False, torch.float16)

    def broken(*args):
        raise ValueError("a damaged numba cache")

    monkeypatch.setattr(fastquant, "_codes", broken)
    monkeypatch.setattr(fastquant, "_broken", [])
    got = quant.quantize(x, 2, False, torch.float16)  # the torch path, same bytes
    assert torch.equal(got.codes, want.codes) and fastquant._broken and not fastquant.enabled(x)


def test_clipped_groups_of_huge_values_stay_finite():
    """Values near float32's limit overflow the clip statistics: their groups keep min/max steps (no NaN)."""
    x = torch.full((64, 32), 3.0e38)
    x[:, ::2] = -3.0e38
    q = quant.quantize(x, 2, False, torch.float16, clip=True)
    assert torch.isfinite(q.scale.float()).all() and torch.isfinite(q.zero.float()).all()


@pytest.mark.parametrize("spec,k_mode", [("rtn:bits=2,group=64,scale=fp8", "tokens"),
                                         ("rtn:bits=4,group=32,symmetric=true", "tokens"),
                                         ("rtn:bits=8,group=64,scale=bf16", "tokens"), ("rtn:bits=2,group=10", "tokens"),
                                         ("kivi:bits=2,group=16", "channels"), ("kivi:bits=4,group=32,scale=fp8", "channels")])
@pytest.mark.parametrize("kind", ["normal", "wide", "flat"])
def test_float32_group_decodes_are_bit_identical(monkeypatch, spec, k_mode, kind):
    """`decode_token_groups` / `decode_channel_groups` into float32 (what QVG and QuantWM add centroids and PSAC
    rows to) from the fused loops equal torch's `dequantize`, bit for bit."""
    from kvbackend.codecs.groups import decode_channel_groups, decode_token_groups

    gen = torch.Generator().manual_seed(13)
    dim = 120 if spec.endswith("group=10") else 128
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, 8, dim, torch.bfloat16), 32)
    k = _data(kind, (512, 8, dim), gen).bfloat16()
    chunk = codec.encode(k, _data("normal", (512, 8, dim), gen).bfloat16(), layout, CodecState())
    s = codec.spec
    calls = [lambda: decode_token_groups(layout, chunk.pages, "v", s.bits, s.group)]
    if k_mode == "channels":
        calls.append(lambda: decode_channel_groups(layout, chunk.pages, "k", s.bits, s.group))
    else:
        calls.append(lambda: decode_token_groups(layout, chunk.pages, "k", s.bits, s.group))
    for call in calls:
        off, on = _both(monkeypatch, call)
        assert off.dtype == on.dtype == torch.float32 and torch.equal(off.view(torch.int32), on.view(torch.int32))
    assert fastquant.decode_enabled(layout.page.view(chunk.pages, "k_codes"), s.bits, None)


@pytest.mark.parametrize("spec", ["qvg:kchannel=16,vcluster=false,cdtype=fp8",
                                  "quantwm:kchannel=32,rank=4,centroids=8,vcluster=false,clip=true"])
def test_centroid_codecs_reconstruct_the_same_with_the_fused_loops(monkeypatch, spec):
    gen = torch.Generator().manual_seed(17)
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, 8, 128, torch.bfloat16), 32)
    k, v = _data("wide", (512, 8, 128), gen).bfloat16(), _data("normal", (512, 8, 128), gen).bfloat16()
    chunk = codec.encode(k, v, layout, CodecState(query_moment=torch.eye(128).expand(8, 128, 128).contiguous()))
    off, on = _both(monkeypatch, lambda: codec.decode_pages(layout, chunk.pages, chunk.codebook))
    for a, b in zip(off, on):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fp8_to_float_gives_torch_conversion_of_every_byte(monkeypatch):
    every = torch.arange(256, dtype=torch.uint8).repeat(200).view(torch.float8_e4m3fn).reshape(40, 10, 128)
    off, on = _both(monkeypatch, lambda: fastquant.fp8_to_float(every))
    assert on.shape == every.shape and on.dtype == torch.float32
    assert torch.equal(_bits_of(on), _bits_of(every.float()))  # NaN bytes and signed zeros included
    assert torch.equal(_bits_of(off), _bits_of(on))
    strided = every.transpose(0, 2)  # not contiguous
    assert torch.equal(_bits_of(fastquant.fp8_to_float(strided)), _bits_of(strided.float()))
    other = torch.randn(64, 1024, dtype=torch.bfloat16)  # other dtypes are converted by torch
    assert torch.equal(fastquant.fp8_to_float(other), other.float())
