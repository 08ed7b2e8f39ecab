"""Device storage for pages: a dense pool for active chunks and a packed pool for encoded ones."""

from __future__ import annotations

import torch

from kvbackend.allocator import PageAllocator
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.layout import PageLayout


class DensePool:
    """Uncompressed pages ``[L, pages, 2, P, H, D]`` in the geometry's dtype (K at 0, V at 1)."""

    def __init__(self, geometry: Geometry, config: CacheConfig) -> None:
        g = geometry
        self.data = torch.zeros(g.num_layers, config.dense_pages, 2, config.page_size, g.num_kv_heads, g.head_dim,
                                dtype=g.dtype, device=config.device)
        self.allocator = PageAllocator(config.dense_pages, "dense")

    @property
    def page_bytes(self) -> int:
        return self.data[0, 0].nbytes


class PackedPool:
    """Packed pages and codebook slots, one tensor pair per layer: ``pages[layer]`` is
    ``[pages, page_bytes(layer)]`` and ``codebooks[layer]`` ``[slots, codebook_bytes(layer)]``.

    Layers may use different layouts (a per-layer codec plan), so their pages differ in size; a page
    id names the same logical page in every layer. Every packed page records its chunk's codebook
    slot; the slot is reference-counted by the pages that point at it and returns to its free list
    with the last of them.
    """

    def __init__(self, layouts: list[PageLayout], config: CacheConfig) -> None:
        self.pages = [torch.zeros(config.packed_pages, lay.page_bytes, dtype=torch.uint8, device=config.device)
                      for lay in layouts]
        self.codebooks = [torch.zeros(config.num_codebook_slots, lay.codebook_bytes, dtype=torch.uint8,
                                      device=config.device) for lay in layouts]
        self.slot_of_page: list[int | None] = [None] * config.packed_pages
        # Per live slot: the chunk it encodes (an id that travels with exported pages) and the page
        # that carries the codebook when pages move to lower tiers (the chunk's first page).
        self.chunk_of_slot: list[int | None] = [None] * config.num_codebook_slots
        self.carrier_of_slot: list[int | None] = [None] * config.num_codebook_slots
        self.slot_of_chunk: dict[int, int] = {}
        self.slots = PageAllocator(config.num_codebook_slots, "codebook", on_release=self._forget_slot)
        self.allocator = PageAllocator(config.packed_pages, "packed", on_release=self._release_slot)

    @property
    def device(self) -> torch.device:
        return self.pages[0].device

    def _release_slot(self, page: int) -> None:
        slot = self.slot_of_page[page]
        assert slot is not None, f"packed page {page} has no codebook slot"
        self.slot_of_page[page] = None
        if self.carrier_of_slot[slot] == page:  # the slot lives on without it: the next export carries the codebook
            self.carrier_of_slot[slot] = None
        self.slots.decref(slot)

    def open_slot(self, slot: int, chunk_id: int, carrier: int | None) -> None:
        """Record which chunk a freshly allocated slot holds and which page carries its codebook."""
        self.chunk_of_slot[slot] = chunk_id
        self.carrier_of_slot[slot] = carrier
        self.slot_of_chunk[chunk_id] = slot

    def _forget_slot(self, slot: int) -> None:
        chunk = self.chunk_of_slot[slot]
        if chunk is not None and self.slot_of_chunk.get(chunk) == slot:
            del self.slot_of_chunk[chunk]
        self.chunk_of_slot[slot] = self.carrier_of_slot[slot] = None

    def bind(self, pages: list[int], slot: int) -> None:
        """Record that ``pages`` belong to the chunk in ``slot`` (the slot gains one ref per page)."""
        for page in pages:
            assert self.slot_of_page[page] is None
            self.slot_of_page[page] = slot
            self.slots.incref(slot)

    def idle_slot(self, keep: set[int] = frozenset()) -> int | None:
        """A codebook slot all of whose pages are cached (none in use) and none in ``keep``, least recently used
        first; None where there is none."""
        cached: dict[int, int] = {}
        kept: set[int] = set()
        for page in self.allocator.cached_pages():
            slot = self.slot_of_page[page]
            if page in keep:
                kept.add(slot)
            cached[slot] = cached.get(slot, 0) + 1
            if cached[slot] == self.slots.ref_count(slot) and slot not in kept:
                return slot
        return None

    def evict_slot(self, slot: int) -> None:
        """Evict the cached pages of ``slot`` (an `idle_slot`): the slot is freed with the last of them."""
        for page in [page for page in self.allocator.cached_pages() if self.slot_of_page[page] == slot]:
            self.allocator.evict_cached(page)

    def live_slots(self) -> set[int]:
        return {s for s in self.slot_of_page if s is not None}

    def stored_bytes(self) -> int:
        """Bytes of every live packed page (in use or cached) and live codebook slot, all layers."""
        live_pages = sum(s is not None for s in self.slot_of_page)
        live_slots = len(self.live_slots())
        return sum(live_pages * pages.shape[1] + live_slots * books.shape[1]  # uint8: one byte per element
                   for pages, books in zip(self.pages, self.codebooks))
