"""The vLLM secondary tier at storage speed (#20): store and load of Llama-8B-shaped chunks through
`KVBackendTier` (its codec on the GPU when there is one: the tier's ``device`` option, ``auto``) against raw
chunks on the same primary buffer and the same disk, in one run: vLLM's own file-system tier (``fs``,
`FileSystemTierManager`) where it can be imported (the subset below carries it), and always the same tier with
``identity`` (raw bytes through kvbackend's file tier); the JSON says which raw rows ran.

    python3 perf/bench_vllm_gpu.py --out $OUT/bench_vllm_gpu.json [--chunks 64]

The primary buffer is page-locked on a CUDA machine, as vLLM's CPU tier allocates it (``--pageable``: plain memory).
Chunks: one worker's 32 layers of 8 KV heads x 128 in bf16, 4 blocks of 16 tokens per chunk (8 MiB each), in the
engine's HND layout. Needs vLLM's offloading interface importable; a machine without vLLM can use the pure-Python
files it takes (`python perf/vllm_subset.py .vllm_min` where vLLM is installed, then ``PYTHONPATH=.vllm_min``).
Figures are GB/s of raw KV per job of all chunks (one `submit_store` or `submit_load`, waited for), medians of
three rounds (fresh keys for every store round; loads read what the last store wrote). Loads are timed twice: from
the OS page cache as the store left it, and from the disk (every file under the run's folder synced and evicted
from the page cache before each round, untimed). vLLM's fs tier reads with O_DIRECT where the file system allows,
so its loads come from the disk either way: `load_cold_vs_raw` compares like with like.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering import factory
from vllm.v1.kv_offload.tiering.base import TransferJob

LAYERS, HEADS, HEAD_DIM, TOKENS_PER_BLOCK, BLOCKS_PER_CHUNK = 32, 8, 128, 16, 4
BLOCK_BYTES = LAYERS * HEADS * TOKENS_PER_BLOCK * 2 * HEAD_DIM * 2  # K and V of every layer, bf16
CHUNK_BYTES = BLOCKS_PER_CHUNK * BLOCK_BYTES
CODECS = ("rtn:bits=2,group=64,scale=fp8", "kivi:bits=2,group=64",
          # the recommended spec as a page codec: PSAC rows need queries and sinks or pre-RoPE keys positions, which
          # an offloading tier never sees
          "quantwm:kchannel=64,rank=0,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16")


def offloading_spec():
    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(f"layers.{i}.attn" for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=False, extra_config={}, engine_id="bench",
        model=OffloadingModelConfig("bench/llama-8b", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=parallel, kv_cache_layout="HND")
    return SimpleNamespace(config=config, blocks_per_chunk=BLOCKS_PER_CHUNK,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def run_job(tier, job_id: int, keys, chunk_ids, promotion: bool) -> bool:
    job = TransferJob(job_id, keys, np.asarray(chunk_ids), promotion, ReqContext("bench"))
    (tier.submit_load if promotion else tier.submit_store)(job)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            if result.job_id == job_id:
                return bool(result.success)
        time.sleep(0.0002)
    raise TimeoutError(f"job {job_id} did not finish")


def drop_page_cache(folder: Path) -> None:
    """Evict the files under ``folder`` from the OS page cache (synced first: clean pages go), so the next reads
    come from the disk, as reads of vLLM's fs tier do (O_DIRECT)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median_time(fn, rounds: int, before=None) -> float:
    times = []
    for i in range(rounds):
        if before is not None:
            before()  # not timed
        start = time.perf_counter()
        assert fn(i), "a job failed"
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--codecs", default="|".join(CODECS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where both tiers write (default: a temporary folder)")
    parser.add_argument("--pageable", action="store_true", help="a primary buffer that is not page-locked")
    args = parser.parse_args()
    n = args.chunks
    # the primary tier: n chunks to store, then n slots loads fill
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2 * n, CHUNK_BYTES // 2, generator=gen).bfloat16()
    pinned = torch.cuda.is_available() and not args.pageable  # vLLM's CPU tier pins its buffer where it can
    if pinned:  # page-locked memory is page-aligned
        primary = torch.empty((2 * n, CHUNK_BYTES), dtype=torch.uint8, pin_memory=True)
    else:  # page-aligned too (vLLM's fs tier reads and writes it with O_DIRECT where the file system allows)
        primary = torch.from_numpy(np.frombuffer(mmap.mmap(-1, 2 * n * CHUNK_BYTES), dtype=np.uint8)
                                   .reshape(2 * n, CHUNK_BYTES))
    primary.copy_(values.view(torch.uint8).view(2 * n, CHUNK_BYTES))
    buffer = primary.numpy()
    view = memoryview(buffer)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-vllm-"))
    spec = offloading_spec()
    raw = n * CHUNK_BYTES
    rows, job = [], [0]

    def keys(r):
        return [make_offload_key(f"r{r}-{i}".encode().ljust(16, b"."), 0) for i in range(n)]

    def measure(name: str, tier, extra: dict) -> dict:
        def store(r):
            job[0] += 1
            return run_job(tier, job[0], keys(r), range(n), promotion=False)

        def load(r):
            job[0] += 1
            return run_job(tier, job[0], keys(args.rounds - 1), range(n, 2 * n), promotion=True)

        run_job(tier, 10**6, [make_offload_key(b"warm".ljust(16, b"."), 0)], [0], promotion=False)  # first use
        store_s = median_time(store, args.rounds)
        load_s = median_time(load, args.rounds)
        cold_s = median_time(load, args.rounds, before=lambda: drop_page_cache(root))  # from the disk
        sent = torch.from_numpy(buffer[:n]).view(torch.bfloat16).float()
        back = torch.from_numpy(buffer[n:]).view(torch.bfloat16).float()
        error = float((back - sent).pow(2).mean().sqrt())
        row = {"tier": name, "store_GBps": raw / store_s / 1e9, "load_GBps": raw / load_s / 1e9,
               "load_cold_GBps": raw / cold_s / 1e9, "rms_error": error, **extra}
        print(f"{name}: store {row['store_GBps']:.2f} GB/s, load {row['load_GBps']:.2f} GB/s (from the page cache), "
              f"{row['load_cold_GBps']:.2f} GB/s (from the disk), rms error {error:.3f}", flush=True)
        tier.shutdown()
        return row

    try:
        fs = factory.SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": str(root / "fs")}, view,
                                                               spec)
    except ImportError as exc:  # vLLM's own tier needs the whole engine's imports
        print(f"vLLM's fs tier not measured: {exc!r}", flush=True)
        skipped = repr(exc)
    else:
        rows.append(measure("vLLM fs tier (raw)", fs, {}))
        assert rows[-1]["rms_error"] == 0.0, "the raw tier must give the bytes back"
        skipped = None
    for codec in ["identity"] + args.codecs.split("|"):
        config = {"type": "KVBackendTier", "module_path": "kvbackend.integration.vllm", "codec": codec,
                  "root_dir": str(root / f"kvbackend-{len(rows)}"), "head_dim": HEAD_DIM, "kv_heads": HEADS}
        tier = factory.SecondaryTierFactory.create_secondary_tier(config, view, spec)
        device = str(tier.device.device)
        row = measure(f"kvbackend ({codec})", tier, {"device": device, "blob_bytes": tier.blob_bytes,
                                                      "bits_per_value": 8 * tier.blob_bytes / (CHUNK_BYTES / 2)})
        if codec == "identity":
            assert row["rms_error"] == 0.0, "the raw tier must give the bytes back"
        rows.append(row)
        row["load_vs_raw"] = row["load_GBps"] / rows[0]["load_GBps"]  # the first raw row: vLLM's fs, else identity
        row["load_cold_vs_raw"] = row["load_cold_GBps"] / rows[0]["load_cold_GBps"]  # both from the disk
        row["store_vs_raw"] = row["store_GBps"] / rows[0]["store_GBps"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "chunks": n,
                   "chunk_bytes": CHUNK_BYTES, "primary_pinned": pinned, "fs_tier_not_measured": skipped,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
