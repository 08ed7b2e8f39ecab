"""`KVCache`: the facade engines talk to. Admit, append, complete chunks, read, fork, free."""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import backends, codecs
from .batch import BatchPlan, plan_batch
from .codecs.base import check_kv
from .errors import CacheFull, InvalidKV, SpecError, UnknownRequest
from .geometry import CacheConfig, Geometry
from .hashing import hash_page, token_bytes
from .page_group import TRAILER_BYTES, PageGroupFormat, Trailer
from .page_group import VERSION as PAGE_GROUP_VERSION
from .page_table import PageTable
from .pool import DensePool, PackedPool


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


class KVCache:
    """A paged, compressed KV cache for one model.

    Tokens go into a request's dense active chunk; once ``chunk_pages`` pages are full in every
    layer the chunk is encoded with the configured codec into packed pages and the dense pages
    are freed. Packed pages of known tokens are hashed, so later requests with the same prefix
    share them.

    Every layer has its own codec when ``config.layer_codecs`` gives a per-layer plan (such as the
    one `kvbackend eval` prints for ``auto:...``): each layer then has its own page layout, page
    size in bytes and backend, and the plan is part of `fingerprint`, so decoding needs no
    recalibration and tiers never mix pages of another plan.
    """

    def __init__(self, geometry: Geometry, config: CacheConfig | None = None) -> None:
        self.geometry = geometry
        self.config = config or CacheConfig()
        specs = self.config.layer_codecs or (self.config.codec,) * geometry.num_layers
        if len(specs) != geometry.num_layers:
            raise SpecError(f"layer_codecs has {len(specs)} specs for {geometry.num_layers} layers")
        built: dict[str, tuple] = {}  # spec -> (codec, layout, backend), shared by layers of one spec
        for spec in specs:
            if spec in built:
                continue
            if spec.split(":", 1)[0] == "auto":
                raise SpecError(f"{spec!r}: an auto plan is chosen on a prompt by `kvbackend eval` (or "
                                "kvbackend.auto.plan_widths); pass its per-layer specs as CacheConfig(layer_codecs=...)")
            codec = codecs.get(spec)
            if codec.levers.active:
                raise SpecError(f"{spec!r}: sink/prerope/vrot act on whole sequences; they are applied by "
                                "`kvbackend eval` and by KVBackendCache(sink=..., pre_rope=...), not by a KVCache "
                                "(kvbackend.auto.cache_specs strips them from a plan)")
            layout = codec.layout(geometry, self.config.page_size)
            built[spec] = (codec, layout, backends.choose(self.config.backend, torch.device(self.config.device),
                                                          codec, layout))
        self.codecs = [built[spec][0] for spec in specs]
        self.layouts = [built[spec][1] for spec in specs]
        self.backends = [built[spec][2] for spec in specs]
        self.uniform = len({lay.fingerprint for lay in self.layouts}) == 1  # one byte layout (spellings may differ)
        self.dense = DensePool(geometry, self.config)
        self.packed = PackedPool(self.layouts, self.config)
        self.fingerprint = self._fingerprint()
        self.group = PageGroupFormat.of(self.layouts, self.fingerprint)  # the bytes of an exported page
        self._tables: dict[int, PageTable] = {}
        # hashed packed page -> its tokens, for the collision check on a hit; entries of evicted pages
        # are harmless (their hash is gone) and are overwritten when the page is hashed again
        self._page_tokens: dict[int, bytes] = {}
        self._ids = itertools.count()
        self._layer_events: list | None = None  # per-layer CUDA events of the last layered restore

    @property
    def codec(self):
        """The codec of every layer (a cache with a per-layer plan has `codecs` instead)."""
        return self._the("codecs")

    @property
    def layout(self):
        """The page layout of every layer (a cache with a per-layer plan has `layouts` instead)."""
        return self._the("layouts")

    @property
    def backend(self):
        return self._the("backends")

    def _the(self, name: str):
        if not self.uniform:
            raise SpecError(f"this cache has a per-layer codec plan: use KVCache.{name}[layer]")
        return getattr(self, name)[0]

    def _fingerprint(self) -> str:
        """16 hex characters naming everything that shapes an exported page group's bytes: the page-group
        format version, layers, heads, head size, dtype, page size, chunk pages and every layer's layout
        (the per-layer plan). Tiers keyed by it never serve one cache's pages to another."""
        g, cfg = self.geometry, self.config
        text = "|".join([f"pagegroup-v{PAGE_GROUP_VERSION}", f"L{g.num_layers}H{g.num_kv_heads}D{g.head_dim}",
                         str(g.dtype), f"P{cfg.page_size}C{cfg.chunk_pages}",
                         *(lay.fingerprint for lay in self.layouts)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- admission --------------------------------------------------------------------------
    def add_request(self, token_ids: Sequence[int] = ()) -> tuple[int, int]:
        """Admit a request. Returns (request id, number of prefix tokens already cached).

        At most ``len(token_ids) - 1`` tokens are reported cached, so the engine always computes
        the last prompt token's logits.
        """
        tokens = [int(t) for t in token_ids]
        raw = token_bytes(tokens)
        p = self.config.page_size
        table = PageTable(next(self._ids), self.geometry.num_layers, p, token_ids=tokens)
        parent = None
        for start in range(0, max(len(tokens) - 1, 0) // p * p, p):
            page_raw = raw[8 * start : 8 * (start + p)]
            key = hash_page(parent, page_raw, self.config.extra_keys)
            page = self.packed.allocator.lookup(key)
            if page is None or self._page_tokens.get(page) != page_raw:
                break
            self.packed.allocator.incref(page)
            table.packed.append(page)
            parent = key
        table.last_hash = parent
        table.lengths = [table.num_packed_tokens] * self.geometry.num_layers
        if table.packed:  # warm-start k-means from the reused prefix's last codebook
            slot = self.packed.slot_of_page[table.packed[-1]]
            for layer, state in enumerate(table.states):
                book = self.layouts[layer].codebook
                for prefix in ("k", "v"):
                    if f"{prefix}_centroids" in book:
                        state.centroids[prefix] = book.view(self.packed.codebooks[layer][slot],
                                                            f"{prefix}_centroids").float().clone()
        self._tables[table.request_id] = table
        return table.request_id, table.num_packed_tokens

    def extend_tokens(self, request_id: int, token_ids: Sequence[int]) -> None:
        """Record the ids of generated tokens, so their pages can be hashed and shared later."""
        self._table(request_id).token_ids.extend(int(t) for t in token_ids)

    # -- writing ----------------------------------------------------------------------------
    def append(self, request_id: int, layer: int, k: torch.Tensor, v: torch.Tensor,
               queries: torch.Tensor | None = None) -> None:
        """Append ``[T, H, D]`` keys and values of one layer. Encodes a chunk once every layer filled it.

        ``queries [T, Hq, D]`` (optional, same tokens, same frame as ``k``) feed query-aware codecs
        (``quantwm``): a chunk is encoded with the second moment of the queries of its own and
        earlier tokens only.

        A chunk that completes while the packed pool (or its codebook slots) is full stays in the
        dense pool as it is and is encoded by a later append once room exists: a step whose first
        layers were appended never fails at its last one.

        Raises:
            UnknownRequest, InvalidKV, CacheFull (the dense pool is full; nothing is written when it
            is raised).
        """
        table = self._table(request_id)
        self._check_layer(layer)
        check_kv(k, v, self.geometry)
        if queries is not None:
            g = self.geometry
            if (queries.dim() != 3 or queries.shape[0] != k.shape[0] or queries.shape[2] != g.head_dim
                    or queries.shape[1] % g.num_kv_heads):
                raise InvalidKV(f"queries must be [{k.shape[0]}, Hq, {g.head_dim}] with Hq a multiple of "
                                f"{g.num_kv_heads}, got {tuple(queries.shape)}")
        if k.device != self.dense.data.device:
            raise InvalidKV(f"k/v on {k.device}, cache on {self.dense.data.device}")
        if self.config.check_finite and not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise InvalidKV(f"request {request_id} layer {layer}: K/V contain NaN or Inf; nothing was written")
        p, n = self.config.page_size, k.shape[0]
        start = table.dense_tokens(layer)
        pages_needed = -(-(start + n) // p) - len(table.dense)
        # Check, then commit: the one allocation that can fail is checked before any write.
        if not self.dense.allocator.can_allocate(max(pages_needed, 0)):
            raise CacheFull("dense", pages_needed, self.dense.allocator.num_free)
        if pages_needed > 0:
            table.dense.extend(self.dense.allocator.allocate(pages_needed))
        written = 0
        while written < n:  # one slice per page touched
            position = start + written
            page, offset = table.dense[position // p], position % p
            m = min(p - offset, n - written)
            self.dense.data[layer, page, 0, offset : offset + m] = k[written : written + m]
            self.dense.data[layer, page, 1, offset : offset + m] = v[written : written + m]
            written += m
        if queries is not None and self.codecs[layer].uses_queries:
            chunk_tokens = self.config.chunk_tokens
            base = table.lengths[layer]  # position of this call's first token
            offset = 0  # split at chunk boundaries
            while offset < n:
                chunk = (base + offset) // chunk_tokens
                stop = min(n, (chunk + 1) * chunk_tokens - base)
                table.states[layer].add_queries(chunk, queries[offset:stop], self.geometry.num_kv_heads)
                offset = stop
        table.lengths[layer] += n
        while table.num_tokens - table.num_packed_tokens >= self.config.chunk_tokens and self._can_pack():
            self._complete_chunk(table)

    def _can_pack(self) -> bool:
        """Whether one more chunk's pages and codebook slot can be allocated, exactly as
        `_complete_chunk` will allocate them: the pages first (free pages, then cached ones in LRU
        order, whose eviction releases a slot once its last page goes), then one slot."""
        pages, pool = self.config.chunk_pages, self.packed
        if not pool.allocator.can_allocate(pages):
            return False
        if pool.slots.can_allocate(1):
            return True
        evicted: dict[int, int] = {}  # slot -> its pages the allocation would evict
        for page in pool.allocator.eviction_order(pages):
            slot = pool.slot_of_page[page]
            evicted[slot] = evicted.get(slot, 0) + 1
        return any(pool.slots.ref_count(slot) == n for slot, n in evicted.items())

    def _complete_chunk(self, table: PageTable) -> None:
        cfg, pool = self.config, self.packed
        chunk_dense = table.dense[: cfg.chunk_pages]
        new_pages = pool.allocator.allocate(cfg.chunk_pages)  # `_can_pack` said both allocations succeed
        (slot,) = pool.slots.allocate(1)
        pool.bind(new_pages, slot)
        pool.slots.decref(slot)  # the pages hold the slot now; drop the allocation's own ref
        page_ids = torch.tensor(new_pages, dtype=torch.int32, device=self.dense.data.device)
        chunk_index = table.num_packed_tokens // cfg.chunk_tokens
        try:
            for layer in range(self.geometry.num_layers):
                table.states[layer].close_chunk(chunk_index)
                kv = self.dense.data[layer, chunk_dense]  # [pages, 2, P, H, D]
                k = kv[:, 0].reshape(-1, *kv.shape[-2:])
                v = kv[:, 1].reshape(-1, *kv.shape[-2:])
                self.backends[layer].encode_chunk(self.codecs[layer], self.layouts[layer], k, v, table.states[layer],
                                                  pool.pages[layer], page_ids, pool.codebooks[layer][slot])
        except BaseException:
            for page in new_pages:  # the chunk stays dense; its pages (and with them the slot) go back
                pool.allocator.decref(page)
            raise
        # A chunk id from the OS's entropy, never from a seedable generator: ids must not repeat across
        # processes and restarts, or a restored page would join another chunk's codebook.
        pool.open_slot(slot, secrets.randbits(63), new_pages[0])
        first_token = table.num_packed_tokens
        table.packed.extend(new_pages)
        table.dense = table.dense[cfg.chunk_pages :]
        for page in reversed(chunk_dense):
            self.dense.allocator.decref(page)
        self._publish(table, new_pages, first_token)

    def _publish(self, table: PageTable, pages: list[int], first_token: int) -> None:
        """Hash newly packed pages whose tokens are known, continuing the request's chain."""
        p = self.config.page_size
        chained = table.last_hash is not None or first_token == 0
        for i, page in enumerate(pages):
            start = first_token + i * p
            tokens = table.token_ids[start : start + p]
            if not chained or len(tokens) < p:
                table.last_hash = None
                return
            raw = token_bytes(tokens)
            key = hash_page(table.last_hash, raw, self.config.extra_keys)
            if self.packed.allocator.set_hash(page, key):
                self._page_tokens[page] = raw
            table.last_hash = key

    # -- reading ----------------------------------------------------------------------------
    def read(self, request_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K and V for a request, ``[tokens, H, D]``: packed pages decoded by the
        torch reference, then the active chunk as stored."""
        pk, pv = self.read_packed(request_id, layer)
        dk, dv = self.read_dense(request_id, layer)
        return torch.cat([pk, dk]), torch.cat([pv, dv])

    def read_packed(self, request_id: int, layer: int, first_page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruction of the request's packed pages from ``first_page`` on, ``[pages * P, H, D]``.

        Packed pages never change, so callers can keep what they decoded and ask only for new pages.
        """
        table = self._table(request_id)
        self._check_layer(layer)
        self.wait_layer(layer)
        keys, values = [self._empty()], [self._empty()]
        for slot, pages in self._runs(table.packed[first_page:]):
            k, v = self.codecs[layer].decode_pages(self.layouts[layer], self.packed.pages[layer][pages],
                                                   self.packed.codebooks[layer][slot])
            keys.append(k)
            values.append(v)
        return torch.cat(keys), torch.cat(values)

    def read_dense(self, request_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The active chunk's K and V as stored, ``[tokens, H, D]``."""
        table = self._table(request_id)
        self._check_layer(layer)
        n = table.dense_tokens(layer)
        if not table.dense:
            return self._empty(), self._empty()
        kv = self.dense.data[layer, table.dense]
        return kv[:, 0].reshape(-1, *kv.shape[-2:])[:n], kv[:, 1].reshape(-1, *kv.shape[-2:])[:n]

    def _empty(self) -> torch.Tensor:
        return self.dense.data.new_zeros((0, self.geometry.num_kv_heads, self.geometry.head_dim))

    def _runs(self, pages: list[int]) -> list[tuple[int, list[int]]]:
        """Split packed pages into runs that share one codebook slot."""
        runs: list[tuple[int, list[int]]] = []
        for page in pages:
            slot = self.packed.slot_of_page[page]
            if runs and runs[-1][0] == slot:
                runs[-1][1].append(page)
            else:
                runs.append((slot, [page]))
        return runs

    # -- batched attention (plan once per batch, run per layer) -----------------------------
    def plan(self, request_ids: list[int], layer: int = 0) -> BatchPlan:
        """Flatten the batch's page tables once; reuse the plan for every layer of one step."""
        for rid in request_ids:
            self._table(rid)
        self._check_layer(layer)
        return plan_batch(self, list(request_ids), layer)

    def gather(self, plan: BatchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every planned token's K and V, ``[total_tokens, H, D]`` in ``plan.cu_seqlens`` order."""
        self._check_layer(layer)
        self.wait_layer(layer)
        return self.backends[layer].gather(self, plan, layer)

    def decode(self, plan: BatchPlan, layer: int, q: torch.Tensor, scale: float | None = None):
        """Decode attention of one query per planned request: (output [B, Hq, D], lse [B, Hq])."""
        self._check_layer(layer)
        self.wait_layer(layer)
        return self.backends[layer].decode(self, plan, layer, q, scale)

    def page_table(self, request_id: int) -> PageTable:
        return self._table(request_id)

    def num_tokens(self, request_id: int) -> int:
        return self._table(request_id).num_tokens

    # -- moving pages between tiers (driven by kvbackend.tiers; the core stays tier-agnostic) ---
    def prefix_keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained keys of the full pages of a prompt that `add_request` could reuse."""
        raw = token_bytes(token_ids)
        p, keys, parent = self.config.page_size, [], None
        for start in range(0, max(len(raw) // 8 - 1, 0) // p * p, p):
            parent = hash_page(parent, raw[8 * start : 8 * (start + p)], self.config.extra_keys)
            keys.append(parent)
        return keys

    def device_prefix(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (from the start) have a packed page on the device."""
        n = 0
        for key in keys:
            if self.packed.allocator.lookup(key) is None:
                break
            n += 1
        return n

    @property
    def blob_bytes(self) -> int:
        """Largest exported page group (see `kvbackend.page_group`): every layer's packed page, the
        trailer, then every layer's codebook slot when this page carries it."""
        return self.group.blob_bytes

    def page_span(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of ``layer``'s page inside an exported page group."""
        return self.group.page_span(layer)

    def export_page(self, page: int) -> torch.Tensor:
        """A copy of one packed page group (uint8, 1-D). Only the chunk's first page carries the
        chunk's codebook; the others name the chunk and share it again when restored."""
        slot = self.packed.slot_of_page[page]
        assert slot is not None, f"packed page {page} is not live"
        carrier = self.packed.carrier_of_slot[slot] == page and self.group.has_codebooks
        key = self.packed.allocator.page_hash(page)
        raw = self.group.pack_trailer(key or 0, self.packed.chunk_of_slot[slot], carrier)  # unhashed: never restored
        trailer = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.packed.device)
        parts = [pages[page] for pages in self.packed.pages] + [trailer]
        if carrier:
            parts += [books[slot] for books in self.packed.codebooks]
        return torch.cat(parts)

    def evictable_pages(self) -> list[tuple[int, int]]:
        """(page, key) of unreferenced cached packed pages, least recently used first."""
        allocator = self.packed.allocator
        return [(page, allocator.page_hash(page)) for page in allocator.cached_pages()]

    def drop_cached(self, page: int) -> None:
        """Free a cached packed page whose bytes now live in a lower tier."""
        self.packed.allocator.evict_cached(page)

    def install_pages(self, keys: Sequence[int], token_ids: Sequence[int], blobs: torch.Tensor, first_page: int,
                      resident: Sequence[bool] | None = None, sizes: Sequence[int | None] | None = None,
                      hold: Sequence[int] = ()) -> int:
        """Put restored page groups back on the device as cached pages, so `add_request` hits them.

        ``keys[i]`` is the key of prompt page ``first_page + i`` and row ``blobs[i]`` its exported bytes
        (rows at least `blob_bytes` long); ``resident[i]`` marks rows that carry no bytes
        because the page was on the device already. A page joins the resident slot of its chunk, or
        opens a slot from the codebook it carries; a page whose chunk's codebook is nowhere, or whose
        bytes are missing, stops the restore there; so does a row that is not a page group of this cache
        (its trailer names another fingerprint, or its stored length ``sizes[i]``, when given, is not the
        length its trailer implies). Returns how many of ``keys`` (a prefix) are now on the device.
        """
        plan = self.plan_install(keys, token_ids, self.read_trailers(blobs, len(keys), resident, sizes), first_page,
                                 hold)
        for layer in range(self.geometry.num_layers):
            self.copy_install_layer(plan, blobs, layer)
        self.finish_install(plan)
        return plan.installed

    def read_trailers(self, blobs: torch.Tensor, count: int, resident: Sequence[bool] | None = None,
                      sizes: Sequence[int | None] | None = None) -> list[Trailer | None]:
        """The trailer of each blob row; None for rows marked resident and for rows that are not a page
        group of this cache (another fingerprint or format version, or a stored length ``sizes[i]``
        that does not match what the trailer says the group holds): `plan_install` stops there."""
        start = self.group.pages_bytes
        resident = list(resident) if resident is not None else [False] * count
        heads = blobs[:count, start : start + TRAILER_BYTES].cpu().numpy()  # one transfer for all trailers
        out: list[Trailer | None] = []
        for i in range(count):
            trailer = None if resident[i] else self.group.unpack_trailer(bytes(heads[i]))
            if trailer is not None and sizes is not None and sizes[i] is not None \
                    and sizes[i] != self.group.length(trailer.carries_codebook):
                trailer = None
            out.append(trailer)
        return out

    def plan_install(self, keys: Sequence[int], token_ids: Sequence[int],
                     trailers: Sequence[Trailer | None], first_page: int, hold: Sequence[int] = ()) -> InstallPlan:
        """The bookkeeping half of `install_pages`: pages and codebook slots are allocated and hashed
        now; their bytes must be copied (`copy_install_layer`) before any kernel reads them, and
        `finish_install` then hands the pages to the cache.

        A page joins the slot of its chunk when that slot is resident; the slot is held while the
        page is allocated, so the allocation's eviction never frees the slot being joined. Resident
        pages counted as installed are held until `finish_install` for the same reason, and so are the
        pages of the keys in ``hold`` (the prompt's prefix already on the device, which these pages extend)."""
        p = self.config.page_size
        tokens = token_bytes(token_ids)
        allocator, pool = self.packed.allocator, self.packed
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
            if opens and not (trailer.carries_codebook or not self.group.has_codebooks):
                break  # the codebook of this page's chunk is neither resident nor carried
            if not allocator.can_allocate(1) or (opens and not pool.slots.can_allocate(1)):
                break
            if not opens:
                pool.slots.incref(slot)  # held across the allocation below, which may evict its pages
            (page,) = allocator.allocate(1)
            if opens:
                (slot,) = pool.slots.allocate(1)
                pool.open_slot(slot, trailer.chunk_id, page)
                plan.new_slots.append(slot)
                plan.slot_rows.append(i)
            pool.bind([page], slot)
            pool.slots.decref(slot)  # the page holds the slot now
            allocator.set_hash(page, key)
            start = (first_page + i) * p
            self._page_tokens[page] = tokens[8 * start : 8 * (start + p)]
            plan.new_pages.append(page)
            plan.rows.append(i)
            plan.installed += 1
        return plan

    def copy_install_layer(self, plan: InstallPlan, blobs: torch.Tensor, layer: int) -> None:
        """Copy one layer of the planned pages (and of the codebooks they open) out of ``blobs``, on
        the current stream."""
        if not plan.new_pages:
            return
        pool, (start, pb) = self.packed, self.group.page_span(layer)
        device = pool.device
        idx = plan.index(blobs.device, device)
        pool.pages[layer][idx["pages"]] = blobs[idx["rows"], start : start + pb].to(device)
        start, cb = self.group.book_span(layer)
        if plan.new_slots and cb:
            pool.codebooks[layer][idx["slots"]] = blobs[idx["slot_rows"], start : start + cb].to(device)

    def finish_install(self, plan: InstallPlan) -> None:
        for page in plan.new_pages + plan.pinned:
            self.packed.allocator.decref(page)  # unreferenced: cached until a request takes it

    def set_layer_events(self, events: Sequence | None) -> None:
        """CUDA events, one per layer, recorded after a restore's copies of that layer: kernels that
        read layer i first make the current stream wait for event i (no host synchronisation)."""
        self._layer_events = list(events) if events else None

    def wait_layer(self, layer: int) -> None:
        events = self._layer_events
        if events is not None:
            torch.cuda.current_stream(self.packed.device).wait_event(events[layer])

    # -- lifetime ---------------------------------------------------------------------------
    def fork(self, request_id: int) -> int:
        """A new request sharing the packed pages and owning a copy of the active chunk."""
        src = self._table(request_id)
        dense = self.dense.allocator.allocate(len(src.dense))  # raises CacheFull before any change
        for page in src.packed:
            self.packed.allocator.incref(page)
        if dense:
            self.dense.data[:, dense] = self.dense.data[:, src.dense]
        table = PageTable(next(self._ids), src.num_layers, src.page_size, token_ids=list(src.token_ids),
                          packed=list(src.packed), dense=dense, lengths=list(src.lengths),
                          states=[s.clone() for s in src.states], last_hash=src.last_hash)
        self._tables[table.request_id] = table
        return table.request_id

    def free(self, request_id: int) -> None:
        """Drop a request. Its hashed packed pages stay cached (tail pages evicted first)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            raise UnknownRequest(f"request {request_id} is unknown or already freed")
        for page in reversed(table.dense):
            self.dense.allocator.decref(page)
        for page in reversed(table.packed):
            self.packed.allocator.decref(page)

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.geometry.num_layers:
            raise InvalidKV(f"layer {layer!r} out of range 0..{self.geometry.num_layers - 1}")

    def _table(self, request_id: int) -> PageTable:
        try:
            return self._tables[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id} is unknown or already freed") from None

    @property
    def request_ids(self) -> list[int]:
        return list(self._tables)

    # -- accounting -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        live_pages = sum(s is not None for s in self.packed.slot_of_page)
        packed_bytes = self.packed.stored_bytes()
        tokens = live_pages * self.config.page_size
        values = tokens * self.geometry.num_layers * self.geometry.values_per_token
        return CacheStats(
            dense_pages_used=self.dense.allocator.num_used,
            packed_pages_used=self.packed.allocator.num_used,
            packed_pages_cached=self.packed.allocator.num_cached,
            codebook_slots_used=len(self.packed.live_slots()),
            requests=len(self._tables),
            dense_bytes=self.dense.allocator.num_used * self.dense.page_bytes * self.geometry.num_layers,
            packed_bytes=packed_bytes,
            packed_tokens=tokens,
            bits_per_value=8.0 * packed_bytes / values if values else None,
            deferred_chunks=sum((t.num_tokens - t.num_packed_tokens) // self.config.chunk_tokens
                                for t in self._tables.values()),
        )

    def check(self) -> None:
        """Assert every pool invariant, including that ref counts match the page tables."""
        self.dense.allocator.check()
        self.packed.allocator.check()
        self.packed.slots.check()
        dense_refs: dict[int, int] = {}
        packed_refs: dict[int, int] = {}
        for table in self._tables.values():
            for page in table.dense:
                dense_refs[page] = dense_refs.get(page, 0) + 1
            for page in table.packed:
                packed_refs[page] = packed_refs.get(page, 0) + 1
        for page in range(self.dense.allocator.num_pages):
            assert self.dense.allocator.ref_count(page) == dense_refs.get(page, 0), f"dense page {page} refs"
        for page in range(self.packed.allocator.num_pages):
            assert self.packed.allocator.ref_count(page) == packed_refs.get(page, 0), f"packed page {page} refs"
        slot_refs: dict[int, int] = {}
        for slot in self.packed.slot_of_page:
            if slot is not None:
                slot_refs[slot] = slot_refs.get(slot, 0) + 1
        for slot in range(self.packed.slots.num_pages):
            assert self.packed.slots.ref_count(slot) == slot_refs.get(slot, 0), f"codebook slot {slot} refs"
