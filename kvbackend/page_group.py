"""The bytes of one exported page group: what tiers and engines move for a packed page.

A page group is every layer's packed page, back to back, then a 32-byte trailer, then (only on the
page that carries its chunk's codebook) every layer's codebook slot:

    [layer 0 page | layer 1 page | ... | trailer | layer 0 codebook | layer 1 codebook | ...]

The trailer names the page, the chunk it belongs to and the cache the bytes were written for:

    page key u64 | chunk id u64 | flags u32 (bit 0: the codebooks follow) | format version u32 |
    cache fingerprint 16 bytes | zero padding 8 bytes

A reader checks the version, the fingerprint and the key before it trusts anything else in the
group, so the bytes of another model, another plan, another page geometry or another page (a blob
filed under the wrong key) are a miss, never data; a blob of another length puts its trailer
elsewhere, where these checks fail too.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvbackend.layout import PageLayout

VERSION = 2  # of the page-group byte format; enters the cache fingerprint
_TRAILER = struct.Struct("<QQII16s8x")  # 48 bytes: codebooks stay 16-byte aligned
TRAILER_BYTES = _TRAILER.size
_CARRIES = 1


@dataclass(frozen=True)
class Trailer:
    key: int  # the page's chained prefix key (`kvbackend.hashing.hash_page`)
    chunk_id: int  # 63-bit id of the chunk the page belongs to (unique across processes and restarts)
    carries_codebook: bool  # the chunk's codebook slot of every layer follows the trailer


@dataclass(frozen=True)
class PageGroupFormat:
    """Offsets of every part of a page group for one cache (one layout per layer)."""

    fingerprint: str | None  # the cache's fingerprint (16 hex characters), written into every trailer; None:
    # offsets only (a reader that keeps trailers verbatim, such as a persistent format)
    page_offsets: tuple[int, ...]  # layer -> offset of its page; one more entry: where the pages end
    book_offsets: tuple[int, ...]  # layer -> offset of its codebook inside the codebook part; one more: the total

    @classmethod
    def of(cls, layouts: Sequence[PageLayout], fingerprint: str | None = None) -> "PageGroupFormat":
        if fingerprint is not None and len(fingerprint.encode()) != 16:
            raise ValueError(f"a cache fingerprint is 16 ASCII characters, got {fingerprint!r}")
        return cls(fingerprint,
                   tuple(itertools.accumulate((lay.page_bytes for lay in layouts), initial=0)),
                   tuple(itertools.accumulate((lay.codebook_bytes for lay in layouts), initial=0)))

    @property
    def pages_bytes(self) -> int:
        """Bytes of every layer's page (the trailer starts here)."""
        return self.page_offsets[-1]

    @property
    def books_offset(self) -> int:
        """Where the first layer's codebook starts, on a carrier page."""
        return self.pages_bytes + TRAILER_BYTES

    @property
    def has_codebooks(self) -> bool:
        return self.book_offsets[-1] > 0

    @property
    def blob_bytes(self) -> int:
        """Bytes of the largest page group (one that carries its chunk's codebooks)."""
        return self.books_offset + self.book_offsets[-1]

    def length(self, carries_codebook: bool) -> int:
        """Exact bytes of a page group with or without the codebooks."""
        return self.blob_bytes if carries_codebook else self.books_offset

    def page_span(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of ``layer``'s page."""
        return self.page_offsets[layer], self.page_offsets[layer + 1] - self.page_offsets[layer]

    def book_span(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of ``layer``'s codebook slot on a carrier page."""
        start = self.book_offsets[layer]
        return self.books_offset + start, self.book_offsets[layer + 1] - start

    def pack_trailer(self, key: int, chunk_id: int, carries_codebook: bool) -> bytes:
        assert self.fingerprint is not None, "a page-group format of offsets only writes no trailers"
        return _TRAILER.pack(key, chunk_id, _CARRIES if carries_codebook else 0, VERSION, self.fingerprint.encode())

    def unpack_trailer(self, raw: bytes) -> Trailer | None:
        """The trailer in ``raw`` (TRAILER_BYTES long), or None when it was written for another cache
        or format: such a page group is a miss."""
        assert self.fingerprint is not None, "a page-group format of offsets only reads no trailers"
        key, chunk_id, flags, version, fingerprint = _TRAILER.unpack(raw)
        if version != VERSION or fingerprint != self.fingerprint.encode() or flags & ~_CARRIES:
            return None
        carries = bool(flags & _CARRIES)
        if carries and not self.has_codebooks:
            return None
        return Trailer(key, chunk_id, carries)
