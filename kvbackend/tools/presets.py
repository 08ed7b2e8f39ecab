"""Measured bits per value of codec presets on synthetic KV (what `kvbackend bpv` prints)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend import codecs
from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry

DEFAULT_SPECS = ("fp16", "fp8", "rtn:bits=2,group=64", "rtn:bits=4,group=64", "kivi:bits=2,group=32",
                 "kivi:bits=4,group=32", "qvg", "qvg:symmetric=true", "qvg-pro")


@dataclass(frozen=True)
class BpvRow:
    spec: str  # canonical spec
    head_dim: int
    tokens: int  # tokens in the chunk
    page_bytes: int
    codebook_bytes: int
    bits_per_value: float  # from the stored tensors' nbytes
    k_nrmse: float
    v_nrmse: float


def measure(spec: str, head_dim: int, tokens: int, heads: int = 8, page_size: int = 64, seed: int = 0) -> BpvRow:
    """Encode one chunk of Gaussian KV with per-channel offsets (outlier-ish channels) and measure it."""
    gen = torch.Generator().manual_seed(seed)
    geometry = Geometry(1, heads, head_dim, torch.bfloat16)
    offsets = torch.randn(heads, head_dim, generator=gen) * 2
    k = (torch.randn(tokens, heads, head_dim, generator=gen) + offsets).bfloat16()
    v = torch.randn(tokens, heads, head_dim, generator=gen).bfloat16()
    codec = codecs.get(spec)
    if codec.levers.active:  # measured here they would be ignored, yet printed with the spec
        raise SpecError(f"{spec!r}: `bpv` measures a codec's own pages; its levers (sink=, prerope=, pagerope=, "
                        "vrot=) are applied by the paged cache: `kvbackend eval` measures them")
    layout = codec.layout(geometry, page_size)
    chunk = codec.encode(k, v, layout)
    kh, vh = codec.decode(chunk)
    nrmse = lambda x, y: float((x.float() - y.float()).norm() / x.float().norm())  # noqa: E731
    return BpvRow(codec.spec_string, head_dim, tokens, layout.page_bytes, layout.codebook_bytes,
                  chunk.bits_per_value, nrmse(k, kh), nrmse(v, vh))
