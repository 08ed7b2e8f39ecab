"""Stored units (one-page chunks with their own codebooks) decoded by the gather kernel (`kvbackend.unit_gather`)
against the torch reference (`Codec.decode_units`, then the frame's value rotation): Triton's interpreter on the CPU,
the kernels on CUDA, odd head counts and several levers."""

import pytest
import torch

from kvbackend.codecs import get as get_codec
from kvbackend.frames import LeverFrame
from kvbackend.geometry import Geometry
from kvbackend.unit_gather import UnitGather

CODECS = [
    "qvg:centroids=4,group=16",
    "quantwm:centroids=4,group=16,keep=0.5,outliers=4,rank=4,vrot=hadamard",
    "quantwm:kchannel=16,rank=4,keep=0.25,centroids=8,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=3",
    "quantwm:centroids=4,group=16,rank=0,whole=2",
]


def units_of(spec: str, heads: int, head_dim: int, page: int, units: int, device: str, seed: int = 0):
    codec = get_codec(spec)
    layout = codec.layout(Geometry(1, heads, head_dim, torch.bfloat16), page)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(units, page, heads, head_dim, generator=gen)
    k[..., 3] += 4.0  # an outlier channel, as real keys have
    v = torch.randn(units, page, heads, head_dim, generator=gen)
    frame = LeverFrame(codec.levers)
    k, v = frame.to_stored(k.reshape(-1, heads, head_dim), v.reshape(-1, heads, head_dim), 0, None, False) \
        if codec.levers.active else (k, v)
    pages, books = codec.encode_units(k.reshape(units, page, heads, head_dim).to(device),
                                      v.reshape(units, page, heads, head_dim).to(device), layout)
    return codec, layout, frame, pages.reshape(units, -1), books


def within(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Finite, and within a few bf16 roundings of ``want`` (the kernel's float32 math against the codec's own; the
    codec's error is 10-30% of the values)."""
    got, want = got.float().reshape(want.shape), want.float()
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= 0.02 * float(want.abs().max()) + 1e-3


def reference(codec, layout, frame, pages, books):
    k, v = codec.decode_units(layout, pages, books)
    if codec.levers.active:
        k, v = frame.from_stored(k, v, 0)
    return k.float(), v.float()


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("heads,units", [(3, 5), (1, 2)])
def test_units_gather_as_the_reference_decodes(spec, heads, units):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, layout, frame, pages, books = units_of(spec, heads, 64, 16, units, device)
    gather = UnitGather.of(codec, layout, torch.bfloat16)
    assert gather is not None
    k, v = gather(pages, books)
    assert k.shape == v.shape == (units, 16, heads, 64) and k.dtype == torch.bfloat16
    rk, rv = reference(codec, layout, frame, pages, books)
    assert within(k, rk) and within(v, rv), spec


@pytest.mark.parametrize("spec", CODECS[1:3])
def test_psac_rows_of_units_are_read(spec):
    """Units encoded without query statistics carry all-zero PSAC rows: written here at random (codes, scales,
    tokens and the codebook's basis), so a kernel that ignored them would differ from the reference by their size."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, layout, frame, pages, books = units_of(spec, 3, 64, 16, 5, device)
    gen = torch.Generator().manual_seed(1)
    codes = layout.page.view(pages, "k_psac")
    codes.copy_(torch.randint(-100, 100, codes.shape, generator=gen, dtype=torch.int8))
    scales = layout.page.view(pages, "k_psac_scale")
    scales.copy_((torch.rand(scales.shape, generator=gen) * 0.02).half())
    if "k_psac_token" in layout.page.fields:  # distinct tokens per (unit, head)
        tokens = layout.page.view(pages, "k_psac_token")
        rows, units, heads = tokens.shape[1], tokens.shape[0], tokens.shape[2]
        picks = torch.stack([torch.randperm(16, generator=gen)[:rows] for _ in range(units * heads)])
        tokens.copy_(picks.view(units, heads, rows).transpose(1, 2).to(torch.uint8))
    basis = layout.codebook.view(books, "k_psac_basis")
    basis.copy_(torch.randn(basis.shape, generator=gen).bfloat16() * 0.2)
    k, _ = UnitGather.of(codec, layout, torch.bfloat16)(pages, books)
    rk, _ = reference(codec, layout, frame, pages, books)
    plain = units_of(spec, 3, 64, 16, 5, device)[3]  # the same units, their PSAC rows still zero
    assert within(k, rk)
    without = reference(codec, layout, frame, plain, books)[0]  # the same units with their PSAC rows zero
    assert float((rk - without).abs().max()) > 0.1 * float(rk.abs().max())  # the rows matter at this size


def test_a_unit_decodes_alone_whatever_its_neighbours_hold():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, layout, frame, pages, books = units_of(CODECS[1], 2, 64, 16, 4, device)
    gather = UnitGather.of(codec, layout, torch.bfloat16)
    k, v = gather(pages, books)
    k2, v2 = gather(pages[2:3], books[2:3])  # unit 2 alone: its own codebook, not slot 0's
    assert torch.equal(k[2:3], k2) and torch.equal(v[2:3], v2)
    swapped = gather(pages[[3, 2]], books[[3, 2]])
    assert torch.equal(swapped[0][1], k[2]) and torch.equal(swapped[1][0], v[3])


@pytest.mark.parametrize("spec,dtype", [
    ("quantwm:centroids=4,group=16,prerope=true", torch.bfloat16),  # keys turned by their positions
    ("quantwm:centroids=4,group=16,sink=4", torch.bfloat16),  # the sequence's first tokens exact
    ("qvg:centroids=4,group=16", torch.float32),  # no fp32 output
])
def test_units_that_need_positions_or_other_outputs_are_left_to_the_codec(spec, dtype):
    codec = get_codec(spec)
    assert UnitGather.of(codec, codec.layout(Geometry(1, 2, 64, torch.bfloat16), 16), dtype) is None


def test_a_page_size_the_kernels_do_not_read_is_left_to_the_codec():
    codec = get_codec(CODECS[0])
    assert UnitGather.of(codec, codec.layout(Geometry(1, 2, 64, torch.bfloat16), 24), torch.bfloat16) is None


def test_shapes_that_disagree_with_the_layout_are_refused():
    codec, layout, _, pages, books = units_of(CODECS[0], 2, 64, 16, 2, "cpu")
    gather = UnitGather.of(codec, layout, torch.bfloat16)
    with pytest.raises(ValueError, match="expected pages"):
        gather(pages[:, :-1], books)
    with pytest.raises(ValueError, match="expected pages"):
        gather(pages, books[:1])
