"""What a cache holds, measured from its pools (`CacheStats`), and the check of every pool invariant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbackend.manager import KVCache


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the pools. Bytes are measured from the stored tensors."""

    dense_pages_used: int
    packed_pages_used: int  # referenced by at least one request
    packed_pages_cached: int  # unreferenced, kept for prefix reuse
    codebook_slots_used: int
    requests: int
    dense_bytes: int  # bytes of dense pages in use (all layers)
    packed_bytes: int  # bytes of live packed pages and codebook slots (all layers)
    packed_tokens: int  # tokens those packed pages represent
    bits_per_value: float | None  # 8 * packed_bytes / values represented; None when nothing is packed
    deferred_chunks: int = 0  # full chunks still dense because the packed pool had no room when they completed
    refused_page_groups: int = 0  # page groups `install_pages` refused for an index field out of range (crafted)


def cache_stats(cache: "KVCache") -> CacheStats:
    """A snapshot of ``cache``'s pools. Bytes are measured from the stored tensors."""
    tables = [cache.page_table(rid) for rid in cache.request_ids]
    live_pages = sum(s is not None for s in cache.packed.slot_of_page)
    packed_bytes = cache.packed.stored_bytes()
    tokens = live_pages * cache.config.page_size
    values = tokens * cache.geometry.num_layers * cache.geometry.values_per_token
    return CacheStats(
        dense_pages_used=cache.dense.allocator.num_used,
        packed_pages_used=cache.packed.allocator.num_used,
        packed_pages_cached=cache.packed.allocator.num_cached,
        codebook_slots_used=len(cache.packed.live_slots()),
        requests=len(tables),
        dense_bytes=cache.dense.allocator.num_used * cache.dense.page_bytes * cache.geometry.num_layers,
        packed_bytes=packed_bytes,
        packed_tokens=tokens,
        bits_per_value=8.0 * packed_bytes / values if values else None,
        deferred_chunks=sum((t.num_tokens - t.num_packed_tokens) // cache.config.chunk_tokens
                            for t in tables),
        refused_page_groups=cache.groups.refused,
    )


def check_cache(cache: "KVCache") -> None:
    """Assert every pool invariant of ``cache``, including that ref counts match the page tables."""
    cache.dense.allocator.check()
    cache.packed.allocator.check()
    cache.packed.slots.check()
    dense_refs: dict[int, int] = {}
    packed_refs: dict[int, int] = {}
    for table in (cache.page_table(rid) for rid in cache.request_ids):
        for page in table.dense:
            dense_refs[page] = dense_refs.get(page, 0) + 1
        for page in table.packed:
            packed_refs[page] = packed_refs.get(page, 0) + 1
    for page in range(cache.dense.allocator.num_pages):
        assert cache.dense.allocator.ref_count(page) == dense_refs.get(page, 0), f"dense page {page} refs"
    for page in range(cache.packed.allocator.num_pages):
        assert cache.packed.allocator.ref_count(page) == packed_refs.get(page, 0), f"packed page {page} refs"
    slot_refs: dict[int, int] = {}
    for slot in cache.packed.slot_of_page:
        if slot is not None:
            slot_refs[slot] = slot_refs.get(slot, 0) + 1
    for slot in range(cache.packed.slots.num_pages):
        assert cache.packed.slots.ref_count(slot) == slot_refs.get(slot, 0), f"codebook slot {slot} refs"
