"""Host-side planning of a batch of requests for the kernels (the `plan` half of plan/run).

A `BatchPlan` flattens the page tables of a batch into int32 arrays, once per batch; every layer's
kernel launch reuses it. Packed pages come first in each request, then its dense active pages.
"""

from __future__ import annotations

import functools
from itertools import chain
from dataclasses import dataclass

import numpy as np
import torch

from kvbackend.errors import InvalidKV

PACKED, DENSE = 0, 1  # page kinds
# a decode program's set-up and its share of the split merge, in pages of work (`BatchPlan.wave_splits`)
WAVE_FIXED_PAGES = 4


@dataclass
class BatchPlan:
    request_ids: list[int]
    page_ids: torch.Tensor  # int32 [W]: physical page of each work page
    kinds: torch.Tensor  # int32 [W]: PACKED or DENSE
    slots: torch.Tensor  # int32 [W]: codebook slot of packed pages (0 for dense)
    valid: torch.Tensor  # int32 [W]: tokens present in the page (1..P)
    rows: torch.Tensor  # int32 [W]: output row of the page's first token (cu_seqlens-style)
    positions: torch.Tensor  # int32 [W]: sequence position of the page's first token
    req_start: torch.Tensor  # int32 [B]: index of each request's first work page
    req_pages: torch.Tensor  # int32 [B]: work pages per request
    req_packed: torch.Tensor  # int32 [B]: how many of those are packed (they come first)
    cu_seqlens: torch.Tensor  # int32 [B + 1]: token offsets of requests in gathered output
    max_pages: int  # most work pages of any request
    page_size: int
    min_pages: int = 1  # fewest work pages of any request (host-side, so launchers need no device sync)
    # each request's page table, its version and its tokens in the planned layer (`KVCache` refuses the plan once the
    # table or its version changed, and on a layer that holds another number of tokens)
    tables: tuple = ()
    total_tokens: int | None = None  # host copy of cu_seqlens[-1] (None: read from the device when asked)
    chunk_pages: int = 0  # packed pages per codebook slot (a cache's `chunk_pages`; 0: not known)

    @property
    def num_tokens(self) -> int:
        """Tokens of the gathered output; from the host copy where the planner kept one (no device sync)."""
        if self.total_tokens is None:
            self.total_tokens = int(self.cu_seqlens[-1])
        return self.total_tokens

    def check_queries(self, q: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        """Raise InvalidKV unless ``q`` is one query per planned request, ``[B, Hq, D]`` with GQA heads."""
        batch = len(self.request_ids)
        if (not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != batch or q.shape[2] != head_dim
                or q.shape[1] % num_kv_heads or not q.dtype.is_floating_point):
            raise InvalidKV(f"decode queries must be float [{batch}, Hq, {head_dim}] with Hq a multiple of "
                            f"{num_kv_heads}, got {getattr(q, 'shape', q)!r}")

    def splits(self, num_kv_heads: int, target_programs: int = 1024) -> tuple[int, int]:
        """(pages per split, number of splits) so the decode grid has about ``target_programs`` programs."""
        batch = len(self.request_ids)
        wanted = max(1, target_programs // max(batch * num_kv_heads, 1))
        per_split = max(1, -(-self.max_pages // wanted))
        return per_split, max(1, -(-self.max_pages // per_split))

    def wave_splits(self, num_kv_heads: int, wave: int, fixed_pages: int = WAVE_FIXED_PAGES,
                    align: int = 1) -> tuple[int, int]:
        """(pages per split, number of splits) for a kernel that runs ``wave`` programs at once (SMs x resident
        blocks): the split count whose grid wastes the least of its last wave.

        Time is modelled as whole waves times one program's work (its pages plus ``fixed_pages`` of set-up and
        merge). Dividing ``wave`` by the (request, KV head) pairs, as `splits` does, fills one wave when the pairs
        are fewer than a wave, but past it gives one split and a grid of 1.39 waves at 368 pairs (B=46, 8 KV heads,
        264 programs a wave) that runs as two: five splits fill seven waves to 99.6% (perf/NOTES.md, session 46).

        ``align`` > 1 (a codebook layout's pages per slot): only grids whose pages per split divide ``align`` or are
        a multiple of it, so a split that starts inside a chunk stays inside it, and none straddles a chunk boundary
        of a request whose chunks start at multiples of ``align``. A request that adopted a cached prefix ending
        mid-chunk (prefixes are shared page by page) has its own chunks elsewhere: its splits may straddle them,
        which costs speed, never values (every grid covers each page once, in order). At B=46 (512 pages, 32-page
        chunks) the recipe's layout ran 1294 us with 2 splits and 1314 with 8 against 1459-1468 with 3 or 5, which
        straddle chunks (H200, perf/NOTES.md, session 51)."""
        if fixed_pages < 0:
            raise ValueError(f"fixed_pages is a cost in pages, at least 0, got {fixed_pages!r}")
        if align < 1:
            raise ValueError(f"align is a count of pages, at least 1, got {align!r}")
        pairs, wave = max(len(self.request_ids) * int(num_kv_heads), 1), max(int(wave), 1)
        if align > 1 and self.max_pages > 0:
            return _aligned_wave_splits(pairs, int(self.max_pages), wave, int(fixed_pages), int(align))
        return _wave_splits(pairs, int(self.max_pages), wave, int(fixed_pages))


MAX_SPLITS = 65535  # a CUDA grid's z dimension (the tensor-core decode's grid is (B, H, splits))


@functools.lru_cache(maxsize=4096)
def _wave_splits(pairs: int, max_pages: int, wave: int, fixed_pages: int) -> tuple[int, int]:
    """`BatchPlan.wave_splits`' search, once per shape (every layer of a decode step asks the same question): over
    the distinct grids only (pages per split falls through at most 2 sqrt(max_pages) values), ending where no larger
    split count can cost less than the best found."""
    if max_pages <= 0:
        return 1, 1
    best = None
    per_split = max_pages
    while per_split >= 1:
        splits = -(-max_pages // per_split)
        if splits > MAX_SPLITS:
            break
        # no later grid can cost less: it has at least ``splits`` programs a pair, each of at least
        # max_pages / splits pages, so it costs at least pairs (max_pages + splits fixed_pages) / wave
        if best is not None and pairs * (max_pages + splits * fixed_pages) >= best[0] * wave:
            break
        cost = -(-pairs * splits // wave) * (per_split + fixed_pages)
        if best is None or cost < best[0]:
            best = (cost, per_split, splits)
        # the next grid: the fewest pages per split that gives more splits (strictly fewer pages than this one)
        per_split = min(per_split - 1, -(-max_pages // (splits + 1)))
    return best[1], best[2]


@functools.lru_cache(maxsize=4096)
def _aligned_wave_splits(pairs: int, max_pages: int, wave: int, fixed_pages: int, align: int) -> tuple[int, int]:
    """`_wave_splits` over the grids whose pages per split divide ``align`` or are a multiple of it (at most
    max_pages / align + log2(align) + 1 of them), the fewest splits among equals."""
    sizes = {d for d in range(1, align + 1) if align % d == 0}
    sizes |= set(range(align, -(-max_pages // align) * align + 1, align))
    best = None
    for per_split in sorted(sizes, reverse=True):
        splits = -(-max_pages // per_split)
        if splits > MAX_SPLITS:
            continue
        cost = -(-pairs * splits // wave) * (per_split + fixed_pages)
        if best is None or cost < best[0]:
            best = (cost, per_split, splits)
    return (best[1], best[2]) if best is not None else _wave_splits(pairs, max_pages, wave, fixed_pages)


def packed_arrays(table, slot_of_page) -> tuple[np.ndarray, np.ndarray]:
    """A table's packed page ids and their codebook slots (int64), made once per (version, page count): packed pages
    join a table only as a chunk is packed, which bumps its version; a page's slot stays while a table holds it."""
    key = (table.version, len(table.packed), id(table.packed))
    held = table.plan_arrays
    if held is None or held[0] != key:
        n = len(table.packed)
        ids = np.fromiter(table.packed, np.int64, n)
        slots = np.fromiter(map(slot_of_page.__getitem__, table.packed), np.int64, n)
        held = table.plan_arrays = (key, ids, slots)
    return held[1], held[2]


def plan_batch(cache, request_ids: list[int], layer: int = 0) -> BatchPlan:
    """Flatten the page tables of ``request_ids`` (lengths taken from ``layer``; all layers of a
    request must hold the same number of tokens when the plan is reused across layers).

    The arrays are built on the host with numpy for the whole batch at once, from each table's packed arrays made
    once per chunk (`packed_arrays`: reading 46 requests' 512 page ids from their lists cost 1.3 ms of a 2.3 ms plan
    on one core), and reach the device in one copy (pinned and asynchronous on CUDA: a decode step's plan does not
    wait for the device's queue)."""
    p = cache.config.page_size
    tables = [cache.page_table(rid) for rid in request_ids]
    b = len(tables)
    arrays = [packed_arrays(table, cache.packed.slot_of_page) for table in tables]
    n_packed = np.fromiter((len(ids) for ids, _ in arrays), np.int64, b)
    lengths = np.fromiter((t.lengths[layer] for t in tables), np.int64, b)
    dense_tokens = lengths - n_packed * p  # (`PageTable.dense_tokens`)
    n_dense = np.where(dense_tokens > 0, -(-dense_tokens // p), 0)
    counts = n_packed + n_dense
    starts = np.cumsum(counts) - counts
    cu = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    total = int(counts.sum())
    request = np.repeat(np.arange(b, dtype=np.int64), counts)  # each work page's request
    j = np.arange(total, dtype=np.int64) - starts[request]  # its index within the request
    is_packed = j < n_packed[request]
    ids = np.empty(total, np.int64)
    slots = np.zeros(total, np.int64)
    if b:  # packed pages of request 0, then of request 1, ...: the order of the work pages they fill
        ids[is_packed] = np.concatenate([a for a, _ in arrays])
        slots[is_packed] = np.concatenate([s for _, s in arrays])
    ids[~is_packed] = np.fromiter(chain.from_iterable(t.dense[:n] for t, n in zip(tables, n_dense.tolist())),
                                  np.int64, int(n_dense.sum()))
    kinds = np.where(is_packed, PACKED, DENSE).astype(np.int64)
    position = j * p  # packed pages by their index; dense ones after the packed tokens, by theirs
    valid = np.where(is_packed, p, np.minimum(p, dense_tokens[request] - (j - n_packed[request]) * p))
    rows = position + cu[request]
    fields = [ids, kinds, slots, valid, rows, position, starts, counts, n_packed, cu]
    views = ints_on_device(fields, cache.dense.data.device)
    planned = tuple((table, table.version, table.lengths[layer]) for table in tables)
    return BatchPlan(list(request_ids), *views, int(counts.max(initial=0)), p, int(counts.min()) if b else 0,
                     planned, int(cu[-1]), cache.config.chunk_pages)


def ints_on_device(fields: list, device: torch.device) -> list[torch.Tensor]:
    """int32 copies of ``fields`` (1-D arrays or lists) on ``device``, as views of one buffer moved in one copy:
    on CUDA from pinned memory, asynchronously (a copy from pageable memory would make the host wait until the
    device has run everything queued). Each view starts on a 16-byte boundary (kernels specialise on pointer
    alignment, so it must not vary between steps)."""
    fields = [np.asarray(f, dtype=np.int64) for f in fields]
    sizes = [len(f) for f in fields]
    padded = [-(-n // 4) * 4 for n in sizes]
    host = np.zeros(sum(padded), np.int32)
    offsets = np.cumsum([0] + padded)
    for f, o in zip(fields, offsets):
        if f.size and (f.max() > np.iinfo(np.int32).max or f.min() < np.iinfo(np.int32).min):
            raise InvalidKV("a batch plan's page ids and token offsets must fit int32")
        host[o : o + len(f)] = f
    buffer = torch.from_numpy(host)
    if device.type == "cuda":
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    else:
        buffer = buffer.to(device)
    return [buffer[o : o + n] for o, n in zip(offsets.tolist(), sizes)]
