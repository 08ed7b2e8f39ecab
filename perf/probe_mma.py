"""The tensor-core decode kernel (`kernels/mma_decode.cu`) against the Triton kernels and SDPA BF16 (H200).

For each 2-bit layout and shape (Llama-8B geometry: Hq 32, Hkv 8, D 128, 64-token pages): the largest
difference from the plain Triton kernel on the same pages, then CUDA-graph replay times of the
tensor-core kernel over a few launch configurations, of the planar and folded Triton kernels, and of
torch SDPA on BF16 K/V, all in one run. Writes JSON to --out.

    python3 perf/probe_mma.py --out $OUT/probe_mma.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.scheme import kernel_schemes  # noqa: E402


def inputs(spec: str, batch: int, length: int, hq=32, heads=8, dim=128, p=64):
    codec, layout, chunk = bk.encoded_pages(spec, heads, dim, p)
    schemes = kernel_schemes(codec, layout)
    packed_per_req = length // p - 1  # the last page of each request is its dense active page
    per_rot = batch * packed_per_req * layout.page_bytes
    rotations = max(1, min(4, math.ceil(4 * bk.L2_BYTES / per_rot)))
    total = rotations * batch * packed_per_req
    pages = chunk.pages.repeat(-(-total // chunk.pages.shape[0]), 1)[:total].contiguous()
    books = chunk.codebook.reshape(1, -1).contiguous()
    dense = torch.randn(rotations * batch, 2, p, heads, dim, device=bk.DEV).bfloat16()
    plans = [bk.make_plan(batch, packed_per_req, p, p, r * batch * packed_per_req, r * batch) for r in range(rotations)]
    qs = [torch.randn(batch, hq, dim, device=bk.DEV).bfloat16() for _ in range(rotations)]
    bytes_read = batch * (packed_per_req * layout.page_bytes + 2 * p * heads * dim * 2)
    return schemes, pages, books, dense, plans, qs, rotations, bytes_read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="", help="e.g. 8x32768,1x32768 (default: the four bench shapes)")
    ap.add_argument("--specs", default="rtn:bits=2,group=64,scale=fp8;rtn:bits=2,group=64")
    args = ap.parse_args()
    shapes = [(8, 32768), (1, 32768), (32, 8192), (8, 131072)]
    if args.quick:
        shapes = shapes[:1]
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=bk.DEV)
    dst = torch.empty_like(src)
    copy_bw = 2 * n / bk.bench(lambda: dst.copy_(src)) / 1e6
    del src, dst
    print(f"copy ceiling {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for spec in args.specs.split(";"):
        for batch, length in shapes:
            t0 = time.time()
            schemes, pages, books, dense, plans, qs, rot, bytes_read = inputs(spec, batch, length)
            row = {"codec": spec, "B": batch, "L": length, "bytes_read": bytes_read}
            ref, ref_lse = paged_decode(qs[0], pages, books, dense, schemes, plans[0], mma=False, fold=False, planar=False)
            out, lse = paged_decode(qs[0], pages, books, dense, schemes, plans[0], mma=True)
            row["max_abs_diff_vs_plain"] = float((out.float() - ref.float()).abs().max())
            row["rel_diff_vs_plain"] = float((out.float() - ref.float()).norm() / ref.float().norm())
            row["lse_max_diff"] = float((lse - ref_lse).abs().max())

            def time_it(**kw):
                return 1e3 * bk.graph_time([lambda j=j: paged_decode(qs[j], pages, books, dense, schemes, plans[j], **kw)
                                            for j in range(rot)])

            variants = {}
            for programs in ((264, 528) if args.quick else (264, 528, 1056, 2112)):
                for stages, warps, minb in ((2, 4, 0), (2, 4, 4), (3, 4, 4), (2, 8, 2)):
                    key = f"mma p{programs} s{stages} w{warps} b{minb}"
                    try:
                        variants[key] = time_it(mma=True, target_programs=programs, num_stages=stages, num_warps=warps,
                                                mma_options={"min_blocks": minb})
                    except Exception as exc:  # noqa: BLE001 - said, and the others still run
                        variants[key] = f"{type(exc).__name__}: {exc}"[:200]
            if batch == 8 and length == 32768:  # what the dense page (one per request, a slower path) costs
                no_dense = [bk.make_plan(batch, length // 64 - 1, 0, 64, r * batch * (length // 64 - 1), r * batch)
                            for r in range(rot)]
                k0 = min((k for k in variants if isinstance(variants[k], float)), key=lambda k: variants[k])
                prog, st, wa, mb = (int(x[1:]) for x in k0.split()[1:])
                variants[f"no dense page: {k0}"] = 1e3 * bk.graph_time([
                    lambda j=j: paged_decode(qs[j], pages, books, dense, schemes, no_dense[j], mma=True,
                                             target_programs=prog, num_stages=st, num_warps=wa,
                                             mma_options={"min_blocks": mb}) for j in range(rot)])
            variants["planar s1 p1024"] = time_it(mma=False, planar=True, num_stages=1, target_programs=1024)
            variants["folded s2 p1024"] = time_it(mma=False, fold=True, planar=False, num_stages=2, target_programs=1024)
            row["us"] = variants
            row["sdpa_graph_us"] = 1e3 * bk.sdpa_time(batch, 32, 8, length, 128, 2 if length * batch <= 262144 else 1,
                                                       graphs=True)
            best_key = min((k for k in variants if k.startswith("mma ") and isinstance(variants[k], float)),
                           key=lambda k: variants[k])
            best = variants[best_key]
            row.update(best_mma=best_key, best_mma_us=best, speedup_vs_sdpa=row["sdpa_graph_us"] / best,
                       pct_of_copy=bytes_read / best / 1e3 / copy_bw * 100,
                       speedup_vs_planar=variants["planar s1 p1024"] / best)
            rows.append(row)
            print(f"{spec:32s} B={batch:2d} L={length:6d}: mma {best:7.1f} us ({best_key}, {row['pct_of_copy']:.1f}% "
                  f"of copy)  planar {variants['planar s1 p1024']:7.1f}  folded {variants['folded s2 p1024']:7.1f}  "
                  f"SDPA {row['sdpa_graph_us']:7.1f} -> {row['speedup_vs_sdpa']:.2f}x SDPA; "
                  f"diff vs plain {row['max_abs_diff_vs_plain']:.2e} (rel {row['rel_diff_vs_plain']:.1e}, "
                  f"lse {row['lse_max_diff']:.1e}) [{time.time() - t0:.0f}s]", flush=True)
            print("   ", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in variants.items()}, flush=True)
            pages = dense = plans = qs = None
            torch.cuda.empty_cache()
            Path(args.out).write_text(json.dumps({"copy_GBps": copy_bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
