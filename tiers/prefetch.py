"""`TieredCache`: a `KVCache` with host and file tiers below it.

- Offload: a background worker (thread, wake event, stop event) moves cached packed pages down when the
  device pool passes the policy's high-water mark: bytes go to the host tier (D2H on a side stream
  where there is a GPU) and on to the file tier, then the device pages are freed.
- Prefetch: `add_request` finds the part of a prompt's prefix that lives only in lower tiers and
  restores it (file -> host -> device) before admitting the request, so it reuses the pages.
  `prefetch` does the same asynchronously and returns a handle; freeing or cancelling stops it.

All calls into the wrapped `KVCache` hold one lock: the core is single-threaded by design.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvbackend.manager import KVCache

from .base import Handle
from .file import FileTier
from .host import HostTier
from .policy import OffloadPolicy

log = logging.getLogger(__name__)
MIN_ROW_BYTES = 64 * 1024  # a restore copies whole layers in rows of at least this many bytes per page


@dataclass(frozen=True)
class RestoreReport:
    device_hits: int  # prefix pages already on the device
    restored_from_host: int
    restored_from_file: int
    failed: int  # pages found in a lower tier that could not be restored (corrupt, evicted meanwhile)


class TieredCache:
    def __init__(self, cache: KVCache, host: HostTier | None = None, file: FileTier | None = None,
                 policy: OffloadPolicy | None = None, background: bool = True) -> None:
        self.cache = cache
        self.host = host
        self.file = file
        self.policy = policy or OffloadPolicy()
        self.lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbackend-prefetch")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list[Handle] = []  # writes in flight; guarded by _pending_lock
        self._pending_lock = threading.Lock()
        self._prefetches: dict[int, list[Prefetch]] = {}  # request id -> its prefetches; under _pending_lock
        self.offloaded_pages = 0
        self._install_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._worker = None
        if background:
            self._worker = threading.Thread(target=self._offload_loop, name="kvbackend-offload", daemon=True)
            self._worker.start()

    # -- offload ----------------------------------------------------------------------------
    def _offload_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.policy.interval_s)  # an append wakes us; else look on the interval
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.offload()
            except Exception:  # the serving path must never see the offloader's failure
                log.exception("offload failed; pages stay on the device")

    def offload(self, max_pages: int | None = None) -> int:
        """Move cached pages down per the policy (or exactly ``max_pages`` of them). Returns pages moved."""
        with self.lock:
            allocator = self.cache.packed.allocator
            if max_pages is None:
                max_pages = self.policy.pages_to_offload(allocator.num_used, allocator.num_cached, allocator.num_pages)
            victims = self.cache.evictable_pages()[:max_pages]
            if not victims or self.host is None and self.file is None:
                return 0
            keys = [key for _, key in victims]
            blobs = [self.cache.export_page(page) for page, _ in victims]
            # Issue the writes before the device pages go, under the lock: a page is always either on
            # the device or registered (WRITING or READY) below, so admission can wait for it.
            first = self.host.put(keys, blobs) if self.host is not None else self.file.put(keys, blobs)
            for page, _ in victims:
                self.cache.drop_cached(page)
            self._track([first])
        if self.host is not None and self.file is not None and self.policy.write_through_to_file:
            first.wait()
            self._track([self.file.put(keys, [b.cpu() if b.is_cuda else b for b in blobs])])
        self.offloaded_pages += len(victims)
        return len(victims)

    def _track(self, handles: list[Handle]) -> None:
        with self._pending_lock:
            self._pending = [h for h in self._pending if not h.done()] + handles

    def flush(self) -> None:
        """Wait for every write issued so far (tests, shutdown)."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    # -- restore ----------------------------------------------------------------------------
    def restore(self, token_ids: Sequence[int], cancel: threading.Event | None = None) -> RestoreReport:
        """Bring the lower-tier part of a prompt's prefix back to the device as cached pages."""
        token_ids = np.asarray(token_ids, dtype=np.int64)  # converted once for hashing and the hit check
        with self.lock:
            keys = self.cache.prefix_keys(token_ids)
            on_device = self.cache.device_prefix(keys)
        rest = keys[on_device:]
        sources: list[str] = []  # per key: "device" (already resident further along), "host" or "file"
        while len(sources) < len(rest):  # bulk prefix look-ups, tier by tier, until no tier has the next key
            start = len(sources)
            with self.lock:
                sources += ["device"] * self.cache.device_prefix(rest[start:])
            if self.host is not None:
                sources += ["host"] * self.host.contains(rest[len(sources):])
            if self.file is not None:
                sources += ["file"] * self.file.contains(rest[len(sources):])
            if len(sources) == start:
                break
        rest = rest[: len(sources)]
        size = self.cache.blob_bytes
        device = self.cache.dense.data.device
        staged = torch.empty(len(rest), size, dtype=torch.uint8, device=device)  # host blobs land here directly
        ok = [s == "device" for s in sources]
        tiers = {"host": self.host, "file": self.file}
        # stored length of each row's page group: one that disagrees with its trailer is not restored
        sizes = [None if s == "device" else tiers[s].blob_size(key) for s, key in zip(sources, rest)]
        host_idx = [i for i, s in enumerate(sources) if s == "host"]
        file_idx = [i for i, s in enumerate(sources) if s == "file"]
        layers = self.cache.geometry.num_layers
        part = sum(self.cache.page_span(layers - 1))  # every layer's page (the last one ends them), then the rest
        layered = self.host.read_layered([rest[i] for i in host_idx], staged, host_idx) if host_idx else None
        arrived = []  # per layer, on CUDA: the event after which that layer's host bytes are in `staged`
        if layered is not None:  # trailers and codebooks first, then the layers, all enqueued now
            for i, g in zip(host_idx, layered.results):
                ok[i] = g
            layered.copy_range(part, size - part)
            tail = self._record(layered.stream)
            first = 0
            while first < layers:  # a few layers per copy: strided rows below ~64 KiB lose DMA bandwidth
                start, count, nbytes = self.cache.page_span(first)[0], 0, 0
                while first + count < layers and (count == 0 or nbytes < MIN_ROW_BYTES):
                    nbytes += self.cache.page_span(first + count)[1]
                    count += 1
                layered.copy_range(start, nbytes)
                arrived += [self._record(layered.stream)] * count
                first += count
        elif host_idx:
            got = self.host.get([rest[i] for i in host_idx], [staged[i] for i in host_idx]).result()
            for i, g in zip(host_idx, got):
                ok[i] = g
        if file_idx and not (cancel is not None and cancel.is_set()):
            bounce = torch.empty(len(file_idx), size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            got = self.file.get([rest[i] for i in file_idx], list(bounce),  # a blob of another length: a miss
                                expected_len=[-1 if sizes[i] is None else sizes[i] for i in file_idx]).result()
            for j, (i, g) in enumerate(zip(file_idx, got)):
                ok[i] = g
                if g:
                    staged[i].copy_(bounce[j], non_blocking=True)
            if self.host is not None:  # keep a warm copy one tier up
                good = [j for j, g in enumerate(got) if g]
                self.host.put([rest[file_idx[j]] for j in good], [bounce[j] for j in good]).wait()
        usable = next((i for i, g in enumerate(ok) if not g), len(ok))  # a prefix stops at the first hole
        if cancel is not None and cancel.is_set():
            usable = 0
        if layered is not None and layered.stream is not None:
            torch.cuda.current_stream().wait_event(tail)  # the trailers are read on the host next
        with self.lock:
            cache = self.cache
            resident = [s == "device" for s in sources[:usable]]
            if layered is None or layered.stream is None:  # bytes all present: install in one go
                installed = cache.install_pages(rest[:usable], token_ids, staged[:usable], on_device, resident,
                                                sizes[:usable], hold=keys[:on_device])
            else:  # each layer installed once it arrived; attention of layer i waits for layer i only
                plan = cache.plan_install(rest[:usable], token_ids,
                                          cache.read_trailers(staged, usable, resident, sizes[:usable]), on_device,
                                          hold=keys[:on_device])
                index = plan.index(staged.device, cache.packed.device)
                stream = self._install_stream
                stream.wait_stream(torch.cuda.current_stream())  # rows from the file tier, the index
                for t in (staged, *index.values()):
                    t.record_stream(stream)
                events = []
                with torch.cuda.stream(stream):
                    for layer in range(cache.geometry.num_layers):
                        stream.wait_event(arrived[layer])
                        cache.copy_install_layer(plan, staged, layer)
                        events.append(self._record(stream))
                cache.set_layer_events(events)
                cache.finish_install(plan)
                installed = plan.installed
            if layered is not None:
                layered.close()
        from_host = sum(1 for s in sources[:installed] if s == "host")
        from_file = sum(1 for s in sources[:installed] if s == "file")
        return RestoreReport(on_device, from_host, from_file, len(rest) - installed)

    @staticmethod
    def _record(stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def prefetch(self, token_ids: Sequence[int], request_id: int | None = None) -> "Prefetch":
        """Start restoring a prompt's prefix in the background. With ``request_id``, freeing that
        request cancels the prefetch if it has not finished (nothing it fetched is installed)."""
        cancel = threading.Event()
        handle = Prefetch(self._pool.submit(self.restore, list(token_ids), cancel), cancel)
        if request_id is not None:
            with self._pending_lock:
                self._prefetches.setdefault(request_id, []).append(handle)
        return handle

    def add_request(self, token_ids: Sequence[int] = ()) -> tuple[int, int]:
        """Restore what lower tiers hold of the prefix, then admit: (request id, cached prefix tokens)."""
        self.restore(token_ids)  # file reads and copies without holding the lock
        with self.lock:  # the offload worker may have moved restored pages down meanwhile: check again
            keys = self.cache.prefix_keys(token_ids)
            if self.cache.device_prefix(keys) < len(keys):
                self.restore(token_ids)  # under the lock, so admission sees what this restore installed
                if self.cache.device_prefix(keys) < len(keys) and self._pending:
                    self.flush()  # pages still on their way down are readable below once written
                    self.restore(token_ids)
            return self.cache.add_request(token_ids)

    # -- pass-through -------------------------------------------------------------------------
    def append(self, request_id: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self.lock:
            self.cache.append(request_id, layer, k, v)
        if self._worker is not None:
            self._wake.set()

    def read(self, request_id: int, layer: int):
        with self.lock:
            return self.cache.read(request_id, layer)

    def free(self, request_id: int) -> None:
        with self._pending_lock:
            prefetches = self._prefetches.pop(request_id, [])
        for handle in prefetches:
            handle.cancel()
        with self.lock:
            self.cache.free(request_id)

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._wake.set()
            self._worker.join(timeout=5)
        self.flush()
        self._pool.shutdown(wait=True)


class Prefetch:
    """A background restore; `cancel()` (e.g. when the request is freed first) stops it early."""

    def __init__(self, future: Future, cancel: threading.Event) -> None:
        self._future = future
        self._cancel = cancel

    def done(self) -> bool:
        return self._future.done()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> RestoreReport | None:
        """The restore's report; None when it was cancelled before it ran."""
        try:
            return self._future.result(timeout=timeout)
        except CancelledError:
            return None

    def cancel(self) -> None:
        self._cancel.set()
        self._future.cancel()
