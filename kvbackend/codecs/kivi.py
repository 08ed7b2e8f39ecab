"""KIVI: keys per channel over groups of ``group`` tokens, values per token over groups of channels.

Asymmetric, fp16 scale and minimum by default, as in the paper. KIVI's full-precision recent
window is the cache's dense active chunk, so it is not part of the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.quant import SCALE_DTYPES, scale_dtype
from kvbackend.spec import Checked, one_of, ranged
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs
from kvbackend.codecs.groups import (channel_group_fields, decode_channel_groups, decode_token_groups, encode_channel_groups,
                     encode_token_groups, token_group_fields)
from kvbackend.codecs.rtn import check_bits_group
from kvbackend.codecs.widths import MAX_GROUP, SPLIT_WIDTHS, WIDTHS, SplitWidths, check_split_widths


@dataclass(frozen=True)
class KIVISpec(SplitWidths, Checked):
    name: str
    bits: int = one_of(2, WIDTHS)  # code width of keys and values
    # tokens per key group (must divide page_size), channels per value group (must divide head_dim)
    group: int = ranged(32, 1, MAX_GROUP)
    scale: str = one_of("fp16", SCALE_DTYPES)  # storage dtype of scales and minima
    kbits: int = one_of(0, SPLIT_WIDTHS)  # key code width when it differs from `bits` (0: same)
    vbits: int = one_of(0, SPLIT_WIDTHS)  # value code width when it differs from `bits` (0: same)
    # keys: MSE-optimal Gaussian step instead of min/max (same bytes; see quant.quantize), for 2-bit
    # keys only: at 3-4 bits clipping key outliers raised next-token KL 6x (K4V3 on GPL-3: 0.0046 -> 0.0305)
    kclip: bool = False
    vclip: bool = False  # values: the same for value groups


class KIVICodec(Codec):
    name: ClassVar[str] = "kivi"
    page_local: ClassVar[bool] = True
    any_float_input: ClassVar[bool] = True  # the field writers read bf16 in their fused loops, else convert

    def validate(self, geometry: Geometry, page_size: int) -> None:
        check_bits_group(self.spec, geometry.head_dim)
        check_split_widths(self.spec)
        if 3 in (self.spec.key_bits, self.spec.value_bits) and self.spec.group % 8:
            raise SpecError("kivi: 3-bit codes need group to be a multiple of 8")
        if page_size % self.spec.group:
            raise SpecError(f"kivi: group={self.spec.group} tokens must divide page_size={page_size}")

    @property
    def kernel_encodes(self) -> bool:
        return not (self.spec.vclip or (self.spec.kclip and self.spec.key_bits == 2))

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        s = self.spec
        h, d, store = geometry.num_kv_heads, geometry.head_dim, scale_dtype(s.scale)
        return (channel_group_fields("k", page_size, h, d, s.key_bits, s.group, store)
                + token_group_fields("v", page_size, h, d, s.value_bits, s.group, False, store)), []

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        s = self.spec
        encode_channel_groups(k, layout, pages, "k", s.key_bits, s.group, clip=s.kclip and s.key_bits == 2)
        encode_token_groups(v, layout, pages, "v", s.value_bits, s.group, symmetric=False, clip=s.vclip)

    def _decode(self, layout: PageLayout, pages, codebook):
        s = self.spec
        dtype = layout.geometry.dtype  # what `decode_pages` returns: decoded straight into it where that is faster
        return (decode_channel_groups(layout, pages, "k", s.key_bits, s.group, dtype),
                decode_token_groups(layout, pages, "v", s.value_bits, s.group, dtype))
