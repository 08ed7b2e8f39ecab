"""File tier: crash-safe page-group files with a checksum per blob.

One file per `put` call (a page group). It is written to a temporary name, fsynced, renamed into
place and the directory fsynced, so a file under its final name is always complete. Layout:

    header (48 bytes): magic, version, layout fingerprint (16 bytes), blob count, table crc32c
    table: per blob (key u64, offset u64, length u64, crc32c u32, pad u32)
    blob bytes

The index is rebuilt by scanning the directory at start-up; partial, foreign-format or damaged files
are deleted. File names come from a hash of the keys, never from user strings; files are 0600.
Nothing is pickled. A blob whose checksum fails on read counts as a miss and its file is removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import torch

from ..alignpred.stream import CorruptStream
from .base import Handle, TierStats, check_pairs, prefix_length
from .persist import BlobFormat

MAGIC = b"KVBKPAGE"
VERSION = 1
_HEADER = struct.Struct("<8sI16sII12x")  # magic, version, fingerprint, count, table crc, padding to 48 bytes
_ENTRY = struct.Struct("<QQQII")  # key, offset, length, crc32c, pad
SUFFIX = ".kvb"


@dataclass(frozen=True)
class _Location:
    path: str
    offset: int
    length: int
    crc: int


class FileTier:
    name = "file"

    def __init__(self, directory: str, budget_bytes: int, fingerprint: str, fsync: bool = True,
                 workers: int = 2, fmt: BlobFormat | None = None) -> None:
        """``fmt``: how blobs are stored (default: their bytes as they are; see :mod:`.persist`)."""
        if len(fingerprint.encode()) != 16:
            raise ValueError(f"fingerprint must be 16 ASCII characters (PageLayout.fingerprint), got {fingerprint!r}")
        if fmt is not None:  # files of another persistent format are another layout on disk
            fingerprint = hashlib.blake2b(f"{fingerprint}|{fmt.name}".encode(), digest_size=8).hexdigest()
        self.fmt = fmt
        self.directory = directory
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint.encode()
        self.fsync = fsync
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._index: dict[int, _Location] = {}
        self._files: OrderedDict[str, tuple[list[int], int]] = OrderedDict()  # path -> (keys, size); LRU first
        self._used = 0
        self._hits = self._misses = self._evictions = self._failures = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvbackend-file")
        self._scan()

    # -- start-up -------------------------------------------------------------------------
    def _scan(self) -> None:
        entries = sorted(os.scandir(self.directory), key=lambda e: e.stat().st_mtime)
        for entry in entries:
            if not entry.is_file():
                continue
            if ".tmp" in entry.name:  # a write that never reached its rename
                _remove(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            parsed = self._read_table(entry.path)
            if parsed is None:
                _remove(entry.path)
                continue
            if parsed == "foreign":
                continue
            self._adopt(entry.path, parsed, entry.stat().st_size)

    def _read_table(self, path: str):
        """[(key, offset, length, crc)] of a well-formed file of our layout; "foreign"; or None if damaged."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return None
                magic, version, fingerprint, count, table_crc = _HEADER.unpack(head)
                if magic != MAGIC or version != VERSION:
                    return None
                if fingerprint != self.fingerprint:
                    return "foreign"
                table = f.read(count * _ENTRY.size)
                if len(table) != count * _ENTRY.size or crc32c.crc32c(table) != table_crc:
                    return None
                rows = [_ENTRY.unpack_from(table, i * _ENTRY.size)[:4] for i in range(count)]
                size = os.fstat(f.fileno()).st_size
                end = _HEADER.size + count * _ENTRY.size + sum(r[2] for r in rows)
                return rows if size == end else None
        except OSError:
            return None

    def _adopt(self, path: str, rows, size: int) -> None:
        keys = []
        for key, offset, length, crc in rows:
            if key not in self._index:
                self._index[key] = _Location(path, offset, length, crc)
                keys.append(key)
        self._files[path] = (keys, size)
        self._used += size

    # -- protocol -------------------------------------------------------------------------
    def contains(self, keys: Sequence[int]) -> int:
        with self._lock:
            return prefix_length(keys, self._index.__contains__)

    def put(self, keys: Sequence[int], blobs: Sequence[torch.Tensor]) -> Handle:
        check_pairs(keys, blobs, "blobs")
        with self._lock:
            fresh = [(k, b) for k, b in zip(keys, blobs) if k not in self._index]
        if not fresh:
            return Handle.finished([True] * len(keys))
        return Handle(self._pool.submit(self._put_now, list(keys), fresh))

    def _put_now(self, keys: list[int], fresh) -> list[bool]:
        payloads = [b.detach().to("cpu").contiguous().numpy().tobytes() for _, b in fresh]
        if self.fmt is not None:
            try:
                payloads = [self.fmt.encode(p) for p in payloads]
            except ValueError:  # a blob this format cannot hold: nothing is written, the caller keeps it
                with self._lock:
                    self._failures += 1
                    return [k in self._index for k in keys]
        ok = self.write_group([k for k, _ in fresh], payloads)
        with self._lock:
            return [ok or k in self._index for k in keys]

    def write_group(self, keys: list[int], payloads: list[bytes]) -> bool:
        """Write one page group synchronously; False (and nothing indexed) if it could not be written."""
        size = _HEADER.size + len(keys) * _ENTRY.size + sum(len(p) for p in payloads)
        with self._lock:
            if size > self.budget_bytes:
                self._failures += 1
                return False
            while self._used + size > self.budget_bytes:
                self._evict_file()  # cannot run dry: the group alone fits the budget
        table, offset, rows = bytearray(), _HEADER.size + len(keys) * _ENTRY.size, []
        for key, payload in zip(keys, payloads):
            crc = crc32c.crc32c(payload)
            table += _ENTRY.pack(key, offset, len(payload), crc, 0)
            rows.append((key, offset, len(payload), crc))
            offset += len(payload)
        header = _HEADER.pack(MAGIC, VERSION, self.fingerprint, len(keys), crc32c.crc32c(bytes(table)))
        name = hashlib.blake2b(struct.pack(f"<{len(keys)}Q", *keys), digest_size=16).hexdigest() + SUFFIX
        path = os.path.join(self.directory, name)
        temp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            self._write_file(temp, [header, bytes(table), *payloads])
            os.replace(temp, path)
            if self.fsync:
                _fsync_dir(self.directory)
        except OSError:
            _remove(temp)
            with self._lock:
                self._failures += 1
            return False
        with self._lock:
            if path in self._files:  # the same group written twice: keep one copy
                return True
            self._adopt(path, rows, size)
        return True

    def _write_file(self, path: str, parts: list[bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write")
                    view = view[written:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, keys: Sequence[int], into: Sequence[torch.Tensor]) -> Handle:
        check_pairs(keys, into, "buffers")
        return Handle(self._pool.submit(self._get_now, list(keys), list(into)))

    def _get_now(self, keys: list[int], into: list[torch.Tensor]) -> list[bool]:
        results = []
        for key, out in zip(keys, into):
            with self._lock:
                where = self._index.get(key)
                if where is not None:
                    self._files.move_to_end(where.path)
            if where is None or out.numel() < self._decoded_size(where):
                with self._lock:
                    self._misses += 1
                results.append(False)
                continue
            ok = self._read_into(where, out)
            if not ok:
                with self._lock:
                    self._failures += 1
                    self._misses += 1
                    self._drop_file(where.path)
                _remove(where.path)
                results.append(False)
                continue
            with self._lock:
                self._hits += 1
            results.append(True)
        return results

    def _read_into(self, where: _Location, out: torch.Tensor) -> bool:
        """Read one blob into ``out`` and check it. CPU buffers (pinned or not) are filled in place;
        device buffers through one bounce copy. On a bad checksum ``out`` holds garbage and False says so."""
        direct = out.device.type == "cpu" and out.is_contiguous() and self.fmt is None
        target = out[: where.length] if direct else torch.empty(where.length, dtype=torch.uint8)
        view = memoryview(target.numpy())
        try:
            with open(where.path, "rb") as f:
                f.seek(where.offset)
                got = f.readinto(view)
        except OSError:
            return False
        if got != where.length or crc32c.crc32c(view) != where.crc:
            return False
        if self.fmt is not None:
            try:
                self.fmt.decode(view, out)  # host or device buffer: the format copies into it
            except CorruptStream:
                return False
        elif not direct:
            out[: where.length].copy_(target)
        return True

    def blob_size(self, key: int) -> int | None:
        with self._lock:
            where = self._index.get(key)
            return None if where is None else self._decoded_size(where)

    def _decoded_size(self, where: _Location) -> int:
        """Bytes a blob occupies once read back (its stored length, or the format's decoded size)."""
        return self.fmt.blob_bytes if self.fmt is not None else where.length

    def _drop_file(self, path: str) -> None:
        keys, size = self._files.pop(path, ([], 0))
        for key in keys:
            self._index.pop(key, None)
        self._used -= size

    def _evict_file(self) -> bool:
        if not self._files:
            return False
        path = next(iter(self._files))
        self._drop_file(path)
        _remove(path)
        self._evictions += 1
        return True

    def evict(self, n: int) -> int:
        """Drop up to ``n`` least recently used page-group files."""
        with self._lock:
            dropped = 0
            while dropped < n and self._evict_file():
                dropped += 1
            return dropped

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, len(self._index), self._used, self.budget_bytes, self._hits, self._misses,
                             self._evictions, self._failures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _remove(path: str) -> None:
    if os.path.exists(path):
        try:
            os.remove(path)
        except FileNotFoundError:  # removed meanwhile by another thread
            return


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
