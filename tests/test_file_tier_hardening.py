"""File tier hardening: start-up over damaged or hostile directories, I/O errors versus corruption,
the byte budget under concurrent writers, files the tier does not own, and a seeded fuzz of the
index rebuild. Every blob served must be exactly the bytes that were put; anything else is a miss."""

import builtins
import errno
import fcntl
import hashlib
import logging
import os
import random
import shutil
import struct
import threading
import time

import crc32c
import pytest
import torch

from kvbackend.tiers.file import SUFFIX, FileTier

FINGERPRINT = "0123456789abcdef"
OTHER = "fedcba9876543210"
HEADER, ENTRY = 48, 32  # the on-disk header and table-entry sizes
COUNT_AT, TABLE_CRC_AT = 28, 32  # byte offsets of the header's blob count and table crc32c
LOGGER = "kvbackend.tiers.file"


def blob_for(key: int, size: int = 300) -> torch.Tensor:
    """Deterministic content per key (lengths differ a little per key)."""
    gen = torch.Generator().manual_seed(key)
    return torch.randint(0, 256, (size + key % 7,), dtype=torch.uint8, generator=gen)


def write_groups(directory, groups, size: int = 300, fingerprint: str = FINGERPRINT) -> dict[str, list[int]]:
    """Put each group of keys as one file; returns file name -> its keys."""
    tier = FileTier(str(directory), 10**7, fingerprint, fsync=False)
    files = {}
    for keys in groups:
        before = set(os.listdir(directory))
        assert all(tier.put(keys, [blob_for(k, size) for k in keys]).result())
        (name,) = set(os.listdir(directory)) - before
        files[name] = list(keys)
    tier.close()
    return files


def served(tier: FileTier, keys: list[int], size: int = 300, pad: int = 64) -> set[int]:
    """Keys whose get succeeded; asserts each served blob is exactly the original (both into a longer
    buffer, whose tail must stay untouched, and into one of the stored length)."""
    longer = [torch.full((size + 8 + pad,), 0xAB, dtype=torch.uint8) for _ in keys]
    ok = tier.get(keys, longer).result()
    exact = [torch.full((blob_for(k, size).numel(),), 0xCD, dtype=torch.uint8) for k in keys]
    ok_exact = tier.get(keys, exact).result()
    for k, out, good in zip(keys, longer, ok):
        if good:
            n = blob_for(k, size).numel()
            assert torch.equal(out[:n], blob_for(k, size)), f"key {k}: wrong bytes served"
            assert bool((out[n:] == 0xAB).all()), f"key {k}: bytes written past the blob"
    for k, out, good in zip(keys, exact, ok_exact):
        if good:
            assert torch.equal(out, blob_for(k, size)), f"key {k}: wrong bytes served"
    return {k for k, a, b in zip(keys, ok, ok_exact) if a and b}


def rewrite_table(path, change) -> None:
    """Apply ``change(rows)`` to a file's table and store it with a matching table crc (a consistent
    but lying table, as opposed to a bit flip that the crc catches)."""
    data = bytearray(path.read_bytes())
    count = struct.unpack_from("<I", data, COUNT_AT)[0]
    rows = [list(struct.unpack_from("<QQQII", data, HEADER + i * ENTRY)) for i in range(count)]
    change(rows)
    table = b"".join(struct.pack("<QQQII", *r) for r in rows)
    data[HEADER : HEADER + len(table)] = table
    struct.pack_into("<I", data, TABLE_CRC_AT, crc32c.crc32c(table))
    path.write_bytes(bytes(data))


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# -- defect 8: start-up over one bad entry -----------------------------------------------------
def test_flipped_high_bit_of_count_is_skipped_not_a_memory_error(tmp_path):
    files = write_groups(tmp_path, [[1, 2, 3], [4, 5, 6]])
    victim, other = sorted(files)
    data = bytearray((tmp_path / victim).read_bytes())
    data[COUNT_AT + 3] ^= 0x80  # count |= 2**31: its table would be 64 GiB
    (tmp_path / victim).write_bytes(bytes(data))
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert served(tier, files[other]) == set(files[other])
    assert served(tier, files[victim]) == set()
    assert not (tmp_path / victim).exists()  # damaged, of our own fingerprint: the tier wrote it
    tier.close()


def test_startup_skips_symlinks_and_entries_that_vanish(tmp_path, monkeypatch, caplog):
    directory, outside = tmp_path / "tier", tmp_path / "outside"
    files = write_groups(directory, [[1, 2], [3, 4], [5, 6]])
    linked, vanishing, kept = sorted(files)
    outside.mkdir()
    shutil.move(str(directory / linked), str(outside / linked))
    os.symlink(outside / linked, directory / linked)  # a valid file of ours, but through a link
    os.symlink(tmp_path / "nowhere", directory / ("d" * 32 + SUFFIX))  # dangling
    os.symlink(directory / ("e" * 32 + SUFFIX), directory / ("e" * 32 + SUFFIX))  # a loop
    real_scandir = os.scandir

    def scandir_then_delete(path):  # the entry is listed, then removed before it is looked at
        entries = list(real_scandir(path))
        if os.path.exists(directory / vanishing):
            os.remove(directory / vanishing)
        return iter(entries)

    monkeypatch.setattr(os, "scandir", scandir_then_delete)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier = FileTier(str(directory), 10**7, FINGERPRINT)
    monkeypatch.undo()
    assert any(r.name == LOGGER for r in caplog.records)  # what was skipped is logged
    assert served(tier, files[kept]) == set(files[kept])
    assert served(tier, files[linked]) == set() and served(tier, files[vanishing]) == set()
    assert (outside / linked).exists() and os.path.islink(directory / linked)  # not followed, not deleted
    assert os.path.islink(directory / ("d" * 32 + SUFFIX)) and os.path.islink(directory / ("e" * 32 + SUFFIX))
    assert tier.evict(10) == 1 and (outside / linked).exists()
    tier.close()


@pytest.mark.parametrize("lie", ["offset_past_end", "offset_into_header", "huge_length", "overlap"])
def test_startup_bounds_every_offset_and_length_by_the_file(tmp_path, lie):
    files = write_groups(tmp_path, [[1, 2, 3]])
    (name,) = files
    size = os.path.getsize(tmp_path / name)

    def change(rows):
        if lie == "offset_past_end":
            rows[1][1] = size + 10
        elif lie == "offset_into_header":
            rows[0][1] = 0
        elif lie == "huge_length":
            rows[2][2] = 2**63
        else:  # the second blob reads the first one's bytes; the lengths still add up to the file size
            rows[1][1] = rows[0][1]

    rewrite_table(tmp_path / name, change)
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert tier.contains([1]) + tier.contains([2]) + tier.contains([3]) == 0  # the file is not indexed
    assert served(tier, [1, 2, 3]) == set()
    tier.close()


# -- defect 9: an I/O error is a miss, not corruption ---------------------------------------------
def test_transient_emfile_keeps_the_file_and_a_later_get_succeeds(tmp_path, monkeypatch):
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    keys = [1, 2, 3]
    assert all(tier.put(keys, [blob_for(k) for k in keys]).result())
    (name,) = os.listdir(tmp_path)
    failed = []
    real_open, real_os_open = builtins.open, os.open

    def failing(real):
        def opener(path, *args, **kwargs):
            if str(path).endswith(SUFFIX) and not failed:
                failed.append(path)
                raise OSError(errno.EMFILE, "Too many open files")
            return real(path, *args, **kwargs)
        return opener

    monkeypatch.setattr(builtins, "open", failing(real_open))
    monkeypatch.setattr(os, "open", failing(real_os_open))
    out = torch.empty(400, dtype=torch.uint8)
    assert tier.get([1], [out]).result() == [False]
    monkeypatch.undo()
    assert failed, "the read never opened the file"
    assert os.path.exists(tmp_path / name) and tier.contains(keys) == 3
    assert served(tier, keys) == set(keys)
    stats = tier.stats()
    assert stats.blobs == 3 and stats.misses >= 1
    tier.close()


def test_checksum_failure_drops_the_blob_then_its_file_and_a_vanished_file_is_forgotten(tmp_path):
    """A blob failing its checksum is a miss and forgotten; its file's other blob (checksummed on its own) stays
    served, and the file and its bytes go with the last of its blobs found corrupt."""
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    tier.put([1, 2], [blob_for(1), blob_for(2)]).wait()
    tier.put([3, 4], [blob_for(3), blob_for(4)]).wait()
    first, second = sorted(os.listdir(tmp_path), key=lambda n: os.path.getmtime(tmp_path / n))
    used = tier.stats().bytes_used
    data = bytearray((tmp_path / first).read_bytes())
    data[-1] ^= 0x01  # in blob 2's payload
    (tmp_path / first).write_bytes(bytes(data))
    assert served(tier, [2]) == set() and tier.contains([2]) == 0 and tier.stats().failures == 1
    assert (tmp_path / first).exists() and served(tier, [1]) == {1}  # blob 1 is intact
    assert tier.stats().bytes_used == used  # the file's bytes stay until its last blob goes
    data[tier._index[1].offset] ^= 0x01  # now blob 1's payload too
    (tmp_path / first).write_bytes(bytes(data))
    assert served(tier, [1]) == set() and not (tmp_path / first).exists() and tier.contains([1]) == 0
    assert tier.stats().bytes_used < used
    os.remove(tmp_path / second)  # removed behind the tier's back: a miss, and no longer indexed
    assert served(tier, [3]) == set() and tier.contains([4]) == 0
    tier.close()


# -- defect 12: the budget is a bound under concurrent writers ------------------------------------
def test_concurrent_writers_stay_within_the_budget(tmp_path, monkeypatch):
    group = 2 * 1000 + HEADER + 2 * ENTRY + 12  # two blobs of about 1000 bytes
    budget = 5 * group
    tier = FileTier(str(tmp_path), budget, FINGERPRINT, fsync=False, workers=8)
    original = tier._write_file

    def slow_write(path, parts):  # widen the window between the budget check and the rename
        time.sleep(0.005)
        original(path, parts)

    monkeypatch.setattr(tier, "_write_file", slow_write)
    errors = []

    def writer(t):
        try:
            for i in range(6):
                keys = [10_000 * (t + 1) + 2 * i, 10_000 * (t + 1) + 2 * i + 1]
                tier.put(keys, [blob_for(k, 1000) for k in keys]).result()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    on_disk = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
    assert on_disk <= budget, f"{on_disk} bytes on disk, budget {budget}"
    assert tier.stats().bytes_used == on_disk and not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    held = [k for k in tier._index]
    assert held and served(tier, held, 1000) == set(held)
    tier.close()


def test_oversized_group_is_refused_and_a_failed_write_releases_its_reservation(tmp_path, monkeypatch):
    budget = 2 * 1000 + HEADER + 2 * ENTRY + 12
    tier = FileTier(str(tmp_path), budget, FINGERPRINT, fsync=False)
    assert tier.put([1, 2, 3], [blob_for(k, 1000) for k in (1, 2, 3)]).result() == [False] * 3
    assert os.listdir(tmp_path) == [] and tier.stats().failures == 1
    original = tier._write_file
    calls = []

    def full_once(path, parts):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(path, parts)

    monkeypatch.setattr(tier, "_write_file", full_once)
    assert tier.put([4, 5], [blob_for(k, 1000) for k in (4, 5)]).result() == [False, False]
    assert tier.put([4, 5], [blob_for(k, 1000) for k in (4, 5)]).result() == [True, True]  # room again
    assert served(tier, [4, 5], 1000) == {4, 5}
    tier.close()


def test_restart_with_a_smaller_budget_evicts_down_to_it(tmp_path):
    files = write_groups(tmp_path, [[1, 2], [3, 4], [5, 6]])
    for age, name in enumerate(sorted(files)):  # the first name is the oldest
        os.utime(tmp_path / name, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    sizes = sorted(os.path.getsize(tmp_path / n) for n in files)
    budget = sizes[-1] + sizes[-2]  # room for two of the three files
    tier = FileTier(str(tmp_path), budget, FINGERPRINT)
    assert tier.stats().bytes_used <= budget
    assert sorted(os.listdir(tmp_path)) == sorted(files)[1:]  # the least recently used file went
    tier.close()


# -- defect 11: never delete what the tier did not create -----------------------------------------
def test_startup_never_deletes_files_it_does_not_own(tmp_path, caplog):
    ours = write_groups(tmp_path, [[1, 2]])
    theirs = write_groups(tmp_path, [[7, 8]], fingerprint=OTHER)  # another model sharing the directory
    foreign = {
        "notes.tmp": b"a user's file",
        "backup.kvb.tmp": b"another program's temp file",
        "readme.txt": b"hello",
        "f" * 32 + SUFFIX: b"NOTKVBKP" + bytes(100),  # our suffix, another format
        "a" * 32 + SUFFIX + f".tmp.{os.getpid()}.1": b"a live writer's temp file",
    }
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    live = os.open(tmp_path / ("a" * 32 + SUFFIX + f".tmp.{os.getpid()}.1"), os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_EX)  # its writer holds the file's lock while it writes
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    os.close(live)
    for name in [*foreign, *theirs]:
        assert (tmp_path / name).exists(), f"{name} was deleted"
    assert any(r.name == LOGGER for r in caplog.records)
    assert served(tier, [1, 2]) == {1, 2} and served(tier, [7, 8]) == set()
    tier.close()
    other = FileTier(str(tmp_path), 10**7, OTHER)
    assert served(other, [7, 8]) == {7, 8}
    other.close()


def test_startup_removes_only_its_own_orphaned_temp_files_and_damaged_files(tmp_path):
    files = write_groups(tmp_path, [[1, 2], [3, 4]])
    pid = os.fork()
    if pid == 0:  # a writer that dies after its temp file is complete, before the rename
        try:
            tier = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
            os.replace = lambda *a: os._exit(0)
            tier.write_group([5, 6], [blob_for(5).numpy().tobytes(), blob_for(6).numpy().tobytes()])
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    (orphan,) = set(os.listdir(tmp_path)) - set(files)
    damaged, good = sorted(files)
    data = bytearray((tmp_path / damaged).read_bytes())
    data[HEADER + 3] ^= 0x04  # inside the table: the table crc fails
    (tmp_path / damaged).write_bytes(bytes(data))
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert sorted(os.listdir(tmp_path)) == [good]  # the orphan and the damaged file were ours
    assert served(tier, files[good]) == set(files[good]) and served(tier, [*files[damaged], 5, 6]) == set()
    tier.close()


def test_models_sharing_a_directory_do_not_overwrite_each_other(tmp_path):
    keys = [11, 12]  # the same page hashes (e.g. the same prompt) under two layouts
    mine = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    theirs = FileTier(str(tmp_path), 10**7, OTHER)
    assert all(mine.put(keys, [blob_for(k) for k in keys]).result())
    assert all(theirs.put(keys, [blob_for(k + 1) for k in keys]).result())
    assert len(os.listdir(tmp_path)) == 2
    assert served(mine, keys) == set(keys)
    mine.close()
    theirs.close()


# -- defect 2: a blob that does not fit its buffer is a miss --------------------------------------
def test_length_mismatch_is_a_miss_and_leaves_the_buffer_untouched(tmp_path):
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    tier.put([1], [blob_for(1)]).wait()
    n = blob_for(1).numel()
    assert tier.blob_size(1) == n
    short = torch.full((n - 1,), 0xAB, dtype=torch.uint8)
    assert tier.get([1], [short]).result() == [False] and bool((short == 0xAB).all())
    exact = torch.full((n + 10,), 0xAB, dtype=torch.uint8)
    assert tier.get([1], [exact], expected_len=[n + 1]).result() == [False] and bool((exact == 0xAB).all())
    assert tier.get([1], [exact], expected_len=[n]).result() == [True] and torch.equal(exact[:n], blob_for(1))
    with pytest.raises(ValueError, match="uint8"):
        tier.get([1], [torch.empty(n, dtype=torch.float32)])
    assert os.listdir(tmp_path)  # a mismatch is not corruption: the file stays
    tier.close()


# -- the gate: a seeded fuzz of the index rebuild ---------------------------------------------------
MUTATIONS = ("flip_header", "flip_table", "flip_payload", "flip_count_high", "truncate", "extend", "lie_table",
             "symlink_outside", "dangling_symlink", "symlink_loop", "directory", "fifo", "foreign_fingerprint",
             "other_format")


def mutate(path, kind: str, rng: random.Random, outside, foreign_file) -> list:
    """Damage or replace one file; returns paths that must still exist after start-up."""
    data = bytearray(path.read_bytes())
    count = struct.unpack_from("<I", data, COUNT_AT)[0]
    table_end = HEADER + count * ENTRY

    def flip(lo, hi):
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))

    if kind == "flip_header":
        flip(0, HEADER)
    elif kind == "flip_table":
        flip(HEADER, table_end)
    elif kind == "flip_payload":
        flip(table_end, len(data))
    elif kind == "flip_count_high":
        data[COUNT_AT + rng.randrange(1, 4)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif kind == "extend":
        path.write_bytes(bytes(data) + rng.randbytes(rng.randint(1, 300)))
    elif kind == "lie_table":
        def change(rows):
            row, field = rng.choice(rows), rng.choice([1, 2])
            row[field] = rng.choice([0, 2**63, 2**64 - 1, (row[field] + rng.randint(-50, 50)) % 2**64, len(data)])
        rewrite_table(path, change)
    elif kind == "symlink_outside":
        target = outside / f"{rng.random()}{SUFFIX}"
        shutil.move(str(path), str(target))
        os.symlink(target, path)
        return [target, path]
    elif kind == "dangling_symlink":
        path.unlink()
        os.symlink(outside / "missing", path)
        return [path]
    elif kind == "symlink_loop":
        path.unlink()
        os.symlink(path, path)
        return [path]
    elif kind == "directory":
        path.unlink()
        path.mkdir()
        return [path]
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
        return [path]
    elif kind == "foreign_fingerprint":
        shutil.copyfile(foreign_file, path)
        return [path]
    else:  # our suffix, not our format
        path.write_bytes(rng.randbytes(rng.randint(0, 200)))
        return [path]
    return []


def test_fuzz_index_rebuild_serves_exact_bytes_or_misses(tmp_path):
    groups = [[10 * g + i for i in range(3)] for g in range(1, 5)]
    master = tmp_path / "master"
    files = write_groups(master, groups)
    (foreign_name,) = write_groups(tmp_path / "foreign", [[1, 2]], fingerprint=OTHER)
    foreign_file = tmp_path / "foreign" / foreign_name
    outside = tmp_path / "outside"
    outside.mkdir()
    all_keys = [k for g in groups for k in g]
    rng = random.Random(20240611)
    seen = set()
    start = time.time()
    for it in range(240):
        directory = tmp_path / f"run{it}"
        shutil.copytree(master, directory)
        victim = rng.choice(sorted(files))
        kind = MUTATIONS[it % len(MUTATIONS)]
        keep = mutate(directory / victim, kind, rng, outside, foreign_file)
        tier = FileTier(str(directory), 10**7, FINGERPRINT, fsync=False)  # must never raise
        try:
            got = served(tier, all_keys)
        finally:
            tier.close()
        untouched = {k for name, keys in files.items() if name != victim for k in keys}
        assert untouched <= got, f"run {it} ({kind}): files it did not touch lost {sorted(untouched - got)}"
        if kind in ("symlink_outside", "foreign_fingerprint", "directory", "fifo", "other_format"):
            assert not got & set(files[victim]), f"run {it} ({kind}): served through a file it must not adopt"
        for path in keep:
            assert os.path.lexists(path), f"run {it} ({kind}): {path} was deleted"
        seen.add(kind)
        shutil.rmtree(directory)
    assert seen == set(MUTATIONS)
    assert time.time() - start < 20


def test_startup_removes_a_leftover_temp_file_whose_pid_was_reused(tmp_path):
    """A crashed writer's temporary file whose pid now belongs to a live process (this one; in a container a
    restarted server often gets its predecessor's pid) holds no writer's lock: it is removed, not kept forever
    outside the budget. The same file while a writer holds its lock is kept."""
    name = "b" * 32 + SUFFIX + f".tmp.{os.getpid()}.7"
    (tmp_path / name).write_bytes(b"half of a group")
    held = os.open(tmp_path / name, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    FileTier(str(tmp_path), 10**7, FINGERPRINT).close()
    assert (tmp_path / name).exists()  # a live writer's
    os.close(held)
    FileTier(str(tmp_path), 10**7, FINGERPRINT).close()
    assert not (tmp_path / name).exists()  # nobody's


def test_a_blob_file_replaced_by_a_link_is_a_miss_and_can_be_stored_again(tmp_path):
    """A blob's file replaced by a symbolic link (never followed: the open fails with ELOOP) is gone, not a transient
    I/O error: its keys leave the index (the link is left in place), so `contains` stops answering for them and
    a later put writes them again and serves them."""
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    assert tier.put([1, 2], [blob_for(1), blob_for(2)]).result() == [True, True]
    path = tier._index[1].path
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    shutil.copy(path, elsewhere)
    os.remove(path)
    os.symlink(elsewhere, path)
    assert served(tier, [1, 2]) == set() and tier.contains([1]) == 0 and tier.contains([2]) == 0
    assert os.path.islink(path)  # nothing of someone else's deleted or followed
    assert tier.put([1, 2], [blob_for(1), blob_for(2)]).result() == [True, True]
    assert served(tier, [1, 2]) == {1, 2}
    tier.close()


def test_a_group_that_cannot_fit_beside_writes_in_flight_evicts_nothing(tmp_path, monkeypatch):
    """Budget of three one-blob groups; a two-blob write is in flight (its bytes reserved) and one group is stored.
    A second two-blob write cannot fit even with every file evicted: it fails without evicting the stored one."""
    tier = FileTier(str(tmp_path), 3 * (HEADER + ENTRY + 307), FINGERPRINT, fsync=False, workers=2)
    assert tier.put([1], [blob_for(1)]).result() == [True]
    release, entered, original = threading.Event(), threading.Event(), tier._write_file

    def slow(path, parts):
        entered.set()
        release.wait(10)
        original(path, parts)

    monkeypatch.setattr(tier, "_write_file", slow)
    in_flight = tier.put([14, 21], [blob_for(14), blob_for(21)])  # 300 bytes each (key % 7 == 0)
    assert entered.wait(10)
    monkeypatch.setattr(tier, "_write_file", original)
    assert tier.put([28, 35], [blob_for(28), blob_for(35)]).result() == [False, False]
    assert tier.contains([1]) == 1, "a stored group was evicted for a write that failed anyway"
    release.set()
    assert in_flight.result() == [True, True]
    assert served(tier, [1, 14, 21]) == {1, 14, 21}
    tier.close()


def test_the_default_workers_follow_the_cores_this_process_may_use(tmp_path, monkeypatch):
    """Reads of a large get go side by side on the tier's threads: by default one per usable core, 2 to 8."""
    from kvbackend.tiers import file as file_module

    for cores, want in ((1, 2), (4, 4), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        tier = FileTier(str(tmp_path / str(cores)), 10**6, FINGERPRINT, fsync=False)
        assert tier._workers == want == file_module.default_workers()
        tier.close()
    tier = FileTier(str(tmp_path / "three"), 10**6, FINGERPRINT, fsync=False, workers=3)
    assert tier._workers == 3
    tier.close()


def test_put_never_reports_a_held_key_that_its_own_write_evicted(tmp_path):
    """Key 1 is held, so `put([2, 1])` writes only 2, and making room for it evicts 1's file: 1 is reported False."""
    blob = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    one_file = 48 + 40 + blob.numel()  # header, one table entry, one blob
    tier = FileTier(str(tmp_path), int(one_file * 1.5), FINGERPRINT, fsync=False)
    assert tier.put([1], [blob]).result() == [True]
    assert tier.put([2, 1], [blob.clone(), blob]).result() == [True, False]
    assert [tier.contains([k]) for k in (2, 1)] == [1, 0]


def test_a_file_removed_behind_the_tiers_back_is_written_again(tmp_path):
    """A held key whose file was deleted by someone else is not skipped as held: the put writes it again and it
    reads back."""
    blob = torch.arange(300, dtype=torch.int32).to(torch.uint8)
    tier = FileTier(str(tmp_path), 1 << 20, FINGERPRINT, fsync=False)
    assert tier.put([1, 2], [blob, blob.flip(0)]).result() == [True, True]
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    assert tier.put([1, 3], [blob, blob]).result() == [True, True]
    out = torch.empty(300, dtype=torch.uint8)
    assert tier.get([1], [out]).result() == [True] and torch.equal(out, blob)
    assert tier.get([2], [out]).result() == [False]  # 2 was not written again: its read misses
    assert tier.contains([2]) == 0


def test_a_blob_put_again_after_its_copy_was_found_corrupt_is_served_after_a_restart(tmp_path):
    """A corrupt blob drops only its own entry: its file stays on disk for its other blobs, still listing the bad
    copy. The key put again lands in a newer file. A restart must index the newer, good copy, not the older one
    known to be bad (which would make the key a miss and leave the good file's bytes held by no entry)."""
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    tier.put([1, 2], [blob_for(1), blob_for(2)]).wait()
    (first,) = os.listdir(tmp_path)
    data = bytearray((tmp_path / first).read_bytes())
    data[-1] ^= 0x01  # in blob 2's payload
    (tmp_path / first).write_bytes(bytes(data))
    os.utime(tmp_path / first, ns=(10**18, 10**18))
    assert served(tier, [2]) == set() and served(tier, [1]) == {1}
    assert all(tier.put([2], [blob_for(2)]).result())  # written again, into a file of its own
    (second,) = set(os.listdir(tmp_path)) - {first}
    os.utime(tmp_path / second, ns=(2 * 10**18, 2 * 10**18))  # newer
    assert served(tier, [1, 2]) == {1, 2}
    tier.close()

    again = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    assert served(again, [1, 2]) == {1, 2}
    again.close()


def test_a_file_whose_every_blob_lives_in_newer_files_is_removed_at_start_up(tmp_path):
    """At start-up each key is indexed at its newest copy; an older file left with no blob of its own to serve is
    removed, and its bytes are not held in the budget."""
    older, here = tmp_path / "older", tmp_path / "here"
    tier = FileTier(str(older), 10**7, FINGERPRINT, fsync=False)
    tier.put([1, 2], [blob_for(1), blob_for(2)]).wait()
    tier.close()
    tier = FileTier(str(here), 10**7, FINGERPRINT, fsync=False)
    tier.put([1], [blob_for(1)]).wait()
    tier.put([2], [blob_for(2)]).wait()
    tier.close()
    (both,) = os.listdir(older)
    (here / both).write_bytes((older / both).read_bytes())
    os.utime(here / both, ns=(10**18, 10**18))
    for name in set(os.listdir(here)) - {both}:
        os.utime(here / name, ns=(2 * 10**18, 2 * 10**18))
    again = FileTier(str(here), 10**7, FINGERPRINT, fsync=False)
    assert not (here / both).exists()
    assert served(again, [1, 2]) == {1, 2}
    assert again.stats().bytes_used == sum(os.path.getsize(here / n) for n in os.listdir(here))
    again.close()


# -- arguments -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [-1, float("nan"), 1e9, True, "100", None])
def test_a_bad_budget_is_refused_before_start_up_touches_the_directory(tmp_path, budget):
    """Start-up evicts down to the budget: a budget of -1 removed every file already stored, and NaN turned the
    bound off."""
    files = write_groups(tmp_path, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="budget_bytes"):
        FileTier(str(tmp_path), budget, FINGERPRINT)
    assert sorted(os.listdir(tmp_path)) == sorted(files)
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert served(tier, [1, 2, 3, 4]) == {1, 2, 3, 4}
    tier.close()


def test_a_closed_tier_and_blobs_that_are_not_tensors_are_clear_errors(tmp_path):
    from kvbackend.tiers.base import TierError

    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    with pytest.raises(ValueError, match="must be a tensor"):
        tier.put([1], [b"bytes"])
    assert tier.contains([1]) == 0 and tier.stats().bytes_used == 0
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.put([1], [blob_for(1)])
    with pytest.raises(TierError, match="closed"):
        tier.get([1], [torch.empty(400, dtype=torch.uint8)])


def test_a_stored_stream_longer_than_its_format_writes_is_not_read(tmp_path, caplog, monkeypatch):
    """With a blob format the buffer of a read is the stored length, which only the file's size bounded: a crafted
    sparse file of 2 GiB made one restore allocate and read 2 GiB. Such a stream is refused unread now."""
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.tiers import file as file_module
    from kvbackend.tiers.persist import AlignPredFormat

    cache = KVCache(Geometry(2, 2, 64, torch.bfloat16), CacheConfig(codec="bf16", page_size=16, chunk_pages=2,
                                                                     dense_pages=32, packed_pages=16, device="cpu"))
    fmt = AlignPredFormat("alignpred:error=1x", cache.layout)
    key = 12345
    fingerprint = hashlib.blake2b(f"{cache.layout.fingerprint}|{fmt.name}".encode(), digest_size=8).hexdigest()
    length = 64 << 20  # more than 4 x the 16 KB page group and 1 MiB
    start = HEADER + ENTRY
    table = struct.pack("<QQQII", key, start, length, 0, 0)
    path = tmp_path / ("1" * 32 + SUFFIX)
    with open(path, "wb") as f:
        f.write(struct.pack("<8sI16sII12x", file_module.MAGIC, file_module.VERSION, fingerprint.encode(), 1,
                            crc32c.crc32c(table)) + table)
        f.truncate(start + length)  # a hole: no disk taken
    tier = FileTier(str(tmp_path), 10**12, cache.layout.fingerprint, fmt=fmt)
    assert tier.contains([key]) == 1
    reads = []
    real = file_module._pread_into
    monkeypatch.setattr(file_module, "_pread_into", lambda *a: reads.append(a) or real(*a))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tier.get([key], [torch.empty(fmt.blob_bytes, dtype=torch.uint8)]).result() == [False]
    assert reads == [] and "past what the format writes" in caplog.text
    assert tier.stats().failures == 1 and tier.contains([key]) == 0
    tier.close()


def test_a_restart_serves_the_copy_written_last_even_within_one_clock_tick(tmp_path):
    """A blob refused while its file stays for another blob, then put again: two files hold the key. Start-up took
    the later by modification time, which ties within a clock tick, and then the (hashed) name decided: about half of
    the restarts served the refused copy again and removed the file of the good one. Each file's header carries a
    write sequence now."""
    for trial in range(30):
        directory = tmp_path / str(trial)
        tier = FileTier(str(directory), 10**6, FINGERPRINT, fsync=False)
        k1, k2 = 1000 * trial + 1, 1000 * trial + 2
        refused, good = torch.full((256,), 0xEE, dtype=torch.uint8), torch.full((256,), 0x11, dtype=torch.uint8)
        assert tier.put([k1, k2], [refused, torch.full((256,), 0x22, dtype=torch.uint8)]).result() == [True, True]
        out = torch.empty(256, dtype=torch.uint8)
        assert tier.get([k1], [out]).result() == [True] and tier.refuse(k1, out, "crafted")
        assert tier.put([k1], [good]).result() == [True]
        new = tier._index[k1].path
        tier.close()
        again = FileTier(str(directory), 10**6, FINGERPRINT, fsync=False)
        got = torch.empty(256, dtype=torch.uint8)
        assert again.get([k1, k2], [got, out]).result() == [True, True]
        assert torch.equal(got, good) and os.path.exists(new), f"trial {trial}"
        again.close()


def test_files_of_releases_that_wrote_no_sequence_are_still_read(tmp_path):
    files = write_groups(tmp_path, [[1, 2], [3]])
    for name in files:  # the sequence's bytes were padding (zeros) in files of earlier releases
        data = bytearray((tmp_path / name).read_bytes())
        data[36:44] = bytes(8)
        (tmp_path / name).write_bytes(bytes(data))
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT)
    assert served(tier, [1, 2, 3]) == {1, 2, 3}
    assert tier.put([4], [blob_for(4)]).result() == [True] and served(tier, [4]) == {4}
    tier.close()


def test_a_table_claiming_more_entries_than_a_file_lists_is_refused_unread(tmp_path, monkeypatch):
    """A crafted header over a sparse file: start-up read its whole table into memory (count x 32 bytes, here 128
    MiB and three copies of it) before its checksum failed. Such a file is removed as damaged now, unread."""
    from kvbackend.tiers import file as file_module

    count = file_module.MAX_ENTRIES * 4
    path = tmp_path / ("2" * 32 + SUFFIX)
    with open(path, "wb") as f:
        f.write(struct.pack("<8sI16sII12x", file_module.MAGIC, file_module.VERSION, FINGERPRINT.encode(), count, 0))
        f.truncate(HEADER + count * ENTRY + 4096)  # a hole: no disk taken
    reads = []
    real = file_module._pread
    monkeypatch.setattr(file_module, "_pread", lambda fd, n, at: reads.append(n) or real(fd, n, at))
    tier = FileTier(str(tmp_path), 10**12, FINGERPRINT, fsync=False)
    assert max(reads) == HEADER and not path.exists() and tier.stats().blobs == 0
    tier.close()


def test_a_put_of_more_keys_than_a_file_lists_is_written_as_several_files(tmp_path, monkeypatch):
    from kvbackend.tiers import file as file_module

    monkeypatch.setattr(file_module, "MAX_ENTRIES", 2)
    tier = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    keys = [11, 12, 13, 14, 15]
    assert tier.put(keys, [blob_for(k) for k in keys]).result() == [True] * 5
    assert len(os.listdir(tmp_path)) == 3 and served(tier, keys) == set(keys)
    with pytest.raises(ValueError, match="at most 2 blobs"):
        tier.write_group([1, 2, 3], [b"a", b"b", b"c"])
    tier.close()
    again = FileTier(str(tmp_path), 10**7, FINGERPRINT, fsync=False)
    assert served(again, keys) == set(keys)
    again.close()
