"""File tier: crash-safe page-group files with a checksum per blob.

One file per `put` call (a page group). It is written to a temporary name, fsynced, renamed into
place and the directory fsynced, so a file under its final name is always complete. Layout:

    header (48 bytes): magic, version, layout fingerprint (16 bytes), blob count, table crc32c, write sequence
    table: per blob (key u64, offset u64, length u64, crc32c u32, pad u32)
    blob bytes, back to back in table order

File names come from a hash of the fingerprint and the keys, never from user strings; files are 0600.
Nothing is pickled. The index is rebuilt by scanning the directory at start-up. The directory may be
shared (another model, another program), so the tier deletes only what it wrote itself: its own
orphaned temporary files, and files of its own fingerprint that are damaged. Everything else
(other names, other formats or fingerprints, symbolic links, which are never followed) is skipped
and logged. Every length read from a file is bounded by the file's size.

On read, a blob whose checksum fails (or whose stored stream the format rejects, or whose contents the
reader's check refuses: `get`'s ``check``) is corrupt: a miss, and no longer indexed; the other blobs of its file
stay (each has its own checksum), and the file is removed with its last blob. An I/O error is only a miss; the file
and its index entries stay.
The byte budget is a bound: a write reserves its bytes (evicting LRU files) before it starts.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import torch

try:
    import fcntl
except ImportError:  # not POSIX: temporary files of a live pid are kept, as before
    fcntl = None

from kvbackend.errors import CorruptStream
from kvbackend.tiers.base import Handle, TierError, TierStats, check_pairs, prefix_length
from kvbackend.tiers.persist import BlobFormat

log = logging.getLogger(__name__)

MAGIC = b"KVBKPAGE"
VERSION = 1
# magic, version, fingerprint, count, table crc, write sequence (u64; 0 in files of earlier releases, which left
# these bytes as padding and ignore them), padding to 48 bytes
_HEADER = struct.Struct("<8sI16sIIQ4x")
_ENTRY = struct.Struct("<QQQII")  # key, offset, length, crc32c, flags (earlier releases wrote 0 and ignore it)
_REPLACED = 1  # flag of an entry whose key a later file holds: never indexed again (a restart must not serve it)
SUFFIX = ".kvb"
TEMP_PREFIX = ".kvbw-"  # temporary files: TEMP_PREFIX + final stem + ".<pid>.<thread>" + SUFFIX + ".tmp"
_FINAL_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + r"\Z")
_TEMP_NAMES = (
    re.compile(re.escape(TEMP_PREFIX) + r"[0-9a-f]{32}\.([0-9]{1,10})\.[0-9]{1,20}" + re.escape(SUFFIX) + r"\.tmp\Z"),
    re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.tmp\.([0-9]{1,10})\.[0-9]{1,20}\Z"),  # earlier versions
)
_NOT_OURS = {errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO}  # open errors of a path replaced meanwhile
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

_HIT, _IO_ERROR, _GONE, _CORRUPT = "hit", "io error", "gone", "corrupt"  # outcomes of one blob read


@dataclass(frozen=True)
class _Location:
    path: str
    offset: int
    length: int
    crc: int
    sequence: int = 0  # the write sequence of its file: of two files holding a key, the later one serves it


READS_PER_WORKER = 4  # a get of fewer blobs per worker stays on one worker
# a blob format's stored stream (AlignPred's) is at most this many times the page group it decodes to (plus 1 MiB):
# a longer one, crafted, would be read whole into memory before its format refused it
_MAX_STORED_RATIO = 4
# blobs one file lists at most (a 40 MiB table): a put of more keys is written as several files; a table claiming more
# (crafted, over a sparse file) is refused before it is read into memory
MAX_ENTRIES = 1 << 20


class FileTier:
    name = "file"

    def __init__(self, directory: str, budget_bytes: int, fingerprint: str, fsync: bool = True,
                 workers: int | None = None, fmt: BlobFormat | None = None) -> None:
        """``fmt``: how blobs are stored (default: their bytes as they are; see :mod:`.persist`). ``workers``:
        threads for writes and side-by-side reads (default: the cores this process may run on, 2 to 8)."""
        if len(fingerprint.encode()) != 16:
            raise ValueError(f"fingerprint must be 16 ASCII characters (PageLayout.fingerprint), got {fingerprint!r}")
        # checked before the directory is scanned: start-up evicts down to the budget (a negative one removed every
        # file, a NaN one turned the bound off)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"file tier budget_bytes must be an int >= 0, got {budget_bytes!r}")
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
        self._used = 0  # bytes of the files indexed
        self._reserved = 0  # bytes of writes in flight (counted against the budget until they land or fail)
        self._hits = self._misses = self._evictions = self._failures = 0
        self._logged: set[str] = set()
        self._workers = max(1, int(workers)) if workers is not None else default_workers()
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvbackend-file")
        self._closed = False
        self._sequence = 0  # the write sequence of the newest file indexed or written (`write_group`)
        self._scan()

    # -- start-up -------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index this tier's files, oldest first; skip (and log) whatever it cannot read or does not own."""
        skipped: dict[str, list[str]] = {}
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("file tier: cannot list %s (%s); starting empty", self.directory, exc)
            return
        candidates = []
        for entry in entries:
            reason = None
            try:
                if entry.is_symlink():
                    reason = "symbolic links (never followed)"
                elif _temp_writer(entry.name) is not None:
                    reason = self._clean_temp(entry)
                elif not _FINAL_NAME.match(entry.name):
                    reason = "files of other names"
                elif not entry.is_file(follow_symlinks=False):
                    reason = "entries that are not regular files"
                else:
                    candidates.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name, entry.path))
            except OSError:  # vanished or unreadable meanwhile
                reason = "entries that could not be read"
            if reason is not None:
                skipped.setdefault(reason, []).append(entry.name)
        tables = []
        for mtime, name, path in sorted(candidates):
            verdict, rows, size, sequence = self._read_table(path)
            if verdict == "ok":
                tables.append(((sequence, mtime, name), path, rows, size))
                self._sequence = max(self._sequence, sequence)
            elif verdict == "damaged":  # our fingerprint, so the tier wrote it
                log.warning("file tier: removing damaged file %s", path)
                _remove(path)
            else:
                skipped.setdefault(verdict, []).append(name)
        # a key in two files was put again after its copy in the older one was found corrupt (`_drop_blob` keeps a
        # file for its other blobs, and its table still lists the bad copy), or the process died between writing a
        # key's new file and marking its entry in the older one (`_adopt`): the newest copy is the one indexed
        # (files in the order they were written: their write sequence, which ties only between files of releases
        # that wrote none; then their modification time, which ties within a clock tick; then their name)
        tables = [(order[0], *rest) for order, *rest in sorted(tables)]
        newest = {row[0]: path for _, path, rows, _ in tables for row in rows}
        for sequence, path, rows, size in tables:  # oldest first: the LRU order
            rows = [row for row in rows if newest[row[0]] == path]
            if rows:
                self._adopt(path, rows, size, sequence)
            else:  # every blob of it lives in a newer file, or was replaced: nothing left to serve
                _remove(path)
        for reason, names in skipped.items():
            level = logging.INFO if reason == "files of another layout" else logging.WARNING
            log.log(level, "file tier %s: skipped %d %s (left in place), e.g. %s", self.directory, len(names),
                    reason, ", ".join(sorted(names)[:3]))
        while self._used > self.budget_bytes and self._evict_file():  # e.g. restarted with a smaller budget
            pass

    def _clean_temp(self, entry: os.DirEntry) -> str | None:
        """Remove one of our temporary files whose writer is gone; the reason it was kept otherwise."""
        if not entry.is_file(follow_symlinks=False):
            return "entries that are not regular files"
        if _process_alive(_temp_writer(entry.name)) and _locked(entry.path):
            return "temporary files of a running writer"
        _remove(entry.path)  # its writer is gone (a live pid of another process, or a writer that no longer holds it)
        return None

    def _read_table(self, path: str) -> tuple[str, list, int, int]:
        """("ok", [(key, offset, length, crc)], size, write sequence) for a well-formed file of our layout; else a
        verdict: "damaged" (our fingerprint, so ours to delete) or why it is skipped (never deleted)."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return "entries that could not be read", [], 0, 0
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return "entries that are not regular files", [], 0, 0
            size = info.st_size
            head = _pread(fd, _HEADER.size, 0)
            if len(head) != _HEADER.size:
                return "files of another format", [], 0, 0
            magic, version, fingerprint, count, table_crc, sequence = _HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                return "files of another format", [], 0, 0
            if fingerprint != self.fingerprint:
                return "files of another layout", [], 0, 0
            data_start = _HEADER.size + count * _ENTRY.size
            if data_start > size or count > MAX_ENTRIES:  # checked before anything of that length is read
                return "damaged", [], 0, 0
            table = _pread(fd, count * _ENTRY.size, _HEADER.size)
            if len(table) != count * _ENTRY.size or crc32c.crc32c(table) != table_crc:
                return "damaged", [], 0, 0
            rows, offset = [], data_start
            for i in range(count):  # blobs lie back to back after the table, exactly as written
                key, start, length, crc, flags = _ENTRY.unpack_from(table, i * _ENTRY.size)
                if start != offset or length > size - offset:
                    return "damaged", [], 0, 0
                if not flags & _REPLACED:
                    rows.append((key, start, length, crc))
                offset += length
            return ("ok", rows, size, sequence) if offset == size else ("damaged", [], 0, 0)
        except OSError:
            return "entries that could not be read", [], 0, 0
        finally:
            os.close(fd)

    def _adopt(self, path: str, rows, size: int, sequence: int) -> bool:
        """Index the blobs ``rows`` of file ``path`` (write sequence ``sequence``; the first row of a key listed
        twice). A key an older file holds moves here: that file goes with its last blob, or else its entry is marked
        replaced on disk, so a restart never serves the replaced copy once this file is evicted. Whether ``path`` was
        indexed (False: a file written later holds one of its keys, two puts of a key having landed out of order;
        ``path`` is removed)."""
        if any((old := self._index.get(key)) is not None and old.path != path and old.sequence > sequence
               for key, *_ in rows):
            _remove(path)
            return False
        keys, seen = [], set()
        for key, offset, length, crc in rows:
            if key in seen:
                continue
            seen.add(key)
            old = self._index.get(key)
            if old is not None and old.path != path:
                if self._drop_blob(key, old):
                    _remove(old.path)
                elif not self._mark_replaced(old.path, key):  # the replaced copy must not come back: its file goes
                    self._drop_file(old.path)
                    _remove(old.path)
            self._index[key] = _Location(path, offset, length, crc, sequence)
            keys.append(key)
        self._files[path] = (keys, size)
        self._used += size
        return True

    def _mark_replaced(self, path: str, key: int) -> bool:
        """Flag the entry of ``key`` in file ``path``'s table as replaced (the table's checksum rewritten with it:
        a crash in between leaves a table that fails its checksum, and start-up removes the file). Whether it was
        marked."""
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            head = _pread(fd, _HEADER.size, 0)
            if len(head) != _HEADER.size:
                return False
            magic, version, fingerprint, count, _, sequence = _HEADER.unpack(head)
            table = bytearray(_pread(fd, count * _ENTRY.size, _HEADER.size))
            if len(table) != count * _ENTRY.size:
                return False
            for i in range(count):
                entry = list(_ENTRY.unpack_from(table, i * _ENTRY.size))
                if entry[0] == key:
                    entry[4] |= _REPLACED
                    _ENTRY.pack_into(table, i * _ENTRY.size, *entry)
            os.pwrite(fd, bytes(table), _HEADER.size)
            os.pwrite(fd, _HEADER.pack(magic, version, fingerprint, count, crc32c.crc32c(bytes(table)), sequence), 0)
            if self.fsync:
                os.fsync(fd)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    # -- protocol -------------------------------------------------------------------------
    def contains(self, keys: Sequence[int]) -> int:
        with self._lock:
            return prefix_length(keys, self._index.__contains__)

    def put(self, keys: Sequence[int], blobs: Sequence[torch.Tensor]) -> Handle:
        self._require_open()
        check_pairs(keys, blobs, "blobs")
        for key, blob in zip(keys, blobs):
            if not isinstance(blob, torch.Tensor):  # (its bytes are read in a worker: refused here, not there)
                raise ValueError(f"blob for key {key} must be a tensor, got {type(blob).__name__}")
        bad = [k for k in keys if not 0 <= k < 1 << 64]
        if bad:  # a key the file's table (u64) cannot hold: refused here, before any budget is reserved
            raise ValueError(f"file tier keys are unsigned 64-bit integers, got {bad[:4]}")
        with self._lock:
            # a file removed behind the tier's back (its directory cleaned while running) holds nothing: its keys
            # are forgotten, so they are written again rather than found held with these bytes
            for path in {self._index[k].path for k in keys if k in self._index}:
                if not os.path.exists(path):
                    self._drop_file(path)
        return Handle(self._pool.submit(self._put_now, list(keys), list(zip(keys, blobs))))

    def _put_now(self, keys: list[int], pairs) -> list[bool]:
        """Write the blobs of ``pairs``: a key held already is written again unless it holds these very bytes (the
        newest blob of a key replaces the held one: a page group differs between encodes of the same tokens)."""
        # written from the blobs' own memory (a uint8 array each), not from a copy of it
        payloads = [b.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy() for _, b in pairs]
        if self.fmt is not None:
            try:
                payloads = [self.fmt.encode(p.tobytes()) for p in payloads]
                if any(len(p) > self._max_stored() for p in payloads):
                    raise ValueError("a stream longer than the tier reads back")  # never written to be refused
            except ValueError:  # a blob this format cannot hold: nothing is written, the caller keeps it
                with self._lock:
                    self._failures += 1
                    return [False] * len(keys)
        crcs, firsts = {}, []
        for (k, _), p in zip(pairs, payloads):
            if k not in crcs:  # a key listed twice in one call: its first blob
                crcs[k] = (len(p), crc32c.crc32c(p))
                firsts.append((k, p))
        with self._lock:
            fresh = [(k, p) for k, p in firsts if self._holds(k) != crcs[k]]
        if fresh:
            for i in range(0, len(fresh), MAX_ENTRIES):  # (a file lists at most MAX_ENTRIES blobs)
                part = fresh[i : i + MAX_ENTRIES]
                self.write_group([k for k, _ in part], [p for _, p in part], [crcs[k][1] for k, _ in part])
        with self._lock:  # True where the key serves these very bytes now (written, or held already)
            return [self._holds(k) == crcs[k] for k in keys]

    def _holds(self, key: int) -> tuple[int, int] | None:
        """Under the lock: (length, crc32c) of the blob ``key`` serves, or None."""
        where = self._index.get(key)
        return None if where is None else (where.length, where.crc)

    def write_group(self, keys: list[int], payloads: list, crcs: list[int] | None = None) -> bool:
        """Write one page group synchronously (``payloads``: bytes or 1-D uint8 arrays, ``crcs`` their crc32c where
        the caller has them); False (and nothing indexed) if it could not be written, including a group larger than
        the whole budget, or one that a put of one of its keys issued later has replaced already."""
        if len(keys) > MAX_ENTRIES:
            raise ValueError(f"a file lists at most {MAX_ENTRIES} blobs, got {len(keys)}")
        size = _HEADER.size + len(keys) * _ENTRY.size + sum(len(p) for p in payloads)
        # the table, header and names first: whatever they raise (a key no u64 holds) raises before any reservation
        table, offset, rows = bytearray(), _HEADER.size + len(keys) * _ENTRY.size, []
        for i, (key, payload) in enumerate(zip(keys, payloads)):
            crc = crc32c.crc32c(payload) if crcs is None else crcs[i]
            table += _ENTRY.pack(key, offset, len(payload), crc, 0)
            rows.append((key, offset, len(payload), crc))
            offset += len(payload)
        with self._lock:  # later than every file indexed and written before it (their clocks' ticks tie)
            self._sequence = max(self._sequence + 1, time.time_ns())
            sequence = self._sequence
        header = _HEADER.pack(MAGIC, VERSION, self.fingerprint, len(keys), crc32c.crc32c(bytes(table)), sequence)
        stem = hashlib.blake2b(self.fingerprint + struct.pack(f"<{len(keys)}Q", *keys), digest_size=16).hexdigest()
        path = os.path.join(self.directory, stem + SUFFIX)
        temp = os.path.join(self.directory, f"{TEMP_PREFIX}{stem}.{os.getpid()}.{threading.get_ident()}{SUFFIX}.tmp")
        with self._lock:
            if not self._reserve(size):
                self._failures += 1
                return False
        held = True  # the reservation, until the file is indexed or the write has failed
        try:
            self._write_file(temp, [header, bytes(table), *payloads])
            with self._lock:  # renamed and indexed at once: an eviction cannot fall in between
                os.replace(temp, path)
                self._reserved -= size
                held = False
                if path in self._files:  # the same group written again: the new file replaced the old
                    self._drop_file(path)
                if not self._adopt(path, rows, size, sequence):
                    return False
        except BaseException as exc:  # any failure (MemoryError too) gives its reservation back and leaves no temp
            if held:
                _remove(temp)
                with self._lock:
                    self._reserved -= size
                    self._failures += 1
            if not isinstance(exc, OSError):
                raise
            self._log_once(f"write {exc.errno}", "file tier: writing %s failed: %s", path, exc)
            return False
        if self.fsync:
            try:
                _fsync_dir(self.directory)
            except OSError as exc:  # the file is complete and readable; only its rename may not survive a crash
                self._log_once(f"dirsync {exc.errno}", "file tier: syncing %s failed: %s", self.directory, exc)
        return True

    def _reserve(self, size: int) -> bool:
        """Under the lock: hold ``size`` bytes of the budget, evicting LRU files for room; False if the
        group cannot fit (larger than the budget, or writes in flight hold the rest of it)."""
        if self._reserved + size > self.budget_bytes:  # no eviction could make room: evict nothing for it
            return False
        while self._used + self._reserved + size > self.budget_bytes:
            if not self._evict_file():
                return False
        self._reserved += size
        return True

    def _write_file(self, path: str, parts: list[bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            # locked while it is written: another process's start-up scan (`_clean_temp`) sees a live writer even
            # where this pid is reused. Between the close and the rename such a scan may still take the file for a
            # leftover; the rename then fails and so does this write (nothing is indexed, nothing served).
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
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

    def get(self, keys: Sequence[int], into: Sequence[torch.Tensor],
            expected_len: Sequence[int | None] | None = None,
            check: Callable[[torch.Tensor], str | None] | None = None) -> Handle:
        """Read blobs into 1-D uint8 buffers (at least as long as the blob; bytes past it are left
        alone). ``expected_len[i]``, when given and not None, is the exact length key ``i``'s blob must
        have once read back (see `blob_size`): a blob of any other length is a miss, nothing copied.
        ``check(blob)``, when given, sees each blob that passed its checksum (on the host, as read back) and
        returns why its contents are refused, or None: a refused blob is corrupt like one that fails its
        checksum (a miss, counted as a failure, its file removed), so the tier never serves bytes its reader
        cannot trust (`kvbackend.page_check`: crafted pages come with a valid checksum)."""
        self._require_open()
        check_pairs(keys, into, "buffers")
        if expected_len is not None:
            check_pairs(keys, expected_len, "expected lengths")
        for out in into:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1:
                raise ValueError(f"file tier buffers are 1-D uint8 tensors, got "
                                 f"{getattr(out, 'dtype', type(out))} of shape {tuple(getattr(out, 'shape', ()))}")
        wanted = list(expected_len) if expected_len is not None else [None] * len(keys)
        keys, into = list(keys), list(into)
        # many blobs: consecutive parts read by the workers side by side (reads and checksums release the GIL)
        parts = max(1, min(self._workers, len(keys) // READS_PER_WORKER))
        step = -(-len(keys) // parts) if keys else 1
        return Handle.combine([Handle(self._pool.submit(self._get_now, keys[at : at + step], into[at : at + step],
                                                        wanted[at : at + step], check))
                               for at in range(0, max(len(keys), 1), step)])

    def _get_now(self, keys: list[int], into: list[torch.Tensor], wanted: list[int | None],
                 check: Callable[[torch.Tensor], str | None] | None = None) -> list[bool]:
        results = []
        for key, out, want in zip(keys, into, wanted):
            with self._lock:
                where = self._index.get(key)
                if where is not None:
                    self._files.move_to_end(where.path)
            size = None if where is None else self._decoded_size(where)
            if size is None or out.numel() < size or (want is not None and want != size):
                with self._lock:
                    self._misses += 1
                results.append(False)
                continue
            outcome, why = self._read_into(where, out, check)
            with self._lock:
                if outcome == _HIT:
                    self._hits += 1
                else:
                    self._misses += 1
                    self._failures += 1
                    if outcome == _GONE and self._index.get(key) is where:  # not re-written meanwhile
                        self._drop_file(where.path)
                    elif outcome == _CORRUPT and self._index.get(key) is where and self._drop_blob(key, where):
                        _remove(where.path)  # its last blob: the file goes
            if outcome == _CORRUPT:
                log.warning("file tier: blob %d in %s is corrupt (%s); dropped", key, where.path, why)
            results.append(outcome == _HIT)
        return results

    def _read_into(self, where: _Location, out: torch.Tensor,
                   check: Callable[[torch.Tensor], str | None] | None = None) -> tuple[str, str]:
        """Read one blob into ``out`` and check it (checksum, then ``check``); the outcome and why. CPU buffers
        (pinned or not) are filled in place, device buffers through one bounce copy. On any outcome but a hit,
        ``out[:length]`` may hold garbage."""
        if self.fmt is not None and where.length > self._max_stored():
            return _CORRUPT, f"a stored stream of {where.length} bytes, past what the format writes"  # nothing read
        direct = out.device.type == "cpu" and out.is_contiguous() and self.fmt is None
        target = out[: where.length] if direct else torch.empty(where.length, dtype=torch.uint8)
        view = memoryview(target.numpy())
        try:
            fd = os.open(where.path, _OPEN_FLAGS)
        except FileNotFoundError:
            return _GONE, "gone"
        except OSError as exc:
            if exc.errno in _NOT_OURS:  # replaced by a link, a directory, ...: its entries go (nothing is deleted)
                self._log_once(f"read {exc.errno}", "file tier: %s is no longer a file of ours: %s", where.path, exc)
                return _GONE, "gone"
            self._log_once(f"read {exc.errno}", "file tier: reading %s failed: %s (a miss)", where.path, exc)
            return _IO_ERROR, "i/o error"
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced by something the tier never wrote
                return _GONE, "gone"
            got = _pread_into(fd, view, where.offset)
        except OSError as exc:
            self._log_once(f"read {exc.errno}", "file tier: reading %s failed: %s (a miss)", where.path, exc)
            return _IO_ERROR, "i/o error"
        finally:
            os.close(fd)
        if got != where.length or crc32c.crc32c(view) != where.crc:
            return _CORRUPT, "checksum"
        try:
            why = check(target) if check is not None and self.fmt is None else None  # before any device copy
            if why is not None:
                return _CORRUPT, why
            if self.fmt is not None:
                self.fmt.decode(view, out)  # host or device buffer: the format copies into it
                why = check(out[: self.fmt.blob_bytes]) if check is not None else None
                if why is not None:
                    return _CORRUPT, why
            elif not direct:
                out[: where.length].copy_(target)
        except CorruptStream as exc:
            return _CORRUPT, f"stream: {exc}"
        except Exception as exc:  # noqa: BLE001 - not proven corrupt: a miss that keeps the file
            self._log_once(f"copy {type(exc).__name__}", "file tier: delivering a blob of %s failed: %r",
                           where.path, exc)
            return _IO_ERROR, "i/o error"
        return _HIT, ""

    def refuse(self, key: int, blob: torch.Tensor, why: str) -> bool:
        """Drop the blob of ``key`` that `get` delivered (a hit) and its reader then refused (a check run over a
        whole batch of blobs at once, `kvbackend.page_check`), as `get` drops one its ``check`` refuses: counted as
        a miss and a failure instead of a hit, its file removed with its last blob. ``blob`` is what was read (its
        first bytes, as long as the stored blob): a blob of the key written since, with another checksum, stays.
        With a blob format (`fmt`, whose stored bytes differ from those read) no checksum names the refused blob,
        and whichever blob the key holds goes. Call it only for a blob this tier's `get` returned as a hit. Whether
        a blob was dropped."""
        with self._lock:
            where = self._index.get(key)
        same = where is not None and (self.fmt is not None or (
            blob.numel() >= where.length
            and crc32c.crc32c(memoryview(blob.detach().reshape(-1)[: where.length].cpu().contiguous().numpy()))
            == where.crc))
        with self._lock:
            self._hits -= 1
            self._misses += 1
            self._failures += 1
            if not same or self._index.get(key) is not where:  # gone, or written again meanwhile: it stays
                return False
            if self._drop_blob(key, where):  # its last blob: the file goes, under the lock (as in `get`), so a
                _remove(where.path)          # group written again under the same name is never the one removed
        log.warning("file tier: blob %d in %s is corrupt (%s); dropped", key, where.path, why)
        return True

    def blob_size(self, key: int) -> int | None:
        with self._lock:
            where = self._index.get(key)
            return None if where is None else self._decoded_size(where)

    def _max_stored(self) -> int:
        """The longest stream this tier's blob format stores (and reads back) for one page group."""
        return _MAX_STORED_RATIO * self.fmt.blob_bytes + (1 << 20)

    def _decoded_size(self, where: _Location) -> int:
        """Bytes a blob occupies once read back (its stored length, or the format's decoded size)."""
        return self.fmt.blob_bytes if self.fmt is not None else where.length

    def _drop_file(self, path: str) -> None:
        keys, size = self._files.pop(path, ([], 0))
        for key in keys:
            if key in self._index and self._index[key].path == path:  # (not a later file's blob of the key)
                del self._index[key]
        self._used -= size

    def _drop_blob(self, key: int, where: _Location) -> bool:
        """Forget one blob found corrupt. The other blobs of its file carry checksums of their own and stay
        served (a reader of one of them, running beside this one, must not lose it); the file, and its bytes in the
        budget, go with its last blob. Whether that was the last."""
        del self._index[key]
        keys, size = self._files.get(where.path, ([], 0))
        live = [k for k in keys if k in self._index and self._index[k].path == where.path]
        if live:
            self._files[where.path] = (live, size)
            return False
        self._drop_file(where.path)
        return True

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

    def _log_once(self, kind: str, message: str, *args) -> None:
        """Log the first failure of each kind as a warning, the rest at debug level (no log storms)."""
        first = kind not in self._logged
        self._logged.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)

    def _require_open(self) -> None:
        if self._closed:
            raise TierError(f"file tier {self.directory} is closed")


def default_workers(most: int = 8) -> int:
    """File-tier threads: the cores this process may run on, between 2 and ``most`` (reads and checksums release
    the GIL, so a large get is read side by side)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, min(most, cores))


def _temp_writer(name: str) -> int | None:
    """The writer's pid if ``name`` is one of this tier's temporary files (of any version); else None."""
    for pattern in _TEMP_NAMES:
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def _locked(path: str) -> bool:
    """Whether a writer holds ``path``'s lock (True where that cannot be told: the file is then kept)."""
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by its writer (or locks unsupported here)
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _process_alive(pid: int | None) -> bool:
    """Whether ``pid`` may still be writing (unknown counts as alive: its file is then kept)."""
    if pid is None or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or not a pid this system could have
        return True
    return True


def _pread(fd: int, length: int, offset: int) -> bytes:
    buffer = bytearray(length)
    return bytes(buffer[: _pread_into(fd, memoryview(buffer), offset)])


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _remove(path: str) -> None:
    """Delete one of the tier's own files (a symbolic link is unlinked, never followed)."""
    try:
        os.remove(path)
    except FileNotFoundError:  # removed meanwhile by another thread
        return
    except OSError as exc:
        log.warning("file tier: cannot remove %s: %s", path, exc)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
