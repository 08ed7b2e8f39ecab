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
import torch

from kvbackend.manager import KVCache

from kvbackend.tiers.base import Handle
from kvbackend.tiers.bounce import BounceRing
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.policy import OffloadPolicy
from kvbackend.tiers.transfer import RestoreReport, Transfer

__all__ = ["Prefetch", "RestoreReport", "TieredCache"]

log = logging.getLogger(__name__)


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
        self._writing: set[tuple[int, int]] = set()  # (page, key) of offloads' writes in flight; under ``lock``
        self._install_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        # windows file reads land in on their way to the device: page-locked once, reused by every restore
        self._bounce = BounceRing(pinned=cache.dense.data.device.type == "cuda")
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
            # pages another offload is writing down are not picked again: that offload drops them once written
            victims = [v for v in self.cache.evictable_pages() if v not in self._writing][:max_pages]
            if not victims or self.host is None and self.file is None:
                return 0
            keys = [key for _, key in victims]
            blobs = [self.cache.export_page(page) for page, _ in victims]
            first = self.host.put(keys, blobs) if self.host is not None else self.file.put(keys, blobs)
            self._track([first])
            self._writing.update(victims)
        # The device pages go only once their writes have landed (waited for without the lock; admission meanwhile
        # finds them on the device): a write that fails or is refused leaves its page where it was.
        written = [False] * len(keys)  # nothing known written: every page stays on the device
        try:
            written = first.result()
        except Exception as exc:  # noqa: BLE001
            log.warning("offload: writing %d pages down failed, they stay on the device: %r", len(keys), exc)
        finally:
            with self.lock:  # one section: no other offload picks these pages between their release and their drop
                self._writing.difference_update(victims)
                taken = [i for i, (page, key) in enumerate(victims)
                         if written[i] and self.cache.drop_cached_page(page, key)]
        # on to the file tier: every page the host tier took (one that left the device meanwhile too)
        through = [i for i in range(len(victims)) if written[i]]
        if self.host is not None and self.file is not None and self.policy.write_through_to_file and through:
            self._track([self.file.put([keys[i] for i in through],
                                       [blobs[i].cpu() if blobs[i].is_cuda else blobs[i] for i in through])])
        self.offloaded_pages += len(taken)
        return len(taken)

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
        transfer = Transfer.locate(self.cache, self.host, self.file, token_ids, self.lock)
        try:
            transfer.stage(self.cache, self.host, self.file, cancel, self._bounce)  # reads and copies without the lock
        except BaseException:
            if transfer.layered is not None:  # the host blobs it was reading are released
                transfer.layered.close()
            raise
        if transfer.warm is not None:
            self._track([transfer.warm])
        with self.lock:
            transfer.cancelled |= cancel is not None and cancel.is_set()
            installed = transfer.install(self.cache, self._install_stream)
        return transfer.report(installed)

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

    def append_step(self, request_ids: Sequence[int], layer: int, k: torch.Tensor, v: torch.Tensor,
                    queries: torch.Tensor | None = None) -> None:
        """`KVCache.append_step` under the lock the offload worker takes (a step may complete chunks,
        whose pages can evict cached ones the worker is moving down)."""
        with self.lock:
            self.cache.append_step(request_ids, layer, k, v, queries)
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
