"""A fixed workload for Nsight Compute: one kernel at B=8, L=32K (Llama-8B geometry), launched a few times.

    ncu --clock-control none --kernel-name regex:folded --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 perf/ncu_kernels.py decode rtn:bits=2,group=64,scale=fp8

Kinds: ``decode`` (paged_decode: the folded kernel where it reads the layout, else the plain one; the
planar kernel with ``--planar``), ``gather`` (gather_dequant).
The profiler's own report is the output; this script only builds inputs and launches.
"""

from __future__ import annotations

import argparse

import torch

from kvbackend.kernels import folded_decode
from kvbackend.kernels.gather_dequant import gather_dequant
from kvbackend.kernels.paged_decode import paged_decode
from kvbackend.rope import Rotary
from kvbackend.scheme import kernel_schemes

import bench_kernels as bk


def with_lineinfo() -> None:
    """Route the tensor-core kernel's nvcc through a wrapper adding -lineinfo, with a cubin cache of its own (the
    cache key holds the options the launcher passes, which the wrapper does not change)."""
    import os
    import stat
    import tempfile

    from kvbackend.kernels import mma_decode

    real = mma_decode.nvcc()
    if real is None:
        raise SystemExit("nvcc not found")
    folder = tempfile.mkdtemp(prefix="kvb-lineinfo-")
    wrapper = os.path.join(folder, "nvcc")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --version ] && exec "{real}" --version; done\n'
                f'exec "{real}" -lineinfo "$@"\n')
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IEXEC)
    os.environ["KVBACKEND_CACHE_DIR"] = os.path.join(folder, "cache")
    mma_decode.nvcc = lambda: wrapper


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("decode", "gather"))
    parser.add_argument("codec")
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--planar", action="store_true", help="decode: the planar kernel")
    parser.add_argument("--mma", action="store_true", help="decode: the CUDA tensor-core kernel (528 programs)")
    parser.add_argument("--min-blocks", type=int, default=0, help="decode --mma: CTAs per SM the registers allow")
    parser.add_argument("--lineinfo", action="store_true",
                        help="decode --mma: compile the kernel with -lineinfo (its own cubin cache), so that the "
                             "profiler's source page maps SASS to lines of mma_decode.cu")
    parser.add_argument("--levers", action="store_true",
                        help="the codec's levers and PSAC rows read by the kernel (decode: the bench's levers rows; "
                             "gather: its recipe rows, on the CUDA kernel)")
    args = parser.parse_args()
    hq, heads, dim, p, batch, length = 32, 8, 128, 64, 8, 32768
    if args.lineinfo:
        with_lineinfo()
    if args.levers:
        case = bk.lever_case(args.codec, batch, length, hq, heads, dim, p, Rotary.default(dim, 500000.0))
        if args.kind == "gather":  # the CUDA gather of the codec's layout with its levers (the bench's recipe rows)
            for _ in range(args.launches):
                gather_dequant(case.pages, case.books, case.dense, case.schemes, case.plans[0], levers=case.levers,
                               rotary=Rotary.default(dim, 500000.0), backend="cuda")
            torch.cuda.synchronize()
            return
        for _ in range(args.launches):
            paged_decode(case.qs[0], case.pages, case.books, case.dense, case.schemes, case.plans[0],
                         target_programs=528, num_warps=args.warps, num_stages=args.stages, mma=args.mma or None,
                         levers=case.levers, rotary=Rotary.default(dim, 500000.0),
                         mma_options={"min_blocks": args.min_blocks} if args.mma else None)
        torch.cuda.synchronize()
        return
    codec, layout, chunk = bk.encoded_pages(args.codec, heads, dim, p)
    schemes = kernel_schemes(codec, layout)
    if args.kind == "decode":
        per_req = length // p - 1
        pages = chunk.pages.repeat(-(-batch * per_req // chunk.pages.shape[0]), 1)[: batch * per_req].contiguous()
        dense = torch.randn(batch, 2, p, heads, dim, device=bk.DEV).bfloat16()
        books, (plan,) = bk.rotation_plans(batch, per_req, p, 1, chunk.codebook)  # a codebook slot per chunk
        q = torch.randn(batch, hq, dim, device=bk.DEV).bfloat16()
        fold = folded_decode.supports(*schemes, p, dim)
        for _ in range(args.launches):
            if args.mma:
                paged_decode(q, pages, books, dense, schemes, plan, target_programs=528, num_warps=args.warps,
                             num_stages=args.stages, mma=True, mma_options={"min_blocks": args.min_blocks})
                continue
            paged_decode(q, pages, books, dense, schemes, plan, target_programs=4096, num_warps=args.warps,
                         num_stages=args.stages, fold=fold, planar=args.planar, mma=False)
    else:
        per_req = length // p
        pages = chunk.pages.repeat(-(-batch * per_req // chunk.pages.shape[0]), 1)[: batch * per_req].contiguous()
        dense = torch.zeros(1, 2, p, heads, dim, device=bk.DEV).bfloat16()
        books, (plan,) = bk.rotation_plans(batch, per_req, p, 1, chunk.codebook, dense_tokens=0)
        for _ in range(args.launches):
            gather_dequant(pages, books, dense, schemes, plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
