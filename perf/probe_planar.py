"""The planar decode kernel against the folded one and SDPA BF16, in one device call.

    python3 perf/probe_planar.py --out $OUT/probe_planar.json

Checks every codec on a small case against the reference attention (both kernels), then times each
(num_warps, num_stages) variant of the planar kernel and the folded kernel's default at B=8, L=32K
(Llama-8B geometry), with SDPA BF16 on the same shape in the same run; the best planar variant is also
timed at the other bench shapes. Inputs rotate past L2.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kvbackend.kernels.paged_decode import paged_decode
from kvbackend.scheme import kernel_schemes

import bench_kernels as bk
from probe_folded import small_case


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--codecs", default="rtn:bits=2,group=64,scale=fp8;rtn:bits=2,group=64;rtn:bits=4,group=64")
    parser.add_argument("--variants", default="4,1;4,2;4,3", help="num_warps,num_stages;...")
    parser.add_argument("--shapes", default="8,32768;1,32768;32,8192;8,131072", help="B,L;... (the first picks)")
    args = parser.parse_args()
    hq, heads, dim, p = 32, 8, 128, 64
    rows = []
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    sdpa = {}
    for spec in args.codecs.split(";"):
        chunk, schemes, pages, books, dense, plan, q, ref = small_case(spec, heads, dim, hq, check_support=False)
        for name, kw in (("planar", dict(planar=True)), ("folded", dict(fold=True, planar=False))):
            o, _ = paged_decode(q, pages, books, dense, schemes, plan, **kw)
            err = float((o.float() - ref).norm() / ref.norm())
            rows.append(dict(codec=spec, kernel=name, check_rel_err=err))
            print(rows[-1], flush=True)
        best = None
        for batch, length in shapes:
            packed_per_req = length // p - 1
            per_rot = batch * packed_per_req * chunk.pages.shape[1]
            rot = max(2, min(4, math.ceil(4 * bk.L2_BYTES / per_rot)))
            total = rot * batch * packed_per_req
            big = chunk.pages.repeat(-(-total // chunk.pages.shape[0]), 1)[:total].contiguous()
            bdense = torch.randn(rot * batch, 2, p, heads, dim, device=bk.DEV).bfloat16()
            plans = [bk.make_plan(batch, packed_per_req, p, p, r * batch * packed_per_req, r * batch) for r in range(rot)]
            qs = [torch.randn(batch, hq, dim, device=bk.DEV).bfloat16() for _ in range(rot)]
            if (batch, length) not in sdpa:
                sdpa[(batch, length)] = 1e3 * bk.sdpa_time(batch, hq, heads, length, dim, 2 if length * batch <= 262144 else 1)
            variants = [("planar", tuple(int(x) for x in v.split(","))) for v in args.variants.split(";")] \
                if best is None else [("planar", best)]
            variants.append(("folded", (4, 1)))
            for name, (warps, stages) in variants:
                kw = dict(planar=True) if name == "planar" else dict(fold=True, planar=False)
                calls = [lambda j=j: paged_decode(qs[j], big, books, bdense, schemes, plans[j], target_programs=4096,
                                                  num_warps=warps, num_stages=stages, **kw)
                         for j in range(rot)]
                try:
                    us = 1e3 * bk.rotating_time(calls)
                except Exception as exc:
                    print(spec, name, warps, stages, "failed", repr(exc)[:300], flush=True)
                    continue
                row = dict(codec=spec, kernel=name, B=batch, L=length, warps=warps, stages=stages, us=us,
                           sdpa_us=sdpa[(batch, length)], speedup_vs_sdpa=sdpa[(batch, length)] / us)
                rows.append(row)
                print(row, flush=True)
            if best is None:
                timed = [r for r in rows if r.get("kernel") == "planar" and r.get("codec") == spec and "us" in r]
                best = min(timed, key=lambda r: r["us"])
                best = (best["warps"], best["stages"])
            big = bdense = plans = qs = None
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
