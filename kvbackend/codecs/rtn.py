"""Round-to-nearest: per token, groups of ``group`` channels, 2/3/4/8 bits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.quant import SCALE_DTYPES, scale_dtype
from kvbackend.spec import Checked, one_of, ranged
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs
from kvbackend.codecs.groups import decode_token_groups, encode_token_groups, token_group_fields
from kvbackend.codecs.widths import MAX_GROUP, WIDTHS


@dataclass(frozen=True)
class RTNSpec(Checked):
    name: str
    bits: int = one_of(2, WIDTHS)  # code width: 2, 3, 4 or 8
    group: int = ranged(64, 1, MAX_GROUP)  # channels per scale (must divide head_dim)
    symmetric: bool = False  # symmetric absmax, or asymmetric min/max with a zero
    scale: str = one_of("fp16", SCALE_DTYPES)  # storage dtype of scales and zeros: fp8, fp16, bf16, fp32


def check_bits_group(spec, dim: int) -> None:
    if spec.bits not in (2, 3, 4, 8):
        raise SpecError(f"{spec.name}: bits={spec.bits} not supported; choose 2, 3, 4 or 8")
    if spec.group <= 0 or dim % spec.group:
        raise SpecError(f"{spec.name}: group={spec.group} must divide head_dim={dim}")
    if spec.bits == 3 and spec.group % 8:
        raise SpecError(f"{spec.name}: 3-bit codes need group to be a multiple of 8")
    scale_dtype(spec.scale)


class RTNCodec(Codec):
    name: ClassVar[str] = "rtn"
    page_local: ClassVar[bool] = True
    any_float_input: ClassVar[bool] = True  # encode_token_groups reads bf16 in its fused loop, else converts

    def validate(self, geometry: Geometry, page_size: int) -> None:
        check_bits_group(self.spec, geometry.head_dim)

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        s = self.spec
        specs: FieldSpecs = []
        for prefix in ("k", "v"):
            specs += token_group_fields(prefix, page_size, geometry.num_kv_heads, geometry.head_dim, s.bits,
                                        s.group, s.symmetric, scale_dtype(s.scale))
        return specs, []

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        s = self.spec
        for prefix, x in (("k", k), ("v", v)):
            encode_token_groups(x, layout, pages, prefix, s.bits, s.group, s.symmetric)

    def _decode(self, layout: PageLayout, pages, codebook):
        s = self.spec
        dtype = layout.geometry.dtype  # what `decode_pages` returns: decoded straight into it where that is faster
        return tuple(decode_token_groups(layout, pages, p, s.bits, s.group, dtype) for p in ("k", "v"))
