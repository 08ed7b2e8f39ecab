"""The packed page layout: the one source of truth for where every field of a page lives.

A `PageLayout` holds two `FieldSet`s: the fields of one packed page (one layer, K and V both)
and the fields of one chunk's codebook slot. Kernels read the offsets as compile-time
constants, tiers copy the bytes as opaque blobs, codecs write and read them through `view`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from kvbackend.geometry import Geometry

ALIGN = 16  # every field starts on a 16-byte boundary, so vector loads stay aligned

_DTYPE_NAMES = {
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "f8e4m3",
    torch.int32: "i32",
    torch.int16: "i16",
}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Field:
    """One named array inside a page or a codebook slot."""

    name: str  # e.g. "k_codes"
    dtype: torch.dtype  # element type as stored
    shape: tuple[int, ...]  # shape per page (or per slot)
    offset: int  # byte offset from the start of the page, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class FieldSet:
    """An ordered set of fields packed into ``nbytes`` contiguous bytes."""

    def __init__(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        fields: dict[str, Field] = {}
        offset = 0
        for name, dtype, shape in specs:
            if name in fields:
                raise ValueError(f"field {name!r} declared twice")
            if dtype not in _DTYPE_NAMES:
                raise ValueError(f"field {name!r}: dtype {dtype} cannot be stored")
            f = Field(name, dtype, tuple(int(s) for s in shape), offset)
            fields[name] = f
            offset = _align(offset + f.nbytes)
        self.fields = fields
        self.nbytes = offset

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """A typed view ``[*lead, *field.shape]`` of field ``name`` inside uint8 ``buffer [*lead, nbytes]``.

        Writes through the view land in ``buffer``.
        """
        f = self.fields[name]
        if buffer.dtype != torch.uint8 or buffer.shape[-1] != self.nbytes:
            raise ValueError(f"expected a uint8 buffer [..., {self.nbytes}], got {buffer.dtype} {tuple(buffer.shape)}")
        raw = buffer[..., f.offset : f.offset + f.nbytes]
        return raw.view(f.dtype).view(*buffer.shape[:-1], *f.shape)

    def describe(self) -> str:
        return ";".join(f"{f.name}:{_DTYPE_NAMES[f.dtype]}{list(f.shape)}@{f.offset}" for f in self.fields.values())


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of packed pages and codebook slots for one codec on one geometry."""

    codec: str  # canonical codec spec string
    geometry: Geometry
    page_size: int  # P: tokens per page
    page: FieldSet  # fields of one packed page of one layer
    codebook: FieldSet  # fields of one chunk's codebook slot of one layer (may be empty)

    @property
    def page_bytes(self) -> int:
        return self.page.nbytes

    @property
    def codebook_bytes(self) -> int:
        return self.codebook.nbytes

    @property
    def fingerprint(self) -> str:
        """A stable hash of everything that decides the bytes; tiers refuse blobs of another layout."""
        g = self.geometry
        text = "|".join(
            [self.codec, f"L{g.num_layers}H{g.num_kv_heads}D{g.head_dim}P{self.page_size}", str(g.dtype),
             self.page.describe(), self.codebook.describe()]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stored_bytes(self, num_pages: int, num_chunks: int) -> int:
        """Bytes that ``num_pages`` packed pages and ``num_chunks`` codebook slots occupy (one layer)."""
        return num_pages * self.page_bytes + num_chunks * self.codebook_bytes
