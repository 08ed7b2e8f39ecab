"""SGLang storage backend on the CPU (pytest-benchmark): set/get throughput, bytes vs HiCacheFile.

    make bench   (or: .venv/bin/python -m pytest perf/test_bench_sglang.py --benchmark-enable -s)

Geometry of an 8B model's page (32 layers, 8 KV heads, D 128, 16-token pages, bf16), 16 pages.
"""

import os
import sys

import pytest

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_sglang import HostPool, host_indices, make_backend  # noqa: E402

PAGES = 16
GEOMETRY = dict(pages=2 * PAGES, page_size=16, layers=32, heads=8, head_dim=128)


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "rtn:bits=2,group=64,scale=fp8", "kivi:bits=4,group=16"])
def test_set_get_and_bytes_vs_hicachefile(benchmark, tmp_path, codec):
    host = HostPool("layer_first", **GEOMETRY)
    host.kv_buffer.normal_()
    backend = make_backend(tmp_path / "kvbackend", host, codec)
    keys = [f"page{i}" for i in range(PAGES)]
    counter = iter(range(1 << 30))

    def set_pages():
        round_ = next(counter)
        assert all(backend.batch_set_v1([f"{k}-{round_}" for k in keys], host_indices(range(PAGES), 16)))

    benchmark.pedantic(set_pages, rounds=3, iterations=1)
    set_seconds = benchmark.stats.stats.median
    page_bytes = 2 * 32 * 16 * 8 * 128 * 2
    assert backend.batch_set_v1(keys, host_indices(range(PAGES), 16)) == [True] * PAGES
    import time

    start = time.perf_counter()
    assert all(backend.batch_get_v1(keys, host_indices(range(PAGES, 2 * PAGES), 16)))
    get_seconds = time.perf_counter() - start
    ours = directory_bytes(backend.directory) / (next(counter) + 1)  # every round stored the same pages

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    config = hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="test/model",
        extra_config={"file_storage_path": str(tmp_path / "hicachefile")})
    reference = HiCacheFile(config)
    for i, key in enumerate(keys):
        assert reference.set(key, host.get_data_page(i * 16, flat=True))
    theirs = directory_bytes(tmp_path / "hicachefile")
    benchmark.extra_info.update(
        codec=codec, set_pages_per_s=PAGES / set_seconds, set_GBps=PAGES * page_bytes / set_seconds / 1e9,
        get_pages_per_s=PAGES / get_seconds, get_GBps=PAGES * page_bytes / get_seconds / 1e9,
        bytes_kvbackend_per_page=ours / PAGES, bytes_hicachefile_per_page=theirs / PAGES, ratio=theirs / ours)
    print(benchmark.extra_info)
    assert theirs > ours


@pytest.mark.parametrize("codec", ["rtn:bits=2,group=64,scale=fp8", "kivi:bits=2,group=16", "kivi:bits=4,group=16"])
def test_one_core_set_get(benchmark, tmp_path, codec):
    """set and get of 16 pages with torch on one thread (the codec's work on one core): set's median of 5
    rounds after a warm-up, get's median of 5 calls after one."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = HostPool("layer_first", **GEOMETRY)
        host.kv_buffer.normal_()
        backend = make_backend(tmp_path / "kvbackend", host, codec)
        keys = [f"page{i}" for i in range(PAGES)]
        page_bytes = 2 * 32 * 16 * 8 * 128 * 2
        counter = iter(range(1 << 30))

        def set_pages():
            round_ = next(counter)
            assert all(backend.batch_set_v1([f"{k}-{round_}" for k in keys], host_indices(range(PAGES), 16)))

        benchmark.pedantic(set_pages, rounds=5, iterations=1, warmup_rounds=1)
        set_seconds = benchmark.stats.stats.median
        assert backend.batch_set_v1(keys, host_indices(range(PAGES), 16)) == [True] * PAGES
        gets = []
        for _ in range(6):  # the first call also compiles the decode loop: not counted
            start = time.perf_counter()
            assert all(backend.batch_get_v1(keys, host_indices(range(PAGES, 2 * PAGES), 16)))
            gets.append(time.perf_counter() - start)
        get_seconds = sorted(gets[1:])[2]
        stored, loaded = host.kv_buffer[:, :, : PAGES * 16].float(), host.kv_buffer[:, :, PAGES * 16:].float()
        assert float((loaded - stored).norm() / stored.norm()) < 0.6  # the pages came back (2-bit error level)
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info.update(codec=codec, set_GBps_one_core=PAGES * page_bytes / set_seconds / 1e9,
                                get_GBps_one_core=PAGES * page_bytes / get_seconds / 1e9)
    print(benchmark.extra_info)
