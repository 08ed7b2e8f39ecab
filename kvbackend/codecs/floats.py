"""Codecs that store every value as a float: ``identity`` (lossless), ``fp16``, ``bf16``, ``fp8``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs, from_pages, to_pages

_STORE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class FloatSpec:
    name: str  # "identity", "fp16", "bf16" or "fp8"


class FloatCodec(Codec):
    """One value per stored float. ``identity`` keeps the geometry's own dtype, so it is lossless."""

    name: ClassVar[str] = "float"
    page_local: ClassVar[bool] = True

    def stored_max_abs(self, geometry: Geometry) -> tuple[float, float]:
        if self.spec.name == "identity":  # the cache's own dtype: nothing saturates
            return math.inf, math.inf
        # below the midpoint of the two largest finite values, a value rounds to a smaller one than the largest
        # (`kvbackend.saturation` refuses a stored value at the largest: it may be a clamp)
        dtype = self._store(geometry)
        big = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
        bits = big.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
        below = (bits - 1).view(dtype)  # the next smaller finite value (positive floats order as their bits)
        bound = (big.float().item() + below.float().item()) / 2
        return bound, bound

    def _store(self, geometry: Geometry) -> torch.dtype:
        return geometry.dtype if self.spec.name == "identity" else _STORE[self.spec.name]

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        shape = (page_size, geometry.num_kv_heads, geometry.head_dim)
        dtype = self._store(geometry)
        return [("k", dtype, shape), ("v", dtype, shape)], []

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        dtype = self._store(layout.geometry)
        big = torch.finfo(dtype).max
        for name, x in (("k", k), ("v", v)):
            # Saturate rather than overflow to inf (fp8 e4m3fn has no inf: it would become NaN).
            layout.page.view(pages, name).copy_(to_pages(x.clamp(-big, big).to(dtype), layout.page_size))

    def _decode(self, layout: PageLayout, pages, codebook):
        return (from_pages(layout.page.view(pages, "k")).float(), from_pages(layout.page.view(pages, "v")).float())
