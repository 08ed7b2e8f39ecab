"""Could the recipe's warm chunk encode run as one CUDA graph? A probe, not a benchmark of the package.

A `KVCache` of Llama-8B geometry (32 layers, 8 KV heads of 128, bf16; ``--tiny``: 2 layers, 2 heads of 64) with the
recommended spec takes chunks of ``--chunk`` tokens, query statistics fed as an engine feeds them. On the last chunk
the codec's one-pass encode (`Codec.encode_units`) is intercepted and its arguments kept. Then, on those arguments:

1. the eager one-pass encode (`Codec._encode_units`, the input checks left out), timed (median of ``--reps``);
2. on CUDA, the same under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that waits for the device,
   with the Python line that asked for it (each such wait breaks a graph capture);
3. on CUDA, a capture of that call in a `torch.cuda.CUDAGraph`: the exception and line where capture fails, or,
   where it succeeds, the replay's time and whether its bytes equal the eager encode's.

    python3 perf/experiments/encode_graph_probe.py --out $OUT/encode_graph_probe.json [--tiny]

Every state is cloned before each encode, so each run starts from the same warm centroids and statistics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings

import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.rope import Rotary
from kvbackend.spec import RECOMMENDED_PAGE_SPEC


def captured_call(args, device: str):
    """(codec, layout, k, v, states) of the last chunk's one-pass encode."""
    layers, heads, d, qheads = (2, 2, 64, 4) if args.tiny else (32, 8, 128, 32)
    page = 64
    chunk_pages = args.chunk // page
    config = CacheConfig(codec=args.spec, page_size=page, chunk_pages=chunk_pages, dense_pages=2 * chunk_pages + 2,
                         packed_pages=(args.chunks + 2) * chunk_pages, device=device)
    cache = KVCache(Geometry(layers, heads, d, torch.bfloat16), config, rotary=Rotary.default(d, 500000.0))
    codec = cache.codecs[0]
    seen = {}
    original = codec.encode_units

    def spy(k, v, layout, states=None):
        seen.update(k=k.clone(), v=v.clone(), layout=layout, states=[s.clone() for s in states])
        return original(k, v, layout, states)

    codec.encode_units = spy
    gen = torch.Generator().manual_seed(0)
    rid, _ = cache.add_request()
    for _ in range(args.chunks):
        for layer in range(layers):
            k = torch.randn(args.chunk, heads, d, generator=gen).bfloat16().to(device)
            v = torch.randn(args.chunk, heads, d, generator=gen).bfloat16().to(device)
            q = torch.randn(args.chunk, qheads, d, generator=gen).to(device)
            cache.append(rid, layer, k, v, queries=q)
    if not seen:
        raise SystemExit("no one-pass encode happened: the spec's codec does not batch its layers")
    return codec, seen


def encoder(codec, seen):
    """A function running the one-pass encode on the kept arguments into fresh outputs, from cloned states."""
    k, v, layout = seen["k"], seen["v"], seen["layout"]
    units = k.shape[0]
    kf, vf, num_pages = codec._padded(k, v, layout.page_size)
    flat = (units * num_pages * layout.page_size, *k.shape[2:])
    kf, vf = kf.reshape(flat), vf.reshape(flat)

    def run():
        states = [s.clone() for s in seen["states"]]
        pages = torch.zeros(units * num_pages, layout.page_bytes, dtype=torch.uint8, device=k.device)
        books = torch.zeros(units, layout.codebook_bytes, dtype=torch.uint8, device=k.device)
        done = codec._encode_units(kf, vf, layout, pages, books, states)
        return pages, books, done

    return run


def median_ms(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def sync_points(run) -> list[dict]:
    """The device waits of one encode, each with the innermost project line that asked for it."""
    found = []
    previous = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "/kvbackend/" in f.filename or "/kernels/" in f.filename]
        where = f"{stack[-1].filename.split('/main/')[-1]}:{stack[-1].lineno} {stack[-1].line}" if stack else "?"
        found.append({"where": where, "message": str(message)[:160]})

    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = previous
    counts: dict[str, int] = {}
    for item in found:
        counts[item["where"]] = counts.get(item["where"], 0) + 1
    return [{"where": w, "count": n} for w, n in sorted(counts.items(), key=lambda x: -x[1])]


def device_ms(run) -> tuple[float, int, list[dict]]:
    """(milliseconds of device time, kernels launched, the 15 kernels of most time summed by name) of one encode,
    from the profiler: what a CUDA graph of it could take at best, the host's share gone."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    own = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))  # noqa: E731
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:120], [0.0, 0])
        entry[0] += own(e)
        entry[1] += 1
    top = [{"kernel": name, "ms": t / 1e3, "launches": n}
           for name, (t, n) in sorted(by_name.items(), key=lambda x: -x[1][0])[:15]]
    return sum(own(e) for e in kernels) / 1e3, len(kernels), top


def try_capture(run, eager, reps: int) -> dict:
    """Capture ``run`` in a CUDA graph (after warm-up on a side stream); its replay time and agreement, or why not."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = run()
    except Exception as error:  # the probe's answer: where capture fails
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "/kvbackend/" in f.filename
                  or "/kernels/" in f.filename]
        return {"captured": False, "error": f"{type(error).__name__}: {str(error)[:300]}",
                "where": [f"{f.filename.split('/main/')[-1]}:{f.lineno} {f.line}" for f in frames[-4:]]}
    replay_ms = median_ms(graph.replay, reps, "cuda")
    return {"captured": True, "replay_ms": replay_ms, "pages_equal": bool(torch.equal(out[0], eager[0])),
            "codebooks_equal": bool(torch.equal(out[1], eager[1]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", default=RECOMMENDED_PAGE_SPEC)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, seen = captured_call(args, device)
    run = encoder(codec, seen)
    eager = run()
    units, tokens = seen["k"].shape[:2]
    values = 2 * seen["k"].numel()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "spec": args.spec,
              "units": units, "tokens": tokens, "one_pass_done": bool(eager[2])}
    result["eager_ms"] = median_ms(run, args.reps, device)
    result["eager_GBps_bf16_in"] = 2 * values / result["eager_ms"] / 1e6
    print(f"eager one-pass encode: {units} layers x {tokens} tokens, {result['eager_ms']:.1f} ms "
          f"({result['eager_GBps_bf16_in']:.1f} GB/s of bf16 input)", flush=True)
    if device == "cuda":
        result["sync_points"] = sync_points(run)
        print(f"device waits in one encode: {sum(p['count'] for p in result['sync_points'])} at "
              f"{len(result['sync_points'])} lines", flush=True)
        for point in result["sync_points"][:20]:
            print(f"  {point['count']:4d}  {point['where']}", flush=True)
        result["device_ms"], result["kernels"], result["top_kernels"] = device_ms(run)
        print(f"device time of one encode: {result['device_ms']:.2f} ms in {result['kernels']} kernels "
              f"({2 * values / result['device_ms'] / 1e6:.1f} GB/s of bf16 input at that time)", flush=True)
        for row in result["top_kernels"]:
            print(f"  {row['ms']:7.3f} ms {row['launches']:5d}x  {row['kernel']}", flush=True)
        result["graph"] = try_capture(run, eager, args.reps)
        print("graph capture:", json.dumps(result["graph"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
