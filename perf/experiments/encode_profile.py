"""Where the recommended spec's chunk encode spends its time (#19's encode row, #20's recipe prefill): one layer's
chunk of Llama-8B geometry (8 KV heads of 128, ``--tokens`` tokens, bf16) encoded by the codec as the paged cache
calls it (a warm-started chunk with query statistics, and a first chunk with k-means++ seeding), timed per call with
the device synchronised, and one call under the torch profiler: operator launches, host syncs and the top
operators by device time (CPU time where there is no GPU).

    python3 perf/experiments/encode_profile.py --out $OUT/encode_profile.json [--spec SPEC] [--tokens 2048]

Session 14 counted on the CPU 583 dispatched operators for a warm chunk and 1971 for a first chunk (1378 of them in
k-means++ seeding, run in row blocks on the CPU; about 690 on a GPU); the serving bench's prefill suggests about
34 ms per chunk and layer on the H200 for this spec. This run says which stages hold those milliseconds there.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from kvbackend import Geometry, codecs
from kvbackend.codecs.base import CodecState
from kvbackend.spec import RECOMMENDED_PAGE_SPEC

HEADS, HEAD_DIM, Q_HEADS = 8, 128, 32
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::masked_select",
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::equal")


def chunk(tokens: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(tokens, HEADS, HEAD_DIM, generator=gen) + 4 * torch.randn(1, HEADS, HEAD_DIM, generator=gen))
    v = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen)
    return k.bfloat16().to(device), v.bfloat16().to(device), q.to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", default=RECOMMENDED_PAGE_SPEC)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec = codecs.get(args.spec)
    layout = codec.layout(Geometry(1, HEADS, HEAD_DIM, torch.bfloat16), 64)
    k0, v0, q0 = chunk(args.tokens, device, 0)
    k1, v1, q1 = chunk(args.tokens, device, 1)

    def first():  # a request's first chunk: k-means++ seeding
        state = CodecState()
        state.add_queries(0, q0, HEADS)
        state.close_chunk(0)
        codec.encode(k0, v0, layout, state)
        return state

    def warm(state):  # a later chunk: warm-started centroids, the queries seen so far
        def run():
            s = state.clone()
            s.add_queries(1, q1, HEADS)
            s.close_chunk(1)
            codec.encode(k1, v1, layout, s)
        return run

    state = first()  # also the warm-up (kernel compilation, allocator)
    rows = {}
    for name, fn in (("first chunk", first), ("warm chunk", warm(state))):
        times = []
        for _ in range(args.repeat):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            sync(device)
        events = prof.key_averages()
        top_level = collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)
        key = "device_time_total" if device == "cuda" else "cpu_time_total"
        by_time = sorted(events, key=lambda e: getattr(e, key, 0.0) or 0.0, reverse=True)[:20]
        gbps = 2 * args.tokens * HEADS * HEAD_DIM * 2 / statistics.median(times) / 1e9
        rows[name] = {
            "ms_median": 1e3 * statistics.median(times), "ms_all": [1e3 * t for t in times],
            "GBps_bf16_input": gbps,
            "top_level_ops": sum(top_level.values()),
            "syncs": {n: c for n, c in top_level.items() if n in SYNC_OPS},
            "kernel_launches": sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
            "top_ops": [{"name": e.key, "count": e.count, "us": (getattr(e, key, 0.0) or 0.0)} for e in by_time],
        }
        print(f"{name}: {rows[name]['ms_median']:.2f} ms ({gbps:.2f} GB/s of bf16 input), "
              f"{rows[name]['top_level_ops']} operators, launches {rows[name]['kernel_launches']}, "
              f"syncs {rows[name]['syncs']}", flush=True)
        for op in rows[name]["top_ops"][:8]:
            print(f"    {op['us']:10.0f} us  x{op['count']:<5d} {op['name']}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "spec": args.spec,
                   "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
