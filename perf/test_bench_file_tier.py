"""CPU micro-benchmarks of the file tier (pytest-benchmark): `make bench`.

Each reports GB/s of page-group bytes in `extra_info`; write with and without fsync, and read.
"""

import torch

from kvbackend.tiers.file import FileTier

GROUP_BLOBS = 16
BLOB_BYTES = 1 << 20  # 1 MiB page groups, about one page of an 8B model at 2.3 bits


def _blobs():
    return [torch.randint(0, 256, (BLOB_BYTES,), dtype=torch.uint8) for _ in range(GROUP_BLOBS)]


def _write(benchmark, tmp_path, fsync):
    tier = FileTier(str(tmp_path), 1 << 40, "0123456789abcdef", fsync=fsync)
    blobs = _blobs()
    counter = iter(range(1 << 30))

    def write():
        base = next(counter) * GROUP_BLOBS
        assert all(tier.put(list(range(base, base + GROUP_BLOBS)), blobs).result())

    benchmark.pedantic(write, rounds=10, iterations=1)
    benchmark.extra_info["GBps"] = GROUP_BLOBS * BLOB_BYTES / benchmark.stats.stats.median / 1e9


def test_write_with_fsync(benchmark, tmp_path):
    _write(benchmark, tmp_path, fsync=True)


def test_write_without_fsync(benchmark, tmp_path):
    _write(benchmark, tmp_path, fsync=False)


def test_read(benchmark, tmp_path):
    tier = FileTier(str(tmp_path), 1 << 40, "0123456789abcdef")
    keys = list(range(GROUP_BLOBS))
    tier.put(keys, _blobs()).wait()
    into = [torch.empty(BLOB_BYTES, dtype=torch.uint8) for _ in keys]
    benchmark.pedantic(lambda: tier.get(keys, into).result(), rounds=10, iterations=1)
    benchmark.extra_info["GBps"] = GROUP_BLOBS * BLOB_BYTES / benchmark.stats.stats.median / 1e9
