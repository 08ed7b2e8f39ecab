"""`Codec.decode_units`: pages that each carry their own codebook slot, decoded in one pass where the codec
can (QVG, QuantWM), give exactly what `decode_pages` gives page by page; other codecs loop."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.base import CodecState
from kvbackend.geometry import Geometry
from kvbackend.psac import query_second_moment

GEOMETRY = Geometry(1, 3, 64, torch.bfloat16)
PAGE = 16


def _units(spec: str, n: int, seed: int = 0):
    """``n`` one-page chunks of ``spec`` (each its own k-means, PSAC basis and scales): pages [n, bytes],
    codebook slots [n, bytes]."""
    codec = codecs.get(spec)
    layout = codec.layout(GEOMETRY, PAGE)
    gen = torch.Generator().manual_seed(seed)
    pages, books = [], []
    for i in range(n):
        k = torch.randn(PAGE, 3, 64, generator=gen) * (1 + i) + torch.randn(1, 3, 64, generator=gen) * 4
        v = torch.randn(PAGE, 3, 64, generator=gen)
        q = torch.randn(6, PAGE, 64, generator=gen)
        chunk = codec.encode(k.bfloat16(), v.bfloat16(), layout, CodecState(query_moment=query_second_moment(q, 3)))
        pages.append(chunk.pages)
        books.append(chunk.codebook)
    return codec, layout, torch.cat(pages), torch.stack(books)


SPECS = [
    "qvg",
    "qvg:stages=2,centroids=8",
    "qvg:kchannel=16,vcluster=false,cdtype=fp8",
    "quantwm:kchannel=16,rank=4,keep=0.25,centroids=8,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=8",
    "quantwm:kchannel=16,rank=4,keep=1,centroids=4",  # a PSAC row per token
    "quantwm:rank=0,centroids=4,outliers=4",
]


@pytest.mark.parametrize("spec", SPECS)
def test_one_pass_equals_page_by_page(spec):
    codec, layout, pages, books = _units(spec, 5)
    assert codec.per_page_codebooks
    k, v = codec.decode_units(layout, pages, books)
    for i in range(pages.shape[0]):
        ki, vi = codec.decode_pages(layout, pages[i : i + 1], books[i])
        assert torch.equal(k[i * PAGE : (i + 1) * PAGE], ki) and torch.equal(v[i * PAGE : (i + 1) * PAGE], vi), i


def test_each_page_reads_its_own_slot():
    """Swapping two pages' slots changes exactly those pages: a pass that read one slot for all would not."""
    codec, layout, pages, books = _units("qvg:kchannel=16,vcluster=false,cdtype=fp8", 4, seed=3)
    k, _ = codec.decode_units(layout, pages, books)
    swapped = books[[1, 0, 2, 3]]
    k2, _ = codec.decode_units(layout, pages, swapped)
    assert not torch.equal(k2[:PAGE], k[:PAGE]) and not torch.equal(k2[PAGE : 2 * PAGE], k[PAGE : 2 * PAGE])
    assert torch.equal(k2[2 * PAGE :], k[2 * PAGE :])


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=16", "heads:base=qvg:centroids=4;kchannel=16,kbits=2-3-2"])
def test_other_codecs_loop_to_the_same_values(spec):
    codec, layout, pages, books = _units(spec, 3, seed=1)
    k, v = codec.decode_units(layout, pages, books)
    for i in range(3):
        ki, vi = codec.decode_pages(layout, pages[i : i + 1], books[i])
        assert torch.equal(k[i * PAGE : (i + 1) * PAGE], ki) and torch.equal(v[i * PAGE : (i + 1) * PAGE], vi)


def test_refuses_mismatched_pages_and_slots():
    codec, layout, pages, books = _units("qvg", 3)
    for bad_pages, bad_books in ((pages, books[:2]), (pages[:, :-1], books), (pages, books[:, 1:]), (pages[0], books)):
        with pytest.raises(ValueError, match="decode_units needs"):
            codec.decode_units(layout, bad_pages, bad_books)


def test_the_fused_centroid_loop_gives_the_torch_values(monkeypatch):
    """fp8 centroids over enough values for the fused CPU loop (`fastquant.plus_fp8_rows`): the same bits as the
    torch gather, which is what runs when the loop does not serve."""
    from kvbackend import fastquant

    if fastquant.numba is None:
        pytest.skip("numba not installed: the torch path is the only one")
    spec = "quantwm:kchannel=16,rank=4,keep=0.25,centroids=8,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8"
    codec, layout, pages, books = _units(spec, 40, seed=5)  # 40 x 16 x 3 x 64 values: above MIN_VALUES
    assert pages.shape[0] * PAGE * 3 * 64 >= fastquant.MIN_VALUES
    calls = []
    real = fastquant.plus_fp8_rows
    monkeypatch.setattr(fastquant, "plus_fp8_rows", lambda *a: calls.append(1) or real(*a))
    fused = codec.decode_units(layout, pages, books)
    assert calls and real(torch.zeros(PAGE * 40, 3, 64), layout.codebook.view(books, "k_centroids").view(torch.uint8)[:, 0],
                          torch.zeros(PAGE * 40, 3, dtype=torch.long), torch.arange(PAGE * 40) // PAGE,
                          layout.codebook.view(books, "k_centroid_scales")[:, 0]) is not None  # the loop served
    monkeypatch.setattr(fastquant, "plus_fp8_rows", lambda *a: None)  # the torch gather
    plain = codec.decode_units(layout, pages, books)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
