"""The paged cache's chunk completion with every layer's chunk in one codec pass (`KVCache._encode_layers`) against
layer by layer (session 14's path): a request of Llama-8B geometry by default (32 layers, 8 KV heads of 128, bf16)
with the recommended spec, query statistics fed as an engine feeds them, chunks of ``--chunk`` tokens appended
layer by layer; the time of each chunk's last append (the one that completes and encodes the chunk in every layer),
device synchronised, for the first chunk (k-means++ seeding) and the warm ones after it.

    python3 perf/experiments/layer_batch_encode.py --out $OUT/layer_batch_encode.json [--chunks 3] [--tiny]
        [--profile $OUT/layer_batch_encode.prof.txt]

``--profile``: one more warm chunk of the one-pass path under cProfile (host time by Python function, the device
synchronised at the end; on a GPU the host's waits for the device land on the calls that read device values),
the top functions by cumulative and by own time written as text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.rope import Rotary
from kvbackend.spec import RECOMMENDED_PAGE_SPEC


def run(batched: bool, args, device: str) -> dict:
    layers, heads, d, qheads = (2, 2, 64, 4) if args.tiny else (32, 8, 128, 32)
    page = 64
    chunk_pages = args.chunk // page
    config = CacheConfig(codec=args.spec, page_size=page, chunk_pages=chunk_pages,
                         dense_pages=2 * chunk_pages + 2, packed_pages=(args.chunks + 2) * chunk_pages, device=device)
    cache = KVCache(Geometry(layers, heads, d, torch.bfloat16), config, rotary=Rotary.default(d, 500000.0))
    if not batched:
        cache._encode_group = lambda layer: None
    gen = torch.Generator().manual_seed(0)
    rid, _ = cache.add_request()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def next_chunk(timed) -> None:
        """Append one chunk layer by layer; ``timed()`` wraps the last layer's append, which completes the chunk
        (every layer encodes)."""
        kv = [(torch.randn(args.chunk, heads, d, generator=gen).bfloat16().to(device),
               torch.randn(args.chunk, heads, d, generator=gen).bfloat16().to(device),
               torch.randn(args.chunk, qheads, d, generator=gen).to(device)) for _ in range(layers)]
        for layer in range(layers - 1):
            cache.append(rid, layer, *kv[layer][:2], queries=kv[layer][2])
        sync()
        timed(lambda: (cache.append(rid, layers - 1, *kv[-1][:2], queries=kv[-1][2]), sync()))

    times = []

    def clocked(fn):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)

    for _ in range(args.chunks):
        next_chunk(clocked)
    if batched and args.profile and not args.profile_done:
        profiler = cProfile.Profile()
        next_chunk(lambda fn: profiler.runcall(fn))
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
        args.profile_done = True
    reads = [cache.read(rid, layer) for layer in (0, layers - 1)]
    return {"first_chunk_ms": 1e3 * times[0], "warm_chunk_ms": 1e3 * statistics.median(times[1:]),
            "all_ms": [1e3 * t for t in times], "layers": layers, "chunk_tokens": args.chunk,
            "_reads": reads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", default=RECOMMENDED_PAGE_SPEC)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run)")
    parser.add_argument("--profile", default=None, help="write a cProfile of one more warm one-pass chunk here")
    args = parser.parse_args()
    args.profile_done = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {}
    for name, batched in (("one pass", True), ("layer by layer", False), ("one pass again", True)):
        rows[name] = run(batched, args, device)
        print(f"{name}: first chunk {rows[name]['first_chunk_ms']:.1f} ms, warm chunk {rows[name]['warm_chunk_ms']:.1f} ms "
              f"({rows[name]['layers']} layers x {args.chunk} tokens)", flush=True)
    # (the profiled run holds one chunk more: compared on the chunks both hold)
    diff = max(float((a[:len(b)].float() - b.float()).abs().max()) for x, y in zip(rows["one pass"]["_reads"],
                                                                            rows["layer by layer"]["_reads"])
               for a, b in zip(x, y))
    for row in rows.values():
        del row["_reads"]
    speedup = rows["layer by layer"]["warm_chunk_ms"] / rows["one pass again"]["warm_chunk_ms"]
    print(f"warm chunk: one pass {speedup:.2f}x faster than layer by layer; largest read difference {diff:.3g}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "spec": args.spec,
                   "rows": rows, "warm_speedup": speedup, "max_read_difference": diff}, f, indent=1)


if __name__ == "__main__":
    main()
