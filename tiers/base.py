"""The tier protocol: opaque blobs keyed by chained page hashes, moved asynchronously.

A blob is one page group: every layer's packed page bytes plus the chunk's codebook slot (see
`KVCache.export_page`). Tiers never look inside blobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Protocol

import torch


def prefix_length(keys: Sequence[int], present) -> int:
    """How many of ``keys``, from the first, satisfy ``present(key)``."""
    n = 0
    for key in keys:
        if not present(key):
            break
        n += 1
    return n


def check_pairs(keys: Sequence[int], items: Sequence, what: str) -> None:
    if len(keys) != len(items):
        raise ValueError(f"{len(keys)} keys but {len(items)} {what}")
    check_keys(keys)


def check_keys(keys: Sequence[int]) -> None:
    """Keys are integers (page hashes): a tensor, None or a bool would be stored under a key nobody finds."""
    for key in keys:
        if isinstance(key, bool) or not hasattr(key, "__index__") or isinstance(key, torch.Tensor):
            raise ValueError(f"tier keys are integers (page hashes), got {key!r} of type {type(key).__name__}")


class TierError(RuntimeError):
    """A tier operation failed (the message says which key and why)."""


class Handle:
    """An asynchronous tier operation. ``result()`` is one bool per key: True when that key's blob
    was moved intact, False when it was missing, corrupt, cancelled or could not be written."""

    def __init__(self, future: Future | None = None, results: list[bool] | None = None,
                 events: list | None = None, accepted: list[bool] | None = None,
                 on_cancel: Callable[[], None] | None = None) -> None:
        self._future = future
        self._results = results
        self.events = events or []  # CUDA events, one per blob, when copies ran on a stream
        # per key, known when the call returns: whether the tier took the blob (or held it already); None where a
        # tier learns it only when the write ends (the file tier)
        self.accepted = accepted
        self._on_cancel = on_cancel  # undoes the bookkeeping of an operation cancelled before it started

    @staticmethod
    def finished(results: list[bool]) -> "Handle":
        return Handle(results=results)

    @staticmethod
    def combine(parts: list["Handle"]) -> "Handle":
        """One handle over consecutive parts of one call (results concatenated in order)."""
        return parts[0] if len(parts) == 1 else _Combined(parts)

    def done(self) -> bool:
        if self._future is not None and not self._future.done():
            return False
        return all(e.query() for e in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished (or ``timeout`` seconds); True when finished."""
        if self._future is not None:
            try:
                self._future.result(timeout=timeout)
            except TimeoutError:
                return False
            except CancelledError:  # a cancelled operation is finished
                return True
        for event in self.events:
            event.synchronize()
        return True

    def cancel(self) -> None:
        """Drop the operation if it has not started (a started copy runs to completion)."""
        if self._future is not None and self._future.cancel() and self._on_cancel is not None:
            self._on_cancel()

    def result(self, timeout: float | None = None) -> list[bool]:
        if self._future is not None:
            if self._future.cancelled():
                raise TierError("operation was cancelled")
            return self._future.result(timeout=timeout)
        self.wait(timeout)
        return list(self._results or [])


class _Combined(Handle):
    def __init__(self, parts: list[Handle]) -> None:
        accepted = None if any(p.accepted is None for p in parts) else [a for p in parts for a in p.accepted]
        super().__init__(events=[e for p in parts for e in p.events], accepted=accepted)
        self._parts = parts

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return all([p.wait() for p in self._parts])
        deadline = time.monotonic() + timeout  # one deadline for the whole call, not one per part
        return all([p.wait(max(0.0, deadline - time.monotonic())) for p in self._parts])

    def cancel(self) -> None:
        for p in self._parts:
            p.cancel()

    def result(self, timeout: float | None = None) -> list[bool]:
        return [r for p in self._parts for r in p.result(timeout)]


@dataclass(frozen=True)
class TierStats:
    name: str
    blobs: int  # blobs held
    bytes_used: int  # bytes of blobs held
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    failures: int  # writes that failed (disk full, I/O error) or reads that failed their checksum


class Tier(Protocol):
    name: str

    def contains(self, keys: Sequence[int]) -> int:
        """Length of the prefix of ``keys`` whose blobs this tier holds."""

    def put(self, keys: Sequence[int], blobs: Sequence[torch.Tensor]) -> Handle:
        """Store blobs (uint8, 1-D) under keys, asynchronously. The newest blob of a key replaces a held one (a page
        group differs between encodes of the same tokens); a tier may skip a blob it holds byte for byte."""

    def get(self, keys: Sequence[int], into: Sequence[torch.Tensor]) -> Handle:
        """Copy the blobs of ``keys`` into the caller's buffers (host or device), asynchronously."""

    def evict(self, n: int) -> int:
        """Drop up to ``n`` least recently used blobs; returns how many were dropped."""

    def stats(self) -> TierStats: ...
