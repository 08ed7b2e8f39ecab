"""`Codec.page_local`: a codec that claims it must give, for M pages encoded in one call, exactly the bytes
of M one-page encodes (storage adapters batch every layer of every page on that promise)."""

import pytest
import torch

from kvbackend.codecs import get
from kvbackend.geometry import Geometry

PAGE_LOCAL = ["rtn:bits=2,group=64", "rtn:bits=2,group=32,scale=fp8", "rtn:bits=3,group=16,symmetric=true",
              "rtn:bits=4,group=64", "kivi:bits=2,group=16", "kivi:bits=2,group=8,kbits=4,kclip=true,vclip=true",
              "kivi:bits=4,group=16,scale=fp8", "identity", "fp8", "rtn:bits=2,group=64,vrot=hadamard"]


@pytest.mark.parametrize("spec", PAGE_LOCAL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_page_local_codecs_encode_pages_independently(spec, dtype):
    codec = get(spec)
    assert codec.page_local
    geometry = Geometry(1, 3, 64, dtype)
    layout = codec.layout(geometry, 16)
    assert layout.codebook_bytes == 0
    g = torch.Generator().manual_seed(3)
    pages = 5
    # pages of very different ranges, so any statistic shared across pages would show in the bytes
    # (the largest within what fp8 values and parameters hold: past it an encode is refused, tests/test_value_range.py)
    scale = torch.tensor([0.01, 1.0, 30.0, 0.3, 60.0]).repeat_interleave(16)[:, None, None]
    k = (torch.randn(pages * 16, 3, 64, generator=g) * scale).to(dtype)
    v = (torch.randn(pages * 16, 3, 64, generator=g) * scale.flip(0)).to(dtype)
    joint = codec.encode(k, v, layout).pages
    alone = torch.cat([codec.encode(k[i * 16:(i + 1) * 16], v[i * 16:(i + 1) * 16], layout).pages
                       for i in range(pages)])
    assert torch.equal(joint, alone)
    kj, vj = codec.decode_pages(layout, joint, torch.empty(0, dtype=torch.uint8))
    for i in range(pages):
        ki, vi = codec.decode_pages(layout, alone[i:i + 1], torch.empty(0, dtype=torch.uint8))
        assert torch.equal(kj[i * 16:(i + 1) * 16], ki) and torch.equal(vj[i * 16:(i + 1) * 16], vi)


@pytest.mark.parametrize("spec", ["qvg", "quantwm:kchannel=16,rank=4,keep=0.0625"])
def test_codecs_with_a_chunk_codebook_are_not_page_local(spec):
    codec = get(spec)
    assert codec.layout(Geometry(1, 3, 64, torch.float16), 16).codebook_bytes > 0
    assert not codec.page_local
