"""Where a serving decode step spends its time (CUDA): `perf/bench_serving.py`'s decode step per cache at BF16's
limit (B=9) and at the cache's own, timed as the bench times it, then one step under the profilers: kernel launches,
device time and the heaviest kernels, host syncs and their Python sites, the heaviest host operations and Python
functions.

    python perf/experiments/serving_step_profile.py --out OUT.json

For query-aware codecs (the recommended page codec) the step is also timed with the decode step's query statistics
added one request at a time (``--per-request-moments``: the code before `add_step_moments`), in the same run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/ for bench_serving
from bench_serving import Shape, decode_rate, fill_random, llama, make_cache, release, requests_like  # noqa: E402

import kvbackend.manager as manager  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402
from kvbackend.tools.llama_runner import LlamaRunner  # noqa: E402

BATCHED = manager.add_step_moments


def per_request(states, chunks, moments, count, sums, *_):
    """The step's statistics one state at a time (the code before `add_step_moments`)."""
    for i, state in enumerate(states):
        state.add_moment(chunks[i], moments[i], count, sums[i])


def profile_step(runner: LlamaRunner, ids: list[int]) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.zeros(len(ids), dtype=torch.long)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.decode(ids, tokens)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    launch_keys = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    launches = sum(e.count for e in ka if e.key in launch_keys)
    syncs = {e.key: e.count for e in ka if "ynchronize" in e.key or "Memcpy" in e.key}
    device_us = sum(e.self_device_time_total for e in ka if e.device_type == DeviceType.CUDA)
    aten = sum(e.count for e in ka if e.key.startswith("aten::"))
    top = sorted((e for e in ka if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)[:20]
    kernels = sorted((e for e in ka if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)[:25]
    # sync sites
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.decode(ids, tokens)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    # Python functions
    pr = cProfile.Profile()
    pr.enable()
    runner.decode(ids, tokens)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
    return {"launches": launches, "aten_calls": aten, "syncs": syncs, "device_ms": device_us / 1e3,
            "top_host_ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in top],
            "top_kernels": [(e.key[:120], e.count, round(e.self_device_time_total / 1e3, 3)) for e in kernels],
            "sync_sites": sites.most_common(20), "cprofile": s.getvalue()[-9000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--caches", default=f"identity:9|rtn:bits=2,group=64:45|{RECOMMENDED_PAGE_SPEC}:46",
                        help="SPEC:BATCH entries separated by |")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print("kvbackend from", manager.__file__, flush=True)
    shape = Shape(args.context, 40 << 30, 64, 32, 64, args.steps, 8192, 16384, 2048, 0, 32, 4)
    model = llama(False, "cuda", torch.bfloat16, args.context + 64)
    heads = model.config.num_attention_heads
    out = {"device": torch.cuda.get_device_name(), "context": args.context, "caches": []}
    for entry in args.caches.split("|"):
        codec, batch = entry.rsplit(":", 1)
        batch = int(batch)
        cache = make_cache(model, codec, shape, batch, shape.context + 4 * shape.steps + 8, "cuda")
        first, _ = cache.add_request(list(range(shape.context)))
        fill_random(cache, first, shape.context, 0, heads)
        ids = [first] + requests_like(cache, first, batch - 1, shape.context, 1000, heads)
        runner = LlamaRunner(model, cache)
        row = {"codec": codec, "batch": batch, "rates": []}
        uses = any(c.uses_queries for c in cache.codecs)
        for b in sorted({min(9, batch), batch}):
            for mode in (["batched", "per-request"] if uses else ["batched"]):
                manager.add_step_moments = BATCHED if mode == "batched" else per_request
                r = decode_rate(runner, ids[:b], shape.steps, "cuda")
                r["moments"] = mode
                row["rates"].append(r)
                print(codec[:24], json.dumps(r), flush=True)
        manager.add_step_moments = BATCHED
        row["profile"] = profile_step(runner, ids)
        p = row["profile"]
        print(codec[:24], f"B={batch}: launches {p['launches']}, aten {p['aten_calls']}, "
              f"device {p['device_ms']:.1f} ms, syncs {p['syncs']}, sites {p['sync_sites'][:8]}", flush=True)
        print("\n".join(f"  {k} x{n}: {ms} ms" for k, n, ms in p["top_host_ops"][:12]), flush=True)
        print("  device:\n" + "\n".join(f"  {k} x{n}: {ms} ms" for k, n, ms in p["top_kernels"][:15]), flush=True)
        print(p["cprofile"][-5000:], flush=True)
        out["caches"].append(row)
        Path(args.out).write_text(json.dumps(out, indent=1))
        del runner, cache
        release("cuda")


if __name__ == "__main__":
    main()
