"""Why the SGLang bench's get of the recipe's page codec shows no gain from the gather kernel where the split of one
get (`sglang_get_split.py`) shows 2.2x (session 41: 8.82 against 10.00 GB/s in the bench, 30 against 66 ms a get in
the split): each get timed alone, in the bench's order and in others, with the backend's time counters and the CUDA
caching allocator's counters of each get.

    python3 perf/experiments/sglang_get_rounds.py OUT.json [--pages 64]

Phases: (a) after a single set, as in the split; (b) after three more sets, as in the bench; (c) after emptying the
allocator's cache; (d) after the OS has written the files back (os.sync). Each phase times gets with the gather
kernel and with the codec's own decode, interleaved.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from sglang_common import parser, setup  # noqa: E402
from test_sglang import host_indices  # noqa: E402

COUNTERS = ("read_s", "decode_s", "to_pool_s")
ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--gets", type=int, default=4)
    args = options.parse_args()
    n, p = args.pages, args.page_size
    s = setup(args)
    cuda, backend = s.cuda, s.backend
    raw = n * s.page_raw
    units = backend.units
    rows = []

    def allocator() -> dict:
        stats = torch.cuda.memory_stats() if cuda else {}
        return {k: stats.get(k, 0) for k in ALLOCATOR}

    def stored(round_: int) -> None:
        start = time.perf_counter()
        assert all(backend.batch_set_v1([f"r{round_}-{i}" for i in range(n)], host_indices(range(n), p)))
        print(f"set r{round_}: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)

    def get(phase: str, decode: str, round_: int) -> None:
        backend.units = units if decode == "kernel" else None
        before, alloc = backend.get_stats(), allocator()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        ok = all(backend.batch_get_v1([f"r{round_}-{i}" for i in range(n)], host_indices(range(n, 2 * n), p)))
        if cuda:
            torch.cuda.synchronize()
        s = time.perf_counter() - start
        after, alloc2 = backend.get_stats(), allocator()
        row = {"phase": phase, "decode": decode, "ms": s * 1e3, "GBps_raw": raw / s / 1e9, "ok": ok,
               **{k: (after[k] - before[k]) * 1e3 for k in COUNTERS}, **{k: alloc2[k] - alloc[k] for k in ALLOCATOR}}
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    backend.batch_set_v1(["warm"], host_indices(range(1), p))
    backend.batch_get_v1(["warm"], host_indices(range(n, n + 1), p))
    stored(0)
    decodes = ("kernel", "codec") if units is not None else ("codec",)
    for i in range(args.gets):
        for d in decodes:
            get("a: after one set", d, 0)
    for r in (1, 2, 3):
        stored(r)
    for i in range(args.gets):
        for d in decodes:
            get("b: after three more sets", d, 3)
    if cuda:
        torch.cuda.empty_cache()
    for i in range(args.gets):
        for d in decodes:
            get("c: after empty_cache", d, 3)
    os.sync()
    time.sleep(1.0)
    for i in range(args.gets):
        for d in decodes:
            get("d: after os.sync", d, 3)
    for i in range(args.gets):  # the bench's order: the kernel's gets, then the codec's
        get("e: bench order", "kernel", 3)
    for i in range(args.gets):
        get("e: bench order", "codec", 3)
    profiles = {}
    if cuda:  # where one get's time goes, by operator, with each decode (after the phases above: everything warm)
        from torch.profiler import ProfilerActivity, profile
        for d in decodes:
            backend.units = units if d == "kernel" else None
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                backend.batch_get_v1([f"r3-{i}" for i in range(n)], host_indices(range(n, 2 * n), p))
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60)
            profiles[d] = table
            print(f"== profile of one get, decode {d}\n{table}", flush=True)
    backend.units = units
    pathlib.Path(args.out).write_text(json.dumps({"codec": args.codec, "pages": n, "device": torch.cuda.get_device_name()
                                                  if cuda else "cpu", "rows": rows, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
