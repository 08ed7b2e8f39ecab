"""`KVCache`: the facade engines talk to. Admit, append, complete chunks, read, fork, free."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import secrets
from collections.abc import Sequence

import torch

from kvbackend.accounting import CacheStats, cache_stats, check_cache
from kvbackend.batch import BatchPlan, ints_on_device, plan_batch
from kvbackend.codecs.base import add_step_moments, book_step_moments, prepare_kv, step_parts
from kvbackend.errors import CacheFull, InvalidKV, SpecError, UnknownRequest
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.frames import SINK_FIELDS, LeverFrame, without_sinks
from kvbackend.install import PageGroups
from kvbackend.layers import build_layers, cache_fingerprint
from kvbackend.page_check import PageCheck
from kvbackend.page_group import PageGroupFormat
from kvbackend.hashing import token_list
from kvbackend.page_table import PageTable
from kvbackend.pool import DensePool, PackedPool
from kvbackend.prefix_index import PrefixIndex
from kvbackend.rope import Rotary
from kvbackend.step_state import CacheLock, MomentBuffers, StepInts, stream_key
from kvbackend.switches import switched_off

FP16_MAX = 65504.0  # largest finite float16

log = logging.getLogger(__name__)


def _locked(method):
    """A `KVCache` method run under the cache's lock (`CacheLock`: calls of several threads take turns)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


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

    def __init__(self, geometry: Geometry, config: CacheConfig | None = None, rotary: Rotary | None = None) -> None:
        """``rotary``: the model's RoPE (`kvbackend.rope.rotary_from_config`), needed by codecs with
        ``prerope=true`` or ``pagerope=true``; it then enters the fingerprint."""
        self._lock = CacheLock()  # (first: every public call takes it)
        self.geometry = geometry
        self.config = config or CacheConfig()
        self.codecs, self.layouts, self.backends = build_layers(geometry, self.config)
        # the levers each layer applies
        self.frames = [LeverFrame(codec.levers, rotary, self.config.page_size) for codec in self.codecs]
        for layer, frame in enumerate(self.frames):
            frame.check(self.config.page_size, f"layer {layer} ({self.codecs[layer].spec_string})", geometry.head_dim)
        self.uniform = len({lay.fingerprint for lay in self.layouts}) == 1  # one byte layout (spellings may differ)
        # per layer, the largest |K|, |V| stored and read without saturating: the codec's fields, and the fp16
        # operands of the kernels' attention (a bf16 or float32 value past 65504 would become inf, then NaN)
        self.kv_limits = [self._limits(layer) for layer in range(geometry.num_layers)]
        self.dense = DensePool(geometry, self.config)
        self.packed = PackedPool(self.layouts, self.config)
        self.fingerprint = cache_fingerprint(geometry, self.config, self.layouts,
                                             rotary if any(f.levers.rope for f in self.frames) else None)
        self.group = PageGroupFormat.of(self.layouts, self.fingerprint)  # the bytes of an exported page
        # the fingerprint is mixed into every page key: two caches of other layouts that share a tier (a host tier
        # handed to both) never file their pages under one key, where one's put would replace the other's blob
        self.index = PrefixIndex(self.packed.allocator, self.config.page_size,
                                 (self.fingerprint, *self.config.extra_keys))
        # export and install of page groups; restored ones pass the range checks of their index fields first
        self.page_check = PageCheck.of([(f"layer {layer}", self.group.page_offsets[layer], codec, layout)
                                        for layer, (codec, layout) in enumerate(zip(self.codecs, self.layouts))])
        self.groups = PageGroups(self.packed, self.group, self.index, self.page_check)
        self._tables: dict[int, PageTable] = {}
        self._ids = itertools.count()
        self._layer_events: list | None = None  # per-layer CUDA events of the last layered restore
        # what a decode step's layers share (`append_step`): its device ints and RoPE tables, the statistics' buffers,
        # and per layer the states the last step added to in place
        self._step: StepInts | None = None
        self._moments = MomentBuffers(geometry.num_kv_heads, geometry.head_dim, self.dense.data.device)
        self._step_memos: list[dict] = [{} for _ in range(geometry.num_layers)]

    def _limits(self, layer: int) -> tuple[float, float, str]:
        """(keys, values, what sets them) for `prepare_kv` of ``layer``: the codec's bound (`Codec.max_abs`), and
        where kernels read the layer, float16's range in the stored frame (a key before RoPE is a rotation of a
        channel pair, up to sqrt(2) times its channels; a Hadamard-rotated value up to sqrt(head_dim) times)."""
        codec = self.codecs[layer]
        bounds = codec.max_abs(self.geometry)
        if self.backends[layer].name != "torch":
            caps = (FP16_MAX / (math.sqrt(2.0) if codec.levers.rope else 1.0),
                    FP16_MAX / (math.sqrt(self.geometry.head_dim) if codec.levers.vrot != "none" else 1.0))
        else:
            caps = (math.inf, math.inf)
        limits = tuple(min(b, cap) for b, cap in zip(bounds, caps))
        why = []
        if any(b == limit for b, limit in zip(bounds, limits) if math.isfinite(limit)):
            why.append(f"layer {layer}'s codec {codec.spec_string} stores values up to it; the bf16 or identity "
                       "codec stores more")
        if any(b > limit for b, limit in zip(bounds, limits)):
            why.append(f"the {self.backends[layer].name} backend's attention reads K/V (in the stored frame) as "
                       "float16; backend='torch' reads them in float32")
        return limits[0], limits[1], "; ".join(why)

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

    # -- admission --------------------------------------------------------------------------
    @_locked
    def add_request(self, token_ids: Sequence[int] = ()) -> tuple[int, int]:
        """Admit a request. Returns (request id, number of prefix tokens already cached).

        At most ``len(token_ids) - 1`` tokens are reported cached, so the engine always computes
        the last prompt token's logits.
        """
        tokens = token_list(token_ids)
        table = PageTable(next(self._ids), self.geometry.num_layers, self.config.page_size, token_ids=tokens)
        table.packed, table.last_hash = self.index.match(tokens)
        table.lengths = [table.num_packed_tokens] * self.geometry.num_layers
        if table.packed:  # warm-start k-means from the reused prefix's last codebook
            self._settle()
            slot = self.packed.slot_of_page[table.packed[-1]]
            for layer, state in enumerate(table.states):
                warm = self.codecs[layer].warm_start(self.layouts[layer], self.packed.codebooks[layer][slot])
                state.centroids.update({name: t.clone() for name, t in warm.items()})
        self._tables[table.request_id] = table
        return table.request_id, table.num_packed_tokens

    @_locked
    def extend_tokens(self, request_id: int, token_ids: Sequence[int]) -> None:
        """Record the ids of generated tokens, so their pages can be hashed and shared later."""
        self._table(request_id).token_ids.extend(token_list(token_ids))  # all checked before any is recorded

    # -- writing ----------------------------------------------------------------------------
    @_locked
    def append(self, request_id: int, layer: int, k: torch.Tensor, v: torch.Tensor,
               queries: torch.Tensor | None = None) -> None:
        """Append ``[T, H, D]`` keys and values of one layer. Encodes a chunk once every layer filled it.

        ``queries [T, Hq, D]`` (optional, same tokens, same frame as ``k``) feed query-aware codecs
        (``quantwm``): a chunk is encoded with the second moment of the queries of its own and
        earlier tokens only.

        A chunk that completes while the packed pool (or its codebook slots) is full stays in the
        dense pool as it is and is encoded by a later append once room exists: a step whose first
        layers were appended never fails at its last one. So does a chunk whose encode fails (a device
        out of memory, ...): the error is logged and the encode is tried again a page of tokens later.

        Raises:
            UnknownRequest, InvalidKV, CacheFull (the dense pool is full; nothing is written when it
            is raised).
        """
        table = self._table(request_id)
        self._check_layer(layer)
        k, v, queries = prepare_kv(k, v, queries, self.geometry, self.dense.data.device, self.config.check_finite,
                                   self.kv_limits[layer][:2], self.kv_limits[layer][2])
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
        self._appended(table, layer, n, queries)

    @_locked
    def append_step(self, request_ids: Sequence[int], layer: int, k: torch.Tensor, v: torch.Tensor,
                    queries: torch.Tensor | None = None) -> None:
        """Append one token per request of a decode batch to one layer: ``k``, ``v`` ``[B, H, D]`` (row i
        for ``request_ids[i]``), ``queries`` ``[B, Hq, D]`` or None. The same as `append` of each row, with
        one check and one scatter into the dense pool for the batch.

        Raises:
            UnknownRequest, InvalidKV (also for a request named twice), CacheFull (the dense pages the
            batch needs are not free; nothing is written when it is raised).
        """
        if type(request_ids) is list and all(type(rid) is int for rid in request_ids):
            ids = request_ids  # (an engine's list of ids, each layer of a step: no conversion)
        else:
            ids = [_request_id(rid) for rid in request_ids]  # a tensor or list of ids alike
        if not ids:
            return  # an empty batch appends nothing
        tables = list(map(self._tables.get, ids))
        if any(table is None for table in tables):
            tables = [self._table(rid) for rid in ids]  # UnknownRequest for the first unknown id
        self._check_layer(layer)
        if len(set(ids)) != len(ids):
            raise InvalidKV(f"a decode step appends one token per request; request ids repeat in {ids}")
        if not isinstance(k, torch.Tensor) or k.dim() != 3 or k.shape[0] != len(ids):
            got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise InvalidKV(f"k must be a tensor [{len(ids)}, H, D] (one row per request), got {got}")
        k, v, queries = prepare_kv(k, v, queries, self.geometry, self.dense.data.device, self.config.check_finite,
                                   self.kv_limits[layer][:2], self.kv_limits[layer][2])
        pool = self.dense.data.untyped_storage().data_ptr()
        if k.untyped_storage().data_ptr() == pool or v.untyped_storage().data_ptr() == pool:
            k, v = k.clone(), v.clone()  # rows read from the pool itself (index_copy_ refuses a source it overlaps)
        p = self.config.page_size
        starts = [table.lengths[layer] - len(table.packed) * p for table in tables]  # `dense_tokens`
        needs = [start // p == len(table.dense) for table, start in zip(tables, starts)]
        # Check, then commit: every page the batch needs is allocated before any write.
        if not self.dense.allocator.can_allocate(sum(needs)):
            raise CacheFull("dense", sum(needs), self.dense.allocator.num_free)
        new_pages = iter(self.dense.allocator.allocate(sum(needs)))
        for table, need in zip(tables, needs):
            if need:
                table.dense.append(next(new_pages))
        step = self._step_ints([table.dense[start // p] for table, start in zip(tables, starts)],
                               [start % p for start in starts], [table.lengths[layer] for table in tables])
        rows = self.dense.data[layer].view(-1, *k.shape[1:])  # [pages * 2 * P, H, D]: K rows, then V rows, per page
        rows.index_copy_(0, step.key_rows, k)  # (an index_put_ with int32 page ids and offsets converted both to
        rows.index_copy_(0, step.value_rows, v)  # int64 on every call: four more kernels a layer)
        chunk_tokens = self.config.chunk_tokens
        if queries is not None and self.codecs[layer].uses_queries:  # one batched product, then a sum per request
            # each request's queries booked before its token is (which may complete a chunk)
            states = [table.states[layer] for table in tables]
            chunks = [table.lengths[layer] // chunk_tokens for table in tables]
            heads, count, memo = self.geometry.num_kv_heads, queries.shape[1] // self.geometry.num_kv_heads, \
                self._step_memos[layer]
            kernel = self.backends[layer].name == "triton"
            # the parts of the last step's chunks, where they all took it in place: the kernel adds into them (its
            # checks cost about 150 us a layer at B=46, so only where the kernel will take these queries)
            parts = step_parts(states, chunks, memo, heads, self.geometry.head_dim, queries.device) \
                if kernel and not switched_off("KVBACKEND_STEP_PARTS") and self.frames[layer].step_kernel_takes(
                    queries) else None
            if parts is not None and self.frames[layer].add_step_query_moments(queries, step.positions, step.rope,
                                                                               heads, parts):
                book_step_moments(states, chunks, count)
            else:
                moments, sums, *rows = self._moments.get(len(ids))
                self.frames[layer].step_query_moments(queries, step.positions, step.rope, heads, (moments, sums),
                                                      kernel=kernel)
                add_step_moments(states, chunks, moments, count, sums, rows, memo)
        for table, start in zip(tables, starts):
            table.lengths[layer] += 1  # (`_appended` of one token without queries)
            if start + 1 >= chunk_tokens:  # a chunk may be complete in every layer (`num_tokens` <= this length)
                self._pack_completed(table)

    def _step_ints(self, pages: list[int], offsets: list[int], positions: list[int]) -> StepInts:
        """The step's dense rows and positions on the device: copied there by the step's first layer, reused by the
        others (and by any call with the same lists on the same stream: the copy is queued on the stream that made
        it, and a layer on another stream would not wait for it)."""
        device = self.dense.data.device
        key = (stream_key(device), tuple(pages), tuple(offsets), tuple(positions))
        step = self._step
        if step is None or step.key != key:
            p, b = self.config.page_size, len(pages)
            keys = [2 * p * page + offset for page, offset in zip(pages, offsets)]
            rows, positions = ints_on_device([keys + [row + p for row in keys], positions], device)
            rows = rows.long()
            step = self._step = StepInts(key, rows[:b], rows[b:], positions)
        return step

    def _appended(self, table: PageTable, layer: int, n: int, queries: torch.Tensor | None) -> None:
        """Book ``n`` tokens just written to ``layer`` of ``table``: their queries (query-aware codecs),
        the layer's length, and every chunk the request completed."""
        if queries is not None and self.codecs[layer].uses_queries:
            chunk_tokens = self.config.chunk_tokens
            base = table.lengths[layer]  # position of this call's first token
            queries = self.frames[layer].queries_to_stored(queries, base)  # the frame its keys are encoded in
            offset = 0  # split at chunk boundaries
            while offset < n:
                chunk = (base + offset) // chunk_tokens
                stop = min(n, (chunk + 1) * chunk_tokens - base)
                table.states[layer].add_queries(chunk, queries[offset:stop], self.geometry.num_kv_heads)
                offset = stop
        table.lengths[layer] += n  # the tokens are written: nothing below fails this call
        self._pack_completed(table)

    def _pack_completed(self, table: PageTable) -> None:
        """Encode every chunk ``table`` completed in every layer (while the pools can take it)."""
        while (table.num_tokens - table.num_packed_tokens >= self.config.chunk_tokens
               and table.num_tokens >= table.retry_packing_at and self._can_pack()):
            try:
                self._complete_chunk(table)
            except Exception as exc:  # noqa: BLE001 - the chunk stays dense (exact); tried again a page later
                table.retry_packing_at = table.num_tokens + self.config.page_size
                log.error("kvbackend: encoding a chunk of request %d failed; it stays in the dense pool and is "
                          "encoded again later: %r", table.request_id, exc)
                break

    def _can_pack(self) -> bool:
        """Whether one more chunk's pages and codebook slot can be allocated, exactly as
        `_complete_chunk` will allocate them: the pages first (free pages, then cached ones in LRU
        order, whose eviction releases a slot once its last page goes), then one slot; where neither frees a
        slot, the cached pages of a slot none of whose pages is in use are evicted first."""
        pool = self.packed
        if not pool.allocator.can_allocate(self.config.chunk_pages):
            return False
        return pool.slots.can_allocate(1) or self._allocation_frees_a_slot() or pool.idle_slot() is not None

    def _allocation_frees_a_slot(self) -> bool:
        """Whether the cached pages `allocate(chunk_pages)` evicts include every page of some slot."""
        pool, evicted = self.packed, {}  # slot -> its pages the allocation would evict
        for page in pool.allocator.eviction_order(self.config.chunk_pages):
            slot = pool.slot_of_page[page]
            evicted[slot] = evicted.get(slot, 0) + 1
        return any(pool.slots.ref_count(slot) == n for slot, n in evicted.items())

    def _complete_chunk(self, table: PageTable) -> None:
        cfg, pool = self.config, self.packed
        self._settle()  # the pages allocated below may have been a restore's, still being copied
        if not pool.slots.can_allocate(1) and not self._allocation_frees_a_slot():
            # every slot is held by chunks reduced to cached pages (their tails went to a lower tier): the least
            # recently used such chunk's pages go, and its slot with them (`_can_pack` found one)
            idle = pool.idle_slot()
            if idle is not None:
                pool.evict_slot(idle)
        chunk_dense = table.dense[: cfg.chunk_pages]
        new_pages = pool.allocator.allocate(cfg.chunk_pages)  # `_can_pack` said both allocations succeed
        (slot,) = pool.slots.allocate(1)
        pool.bind(new_pages, slot)
        pool.slots.decref(slot)  # the pages hold the slot now; drop the allocation's own ref
        page_ids = torch.tensor(new_pages, dtype=torch.int32, device=self.dense.data.device)
        first = table.num_packed_tokens  # position of the chunk's first token
        chunk_index = first // cfg.chunk_tokens
        try:
            groups: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # layers encoded in one pass
            sinks = []  # (layer, its codebook slot, exact K and V of the sequence's first tokens)
            dropped = [layer for layer in range(self.geometry.num_layers)
                       if table.states[layer].close_chunk(chunk_index)]
            if dropped:  # queries appended unchecked (check_finite=False) held NaN or Inf
                log.warning("kvbackend: request %d, chunk %d: the queries booked in layer(s) %s hold NaN or Inf; "
                            "their statistics are dropped and the chunk is encoded with what is left (append finite "
                            "queries, or keep check_finite=True)", table.request_id, chunk_index, dropped)
            for layer in range(self.geometry.num_layers):
                kv = self.dense.data[layer, chunk_dense]  # [pages, 2, P, H, D]
                k = kv[:, 0].reshape(-1, *kv.shape[-2:])
                v = kv[:, 1].reshape(-1, *kv.shape[-2:])
                frame, book = self.frames[layer], pool.codebooks[layer][slot]
                key = self._encode_group(layer)
                if key is not None:  # into the stored frame with the group's other layers, in one pass
                    groups.setdefault(key, []).append((layer, k, v))
                else:
                    ks, vs = self._stored(layer, k, v, first)
                    self.backends[layer].encode_chunk(self.codecs[layer], self.layouts[layer], ks, vs,
                                                      table.states[layer], pool.pages[layer], page_ids, book)
                if frame.levers.sink and first == 0:
                    sinks.append((layer, book, k[: frame.levers.sink], v[: frame.levers.sink]))
            for batch in self._merged(groups):
                stored = []
                for members in batch:
                    layers = [layer for layer, _, _ in members]
                    stored.append((layers, *self._stored(layers, torch.stack([k for _, k, _ in members]),
                                                         torch.stack([v for _, _, v in members]), first)))
                if len(stored) == 1 or not self._encode_mixed(table, stored, page_ids, slot):
                    for layers, ks, vs in stored:
                        self._encode_layers(table, layers, ks, vs, page_ids, slot)
            for layer, book, k, v in sinks:  # the sequence's first tokens, exact, with the chunk (after its codebook)
                for name, x in zip(SINK_FIELDS, (k, v)):
                    field = self.layouts[layer].codebook.view(book, name)
                    big = torch.finfo(field.dtype).max  # a float32 cache's sinks are 16-bit: past it, refused
                    if x.dtype != field.dtype and not bool(x.abs().amax() <= big):
                        raise InvalidKV(f"layer {layer}'s sink tokens hold values past the {big:.6g} of their "
                                        f"{str(field.dtype).replace('torch.', '')} fields; nothing was stored")
                    field.copy_(x)
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
        table.version += 1  # plans of the dense pages freed below are stale
        for page in reversed(chunk_dense):
            self.dense.allocator.decref(page)
        self.index.publish(table, new_pages, first_token)

    def _encode_group(self, layer: int) -> tuple | None:
        """The key of the layers whose chunks `_encode_layers` encodes in one pass with ``layer``'s (one codec
        spec, byte layout and backend, which batches them: `Codec.encode_units`, on the Triton backend with the
        kernels' one-pass encode where it serves), or None where ``layer`` encodes alone (a GPU encode kernel of
        one chunk, or a codec that does not batch)."""
        codec, backend = self.codecs[layer], self.backends[layer]
        if not codec.batch_encodes or (backend.name != "torch" and codec.kernel_encodes):
            return None
        return codec.spec_string, self.layouts[layer].fingerprint, backend.name

    def _merged(self, groups: dict) -> list[list]:
        """The one-pass groups of `_encode_group` batched further where their backend encodes layers of several
        codecs in one pass (`TritonBackend.encode_mixed`: a ``depth:`` spec's layers, which differ only in key
        code width and outlier count, share one k-means pass); each batch a list of groups' members."""
        batches: dict[tuple, list] = {}
        for key, members in groups.items():
            layer = members[0][0]
            backend = self.backends[layer]
            mix = backend.clustering_key(self.codecs[layer]) if hasattr(backend, "encode_mixed") else None
            batches.setdefault(key if mix is None else ("mixed", backend.name, mix), []).append(members)
        return list(batches.values())

    def _encode_mixed(self, table: PageTable, stored: list, page_ids: torch.Tensor, slot: int) -> bool:
        """Encode the chunk of several groups' layers (``stored``: (layers, K, V) of each, in the stored frame) in
        one pass of their backend, or return False, before writing anything, where it does not take them."""
        layers = [layer for group, _, _ in stored for layer in group]
        parts, at = [], 0
        for group, _, _ in stored:
            parts.append((self.codecs[group[0]], self.layouts[group[0]], list(range(at, at + len(group)))))
            at += len(group)
        encoded = self.backends[layers[0]].encode_mixed(parts, torch.cat([ks for _, ks, _ in stored]),
                                                        torch.cat([vs for _, _, vs in stored]),
                                                        [table.states[layer] for layer in layers])
        if encoded is None:
            return False
        pool, rows = self.packed, page_ids.long()
        for (group, _, _), (pages, books) in zip(stored, encoded):
            for i, layer in enumerate(group):
                pool.pages[layer][rows] = pages[i]
                pool.codebooks[layer][slot].copy_(books[i])
        return True

    def _stored(self, layers, k: torch.Tensor, v: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's K and V (``[T, H, D]`` of one layer, or ``[L, T, H, D]`` of ``layers``, which share one codec
        spec and so one set of levers) in the stored frame, with a sequence's exact sink tokens taken out of the
        codec's statistics (they replace these rows on read). Several layers go in one pass: the bits of one
        layer at a time (`LeverFrame.to_stored`)."""
        frame = self.frames[layers[0] if isinstance(layers, list) else layers]
        ks, vs = frame.to_stored(k, v, first) if frame.levers.active else (k, v)
        if frame.levers.sink and first == 0:
            ks, vs = without_sinks(ks, vs, frame.levers.sink)
        return ks, vs

    def _encode_layers(self, table: PageTable, layers: list[int], ks: torch.Tensor, vs: torch.Tensor,
                       page_ids: torch.Tensor, slot: int) -> None:
        """Encode one chunk of several ``layers`` (stored K and V ``[L, T, H, D]``) in one codec pass, each
        layer from its own state (warm starts, query statistics): the bytes a layer-by-layer encode writes,
        with one pass's host overhead instead of one per layer (the reference encoder is launch-bound on a GPU)."""
        codec, layout = self.codecs[layers[0]], self.layouts[layers[0]]
        states = [table.states[layer] for layer in layers]
        pages, books = self.backends[layers[0]].encode_units(codec, layout, ks, vs, states)
        pool, rows = self.packed, page_ids.long()
        for i, layer in enumerate(layers):
            pool.pages[layer][rows] = pages[i]
            pool.codebooks[layer][slot].copy_(books[i])

    # -- reading ----------------------------------------------------------------------------
    @_locked
    def read(self, request_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K and V for a request, ``[tokens, H, D]``: packed pages decoded by the
        torch reference, then the active chunk as stored."""
        pk, pv = self.read_packed(request_id, layer)
        dk, dv = self.read_dense(request_id, layer)
        return torch.cat([pk, dk]), torch.cat([pv, dv])

    @_locked
    def read_packed(self, request_id: int, layer: int, first_page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruction of the request's packed pages from ``first_page`` on, ``[pages * P, H, D]``.

        Packed pages never change, so callers can keep what they decoded and ask only for new pages.
        """
        table = self._table(request_id)
        self._check_layer(layer)
        self.wait_layer(layer)
        index = _as_index(first_page)
        if index is None or index < 0:
            raise InvalidKV(f"first_page must be an int >= 0, got {first_page!r}")
        first_page = index
        keys, values = [self._empty()], [self._empty()]
        frame, layout, p = self.frames[layer], self.layouts[layer], self.config.page_size
        position = first_page * p
        for slot, pages in self._runs(table.packed[first_page:]):
            book = self.packed.codebooks[layer][slot]
            k, v = self.codecs[layer].decode_pages(layout, self.packed.pages[layer][pages], book)
            if frame.levers.active:
                k, v = frame.from_stored(k, v, position)
                if frame.levers.sink and position == 0:  # page 0 starts the sequence: its chunk holds the sinks
                    sink = frame.levers.sink
                    k[:sink] = layout.codebook.view(book, "sink_k").to(k.dtype)
                    v[:sink] = layout.codebook.view(book, "sink_v").to(v.dtype)
            keys.append(k)
            values.append(v)
            position += len(pages) * p
        return torch.cat(keys), torch.cat(values)

    @_locked
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
    @_locked
    def plan(self, request_ids: list[int], layer: int = 0) -> BatchPlan:
        """Flatten the batch's page tables once; reuse the plan for every layer of one step."""
        for rid in request_ids:
            self._table(rid)
        self._check_layer(layer)
        # ints, as the tables are keyed (a 0-d tensor hashes by identity: the plan would never match a table again)
        return plan_batch(self, [_request_id(rid) for rid in request_ids], layer)

    @_locked
    def gather(self, plan: BatchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every planned token's K and V, ``[total_tokens, H, D]`` in ``plan.cu_seqlens`` order."""
        self._check_layer(layer)
        self._check_plan(plan, layer)
        self.wait_layer(layer)
        return self.backends[layer].gather(self, plan, layer)

    @_locked
    def decode(self, plan: BatchPlan, layer: int, q: torch.Tensor, scale: float | None = None):
        """Decode attention of one query per planned request: (output [B, Hq, D], lse [B, Hq])."""
        self._check_layer(layer)
        self._check_plan(plan, layer)
        empty = [rid for rid, (_, _, tokens) in zip(plan.request_ids, plan.tables) if not tokens]
        if empty:  # (the torch path answered zeros with an lse of -inf, the kernels refused: now both refuse)
            raise InvalidKV(f"every request in a decode batch needs at least one token; request {empty[0]} holds "
                            f"none in layer {layer} (append its first token before decoding it)")
        plan.check_queries(q, self.geometry.num_kv_heads, self.geometry.head_dim)
        self.wait_layer(layer)
        return self.backends[layer].decode(self, plan, layer, q, scale)

    def _check_plan(self, plan: BatchPlan, layer: int) -> None:
        """Refuse a plan whose requests were freed or packed a chunk since: its page ids may name pages another
        request holds now (the kernels would read them; a plan is for one step, made after its appends). Refuse it
        too on a layer whose requests hold another number of tokens than planned: the kernels would read rows of a
        dense page the request never wrote there (a freed request's), the torch path rows past the plan's."""
        for rid, (table, version, tokens) in zip(plan.request_ids, plan.tables):
            if self._tables.get(rid) is not table:
                raise UnknownRequest(f"the plan is stale: request {rid} was freed after it was planned")
            if table.version != version:
                raise InvalidKV(f"the plan is stale: request {rid} packed a chunk after it was planned "
                                f"(its dense pages went back to the pool); plan the batch again")
            if table.lengths[layer] != tokens:
                raise InvalidKV(f"the plan does not fit layer {layer}: request {rid} holds {table.lengths[layer]} "
                                f"tokens there, the plan {tokens}; plan after appending, or plan this layer")

    def page_table(self, request_id: int) -> PageTable:
        return self._table(request_id)

    def num_tokens(self, request_id: int) -> int:
        return self._table(request_id).num_tokens

    # -- moving pages between tiers (driven by kvbackend.tiers; the core stays tier-agnostic) ---
    def prefix_keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained keys of the full pages of a prompt that `add_request` could reuse."""
        return self.index.keys(token_ids)

    def device_prefix(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (from the start) have a packed page on the device."""
        return self.index.resident(keys)

    @property
    def blob_bytes(self) -> int:
        """Largest exported page group (see `kvbackend.page_group`): every layer's packed page, the
        trailer, then every layer's codebook slot when this page carries it."""
        return self.group.blob_bytes

    def page_span(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of ``layer``'s page inside an exported page group."""
        return self.group.page_span(layer)

    @_locked
    def export_page(self, page: int) -> torch.Tensor:
        """A copy of one packed page group (uint8, 1-D); see `kvbackend.install.PageGroups.export`.

        Raises:
            ValueError: ``page`` is not a live packed page.
        """
        page = self._check_page(page)
        self._settle()
        return self.groups.export(page)

    @_locked
    def evictable_pages(self) -> list[tuple[int, int]]:
        """(page, key) of unreferenced cached packed pages, least recently used first."""
        allocator = self.packed.allocator
        return [(page, allocator.page_hash(page)) for page in allocator.cached_pages()]

    @_locked
    def drop_cached(self, page: int) -> None:
        """Free a cached packed page whose bytes now live in a lower tier.

        Raises:
            ValueError: ``page`` is not a cached (unreferenced) packed page.
        """
        page = self._check_page(page)
        if not self.packed.allocator.is_cached(page):
            raise ValueError(f"packed page {page} is not cached (a request holds it, or it is free)")
        self.packed.allocator.evict_cached(page)

    def _check_page(self, page: int) -> int:
        """``page`` as the int it names (numpy and 0-d integer tensors too, as request ids); ValueError for a bool,
        a float or a page out of range."""
        index = _as_index(page)
        if index is None or not 0 <= index < self.packed.allocator.num_pages:
            raise ValueError(f"packed page {page!r} out of range 0..{self.packed.allocator.num_pages - 1}")
        return index

    @_locked
    def drop_cached_page(self, page: int, key: int) -> bool:
        """Free ``page`` if it is still a cached (unreferenced) page keyed ``key``, as `evictable_pages` named it
        before its bytes were written down; whether it was freed (a request took it meanwhile, or it was evicted
        and reused: it stays)."""
        allocator = self.packed.allocator
        if allocator.lookup(key) != page or not allocator.is_cached(page):
            return False
        allocator.evict_cached(page)
        return True

    @_locked
    def install_pages(self, keys: Sequence[int], token_ids: Sequence[int], blobs: torch.Tensor, first_page: int,
                      resident: Sequence[bool] | None = None, sizes: Sequence[int | None] | None = None,
                      hold: Sequence[int] = ()) -> int:
        """Put restored page groups back as cached pages; see `kvbackend.install.PageGroups.install`.

        Raises:
            ValueError: ``keys`` are not the chained keys of pages ``first_page ...`` of ``token_ids`` (too few
                token ids, or other ones: such pages would be keyed yet never match a prompt, and would stand in
                for the real ones in every later restore), or ``resident``/``sizes`` do not give one entry a key.
            InvalidKV: a token id that is not an integer in 0..2^63-1.
        """
        keys = list(keys)
        index = _as_index(first_page)
        if index is None or index < 0:
            raise ValueError(f"install_pages: first_page must be an int >= 0, got {first_page!r}")
        first_page = index
        for name, given in (("resident", resident), ("sizes", sizes)):
            if given is not None and len(given) != len(keys):
                raise ValueError(f"install_pages: {name} has {len(given)} entries for {len(keys)} keys")
        tokens = token_list(token_ids)
        try:
            chain = self.index.page_keys(tokens, first_page + len(keys))
        except ValueError as exc:
            raise ValueError(f"install_pages: {exc} (pages {first_page}..{first_page + len(keys) - 1})") from None
        if chain[first_page:] != keys:
            wrong = next(i for i, (a, b) in enumerate(zip(chain[first_page:], keys)) if a != b)
            raise ValueError(f"install_pages: keys[{wrong}] is not the key of page {first_page + wrong} of token_ids "
                             f"(keys must be `prefix_keys` of the same tokens, with this cache's extra_keys)")
        return self.groups.install(keys, tokens, blobs, first_page, resident, sizes, hold)

    def set_layer_events(self, events: Sequence | None) -> None:
        """CUDA events, one per layer, recorded after a restore's copies of that layer: kernels that
        read layer i first make the current stream wait for event i (no host synchronisation)."""
        self._layer_events = list(events) if events else None

    def wait_layer(self, layer: int) -> None:
        events = self._layer_events
        if events is not None:
            torch.cuda.current_stream(self.packed.device).wait_event(events[layer])

    def _settle(self) -> None:
        """Make the current stream wait for every layer of the last restore (its last event follows all its
        copies): work other than attention of one layer (exports, chunk encodes into pages a restore may
        still be filling, codebook reads) must see the restored bytes."""
        if self._layer_events is not None:
            self.wait_layer(self.geometry.num_layers - 1)

    # -- lifetime ---------------------------------------------------------------------------
    @_locked
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

    @_locked
    def free(self, request_id: int) -> None:
        """Drop a request. Its hashed packed pages stay cached (tail pages evicted first)."""
        table = self._tables.pop(_request_id(request_id), None)
        if table is None:
            raise UnknownRequest(f"request {request_id} is unknown or already freed")
        for page in reversed(table.dense):
            self.dense.allocator.decref(page)
        for page in reversed(table.packed):
            self.packed.allocator.decref(page)

    def _check_layer(self, layer: int) -> None:
        try:  # numpy and 0-d tensor ints too, as request ids
            index = None if isinstance(layer, bool) else operator.index(layer)
        except TypeError:
            index = None
        if index is None or not 0 <= index < self.geometry.num_layers:
            raise InvalidKV(f"layer {layer!r} out of range 0..{self.geometry.num_layers - 1}")

    def _table(self, request_id: int) -> PageTable:
        table = self._tables.get(_request_id(request_id))  # (its own UnknownRequest for a non-int id)
        if table is None:
            raise UnknownRequest(f"request {request_id!r} is unknown or already freed")
        return table

    @property
    def request_ids(self) -> list[int]:
        return list(self._tables)

    # -- accounting -------------------------------------------------------------------------
    @_locked
    def stats(self) -> CacheStats:
        return cache_stats(self)

    @_locked
    def check(self) -> None:
        """Assert every pool invariant, including that ref counts match the page tables."""
        check_cache(self)


def _as_index(value) -> int | None:
    """``value`` as the int it names (Python, numpy and 0-d integer tensors); None for anything else: a float or a
    bool would be rounded or compare equal to another int (1.7 appended to request 1)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _request_id(request_id) -> int:
    """``request_id`` as the int it names (`_as_index`); UnknownRequest for anything else."""
    index = _as_index(request_id)
    if index is None:
        raise UnknownRequest(f"request ids are ints, got {request_id!r}")
    return index
