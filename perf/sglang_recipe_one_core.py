"""One-core set and get of the SGLang storage backend for one codec, one set and four gets (16 pages, Llama-8B
geometry, 16-token pages of 2 MiB unless a page size follows the spec, torch on one thread): for codecs too slow
for the pytest-benchmark rounds of `perf/test_bench_sglang.py`, such as the recommended spec's codec. A first set
and get of other keys load the compiled loops (numba's cache) and are reported apart; set is then the median of
three sets of fresh keys, get the median of three gets. Prints the stored bits per value too (blob bytes over raw
values).

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

    def set_pages(tag):
        keys = [f"{tag}{i}" for i in range(PAGES)]
        start = time.perf_counter()
        stored = backend.batch_set_v1(keys, host_indices(range(PAGES), page_size))
        assert all(stored), stored
        return keys, time.perf_counter() - start

    def get_pages(keys):
        start = time.perf_counter()
        loaded = backend.batch_get_v1(keys, host_indices(range(PAGES, 2 * PAGES), page_size))
        assert all(loaded), loaded
        return time.perf_counter() - start

    first_keys, first_set = set_pages("first")  # loads compiled loops: reported apart
    first_get = get_pages(first_keys)
    sets = [set_pages(f"round{r}_") for r in range(3)]
    gets = [get_pages(sets[-1][0]) for _ in range(3)]
    set_s = sorted(t for _, t in sets)[1]
    get_s = sorted(gets)[1]
    raw = PAGES * PAGE_BYTES
    print(f"{codec}: set {raw / set_s / 1e9:.3f} GB/s, get {raw / get_s / 1e9:.3f} GB/s (medians of 3; first call "
          f"{raw / first_set / 1e9:.3f} / {raw / first_get / 1e9:.3f}) (raw KV, one core), "
          f"{8 * backend.get_stats()['bytes_stored'] / (4 * raw / 2):.2f} bits per value stored, {page_size}-token pages")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
