"""Host tier: one (pinned, when CUDA is present) buffer carved into fixed-size slots.

A blob occupies ceil(len / slot_bytes) slots, not necessarily adjacent. Each entry moves through
WRITING -> READY -> READING -> READY; only READY entries are evicted, in LRU order. Copies from or
to CUDA buffers run on a dedicated stream with one event per blob; CPU copies run on a worker thread,
so the same code is exercised on machines without a GPU.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvbackend.tiers.base import Handle, TierError, TierStats, check_keys, check_pairs, prefix_length
from kvbackend.tiers.copy2d import copy_2d

DEBUG = os.environ.get("KVBACKEND_DEBUG_TIERS") == "1"
log = logging.getLogger(__name__)
# Blobs per batch of one put/get: each batch's copies are enqueued before the next batch's bookkeeping,
# so the host-side work (about 7-10 us a blob) overlaps the transfers instead of adding to them.
BATCH = 32


class SlotState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    READING = "reading"


@dataclass
class _Entry:
    slots: list[int]  # slot indices, in blob order
    nbytes: int
    state: SlotState
    readers: int = 0  # concurrent reads in flight


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, slot_bytes: int, pin: bool | None = None) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"host tier {name} must be an int, got {value!r}")
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise ValueError(f"host tier needs capacity_bytes >= slot_bytes > 0, got {capacity_bytes}, {slot_bytes}")
        pin = torch.cuda.is_available() if pin is None else pin
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.buffer = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU: first = evicted first
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbackend-host")
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._hits = self._misses = self._evictions = self._failures = 0
        self._closed = False

    # -- bookkeeping (always under the lock) ---------------------------------------------
    def _slot_view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffer[slot * self.slot_bytes : slot * self.slot_bytes + nbytes]

    def _take_slots(self, count: int) -> list[int] | None:
        """``count`` slots, evicting least recently used blobs as needed; None (and nothing evicted) where even
        every idle blob's slots would not be enough."""
        if len(self._free) < count:
            idle = sum(len(e.slots) for e in self._entries.values() if e.state is SlotState.READY and e.readers == 0)
            if len(self._free) + idle < count:
                return None
        while len(self._free) < count:
            self._evict_one()
        return [self._free.pop() for _ in range(count)]

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if entry.state is SlotState.READY and entry.readers == 0:
                del self._entries[key]
                self._free.extend(entry.slots)
                self._evictions += 1
                return True
        return False

    def _check(self) -> None:
        used = [s for e in self._entries.values() for s in e.slots]
        assert len(used) == len(set(used)), "slot owned twice"
        assert not set(used) & set(self._free), "slot both used and free"
        assert len(used) + len(self._free) == self.num_slots, "slot leaked"

    # -- protocol -------------------------------------------------------------------------
    def contains(self, keys: Sequence[int]) -> int:
        check_keys(keys)
        with self._lock:
            return prefix_length(keys, self._readable)

    def _readable(self, key: int) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is not SlotState.WRITING

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("the host tier is closed")

    def put(self, keys: Sequence[int], blobs: Sequence[torch.Tensor]) -> Handle:
        """Store blobs (1-D uint8, not empty, on the CPU or a CUDA device) asynchronously. A key held already is
        written again (the newest blob replaces the held one), unless an earlier put of it is still landing or a read
        of it is in flight: then this blob is not stored (False). The handle's ``accepted`` says at once which keys
        the tier took; a copy that fails later drops its entry (that key's result is False)."""
        self._check_open()
        check_pairs(keys, blobs, "blobs")
        for key, blob in zip(keys, blobs):  # every blob checked before any entry is registered
            if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
                raise ValueError(f"blob for key {key} must be 1-D uint8, got {getattr(blob, 'dtype', type(blob))} "
                                 f"{tuple(getattr(blob, 'shape', ()))}")
            if blob.numel() == 0 or blob.device.type not in ("cpu", "cuda"):
                raise ValueError(f"blob for key {key} must hold bytes on the CPU or a CUDA device, got "
                                 f"{blob.numel()} bytes on {blob.device}")
        return Handle.combine([self._put_batch(keys[i : i + BATCH], blobs[i : i + BATCH])
                               for i in range(0, max(len(keys), 1), BATCH)])

    def _put_batch(self, keys: Sequence[int], blobs: Sequence[torch.Tensor]) -> Handle:
        plan: list[tuple[int, torch.Tensor, _Entry] | None] = []  # None: not stored
        with self._lock:
            self._free.sort(reverse=True)  # hand out ascending slots, so neighbouring blobs coalesce
            for key, blob in zip(keys, blobs):
                if blob.dtype != torch.uint8 or blob.dim() != 1:
                    raise ValueError(f"blob for key {key} must be 1-D uint8, got {blob.dtype} {tuple(blob.shape)}")
                held = self._entries.get(key)
                if held is not None:
                    # an earlier put of the key is landing (its outcome unknown yet), or a read of it is in flight:
                    # that copy stays, and this blob is not stored (False below: the caller keeps it)
                    if held.state is SlotState.WRITING or held.readers:
                        plan.append(None)
                        continue
                    # the newest blob of a key replaces the one held: a page group differs between encodes of the
                    # same tokens (its chunk, whether it carries the chunk's codebook), and a held copy whose
                    # chunk's codebook has left the tier could never be restored
                    del self._entries[key]
                    self._free.extend(held.slots)
                slots = self._take_slots(-(-blob.numel() // self.slot_bytes))
                if slots is None:
                    self._failures += 1
                    plan.append(None)
                    continue
                entry = _Entry(slots, blob.numel(), SlotState.WRITING)
                self._entries[key] = entry
                plan.append((key, blob, entry))
            if DEBUG:
                self._check()
        results = [item is not None for item in plan]
        work = [(i, *item) for i, item in enumerate(plan) if item is not None]
        accepted = list(results)

        def undo():  # the batch's entries go, as if it had never been called
            self._drop_written(work, results)

        try:
            if any(b.is_cuda for _, _, b, _ in work) and self._stream is not None:
                return self._put_cuda(work, results, accepted, undo)
            return Handle(self._pool.submit(self._copy_in, work, results), accepted=accepted, on_cancel=undo)
        except BaseException:
            undo()
            raise

    def _drop_written(self, work, results) -> None:
        """Drop the WRITING entries of ``work`` whose copy did not complete (their slots go back)."""
        with self._lock:
            for i, key, _, entry in work:
                if self._entries.get(key) is entry and entry.state is SlotState.WRITING:
                    del self._entries[key]
                    self._free.extend(entry.slots)
                    self._failures += 1
                    results[i] = False

    def _copy_in(self, work, results) -> list[bool]:
        for n, (i, key, blob, entry) in enumerate(work):
            try:
                self._scatter(blob, entry)
            except Exception as exc:  # noqa: BLE001 - this blob and those not copied yet are not stored
                self._drop_written(work[n:], results)
                log.error("kvbackend host tier: copying a blob in failed (%d keys not stored): %r", len(work) - n, exc)
                return results
            with self._lock:
                entry.state = SlotState.READY
        return results

    def _put_cuda(self, work, results, accepted, undo) -> Handle:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for blob, entries in self._runs([(blob, entry) for _, _, blob, entry in work]):
                blob.record_stream(self._stream)
                if len(entries) == 1 and len(entries[0].slots) > 1:
                    self._scatter(blob, entries[0], non_blocking=True)
                else:
                    self._host_run(entries).copy_(blob, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)

        def mark_ready():
            try:
                event.synchronize()
            except BaseException:
                undo()
                return results
            with self._lock:
                for _, _, _, entry in work:
                    entry.state = SlotState.READY
            return results

        return Handle(self._pool.submit(mark_ready), events=[event], accepted=accepted)

    def _runs(self, pairs):
        """Merge (device tensor, entry) pairs into runs that are adjacent both in device memory and in
        host slots, so a run moves in one copy; yields (device view, [entries])."""
        run_tensor, run_entries, run_end, next_slot = None, [], None, None
        for tensor, entry in pairs:
            single = len(entry.slots) == 1 and entry.nbytes == self.slot_bytes and tensor.numel() == entry.nbytes
            if (single and run_tensor is not None and tensor.data_ptr() == run_end and entry.slots[0] == next_slot
                    and tensor.untyped_storage().data_ptr() == run_tensor.untyped_storage().data_ptr()):
                run_entries.append(entry)
                run_end += entry.nbytes
                next_slot += 1
                continue
            if run_tensor is not None:
                yield self._device_run(run_tensor, run_entries), run_entries
            run_tensor, run_entries = tensor, [entry]
            run_end = tensor.data_ptr() + tensor.numel()
            next_slot = entry.slots[0] + 1 if single else None
        if run_tensor is not None:
            yield self._device_run(run_tensor, run_entries), run_entries

    @staticmethod
    def _device_run(first: torch.Tensor, entries) -> torch.Tensor:
        total = sum(e.nbytes for e in entries)
        if len(entries) == 1:
            return first[: entries[0].nbytes]
        return torch.as_strided(first, (total,), (1,))

    def _host_run(self, entries) -> torch.Tensor:
        if len(entries) == 1 and len(entries[0].slots) > 1:
            raise AssertionError("multi-slot blobs are copied slot by slot")
        start = entries[0].slots[0] * self.slot_bytes
        return self.buffer[start : start + sum(e.nbytes for e in entries)]

    def _scatter(self, blob: torch.Tensor, entry: _Entry, non_blocking: bool = False) -> None:
        for i, slot in enumerate(entry.slots):
            part = blob[i * self.slot_bytes : (i + 1) * self.slot_bytes]
            self._slot_view(slot, part.numel()).copy_(part, non_blocking=non_blocking)

    def get(self, keys: Sequence[int], into: Sequence[torch.Tensor]) -> Handle:
        self._check_open()
        check_pairs(keys, into, "buffers")
        for out in into:  # a bad buffer must fail here, not in a worker holding an entry in READING
            if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1:
                raise ValueError(f"host tier buffers are 1-D uint8 tensors, got {getattr(out, 'dtype', type(out))} "
                                 f"of shape {tuple(getattr(out, 'shape', ()))}")
        return Handle.combine([self._get_batch(keys[i : i + BATCH], into[i : i + BATCH])
                               for i in range(0, max(len(keys), 1), BATCH)])

    def _get_batch(self, keys: Sequence[int], into: Sequence[torch.Tensor]) -> Handle:
        work, results = [], []
        with self._lock:
            for i, (key, out) in enumerate(zip(keys, into)):
                entry = self._begin_read(key, out.numel())
                results.append(entry is not None)
                if entry is not None:
                    work.append((i, out, entry))
        def release_all():  # a batch cancelled before it started, or whose copies could not be enqueued
            for _, _, entry in work:
                self._release(entry)

        try:
            if any(out.is_cuda for _, out, _ in work) and self._stream is not None:
                return self._get_cuda(work, results)
            return Handle(self._pool.submit(self._copy_out, work, results), on_cancel=release_all)
        except BaseException:
            release_all()
            raise

    def _copy_out(self, work, results) -> list[bool]:
        """The CPU copies of a get: every entry is released, whatever happens; a copy that fails is a miss."""
        for i, out, entry in work:
            try:
                self._gather(out, entry)
            except Exception:  # noqa: BLE001 - the caller's buffer refused the bytes: that key misses
                with self._lock:
                    self._hits -= 1
                    self._misses += 1
                results[i] = False
            finally:
                self._release(entry)
        return results

    def _get_cuda(self, work, results) -> Handle:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for out, entries in self._runs([(out, entry) for _, out, entry in work]):
                out.record_stream(self._stream)  # the caller's buffer outlives the copy into it
                if len(entries) == 1 and len(entries[0].slots) > 1:
                    self._gather(out, entries[0], non_blocking=True)
                else:
                    out.copy_(self._host_run(entries), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)

        def release():
            try:
                event.synchronize()
            finally:
                for _, _, entry in work:
                    self._release(entry)
            return results

        return Handle(self._pool.submit(release), events=[event])

    def read_layered(self, keys: Sequence[int], out: torch.Tensor, rows: Sequence[int]) -> "LayeredRead | None":
        """Start a read of ``keys`` into rows ``rows`` of ``out`` [N, row_bytes] in byte ranges of the
        caller's choice (`LayeredRead.copy_range`), so each layer can be used as soon as it landed.
        Returns None (and takes nothing) when a blob spans several slots: use `get` then."""
        self._check_open()
        check_pairs(keys, rows, "rows")
        if out.dim() != 2 or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous uint8 [N, row_bytes] buffer, got {out.dtype} {tuple(out.shape)}")
        with self._lock:
            entries = [self._entries.get(key) for key in keys]
            if any(e is not None and len(e.slots) > 1 for e in entries):
                return None
            work, results = [], []
            for key, row in zip(keys, rows):
                entry = self._begin_read(key, out.shape[1])
                results.append(entry is not None)
                if entry is not None:
                    work.append((row, entry))
        return LayeredRead(self, out, work, results)

    def _begin_read(self, key: int, capacity: int) -> _Entry | None:
        """Under the lock: the entry of ``key`` marked READING (a hit), or None (a miss: absent, still
        being written, or larger than ``capacity`` bytes)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is SlotState.WRITING or capacity < entry.nbytes:
            self._misses += 1
            return None
        self._hits += 1
        entry.readers += 1
        entry.state = SlotState.READING
        self._entries.move_to_end(key)
        return entry

    def _gather(self, out: torch.Tensor, entry: _Entry, non_blocking: bool = False) -> None:
        for i, slot in enumerate(entry.slots):
            n = min(self.slot_bytes, entry.nbytes - i * self.slot_bytes)
            out[i * self.slot_bytes : i * self.slot_bytes + n].copy_(self._slot_view(slot, n), non_blocking=non_blocking)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1
            if entry.readers == 0:
                entry.state = SlotState.READY

    def blob_size(self, key: int) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.nbytes

    def evict(self, n: int) -> int:
        with self._lock:
            dropped = 0
            while dropped < n and self._evict_one():
                dropped += 1
            return dropped

    def discard(self, keys: Sequence[int]) -> None:
        """Drop these keys if present and idle (used when a blob is found stale)."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.state is SlotState.READY and entry.readers == 0:
                    del self._entries[key]
                    self._free.extend(entry.slots)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, len(self._entries), sum(e.nbytes for e in self._entries.values()),
                             self.num_slots * self.slot_bytes, self._hits, self._misses, self._evictions,
                             self._failures)

    def check(self) -> None:
        with self._lock:
            self._check()

    def close(self) -> None:
        """Finish the copies in flight; later calls raise `TierError`."""
        self._closed = True
        self._pool.shutdown(wait=True)


class LayeredRead:
    """A host -> buffer read moved range by range (for example trailers first, then layer by layer).

    Rows consecutive both in the buffer and in host slots move as one strided copy per range; on CUDA
    every copy is enqueued on the tier's side stream (``stream``), which the caller may also use for
    work that must follow a range. `close` releases the slots once everything enqueued has landed.
    """

    def __init__(self, tier: HostTier, out: torch.Tensor, work: list[tuple[int, _Entry]], results: list[bool]) -> None:
        self.tier = tier
        self.out = out
        self.results = results
        self.stream = tier._stream if out.is_cuda else None
        self._work = sorted(work, key=lambda w: w[0])
        self._min_bytes = min((entry.nbytes for _, entry in self._work), default=0)
        self._runs = self._group(lambda entry: 0)  # runs of rows adjacent in the buffer and in host slots
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            out.record_stream(self.stream)

    def _group(self, width_of) -> list[list[int]]:
        runs: list[list[int]] = []  # [first row, first slot, count, width]
        for row, entry in self._work:
            w = width_of(entry)
            last = runs[-1] if runs else None
            if last and last[0] + last[2] == row and last[1] + last[2] == entry.slots[0] and last[3] == w:
                last[2] += 1
            else:
                runs.append([row, entry.slots[0], 1, w])
        return runs

    def copy_range(self, offset: int, width: int) -> None:
        """Enqueue bytes [offset, offset + width) of every blob, clipped to each blob's own length (a
        page that carries no codebook moves no codebook bytes). Rows consecutive in the buffer and in
        host slots, with one clipped width, move as one strided copy."""
        pitch, slot_bytes = self.out.shape[1], self.tier.slot_bytes
        if offset < 0 or width < 0 or offset + width > pitch:
            raise ValueError(f"copy_range({offset}, {width}) is outside rows of {pitch} bytes")
        if offset + width <= self._min_bytes:  # every blob holds the whole range (layers): the fixed runs
            runs = [(row, slot, count, width) for row, slot, count, _ in self._runs]
        else:
            runs = self._group(lambda entry: max(0, min(width, entry.nbytes - offset)))
        for row, slot, count, w in runs:
            copy_2d(self.out, row * pitch + offset, pitch, self.tier.buffer, slot * slot_bytes + offset, slot_bytes,
                    w, count, self.stream)  # copy_2d skips zero widths

    def close(self) -> Handle:
        """Release the blobs once everything enqueued has landed. A second call releases nothing (each blob's
        read was counted once)."""
        entries = [entry for _, entry in self._work]
        self._work, self._runs = [], []
        if self.stream is None:
            for entry in entries:
                self.tier._release(entry)
            return Handle.finished(self.results)
        event = torch.cuda.Event()
        event.record(self.stream)

        def release():
            event.synchronize()
            for entry in entries:
                self.tier._release(entry)
            return self.results

        return Handle(self.tier._pool.submit(release), events=[event])


__all__ = ["HostTier", "LayeredRead", "SlotState"]
