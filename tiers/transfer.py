"""A restore as an operation: the pages of a prompt's prefix that live below the device, where each one
comes from, the buffers their bytes land in, and the CUDA work that installs them layer by layer.

`Transfer.locate` finds the pages (under the cache's lock), `stage` issues every read (no lock held:
file reads and host copies run while the cache serves), and `install` (lock held again) plans the
pages in the core and copies them in. On CUDA, host bytes arrive on the host tier's side stream, range
by range: trailers and codebooks first, then a few layers per copy, each followed by an event; every
layer is installed on the transfer's own stream once its event fired, and its own event tells
attention of that layer when it may read (`KVCache.set_layer_events`).
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbackend.manager import KVCache
from kvbackend.page_check import refuse_crafted
from kvbackend.tiers.base import Handle
from kvbackend.tiers.bounce import BounceRing
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.host import HostTier, LayeredRead

MIN_ROW_BYTES = 64 * 1024  # host copies move whole layers in rows of at least this many bytes per page
READ_AHEAD = 2  # runs of file rows read ahead of the one being copied to the device (windows permitting)


class Source(enum.Enum):
    DEVICE = "device"  # resident already (found further along the prefix)
    HOST = "host"
    FILE = "file"


@dataclass(frozen=True)
class RestoreReport:
    device_hits: int  # prefix pages already on the device
    restored_from_host: int
    restored_from_file: int
    failed: int  # pages found in a lower tier that could not be restored (corrupt, evicted meanwhile)


def _record(stream) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclass
class Transfer:
    token_ids: np.ndarray  # the prompt, int64
    hold: list[int]  # keys of the prompt's pages already on the device (the prefix the transfer extends)
    keys: list[int]  # keys of the pages after them that some tier holds, in prompt order
    sources: list[Source]  # where each of `keys` is
    sizes: list[int | None]  # each one's stored length in its tier (None: on the device)
    staged: torch.Tensor | None = None  # [keys, blob_bytes] on the cache's device: the bytes land here
    ok: list[bool] = field(default_factory=list)  # whether each row's bytes arrived
    layered: LayeredRead | None = None  # the host tier's range-by-range read, when one is used
    arrived: list = field(default_factory=list)  # per layer (CUDA): event after its host bytes are staged
    tail: torch.cuda.Event | None = None  # (CUDA) event after the trailers and codebooks are staged
    warm: Handle | None = None  # the copy of file rows up to the host tier (never waited on here)
    cancelled: bool = False
    installed_rows: list[int] = field(default_factory=list)  # rows whose bytes went into new device pages

    @property
    def first_page(self) -> int:
        return len(self.hold)

    @classmethod
    def locate(cls, cache: KVCache, host: HostTier | None, file: FileTier | None, token_ids: Sequence[int],
               lock: threading.RLock) -> "Transfer":
        """Which tier holds each page after the device prefix: bulk prefix look-ups, tier by tier, until
        no tier has the next key."""
        token_ids = np.asarray(token_ids, dtype=np.int64)  # converted once for hashing and the hit check
        with lock:
            keys = cache.prefix_keys(token_ids)
            on_device = cache.device_prefix(keys)
        rest = keys[on_device:]
        sources: list[Source] = []
        tiers = [(Source.HOST, host), (Source.FILE, file)]
        while len(sources) < len(rest):
            start = len(sources)
            with lock:
                sources += [Source.DEVICE] * cache.device_prefix(rest[start:])
            for source, tier in tiers:
                if tier is not None:
                    sources += [source] * tier.contains(rest[len(sources):])
            if len(sources) == start:
                break
        rest = rest[: len(sources)]
        by_source = {Source.HOST: host, Source.FILE: file}
        # the stored length of each row: a page group whose trailer implies another length is not installed
        sizes = [None if s is Source.DEVICE else by_source[s].blob_size(key) for s, key in zip(sources, rest)]
        return cls(token_ids, keys[:on_device], rest, sources, sizes)

    def rows(self, source: Source) -> list[int]:
        return [i for i, s in enumerate(self.sources) if s is source]

    def stage(self, cache: KVCache, host: HostTier | None, file: FileTier | None,
              cancel: threading.Event | None = None, bounce: BounceRing | None = None) -> None:
        """Issue every read into `staged` (host rows on the host tier's stream, file rows through the windows
        of ``bounce``, a run of rows per window) and start the warm copy of file rows to the host tier."""
        size, layers = cache.blob_bytes, cache.geometry.num_layers
        self.staged = torch.empty(len(self.keys), size, dtype=torch.uint8, device=cache.dense.data.device)
        self.ok = [s is Source.DEVICE for s in self.sources]
        host_rows, file_rows = self.rows(Source.HOST), self.rows(Source.FILE)
        if host_rows:
            self.layered = host.read_layered([self.keys[i] for i in host_rows], self.staged, host_rows)
        if self.layered is not None:  # trailers and codebooks first, then the layers, all enqueued now
            for i, good in zip(host_rows, self.layered.results):
                self.ok[i] = good
            part = cache.group.pages_bytes
            self.layered.copy_range(part, size - part)
            self.tail = _record(self.layered.stream)
            first = 0
            while first < layers:  # a few layers per copy: strided rows below ~64 KiB lose DMA bandwidth
                start, count, nbytes = cache.page_span(first)[0], 0, 0
                while first + count < layers and (count == 0 or nbytes < MIN_ROW_BYTES):
                    nbytes += cache.page_span(first + count)[1]
                    count += 1
                self.layered.copy_range(start, nbytes)
                self.arrived += [_record(self.layered.stream)] * count
                first += count
        elif host_rows:
            got = host.get([self.keys[i] for i in host_rows], [self.staged[i] for i in host_rows]).result()
            for i, good in zip(host_rows, got):
                self.ok[i] = good
        if file_rows and not (cancel is not None and cancel.is_set()):
            self._read_files(cache, file, host, file_rows, bounce or BounceRing(pinned=torch.cuda.is_available()),
                             cancel)
        self.cancelled = cancel is not None and cancel.is_set()

    def _read_files(self, cache: KVCache, file: FileTier, host: HostTier | None, rows: list[int], bounce: BounceRing,
                    cancel: threading.Event | None) -> None:
        """File rows in runs that fill a window each: a run is read (the file tier's workers side by side)
        while the copies of the run before it go to the device; READ_AHEAD runs are read ahead where the
        ring has a free window. Each window goes back to the ring with the event after its copies and its
        warm copy to the host tier (the next taker waits for both)."""
        room = self.staged.shape[1]  # a blob longer than a staged row (a foreign or crafted file) is a miss
        # a blob whose index fields are out of range (crafted with a valid checksum) is corrupt: never staged, never
        # copied up to the host tier (whose blobs are then all ones this process wrote or checked). Each run's blobs
        # are checked together once read (`refuse_crafted`); checking blob by blob in the reader threads held the
        # interpreter lock once per blob (512 blobs of the recipe's page codec: 0.2-0.4 s added to a 32K-token restore)
        check = cache.page_check
        sizes = [0 if self.sizes[i] is None or self.sizes[i] > room else self.sizes[i] for i in rows]
        runs, start, filled = [], 0, 0
        for j, size in enumerate(sizes):
            if j > start and filled + size > bounce.window_bytes:
                runs.append((start, j))
                start, filled = j, 0
            filled += size
        runs.append((start, len(rows)))
        warm: list[Handle] = []
        issued: collections.deque = collections.deque()

        def issue(run, block: bool) -> bool:
            lo, hi = run
            window = bounce.take(max(sum(sizes[lo:hi]), 1), block=block)
            if window is None:
                return False
            try:
                views, at = [], 0
                for size in sizes[lo:hi]:
                    views.append(window.data[at : at + size])
                    at += size
                expected = [-1 if size == 0 else size for size in sizes[lo:hi]]  # unknown or too long: a miss
                handle = file.get([self.keys[i] for i in rows[lo:hi]], views, expected_len=expected)
            except BaseException:  # never a window lost to the ring (later restores would wait for it forever)
                bounce.give(window)
                raise
            issued.append((run, window, views, handle))
            return True

        def stopped() -> bool:
            return cancel is not None and cancel.is_set()

        pending = collections.deque(runs)
        try:
            while (pending and not stopped()) or issued:  # a cancel stops the reads not yet issued
                if not issued:
                    issue(pending.popleft(), block=True)  # holding no window: may wait for one
                while pending and not stopped() and len(issued) < READ_AHEAD and issue(pending[0], block=False):
                    pending.popleft()
                (lo, hi), window, views, handle = issued.popleft()
                handles = []
                try:
                    got = _checked(check, file, [self.keys[i] for i in rows[lo:hi]], views, handle.result())
                    for i, view, good in zip(rows[lo:hi], views, got):
                        self.ok[i] = good
                        if good:
                            self.staged[i, : view.numel()].copy_(view, non_blocking=True)
                    good = [j for j, g in enumerate(got) if g]
                    if host is not None and good:  # a warm copy one tier up; admission does not wait for it
                        handles.append(host.put([self.keys[rows[lo + j]] for j in good], [views[j] for j in good]))
                        warm.append(handles[-1])
                finally:
                    bounce.give(window, _record(torch.cuda.current_stream()) if self.staged.is_cuda else None,
                                handles)
        finally:
            while issued:  # runs read ahead when an error stopped the loop: every window goes back
                _, window, _, handle = issued.popleft()
                try:
                    handle.wait()
                finally:
                    bounce.give(window)
        if warm:
            self.warm = Handle.combine(warm)

    def usable(self) -> int:
        """How many rows (a prefix) can be installed: up to the first hole; none once cancelled."""
        if self.cancelled:
            return 0
        return next((i for i, good in enumerate(self.ok) if not good), len(self.ok))

    def install(self, cache: KVCache, stream: torch.cuda.Stream | None) -> int:
        """Plan the usable rows in the core and copy them in; the cache's lock must be held. Returns how
        many of `keys` (a prefix) are on the device afterwards."""
        usable = self.usable()
        resident = [s is Source.DEVICE for s in self.sources[:usable]]
        staged, layered, groups = self.staged, self.layered, cache.groups
        try:
            on_streams = layered is not None and layered.stream is not None
            if on_streams:
                torch.cuda.current_stream().wait_event(self.tail)  # the trailers are read on the host next
            plan = groups.plan(self.keys[:usable], self.token_ids,
                               groups.read_trailers(staged, usable, resident, self.sizes[:usable]), self.first_page,
                               hold=self.hold)
            try:
                if not on_streams:  # bytes all present: every layer now, on the current stream
                    for layer in range(cache.geometry.num_layers):
                        groups.copy_layer(plan, staged, layer)
                else:  # each layer once it arrived; attention of layer i waits for layer i only
                    index = plan.index(staged.device, cache.packed.device)
                    stream.wait_stream(torch.cuda.current_stream())  # rows from the file tier, the index
                    for t in (staged, *index.values()):
                        t.record_stream(stream)
                    events = []
                    with torch.cuda.stream(stream):
                        for layer in range(cache.geometry.num_layers):
                            stream.wait_event(self.arrived[layer])
                            groups.copy_layer(plan, staged, layer)
                            events.append(_record(stream))
                    cache.set_layer_events(events)
            except BaseException:
                groups.abort(plan)  # nothing planned is left keyed without its bytes
                raise
            groups.finish(plan)
            self.installed_rows = list(plan.rows)
            return plan.installed
        finally:
            if layered is not None:
                layered.close()

    def report(self, installed: int) -> RestoreReport:
        """What the transfer did: pages found on the device, pages whose bytes came from each tier."""
        came = [self.sources[i] for i in self.installed_rows]
        return RestoreReport(len(self.hold), came.count(Source.HOST), came.count(Source.FILE),
                             len(self.keys) - installed)


def _checked(check, file: FileTier, keys: list[int], views: list[torch.Tensor], got: list[bool]) -> list[bool]:
    """``got`` with the hits whose index fields ``check`` (a `kvbackend.page_check.PageCheck`, or None) refuses
    turned into misses, refused in ``file`` as corrupt. ``views``: the run's consecutive slices of one window; each
    stretch of blobs of one length (a chunk's pages between the longer ones that carry its codebook) is checked as
    one [n, length] view of the window (no copy)."""
    if check is None or not any(got):
        return got
    passed = set()
    start = 0
    while start < len(views):
        size, end = views[start].numel(), start + 1
        while end < len(views) and views[end].numel() == size and \
                views[end].data_ptr() == views[start].data_ptr() + (end - start) * size:
            end += 1
        hits = [j - start for j in range(start, end) if got[j]]
        if size < check.span:  # too short to hold its index fields: refused
            for j in hits:
                file.refuse(keys[start + j], views[start + j], check.reason(views[start + j]) or "short")
        elif hits:
            blobs = views[start].as_strided((end - start, size), (size, 1))
            passed.update(start + j for j in refuse_crafted(check, file, blobs, hits, keys[start:end]))
        start = end
    return [j in passed for j in range(len(got))]
