"""The tensor-core decode kernel on the recipe's quick lever layouts (B=8, L=32K, Llama-8B geometry): CTAs per SM
the registers must allow (``min_blocks`` 0, 2, 3), program counts (264, 396, 528) and, optionally, another kernel
source, each timed from CUDA graphs beside SDPA on BF16 K/V in the same run. A probe for the next kernel change,
not a product path.

    python3 perf/experiments/mma_occupancy.py --out $OUT/mma_occupancy.json \
        [--source outlier_terms=perf/experiments/mma_decode_outlier_terms.cu]

An alternative source whose outlier terms take (P + OUT_N) x N floats of scratch (the ``outlier_terms`` variant)
is launched with that shared-memory count (``--outlier-scratch``).
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


def outlier_scratch_smem(self) -> int:
    """``Config.smem_bytes`` for a source whose outlier terms need (P + OUT_N) x N floats of scratch per warp (a copy
    of the product's count with that one change)."""
    d, p, n = self.head_dim, self.page, 8
    kes = 1 if self.k_kind == 0 else 2
    extra = ((2 * d * kes if self.k_chan else 0) + (-(-8 * self.outliers // 16) * 16 if self.outliers else 0)
             + (4 * d if self.page_rope or self.rope_token else 0)
             + (-(-(self.psac_rows * self.psac_rank + 8 * self.psac_rows) // 16) * 16 if self.psac_rank else 0))
    stage = 2 * p * (d // 4) + 4 * p * 4 + extra
    sp = self.vg * p * n * 2
    if self.outliers:
        sp = max(sp, (p + self.outliers) * n * 4)
    if self.rope_token:
        table = 32 * d * 2 if self.centroids else 0
        table += 2 * 8 * (d // 64) * 32 * 4
    else:
        table = 32 * n * 4 + 2 * (d // 64) * 4 * 4 * 32 * 4 if self.centroids else 0
    if self.psac_rank:
        table += d * self.psac_rank * 2 + self.psac_rows * d * 2 + -(-p // 16) * 16
    ring = self.warps * (self.stages * stage + sp + table)
    rot = 2 * p * d if self.rope_token else 0
    merge = self.warps * n * d * 4 + 2 * self.warps * n * 4
    in_ring = self.stages * stage >= n * d * 4
    return ring + rot + merge if self.vrot and not in_ring else max(ring + rot, merge)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--source", action="append", default=[], help="NAME=PATH of another mma_decode.cu")
    parser.add_argument("--min-blocks", default=",".join(map(str, MIN_BLOCKS)))
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
    variants = [(n, s) for n, s in bk.LEVER_VARIANTS if n in bk.QUICK_LEVER_VARIANTS]
    original_source, original_smem = mma_decode.SOURCE, mma_decode.Config.smem_bytes
    sources = [("main", str(original_source))] + [tuple(x.split("=", 1)) for x in args.source]
    for source_name, path in sources:
        mma_decode.SOURCE = Path(path)
        mma_decode.Config.smem_bytes = original_smem if source_name == "main" else property(outlier_scratch_smem)
        mma_decode._functions.clear()
        mma_decode._failed.clear()
        for name, spec in variants:
            case = bk.lever_case(spec, batch, length, hq, heads, dim, p, rotary)
            if source_name != "main" and not case.levers.outliers:
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
    mma_decode.SOURCE, mma_decode.Config.smem_bytes = original_source, original_smem
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
