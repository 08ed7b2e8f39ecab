"""Persistent formats: how the file tier stores a page group's bytes.

The default stores the packed bytes as they are (nothing is re-encoded on the way down). A cache
whose device pages are dense floats (``identity``/``fp16``/``bf16``) can instead keep its file tier in
AlignPred, an error-bounded format: fewer bytes for a guaranteed NRMSE per page group. The decoded
page returns in the page's own dtype, so its error is AlignPred's bound plus that dtype's rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvbackend.errors import CorruptStream
from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.page_group import TRAILER_BYTES, PageGroupFormat  # the page group's trailer is kept verbatim

if TYPE_CHECKING:
    from kvbackend.alignpred import Calibration



class BlobFormat(Protocol):
    name: str  # enters the file tier's fingerprint: files of another format are never served
    blob_bytes: int  # bytes of one decoded page group

    def encode(self, blob: bytes) -> bytes: ...

    def decode(self, stored: memoryview, out: torch.Tensor) -> None:
        """Write the page group into ``out`` (uint8, >= blob_bytes); raise CorruptStream if damaged."""


class AlignPredFormat:
    """Page groups of a dense-float cache stored as AlignPred streams (plus the verbatim trailer)."""

    def __init__(self, spec: str, layout: PageLayout, calibration: "Calibration | None" = None) -> None:
        from kvbackend.alignpred import AlignPredCodec  # needs the ``codecs`` extra (constriction)

        page = layout.page
        fields = page.fields
        if layout.codebook_bytes or set(fields) != {"k", "v"} or not fields["k"].dtype.is_floating_point:
            raise UnsupportedLayout(
                f"alignpred persists dense float pages (identity, fp16 or bf16 caches); this cache stores "
                f"{layout.codec!r} pages, whose packed bytes the file tier keeps as they are")
        self.codec = AlignPredCodec(spec, calibration)
        self.layout = layout
        self.layers = layout.geometry.num_layers
        self.group = PageGroupFormat.of([layout] * self.layers)  # offsets; no codebooks, so no carrier pages
        self.blob_bytes = self.group.blob_bytes
        self.name = self.codec.spec_string + (f"@{calibration.fingerprint():08x}" if self.codec.calibration else "")

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = buffer[: self.group.pages_bytes].view(self.layers, self.layout.page.nbytes)
        return self.layout.page.view(rows, "k"), self.layout.page.view(rows, "v")  # [L, P, H, D] each

    def encode(self, blob: bytes) -> bytes:
        if len(blob) != self.blob_bytes:
            raise ValueError(f"a page group of this layout is {self.blob_bytes} bytes, got {len(blob)}")
        buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        k, v = self._views(buffer)
        return bytes(blob[self.group.pages_bytes : self.group.books_offset]) + self.codec.encode(k.float(), v.float())

    def decode(self, stored: memoryview, out: torch.Tensor) -> None:
        if len(stored) < TRAILER_BYTES:
            raise CorruptStream("stored page group shorter than its trailer")
        # The page group's own shape: a stream of another shape is a miss, never broadcast into the page.
        k, v = self.codec.decode(stored[TRAILER_BYTES:], shape=(self.layers, *self.layout.page.fields["k"].shape))
        target = out[: self.blob_bytes]
        kv, vv = self._views(target)
        # The lattice may step a value at the edge of the page dtype's range just past it (65504 -> 65504.5
        # in fp16 would become inf): clamp to the finite range, which only brings it closer to the original.
        finite = torch.finfo(kv.dtype)
        kv.copy_(torch.from_numpy(k).clamp_(finite.min, finite.max))
        vv.copy_(torch.from_numpy(v).clamp_(finite.min, finite.max))
        trailer = np.frombuffer(stored[:TRAILER_BYTES], np.uint8).copy()
        target[self.group.pages_bytes : self.group.books_offset].copy_(torch.from_numpy(trailer))
