"""The fused CPU decode of QVG-family pages (`kvbackend.fastdecode`, numba) gives the torch decode's bits.

The reference is the codec's own `decode_units` (rounded to bf16, as the storage backends take it), then, for
``vrot=hadamard``, `rotate_values` of those bf16 values rounded to bf16 again (`LeverFrame.from_stored`). The
comparison is bit for bit: both paths make the same float32 operations in the same order, so no tolerance.
"""

import math

import pytest
import torch

from kvbackend import codecs, fastquant
from kvbackend.codecs.base import CodecState
from kvbackend.codecs.qvg_fused import decode_units_bf16
from kvbackend.geometry import Geometry
from kvbackend.levers import rotate_values
from kvbackend.psac import query_second_moment

pytestmark = pytest.mark.skipif(fastquant.numba is None, reason="numba not installed (the fused path is optional)")


def _reference(codec, layout, pages, books, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = codec.decode_units(layout, pages, books)  # bf16, as `Codec.decode_units` gives them
    if rotate:
        v = rotate_values(v).to(torch.bfloat16)
    return k, v


def _encoded(spec: str, heads: int, dim: int, page_size: int, units: int, queries: bool, seed: int):
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, heads, dim, torch.bfloat16), page_size)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(1, 1, heads, dim, generator=gen))  # outlier channels, as real keys have
    k = (torch.randn(units, page_size, heads, dim, generator=gen) * scale).bfloat16()
    v = torch.randn(units, page_size, heads, dim, generator=gen).bfloat16()
    states = None
    if queries:  # query statistics: QuantWM stores non-zero PSAC rows
        q = torch.randn(2 * heads, page_size, dim, generator=gen) * torch.linspace(0.1, 3.0, dim)
        states = [CodecState(query_moment=query_second_moment(q, heads)) for _ in range(units)]
    pages, books = codec.encode_units(k, v, layout, states)
    return codec, layout, pages.reshape(units, -1), books.reshape(units, -1)


def _check(codec, layout, pages, books, rotate: bool, groups: int = 1) -> None:
    want_k, want_v = _reference(codec, layout, pages, books, rotate)
    got = decode_units_bf16(codec, layout, pages, books, rotate, groups)
    assert got is not None, "the fused decode did not serve"
    h, d = want_k.shape[1:]
    assert torch.equal(got[:, 0].reshape(-1, h, d).view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(got[:, 1].reshape(-1, h, d).view(torch.int16), want_v.view(torch.int16))


SPECS = [
    # the recommended recipe's page codec, and its neighbours: outliers off, bf16 centroids, clustered values
    "quantwm:kchannel={p},centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16",
    "quantwm:kchannel={p},centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=0",
    "quantwm:kchannel={p},centroids=16,clip=true,vcluster=false,cdtype=bf16,outliers=8",
    "quantwm:centroids=16,cdtype=fp8,outliers=4,rank=4,keep=0.25",
    "quantwm:kchannel=8,centroids=8,cdtype=bf16,rank=0,stages=2,bits=4",
    "qvg:centroids=16,cdtype=fp8,stages=2,symmetric=true",
    "qvg:centroids=8,kchannel={p},bits=8,group=32,vcluster=false",
    "qvg:centroids=16,kbits=4,vbits=2,cdtype=bf16",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dim,heads,page_size", [(128, 8, 64), (64, 3, 16), (128, 2, 16), (64, 4, 64)])
@pytest.mark.parametrize("rotate", [False, True])
def test_fused_decode_is_bit_identical(spec, dim, heads, page_size, rotate):
    spec = spec.format(p=page_size)
    units = max(2, math.ceil(fastquant.MIN_VALUES / (page_size * heads * dim)))
    codec, layout, pages, books = _encoded(spec, heads, dim, page_size, units, queries=False, seed=dim + page_size)
    _check(codec, layout, pages, books, rotate)


@pytest.mark.parametrize("spec", ["quantwm:kchannel=16,centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16,rank=4",
                                  "quantwm:centroids=16,cdtype=fp8,outliers=4,rank=8,keep=0.25"])
def test_fused_decode_with_psac_rows(spec):
    """Chunks with query statistics store non-zero PSAC rows: the fused loop adds the codec's own correction."""
    codec, layout, pages, books = _encoded(spec, 4, 64, 16, 16, queries=True, seed=3)
    assert not codec.psac_is_zero(layout, pages, books)
    _check(codec, layout, pages, books, rotate=True)


@pytest.mark.parametrize("spec", ["quantwm:kchannel=16,centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16,rank=4,"
                                  "keep=0.125,whole=2",
                                  "quantwm:centroids=16,cdtype=fp8,rank=0,whole=1"])
@pytest.mark.parametrize("queries", [False, True])
def test_fused_decode_with_whole_keys(spec, queries):
    """Whole keys join the PSAC rows in the one correction the fused loop adds (`QuantWMCodec.key_fix`)."""
    codec, layout, pages, books = _encoded(spec, 4, 64, 16, 16, queries=queries, seed=4)
    assert bool(layout.page.view(pages, "k_whole_scale").float().abs().gt(0).any())
    _check(codec, layout, pages, books, rotate=True)


def test_groups_are_storage_blobs():
    """``groups``: each group of consecutive units is one blob's layers, K then V."""
    codec, layout, pages, books = _encoded(SPECS[0].format(p=16), 2, 128, 16, 12, queries=False, seed=5)
    _check(codec, layout, pages, books, rotate=True, groups=4)


def test_negative_zero_becomes_positive_as_torch_adds_the_zero_correction():
    """With an all-zero PSAC correction torch still adds +0, which turns a -0 key into +0: so does the fused loop."""
    spec = "quantwm:kchannel=16,centroids=4,cdtype=fp8,outliers=2,rank=4"
    codec, layout, pages, books = _encoded(spec, 2, 128, 16, 8, queries=False, seed=9)
    page, book = layout.page, layout.codebook
    page.view(pages, "k_codes").zero_()
    page.view(pages, "k_scales").view(torch.uint8).fill_(0x80)  # e4m3 -0: 0 x -0 + -0, every residual is -0
    page.view(pages, "k_zeros").view(torch.uint8).fill_(0x80)
    book.view(books, "k_centroids").view(torch.uint8).fill_(0x80)  # -0 centroids keep it -0
    k_ref, _ = _reference(codec, layout, pages, books, rotate=False)
    assert int((k_ref.view(torch.int16) == 0).sum()) > k_ref.numel() // 2  # +0 after the correction
    _check(codec, layout, pages, books, rotate=True)


def test_damaged_indices_take_the_torch_path():
    codec, layout, pages, books = _encoded(SPECS[0].format(p=16), 2, 128, 16, 8, queries=False, seed=11)
    layout.page.view(pages, "k_out_index")[0, 0, 0] = -1
    assert decode_units_bf16(codec, layout, pages, books, True, 1) is None
    codec, layout, pages, books = _encoded(SPECS[0].format(p=16), 2, 128, 16, 8, queries=False, seed=11)
    layout.page.view(pages, "k_assign")[0, 0, 0, 0] = 200  # beyond the 32 centroids
    assert decode_units_bf16(codec, layout, pages, books, True, 1) is None


def test_off_switch_takes_the_torch_path(monkeypatch):
    codec, layout, pages, books = _encoded(SPECS[0].format(p=16), 2, 128, 16, 8, queries=False, seed=13)
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    assert decode_units_bf16(codec, layout, pages, books, True, 1) is None


def test_a_nan_scale_decodes_to_nan_where_the_torch_path_does(monkeypatch):
    """Only a crafted page holds a NaN scale (encoders refuse non-finite values); it decodes to NaN on both paths, in
    the same places, and every other value to the same bits. (The NaN bits differ: the fused loop writes 0x7FC0, torch's
    vectorized CPU rounding to bf16 0xFFFF on some builds, its scalar rounding 0x7FC0.)"""
    spec = "quantwm:kchannel=16,centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16"
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, 2, 128, torch.bfloat16), 16)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(8 * 16, 2, 128, generator=gen).bfloat16() for _ in range(2))
    pages, books = codec.encode_units(k.view(8, 16, 2, 128), v.view(8, 16, 2, 128), layout)
    pages, books = pages.reshape(8, -1), books.reshape(8, -1)
    layout.page.view(pages, "k_scales").view(torch.uint8)[0, 0, 0, 0] = 0x7F  # e4m3 NaN
    got = decode_units_bf16(codec, layout, pages, books, False, 1)
    assert got is not None
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    want, _ = codec.decode_units(layout, pages, books)
    assert torch.isnan(want.float()).any()
    got = got[:, 0].reshape(want.shape)
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
