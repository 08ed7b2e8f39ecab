"""The SGLang storage backend at storage speed (#20): set and get of Llama-8B-shaped pages through
`KVBackendStorage` (its codec on the GPU when there is one: the backend's ``device`` option, ``auto``) against
SGLang's own `HiCacheFile` writing the raw pages, on the same pages and the same disk, in one run.

    python3 perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json [--pages 64] [--page-size 64] [--pageable-pool]

Needs SGLang's storage interface importable. A machine without SGLang can use the three pure-Python files it takes
(`bash perf/sglang_subset.sh .sglang_min` where SGLang is installed, then ``PYTHONPATH=.sglang_min``).
Figures are GB/s of raw KV (bf16 K and V of every layer) per call of `batch_set_v1` / `batch_get_v1`, medians of
five rounds (fresh keys for every set round; gets read what the last set wrote, so from the OS page cache on both
sides). The host pool is page-locked where CUDA is present, as SGLang allocates it (``--pageable-pool``: plain
memory); HiCacheFile's targets are of the same kind. Each backend sets and gets a batch like the timed ones before
timing (first-use compiles and allocations). Codecs with codebooks decode on a GPU through the gather kernel
(`kvbackend.unit_gather`); their gets are timed again with the codec's own decode in the same run
(``get_GBps_codec_decode``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sglang import HostPool, host_indices, make_backend  # noqa: E402

from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402

CODECS = ("rtn:bits=2,group=64,scale=fp8", "kivi:bits=2,group=64",
          RECOMMENDED_PAGE_SPEC.replace(",sink=4", "").replace(",prerope=true", ""))  # the recipe's page-local codec


def median_time(fn, rounds: int) -> float:
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        result = fn(i)
        times.append(time.perf_counter() - start)
        assert result is not False, f"round {i} failed: its time is not a figure"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--codecs", default="|".join(CODECS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where both backends write (default: a temporary folder)")
    parser.add_argument("--pageable-pool", action="store_true",
                        help="a host pool in pageable memory (SGLang page-locks its host pool where it can: the default "
                             "here too, where CUDA is present)")
    parser.add_argument("--batch-pages", type=int, default=None, help="pages per GPU codec call (the backend's default)")
    args = parser.parse_args()
    from sglang.srt.mem_cache import hicache_storage as hicache

    import kvbackend.integration.sglang as module

    if args.batch_pages:
        module.BATCH_PAGES = args.batch_pages
    n, p = args.pages, args.page_size
    host = HostPool("layer_first", pages=2 * n, page_size=p, layers=args.layers, heads=8, head_dim=128)
    pinned = torch.cuda.is_available() and not args.pageable_pool
    if pinned:
        host.kv_buffer = host.kv_buffer.pin_memory()
    host.kv_buffer.normal_()
    page_bytes = 2 * args.layers * p * 8 * 128 * 2
    raw = n * page_bytes
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-"))
    rows = []

    # SGLang's HiCacheFile: raw pages, one file each
    config = hicache.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="bench/model",
        extra_config={"file_storage_path": str(root / "hicachefile")})
    reference = hicache.HiCacheFile(config)
    pages = [host.get_data_page(i * p, flat=True) for i in range(n)]
    targets = [torch.empty(pages[0].shape, dtype=pages[0].dtype, pin_memory=pinned) for _ in range(n)]
    set_s = median_time(lambda r: reference.batch_set([f"r{r}-{i}" for i in range(n)], pages), args.rounds)
    last = args.rounds - 1
    get_s = median_time(lambda r: reference.batch_get([f"r{last}-{i}" for i in range(n)], targets), args.rounds)
    assert all(torch.equal(a, b) for a, b in zip(pages, targets))
    rows.append({"backend": "HiCacheFile (raw)", "set_GBps": raw / set_s / 1e9, "get_GBps": raw / get_s / 1e9,
                 "bytes_per_page": page_bytes})
    print(f"HiCacheFile: set {raw / set_s / 1e9:.2f} GB/s, get {raw / get_s / 1e9:.2f} GB/s", flush=True)

    for codec in args.codecs.split("|"):
        backend = make_backend(root / f"kvbackend-{len(rows)}", host, codec)
        keys = lambda r: [f"r{r}-{i}" for i in range(n)]  # noqa: E731
        # compile, load and allocate before timing, at the timed calls' batch sizes (the encode's kernels, then the
        # decode's: a first get of whole batches took 256 ms against 30-70 ms after, session 41)
        warm = [f"warm-{i}" for i in range(n)]
        backend.batch_set_v1(warm, host_indices(range(n), p))
        backend.batch_get_v1(warm, host_indices(range(n, 2 * n), p))
        if backend.units is not None:
            units, backend.units = backend.units, None
            backend.batch_get_v1(warm, host_indices(range(n, 2 * n), p))  # the codec's own decode, timed below too
            backend.units = units
        # (a call that fails returns False per page instead of raising: a failed round must not be timed as one)
        set_s = median_time(lambda r: all(backend.batch_set_v1(keys(r), host_indices(range(n), p))), args.rounds)
        get_s = median_time(lambda r: all(backend.batch_get_v1(keys(last), host_indices(range(n, 2 * n), p))),
                            args.rounds)
        stats = backend.get_stats()
        error = (host.kv_buffer[:, :, n * p:].float() - host.kv_buffer[:, :, :n * p].float()).pow(2).mean().sqrt().item()
        codec_get_s = None
        kernel = backend.units is not None and backend.device.device.type == "cuda"
        if kernel:  # the same gets with the codec's own decode: the gather kernel's gain, in the same run
            units, backend.units = backend.units, None
            codec_get_s = median_time(lambda r: all(backend.batch_get_v1(keys(last), host_indices(range(n, 2 * n), p))),
                                      args.rounds)
            backend.units = units
        stored = stats["bytes_stored"] / ((args.rounds + 1) * n)
        row = {"backend": f"kvbackend ({codec})", "device": str(backend.device.device), "set_GBps": raw / set_s / 1e9,
               "get_GBps": raw / get_s / 1e9,
               "bytes_per_page": stored, "bits_per_value": 8 * stored / (page_bytes / 2), "rms_error": error}
        row["get_vs_hicachefile"] = row["get_GBps"] / rows[0]["get_GBps"]
        row["decode"] = "gather kernel" if kernel else "codec"
        if codec_get_s is not None:
            row["get_GBps_codec_decode"] = raw / codec_get_s / 1e9
        # whether gets decode straight into the pool (`PoolWriter`), asynchronously (a page-locked pool)
        row["into_pool"] = "direct" if backend.writer is not None and backend.writer.direct else (
            "strided host copy" if backend.writer is not None else "set_from_flat_data_page")
        # where the time of every round went (seconds summed over the warm-up, the set and the get rounds)
        row["seconds"] = {key: stats[key] for key in ("from_pool_s", "encode_s", "write_s", "read_s", "decode_s",
                                                     "to_pool_s") if key in stats}
        rows.append(row)
        print(f"{row['backend']}: set {row['set_GBps']:.2f} GB/s, get {row['get_GBps']:.2f} GB/s "
              f"({row['get_vs_hicachefile']:.2f}x HiCacheFile's; decode: {row['decode']}"
              + (f", {row['get_GBps_codec_decode']:.2f} GB/s with the codec's" if codec_get_s is not None else "")
              + f"), {row['bits_per_value']:.2f} bits per value, "
              f"rms error {error:.3f}; seconds " + ", ".join(f"{k} {v:.3f}" for k, v in row["seconds"].items()),
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "pages": n, "page_size": p, "layers": args.layers, "pool_pinned": pinned,
                   "batch_pages": module.BATCH_PAGES, "read_ahead": module.READ_AHEAD, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
