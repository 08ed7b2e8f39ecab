"""Variants of the folded decode kernel side by side (one device call; the plain kernel is in bench_kernels).

    python3 perf/probe_folded.py --out $OUT/probe_folded.json

Times each variant at B=8, L=32K (Llama-8B geometry) and checks each against the torch reference on
a small case, so a variant that is fast but wrong shows up as wrong.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton.testing

from kvbackend.attention import decode_attention
from kvbackend.kernels import folded_decode
from kvbackend.kernels.paged_decode import paged_decode
from kvbackend.scheme import kernel_schemes

import bench_kernels as bk


def folded(q, pages, books, dense, schemes, plan, warps, stages, asm, lazy, programs=4096, vfold=True):
    """The folded kernel in one variant, through `paged_decode`."""
    out, _ = paged_decode(q, pages, books, dense, schemes, plan, target_programs=programs, num_warps=warps,
                          num_stages=stages, fold=True, fold_options=dict(asm=asm, lazy=lazy, vfold=vfold))
    return out


def small_case(spec, heads, dim, hq, check_support=True):
    """Two requests of 8 packed pages + 37 dense tokens, and the reference attention over them; None
    when the folded kernel does not read the layout (and check_support)."""
    codec, layout, chunk = bk.encoded_pages(spec, heads, dim, tokens=1024)
    schemes = kernel_schemes(codec, layout)
    if check_support and not folded_decode.supports(*schemes, 64, dim):
        return None
    pages, books = chunk.pages.contiguous(), chunk.codebook.reshape(1, -1).contiguous()
    dense = torch.randn(2, 2, 64, heads, dim, device=bk.DEV).bfloat16()
    plan = bk.make_plan(2, 8, 37, 64, 0, 0)
    rk, rv = codec.decode_pages(layout, pages, chunk.codebook)
    ks = [torch.cat([rk[:512], dense[0, 0, :37]]), torch.cat([rk[512:1024], dense[1, 0, :37]])]
    vs = [torch.cat([rv[:512], dense[0, 1, :37]]), torch.cat([rv[512:1024], dense[1, 1, :37]])]
    q = torch.randn(2, hq, dim, device=bk.DEV).bfloat16()
    ref, _ = decode_attention(q, ks, vs)
    return chunk, schemes, pages, books, dense, plan, q, ref


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--codecs", default="rtn:bits=2,group=64,scale=fp8;kivi:bits=2,group=64;qvg;qvg-pro")
    parser.add_argument("--check-only", action="store_true", help="correctness of every variant, no timing")
    args = parser.parse_args()
    rows = []
    if args.check_only:
        for spec in args.codecs.split(";"):
            for heads, dim, ratio in ((8, 128, 4), (3, 64, 3)):
                case = small_case(spec, heads, dim, heads * ratio)
                if case is None:
                    print(spec, heads, dim, "not supported", flush=True)
                    continue
                chunk, schemes, pages, books, dense, plan, q, ref = case
                for asm in (0,) if os.environ.get("TRITON_INTERPRET") == "1" else (0, 1):  # no PTX there
                    o = folded(q, pages, books, dense, schemes, plan, 4, 1, bool(asm), False)
                    row = dict(codec=spec, heads=heads, dim=dim, asm=asm, schemes=str(schemes),
                               rel_err=float((o.float() - ref).norm() / ref.norm()))
                    rows.append(row)
                    print({k: v for k, v in row.items() if k != "schemes"}, flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        return
    hq, heads, dim, p = 32, 8, 128, 64
    for spec in args.codecs.split(";"):
        # correctness on a small case, every variant
        chunk, schemes, pages, books, dense, plan, q, ref = small_case(spec, heads, dim, hq, check_support=False)
        # timing shapes
        batch, length = 8, 32768
        packed_per_req = length // p - 1
        rot = 2
        total = rot * batch * packed_per_req
        big = chunk.pages.repeat(-(-total // chunk.pages.shape[0]), 1)[:total].contiguous()
        bdense = torch.randn(rot * batch, 2, p, heads, dim, device=bk.DEV).bfloat16()
        plans = [bk.make_plan(batch, packed_per_req, p, p, r * batch * packed_per_req, r * batch) for r in range(rot)]
        qs = [torch.randn(batch, hq, dim, device=bk.DEV).bfloat16() for _ in range(rot)]
        variants = [(w, st, 1, 0, vf) for w in (2, 4) for st in (1, 3) for vf in (0, 1)]
        for warps, stages, asm, lazy, vfold in variants:
            try:
                o = folded(q, pages, books, dense, schemes, plan, warps, stages, bool(asm), bool(lazy),
                           vfold=bool(vfold))
                err = float((o.float() - ref).norm() / ref.norm())
                i = [0]

                def run():
                    i[0] += 1
                    j = i[0] % rot
                    return folded(qs[j], big, books, bdense, schemes, plans[j], warps, stages, bool(asm),
                                  bool(lazy), vfold=bool(vfold))

                us = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as exc:
                print(spec, warps, stages, asm, lazy, vfold, "failed", repr(exc)[:300], flush=True)
                continue
            row = dict(codec=spec, warps=warps, stages=stages, asm=asm, lazy=lazy, vfold=vfold, rel_err=err,
                       us=us)
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
