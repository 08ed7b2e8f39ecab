"""The tensor-core decode kernel on the recipe's quick lever layouts (B=8, L=32K, Llama-8B geometry): CTAs per SM
the registers must allow (``min_blocks``), program counts (0: `paged_decode`'s default grid) and, optionally, other
kernel sources, each timed from CUDA graphs beside SDPA on BF16 K/V in the same run. A probe for the next kernel
change, not a product path.

    python3 perf/experiments/mma_occupancy.py --out $OUT/mma_occupancy.json [--min-blocks 0,2] [--programs 0,264,528] \
        [--source NAME=PATH] [--variants all] [--fold 1,0]

Another source (e.g. a branch's ``mma_decode.cu``) must keep the shared-memory count of ``Config.smem_bytes``: the
kernel checks it at compile time. Session 12 ran this with the outlier-terms source, since merged.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_kernels as bk  # noqa: E402

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402

MIN_BLOCKS = (0, 2, 3)
PROGRAMS = (264, 396, 528)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--source", action="append", default=[], help="NAME=PATH of another mma_decode.cu")
    parser.add_argument("--min-blocks", default=",".join(map(str, MIN_BLOCKS)))
    parser.add_argument("--variants", default="quick", help="quick (bench_kernels' three levers rows) or all (every "
                        "lever row, one lever at a time included; those the kernel does not read are recorded)")
    parser.add_argument("--fold", default="1", help="PSAC_FOLD values to time (1,0: sparse PSAC rows folded into "
                        "the centroid table, and the per-key path)")
    parser.add_argument("--programs", default=",".join(map(str, PROGRAMS)),
                        help="program counts; 0 = paged_decode's default (one full wave)")
    args = parser.parse_args()
    min_blocks = [int(x) for x in args.min_blocks.split(",")]
    programs_list = [int(x) for x in args.programs.split(",")]
    hq, heads, dim, p, batch, length = 32, 8, 128, 64, 8, 32768
    rotary = Rotary.default(dim, 500000.0)
    sdpa_graph_ms = bk.sdpa_time(batch, hq, heads, length, dim, 2, graphs=True)
    print(f"SDPA BF16 (graphs): {sdpa_graph_ms * 1e3:.1f} us", flush=True)
    rows = []
    wanted = {"quick": bk.QUICK_LEVER_VARIANTS, "all": [n for n, _ in bk.LEVER_VARIANTS]}.get(
        args.variants, args.variants.split("|"))  # or names joined by |
    variants = [(n, s) for n, s in bk.LEVER_VARIANTS if n in wanted]
    unknown = set(wanted) - {n for n, _ in variants}
    if unknown:
        parser.error(f"--variants: no lever row named {', '.join(sorted(unknown))}")
    original_source = mma_decode.SOURCE
    sources = [("main", str(original_source))] + [tuple(x.split("=", 1)) for x in args.source]
    folds = [x != "0" for x in args.fold.split(",")]
    sources = [(f"{name}{'' if len(folds) == 1 else (' fold' if fold else ' nofold')}", path, fold)
               for name, path in sources for fold in folds]
    for source_name, path, fold in sources:
        mma_decode.SOURCE = Path(path)
        mma_decode.PSAC_FOLD = fold
        mma_decode.config_for.cache_clear()
        mma_decode._default_stages.cache_clear()
        mma_decode._wave_programs.cache_clear()
        mma_decode._functions.clear()
        mma_decode._failed.clear()
        for name, spec in variants:
            case = bk.lever_case(spec, batch, length, hq, heads, dim, p, rotary)
            if not mma_decode.supports_levers(case.schemes[0], case.levers, p, dim):
                print(f"{source_name} {name}: the tensor-core kernel does not read this layout", flush=True)
                continue
            stages = mma_decode.default_stages(*case.schemes, p, dim, torch.bfloat16, torch.bfloat16, 4, case.levers,
                                               torch.device("cuda"))
            configs = [mma_decode.config_for(*case.schemes, p, dim, torch.bfloat16, torch.bfloat16, stages, 4, mb,
                                             case.levers) for mb in min_blocks]
            with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:  # nvcc in parallel
                list(pool.map(lambda c: mma_decode.compile_cubin(c, "sm_90"), configs))
            for mb in min_blocks:
                for programs in programs_list:
                    def call(j, mb=mb, programs=programs):
                        return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                            num_warps=4, num_stages=stages, mma=True, levers=case.levers,
                                            rotary=rotary, target_programs=programs or None, mma_options={"min_blocks": mb})
                    try:
                        graph_ms = bk.graph_time([lambda j=j: call(j) for j in range(case.rotations)])
                    except Exception as exc:  # a variant that does not build or launch: recorded, not fatal
                        print(f"{source_name} {name} min_blocks={mb} programs={programs}: {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)
                        continue
                    row = {"source": source_name, "variant": name, "codec": spec, "stages": stages, "min_blocks": mb,
                           "programs": programs, "graph_us": graph_ms * 1e3, "sdpa_graph_us": sdpa_graph_ms * 1e3,
                           "speedup_vs_sdpa": sdpa_graph_ms / graph_ms}
                    rows.append(row)
                    print(f"{source_name:14s} {name:42s} minb={mb} programs={programs}: {graph_ms * 1e3:7.1f} us "
                          f"({row['speedup_vs_sdpa']:.2f}x SDPA)", flush=True)
            case = None
            torch.cuda.empty_cache()
    mma_decode.SOURCE = original_source
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
