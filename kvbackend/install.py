"""Page groups in and out of the packed pool: export a page's bytes for a lower tier, and install
restored ones as cached pages that admission then hits.

Installing is planned once (`plan`: pages and codebook slots allocated and keyed, nothing copied),
copied layer by layer (`copy_layer`, on whatever stream the caller runs it) and finished (`finish`:
the pages become cached). The byte format itself is `kvbackend.page_group`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvbackend.hashing import token_bytes
from kvbackend.page_check import PageCheck
from kvbackend.page_group import PageGroupFormat, Trailer
from kvbackend.pool import PackedPool
from kvbackend.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class InstallPlan:
    """Restored page groups assigned to device pages (see `KVCache.plan_install`)."""

    installed: int = 0  # how many of the keys (a prefix) are on the device once the copies land
    pinned: list[int] = field(default_factory=list)  # resident pages held until `finish_install`, so no
    # allocation of this plan evicts a page it counted as installed
    rows: list[int] = field(default_factory=list)  # blob row of each new page
    new_pages: list[int] = field(default_factory=list)  # device pages that receive those rows
    slot_rows: list[int] = field(default_factory=list)  # blob row carrying each newly opened codebook
    new_slots: list[int] = field(default_factory=list)  # codebook slots opened
    _index: dict = field(default_factory=dict, repr=False)  # device index tensors, made once per plan

    def index(self, blobs_device: torch.device, pool_device: torch.device) -> dict[str, torch.Tensor]:
        """The plan's lists as index tensors. Made on first use, on the current stream: make them
        before enqueueing per-layer copies on another stream (a pageable upload waits for its stream)."""
        if not self._index:
            self._index = {"rows": torch.tensor(self.rows, device=blobs_device),
                           "pages": torch.tensor(self.new_pages, device=pool_device),
                           "slot_rows": torch.tensor(self.slot_rows, device=blobs_device),
                           "slots": torch.tensor(self.new_slots, device=pool_device)}
        return self._index


class PageGroups:
    """Export and install of page groups for one cache's packed pool."""

    def __init__(self, pool: PackedPool, group: PageGroupFormat, index: PrefixIndex,
                 check: PageCheck | None = None) -> None:
        self.pool = pool
        self.group = group  # byte offsets of a page group
        self.index = index  # restored pages are keyed into it
        self.check = check  # the index fields of a page group (None: its layouts have none)
        self.refused = 0  # page groups `install` refused for an index out of range

    def export(self, page: int) -> torch.Tensor:
        """A copy of one packed page group (uint8, 1-D). Only the chunk's first page carries the
        chunk's codebook; the others name the chunk and share it again when restored."""
        slot = self.pool.slot_of_page[page]
        if slot is None:
            raise ValueError(f"packed page {page} is not live")
        # The slot's carrier page exports its codebook; a slot whose carrier is gone (evicted while other
        # pages of the chunk stayed) hands that role to the next page exported, so the codebook survives.
        if self.pool.carrier_of_slot[slot] is None:
            self.pool.carrier_of_slot[slot] = page
        carrier = self.pool.carrier_of_slot[slot] == page and self.group.has_codebooks
        key = self.pool.allocator.page_hash(page)
        raw = self.group.pack_trailer(key or 0, self.pool.chunk_of_slot[slot], carrier)  # unhashed: never restored
        trailer = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.pool.device)
        parts = [pages[page] for pages in self.pool.pages] + [trailer]
        if carrier:
            parts += [books[slot] for books in self.pool.codebooks]
        return torch.cat(parts)

    def install(self, keys: Sequence[int], token_ids: Sequence[int], blobs: torch.Tensor, first_page: int,
                      resident: Sequence[bool] | None = None, sizes: Sequence[int | None] | None = None,
                      hold: Sequence[int] = ()) -> int:
        """Put restored page groups back on the device as cached pages, so `add_request` hits them.

        ``keys[i]`` is the key of prompt page ``first_page + i`` and row ``blobs[i]`` its exported bytes
        (rows at least `blob_bytes` long); ``resident[i]`` marks rows that carry no bytes
        because the page was on the device already. A page joins the resident slot of its chunk, or
        opens a slot from the codebook it carries; a page whose chunk's codebook is nowhere, or whose
        bytes are missing, stops the restore there; so does a row that is not a page group of this cache
        (its trailer names another fingerprint, or its stored length ``sizes[i]``, when given, is not the
        length its trailer implies), and so does a row whose index fields (centroid ids, PSAC row tokens, key
        outlier positions) are out of range (`kvbackend.page_check`): no reader ever sees it. Returns how many
        of ``keys`` (a prefix) are now on the device.
        """
        if (not isinstance(blobs, torch.Tensor) or blobs.dtype != torch.uint8 or blobs.dim() != 2
                or blobs.shape[0] < len(keys) or blobs.shape[1] < self.group.blob_bytes):
            raise ValueError(f"page groups are uint8 rows [>= {len(keys)} keys, >= {self.group.blob_bytes} bytes], "
                             f"got {getattr(blobs, 'dtype', type(blobs))} {tuple(getattr(blobs, 'shape', ()))}")
        trailers = self.read_trailers(blobs, len(keys), resident, sizes)
        if self.check is not None:
            bad = self.check.bad_rows(blobs[: len(keys)]) if any(t is not None for t in trailers) else []
            for i, refused in enumerate(bad):
                if refused and trailers[i] is not None:  # (rows marked resident carry no bytes)
                    trailers[i] = None
                    self.refused += 1
                    log.warning("install: page group %d refused: %s", i, self.check.reason(blobs[i]))
        plan = self.plan(keys, token_ids, trailers, first_page, hold)
        try:
            for layer in range(len(self.pool.pages)):
                self.copy_layer(plan, blobs, layer)
        except BaseException:
            self.abort(plan)
            raise
        self.finish(plan)
        return plan.installed

    def read_trailers(self, blobs: torch.Tensor, count: int, resident: Sequence[bool] | None = None,
                      sizes: Sequence[int | None] | None = None) -> list[Trailer | None]:
        """The trailer of each blob row; None for rows marked resident and for rows that are not a page
        group of this cache (another fingerprint or format version, or a stored length ``sizes[i]``
        that does not match what the trailer says the group holds): `plan` stops there."""
        start = self.group.pages_bytes
        resident = list(resident) if resident is not None else [False] * count
        heads = blobs[:count, start : self.group.books_offset].cpu().numpy()  # one transfer for all trailers
        out: list[Trailer | None] = []
        for i in range(count):
            trailer = None if resident[i] else self.group.unpack_trailer(bytes(heads[i]))
            if trailer is not None and sizes is not None and sizes[i] is not None \
                    and sizes[i] != self.group.length(trailer.carries_codebook):
                trailer = None
            out.append(trailer)
        return out

    def plan(self, keys: Sequence[int], token_ids: Sequence[int],
                     trailers: Sequence[Trailer | None], first_page: int, hold: Sequence[int] = ()) -> InstallPlan:
        """The bookkeeping half of `install`: pages and codebook slots are allocated and hashed
        now; their bytes must be copied (`copy_layer`) before any kernel reads them, and
        `finish` then hands the pages to the cache.

        A page joins the slot of its chunk when that slot is resident; the slot is held while the
        page is allocated, so the allocation's eviction never frees the slot being joined. Resident
        pages counted as installed are held until `finish_install` for the same reason, and so are the
        pages of the keys in ``hold`` (the prompt's prefix already on the device, which these pages extend)."""
        p = self.index.page_size
        tokens = token_bytes(token_ids)
        allocator, pool = self.pool.allocator, self.pool
        plan = InstallPlan()
        for key in hold:
            page = allocator.lookup(key)
            if page is None:
                return plan  # the prefix these pages extend is gone: nothing to install
            allocator.incref(page)
            plan.pinned.append(page)
        for i, key in enumerate(keys):
            resident = allocator.lookup(key)
            if resident is not None:
                allocator.incref(resident)
                plan.pinned.append(resident)
                plan.installed += 1
                continue
            trailer = trailers[i]
            if trailer is None or trailer.key != key:
                break  # expected on the device but evicted meanwhile, or not this page of this cache
            slot = pool.slot_of_chunk.get(trailer.chunk_id)
            opens = slot is None
            # the row carrying this chunk's codebook: this page's, or a later page's of the same chunk
            book_row = next((j for j in range(i, len(keys)) if trailers[j] is not None and trailers[j].key == keys[j]
                             and trailers[j].chunk_id == trailer.chunk_id and trailers[j].carries_codebook), None)
            if opens and book_row is None and self.group.has_codebooks:
                break  # the codebook of this page's chunk is neither resident nor carried
            if opens and not pool.slots.can_allocate(1):
                # every slot is held: a chunk reduced to cached pages gives its slot up, as for a chunk that
                # completes (`KVCache._complete_chunk`), unless it holds a page this restore counts on further on
                later = {allocator.lookup(k) for k in keys[i + 1 :]} - {None}
                idle = pool.idle_slot(keep=later)
                if idle is None:
                    break
                pool.evict_slot(idle)
            if not allocator.can_allocate(1):
                break
            if not opens:
                pool.slots.incref(slot)  # held across the allocation below, which may evict its pages
            (page,) = allocator.allocate(1)
            if opens:
                (slot,) = pool.slots.allocate(1)
                pool.open_slot(slot, trailer.chunk_id, page if book_row == i else None)
                plan.new_slots.append(slot)
                plan.slot_rows.append(i if book_row is None else book_row)
            if trailer.carries_codebook:  # this page carries the codebook when exported again
                pool.carrier_of_slot[slot] = page
            pool.bind([page], slot)
            pool.slots.decref(slot)  # the page holds the slot now
            start = (first_page + i) * p
            self.index.adopt(page, key, tokens[8 * start : 8 * (start + p)])
            plan.new_pages.append(page)
            plan.rows.append(i)
            plan.installed += 1
        return plan

    def copy_layer(self, plan: InstallPlan, blobs: torch.Tensor, layer: int) -> None:
        """Copy one layer of the planned pages (and of the codebooks they open) out of ``blobs``, on
        the current stream."""
        if not plan.new_pages:
            return
        pool, (start, pb) = self.pool, self.group.page_span(layer)
        device = pool.device
        idx = plan.index(blobs.device, device)
        pool.pages[layer][idx["pages"]] = blobs[idx["rows"], start : start + pb].to(device)
        start, cb = self.group.book_span(layer)
        if plan.new_slots and cb:
            pool.codebooks[layer][idx["slots"]] = blobs[idx["slot_rows"], start : start + cb].to(device)

    def finish(self, plan: InstallPlan) -> None:
        for page in plan.new_pages + plan.pinned:
            self.pool.allocator.decref(page)  # unreferenced: cached until a request takes it

    def abort(self, plan: InstallPlan) -> None:
        """Undo a plan whose copies failed: its pages lose their keys and go back free (with the slots
        they opened); nothing it planned is ever found by a lookup."""
        allocator = self.pool.allocator
        for page in plan.new_pages:
            allocator.decref(page)  # cached under its key for a moment ...
            allocator.evict_cached(page)  # ... and gone: unkeyed, free, its slot released with it
        for page in plan.pinned:
            allocator.decref(page)
        plan.new_pages, plan.rows, plan.new_slots, plan.slot_rows, plan.pinned = [], [], [], [], []
        plan.installed = 0
