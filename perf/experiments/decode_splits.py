"""The tensor-core decode's split-K grid at serving batch sizes: each layout at (B, L) timed with CUDA graphs for a
range of split counts, beside the default grid (`BatchPlan.wave_splits`) and the grid of one wave divided by the
(request, KV head) pairs (`BatchPlan.splits`, the default before session 46). Writes one JSON.

    python3 perf/experiments/decode_splits.py --out OUT.json [--batches 8,9,24,46] [--length 32768]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench_kernels import graph_time, lever_case  # noqa: E402

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="8,9,24,46")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--specs", default=f"{RECOMMENDED_PAGE_SPEC}|rtn:bits=2,group=64")
    parser.add_argument("--splits", default="1,2,3,4,5,6,8,11,16")
    args = parser.parse_args()
    hq, heads, dim, p = 32, 8, 128, 64
    rotary = Rotary.default(dim, 500000.0)
    rows = []
    for spec in args.specs.split("|"):
        for batch in map(int, args.batches.split(",")):
            case = lever_case(spec, batch, args.length, hq, heads, dim, p, rotary)
            lv = case.levers
            plan = case.plans[0]
            stages = mma_decode.default_stages(*case.schemes, p, dim, torch.bfloat16, torch.bfloat16, 4, lv,
                                               torch.device("cuda"))
            wave = mma_decode.wave_programs(*case.schemes, p, dim, torch.bfloat16, torch.bfloat16, stages, 4, lv,
                                            torch.device("cuda"))

            def call(j, programs):
                return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                    mma=True, levers=lv, rotary=rotary, target_programs=programs)[0]

            row = {"spec": spec, "B": batch, "L": args.length, "wave": wave, "stages": stages,
                   "max_pages": plan.max_pages, "old_default": list(plan.splits(heads, wave)),
                   "new_default": list(plan.wave_splits(heads, wave)), "us": {}}
            ref = call(0, None)
            for s in ["default", "old"] + args.splits.split(","):
                programs = (None if s == "default" else wave if s == "old" else int(s) * batch * heads)
                out = call(0, programs)
                err = (out.float() - ref.float()).abs().max().item()
                us = 1e3 * graph_time([lambda j=j: call(j, programs) for j in range(case.rotations)])
                row["us"][s] = round(us, 2)
                row.setdefault("max_diff_vs_default", {})[s] = err
                print(f"{spec[:20]} B={batch} L={args.length} wave {wave} splits {s}: {us:8.1f} us (diff {err:.2e})",
                      flush=True)
            rows.append(row)
            pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
