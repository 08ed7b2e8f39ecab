"""gather_dequant launch variants side by side (one device call), against the copy and write ceilings.

    python3 perf/probe_gather.py --out $OUT/probe_gather.json

Times every (num_warps, unpack) variant at B=8, L=32K (Llama-8B geometry: 8 KV heads, D 128, 64-token
pages) for each codec, checks each variant's output bit for bit against the default one, and
reports GB/s moved (compressed read + BF16 write) as % of the measured HBM copy bandwidth.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvbackend.kernels.gather_dequant import gather_dequant
from kvbackend.scheme import kernel_schemes

import bench_kernels as bk


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--codecs", default="rtn:bits=2,group=64,scale=fp8;qvg;kivi:bits=2,group=64")
    parser.add_argument("--variants", default="4,0;4,1;4,2;4,3;2,0;2,3;8,0;8,3", help="num_warps,unpack;...")
    args = parser.parse_args()
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=bk.DEV)
    dst = torch.empty_like(src)
    copy_bw = 2 * n / bk.bench(lambda: dst.copy_(src)) / 1e6
    write_bw = n / bk.bench(lambda: dst.zero_()) / 1e6
    src = dst = None
    rows = [dict(ceiling="copy", GBps=copy_bw), dict(ceiling="write", GBps=write_bw)]
    print(rows, flush=True)
    heads, dim, p, batch, length = 8, 128, 64, 8, 32768
    for spec in args.codecs.split(";"):
        codec, layout, chunk = bk.encoded_pages(spec, heads, dim, p)
        schemes = kernel_schemes(codec, layout)
        per_req = length // p
        pages = chunk.pages.repeat(-(-batch * per_req // chunk.pages.shape[0]), 1)[: batch * per_req].contiguous()
        books = chunk.codebook.reshape(1, -1).contiguous()
        dense = torch.zeros(1, 2, p, heads, dim, device=bk.DEV).bfloat16()
        plan = bk.make_plan(batch, per_req, 0, p, 0, 0)
        out = tuple(torch.empty(batch * length, heads, dim, device=bk.DEV).bfloat16() for _ in range(2))
        want = [x.clone() for x in gather_dequant(pages, books, dense, schemes, plan)]
        moved = batch * per_req * layout.page_bytes + 2 * batch * length * heads * dim * 2
        for variant in args.variants.split(";"):
            warps, unpack = (int(x) for x in variant.split(","))
            try:
                k, v = gather_dequant(pages, books, dense, schemes, plan, out=out, num_warps=warps, unpack=unpack)
                same = bool(torch.equal(k.view(torch.int16), want[0].view(torch.int16))
                            and torch.equal(v.view(torch.int16), want[1].view(torch.int16)))
                ms = bk.bench(lambda: gather_dequant(pages, books, dense, schemes, plan, out=out, num_warps=warps,
                                                     unpack=unpack))
            except Exception as exc:
                print(spec, variant, "failed", repr(exc)[:300], flush=True)
                continue
            row = dict(codec=spec, B=batch, L=length, warps=warps, unpack=unpack, bit_identical=same, us=ms * 1e3,
                       GBps=moved / ms / 1e6, pct_of_copy=moved / ms / 1e6 / copy_bw * 100,
                       pct_of_write=2 * batch * length * heads * dim * 2 / ms / 1e6 / write_bw * 100)
            rows.append(row)
            print(row, flush=True)
        pages = out = want = None
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
