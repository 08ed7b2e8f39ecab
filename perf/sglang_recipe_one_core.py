"""One-core set and get of the SGLang storage backend for one codec, one set and four gets (16 pages, Llama-8B
geometry, 16-token pages of 2 MiB unless a page size follows the spec, torch on one thread): for codecs too slow
for the pytest-benchmark rounds of `perf/test_bench_sglang.py`, such as the recommended spec's codec. Prints the
stored bits per value too (blob bytes over raw values).

    .venv/bin/python perf/sglang_recipe_one_core.py "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16"
    .venv/bin/python perf/sglang_recipe_one_core.py "quantwm:kchannel=64,..." 64
"""
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from test_sglang import HostPool, host_indices, make_backend  # noqa: E402

PAGES = 16


def main(codec: str, page_size: int = 16) -> None:
    PAGE_BYTES = 2 * 32 * page_size * 8 * 128 * 2  # K and V of 32 layers, 8 heads of 128, bf16
    torch.set_num_threads(1)
    host = HostPool("layer_first", pages=2 * PAGES, page_size=page_size, layers=32, heads=8, head_dim=128)
    host.kv_buffer.normal_()
    backend = make_backend(pathlib.Path(tempfile.mkdtemp()) / "kv", host, codec)
    keys = [f"page{i}" for i in range(PAGES)]
    start = time.perf_counter()
    stored = backend.batch_set_v1(keys, host_indices(range(PAGES), page_size))
    set_s = time.perf_counter() - start
    gets = []
    for _ in range(4):  # the first get also loads compiled loops (numba's cache): reported apart
        start = time.perf_counter()
        loaded = backend.batch_get_v1(keys, host_indices(range(PAGES, 2 * PAGES), page_size))
        gets.append(time.perf_counter() - start)
        assert all(loaded), loaded
    assert all(stored), stored
    warm = sorted(gets[1:])[1]
    print(f"{codec}: set {PAGES * PAGE_BYTES / set_s / 1e9:.3f} GB/s (one call), get {PAGES * PAGE_BYTES / warm / 1e9:.3f} "
          f"GB/s (median of 3 after a first of {PAGES * PAGE_BYTES / gets[0] / 1e9:.3f}) (raw KV, one core), "
          f"{8 * backend.get_stats()['bytes_stored'] / (PAGES * PAGE_BYTES / 2):.2f} bits per value stored, {page_size}-token pages")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
