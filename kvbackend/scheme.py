"""What a kernel needs to know to read (or write) one of K or V in a packed page.

`kernel_schemes(codec, layout)` turns a codec's layout into two `TensorScheme`s of plain ints,
which kernels take as compile-time constants. Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout

FLOAT, TOKEN_GROUPS, CHANNEL_GROUPS = 0, 1, 2  # storage modes
FP8_E4M3, FP16, BF16, FP32 = 0, 1, 2, 3  # element kinds of scales, zeros and float values
_KINDS = {torch.float8_e4m3fn: FP8_E4M3, torch.float16: FP16, torch.bfloat16: BF16, torch.float32: FP32}
NONE = -1  # offset of an absent field


@dataclass(frozen=True)
class TensorScheme:
    """How K (or V) of one token block is stored in a page; all offsets in bytes."""

    mode: int  # FLOAT, TOKEN_GROUPS (per token, groups of channels) or CHANNEL_GROUPS (per channel, groups of tokens)
    bits: int  # code width (2, 4, 8); 0 in FLOAT mode
    group: int  # channels (TOKEN_GROUPS) or tokens (CHANNEL_GROUPS) per scale; 0 in FLOAT mode
    symmetric: bool  # codes centred on 2**(bits-1) - 1 and no zeros
    kind: int  # element kind of scales/zeros, or of the values themselves in FLOAT mode
    codes: int  # offset of codes (or float values)
    scales: int = NONE
    zeros: int = NONE
    assign: int = NONE  # uint8 [S, P, H] centroid ids
    stages: int = 0  # S
    centroids: int = 0  # C
    codebook: int = NONE  # offset of bf16 centroids [S, H, C, D] in the codebook slot

    def supported_by_kernels(self) -> bool:
        return self.mode == FLOAT or self.bits in (2, 4, 8)


def kind_of(dtype: torch.dtype) -> int:
    return _KINDS[dtype]


def kernel_schemes(codec, layout: PageLayout) -> tuple[TensorScheme, TensorScheme]:
    """(K scheme, V scheme) for ``codec`` on ``layout``.

    Raises:
        UnsupportedLayout: for a codec whose fields no kernel reads (the torch reference still works).
    """
    spec = codec.spec
    page, book = layout.page.fields, layout.codebook.fields
    if "k_psac" in page:
        raise UnsupportedLayout(f"no kernel adds PSAC corrections yet ({codec.spec_string!r}); the torch reference serves it")
    out = []
    for prefix in ("k", "v"):
        if prefix in page:  # identity / fp16 / bf16 / fp8: plain values
            out.append(TensorScheme(FLOAT, 0, 0, False, kind_of(page[prefix].dtype), page[prefix].offset))
            continue
        if f"{prefix}_codes" not in page:
            raise UnsupportedLayout(f"no kernel reads the fields of codec {codec.spec_string!r}")
        scales = page[f"{prefix}_scales"]
        channel = scales.shape[0] != layout.page_size  # KIVI keys: [P / G, H, D]
        zeros = page.get(f"{prefix}_zeros")
        assign = page.get(f"{prefix}_assign")
        cents = book.get(f"{prefix}_centroids")
        out.append(TensorScheme(
            mode=CHANNEL_GROUPS if channel else TOKEN_GROUPS,
            bits=getattr(spec, "key_bits" if prefix == "k" else "value_bits", spec.bits),
            group=layout.page_size // scales.shape[0] if channel else layout.geometry.head_dim // scales.shape[-1],
            symmetric=zeros is None,
            kind=kind_of(scales.dtype),
            codes=page[f"{prefix}_codes"].offset,
            scales=scales.offset,
            zeros=zeros.offset if zeros is not None else NONE,
            assign=assign.offset if assign is not None else NONE,
            stages=assign.shape[0] if assign is not None else 0,
            centroids=cents.shape[2] if cents is not None else 0,
            codebook=cents.offset if cents is not None else NONE,
        ))
    return out[0], out[1]
