"""GPU benchmark of the host tier and restore path (the lent H200), one run.

    python perf/bench_tiers.py --out $OUT/bench_tiers.json

1. pinned host <-> device copy bandwidth (the ceiling);
2. HostTier put from device buffers (D2H) and get into device buffers (H2D), page-group blobs;
3. restore of a 32K-token prefix, Llama-8B geometry (32 layers, 8 KV heads, D 128), host tier ->
   device pool through `TieredCache.restore`, for compressed layouts and for raw BF16 pages; when
   each layer becomes usable, and restore + one decode step layer by layer vs waiting for all;
4. decode step (32 layers of paged_decode, B=8, L=32K) with and without concurrent tier traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import triton.testing

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.prefetch import TieredCache

sys.path.insert(0, os.path.dirname(__file__))
DEV = "cuda"
RESULTS: dict = {}


def median_ms(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def pinned_bandwidth():
    n = 2**30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=DEV)
    h2d = median_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h = median_ms(lambda: host.copy_(dev, non_blocking=True))
    out = {"h2d_GBps": n / h2d / 1e6, "d2h_GBps": n / d2h / 1e6}
    print(f"pinned copy: H2D {out['h2d_GBps']:.1f} GB/s, D2H {out['d2h_GBps']:.1f} GB/s", flush=True)
    return out


def host_tier_throughput(blob_bytes: int, count: int, ceiling):
    host = HostTier(blob_bytes * count, blob_bytes)
    blobs = torch.randint(0, 255, (count, blob_bytes), dtype=torch.uint8, device=DEV)
    keys = list(range(count))
    put_ms = median_ms(lambda: (host.evict(count), host.put(keys, list(blobs)).wait()), reps=5)
    host.put(keys, list(blobs)).wait()
    into = torch.empty_like(blobs)
    get_ms = median_ms(lambda: host.get(keys, list(into)).wait(), reps=5)
    assert torch.equal(into, blobs)
    total = blob_bytes * count
    out = {"blob_bytes": blob_bytes, "blobs": count, "put_GBps": total / put_ms / 1e6, "get_GBps": total / get_ms / 1e6}
    out["put_pct_of_d2h"] = out["put_GBps"] / ceiling["d2h_GBps"] * 100
    out["get_pct_of_h2d"] = out["get_GBps"] / ceiling["h2d_GBps"] * 100
    print(f"host tier, {count} blobs of {blob_bytes / 2**20:.2f} MiB: put (D2H) {out['put_GBps']:.1f} GB/s "
          f"({out['put_pct_of_d2h']:.0f}%), get (H2D) {out['get_GBps']:.1f} GB/s ({out['get_pct_of_h2d']:.0f}%)", flush=True)
    host.close()
    return out


def prefix_on_host(codec: str, tokens: int = 32768):
    """A Llama-8B-shaped cache whose ``tokens``-token prefix sits in the host tier only:
    (cache, tiered, prompt, page groups as stored)."""
    geometry = Geometry(32, 8, 128, torch.bfloat16)
    pages = tokens // 64
    cache = KVCache(geometry, CacheConfig(codec=codec, page_size=64, chunk_pages=16, dense_pages=4,
                                          packed_pages=pages + 8, device=DEV))
    prompt = list(range(tokens + 1))
    keys = cache.prefix_keys(prompt)[:pages]
    host = HostTier(cache.blob_bytes * pages, cache.blob_bytes)
    # Page groups as `export_page` writes them: 16-page chunks whose first page carries the codebook.
    group = cache.group
    payload = torch.randint(0, 255, (cache.blob_bytes,), dtype=torch.uint8)
    blobs = []
    for j in range(pages):
        carrier = j % 16 == 0 and group.has_codebooks
        blob = payload[: group.length(carrier)].clone()
        blob[group.pages_bytes : group.books_offset] = torch.frombuffer(
            bytearray(group.pack_trailer(keys[j], j // 16, carrier)), dtype=torch.uint8)
        blobs.append(blob)
    host.put(keys, blobs).wait()
    return cache, TieredCache(cache, host, None, background=False), prompt, blobs


def restore_prefix(codec: str, tokens: int = 32768):
    cache, tiered, prompt, blobs = prefix_on_host(codec, tokens)
    pages = len(blobs)

    def drop():  # outside the timed region: only the restore is timed
        for page, _ in cache.evictable_pages():
            cache.drop_cached(page)

    def once():
        report = tiered.restore(prompt)
        assert report.restored_from_host == pages, report

    times = []
    for rep in range(6):
        drop()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = sorted(times[1:])[2]  # median of 5 after one warm-up
    total = sum(b.numel() for b in blobs)
    out = {"codec": codec, "tokens": tokens, "blob_bytes": cache.blob_bytes, "bytes": total, "restore_ms": ms,
           "GBps": total / ms / 1e6}
    print(f"restore {tokens} tokens, {codec}: {ms:.1f} ms for {total / 2**30:.2f} GiB ({out['GBps']:.1f} GB/s)", flush=True)
    try:
        out.update(layer_readiness(cache, tiered, once, drop))
        out.update(decode_after_restore(cache, tiered, prompt, once, drop))
    except Exception as exc:  # noqa: BLE001 - keep the other figures
        out["layered_error"] = repr(exc)
        print(f"  layered restore measurement failed: {exc!r}", flush=True)
    tiered.close()
    return out


def layer_readiness(cache, tiered, once, drop, reps=5):
    """When does layer 0 (and the last layer) become usable, measured from the restore call? Events
    are polled from the host, so the figures include up to a few microseconds of polling."""
    firsts, lasts, returns = [], [], []
    for _ in range(reps):
        drop()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        returns.append((time.perf_counter() - t0) * 1e3)
        events = cache._layer_events
        assert events is not None and len(events) == cache.geometry.num_layers, "restore did not run layer by layer"
        while not events[0].query():
            pass
        firsts.append((time.perf_counter() - t0) * 1e3)
        while not events[-1].query():
            pass
        lasts.append((time.perf_counter() - t0) * 1e3)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {"restore_call_returns_ms": med(returns), "layer0_ready_ms": med(firsts), "last_layer_ready_ms": med(lasts)}
    print(f"  layer by layer: call returns {out['restore_call_returns_ms']:.2f} ms, layer 0 ready "
          f"{out['layer0_ready_ms']:.2f} ms, layer 31 ready {out['last_layer_ready_ms']:.2f} ms", flush=True)
    return out


def decode_after_restore(cache, tiered, prompt, once, drop, reps=5):
    """Restore, then one decode step over the restored 32K prefix (32 layers of paged_decode, B=1):
    layer by layer (layer i waits for its own copies only) against waiting for the whole restore."""
    q = torch.randn(1, 32, cache.geometry.head_dim, device=DEV, dtype=torch.bfloat16)

    def run(wait_all: bool) -> float:
        times = []
        for _ in range(reps + 1):
            drop()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            once()
            if wait_all:
                torch.cuda.synchronize()
            rid, hit = cache.add_request(prompt)
            plan = cache.plan([rid])
            for layer in range(cache.geometry.num_layers):
                cache.decode(plan, layer, q)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            cache.free(rid)
        return sorted(times[1:])[reps // 2]

    layered, waited = run(False), run(True)
    out = {"restore_then_decode_layered_ms": layered, "restore_then_decode_wait_all_ms": waited,
           "layered_gain": waited / layered}
    print(f"  restore + one decode step: {layered:.2f} ms layer by layer vs {waited:.2f} ms waiting for all "
          f"({out['layered_gain']:.2f}x)", flush=True)
    return out


def decode_under_traffic():
    from bench_kernels import encoded_pages, make_plan

    from kvbackend.kernels.paged_decode import paged_decode
    from kvbackend.scheme import kernel_schemes

    codec, layout, chunk = encoded_pages("kivi:bits=2,group=64", 8, 128, 64)
    schemes = kernel_schemes(codec, layout)
    batch, length, p = 8, 32768, 64
    per_req = length // p - 1
    pages = chunk.pages.repeat(-(-batch * per_req // chunk.pages.shape[0]), 1)[: batch * per_req].contiguous()
    books = chunk.codebook.reshape(1, -1).contiguous()
    dense = torch.randn(batch, 2, p, 8, 128, device=DEV).bfloat16()
    plan = make_plan(batch, per_req, p, p, 0, 0)
    q = torch.randn(batch, 32, 128, device=DEV).bfloat16()

    def layers():  # 32 layers sharing one pool: same bytes per layer as a real model
        for _ in range(32):
            paged_decode(q, pages, books, dense, schemes, plan)

    layers()
    graph = torch.cuda.CUDAGraph()  # an engine replays decode steps as graphs; Python threads cannot delay them
    with torch.cuda.graph(graph):
        layers()

    def step():
        graph.replay()

    quiet = triton.testing.do_bench(step, warmup=20, rep=300, return_mode="median")
    host = HostTier(64 * 2**20 * 8, 64 * 2**20)
    blobs = torch.randint(0, 255, (4, 64 * 2**20), dtype=torch.uint8, device=DEV)
    into = torch.empty_like(blobs)
    stop = threading.Event()
    moved = [0]

    def traffic():
        keys = [0, 1, 2, 3]
        while not stop.is_set():
            host.evict(8)
            host.put(keys, list(blobs)).wait()
            host.get(keys, list(into)).wait()
            moved[0] += 2 * blobs.numel()

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(0.2)
    t0, m0 = time.perf_counter(), moved[0]  # the traffic of the timed window only
    busy = triton.testing.do_bench(step, warmup=20, rep=300, return_mode="median")
    seconds, m1 = time.perf_counter() - t0, moved[0]
    stop.set()
    thread.join()
    out = {"step_quiet_ms": quiet, "step_with_traffic_ms": busy, "slowdown": busy / quiet,
           "traffic_GBps_during": (m1 - m0) / seconds / 1e9}
    print(f"decode step (32 layers, B=8, L=32K, kivi-2): {quiet:.3f} ms quiet, {busy:.3f} ms with tier traffic "
          f"({out['traffic_GBps_during']:.1f} GB/s moving) -> {out['slowdown']:.3f}x", flush=True)
    host.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    RESULTS["ceiling"] = ceiling = pinned_bandwidth()
    quick = os.environ.get("KVB_BENCH_QUICK") == "1"  # `make gpu-test`: smaller transfers, same code paths
    sizes = ((1179648, 128),) if quick else ((1179648, 512), (8 * 2**20, 128))
    RESULTS["host_tier"] = [host_tier_throughput(b, c, ceiling) for b, c in sizes]
    tokens = 8192 if quick else 32768
    RESULTS["restore"] = [restore_prefix(c, tokens) for c in ("rtn:bits=2,group=64,scale=fp8", "kivi:bits=2,group=64",
                                                               "qvg", "identity")]
    raw = next(r for r in RESULTS["restore"] if r["codec"] == "identity")
    for r in RESULTS["restore"]:
        r["speedup_vs_raw_bf16"] = raw["restore_ms"] / r["restore_ms"]
        print(f"  {r['codec']}: {r['speedup_vs_raw_bf16']:.2f}x faster than raw BF16 pages", flush=True)
    RESULTS["decode_under_traffic"] = decode_under_traffic()
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=2)


if __name__ == "__main__":
    main()
