"""Launches for Nsight Compute: the tensor-core decode over ``chw:...,order=lane`` pages (the bench's mixed 2.66-bit
layout) or KIVI-2 through the same kernel family, B=8, L=32K, Llama-8B geometry, compiled with -lineinfo.

    python3 perf/ncu_chw.py chw|kivi [--launches 4] [--options '{"fold": false}']

``perf/ncu_chw.sh`` profiles the last launch of each (source page, warp states).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_chw_gather import mixed_widths  # noqa: E402
from bench_chw_mma import batch_of, encoded  # noqa: E402
from bench_kernels import encoded_pages  # noqa: E402
from ncu_kernels import with_lineinfo  # noqa: E402
from kvbackend.kernels.chw_decode import chw_decode  # noqa: E402
from kvbackend.kernels.chw_gather import layer_schemes  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.scheme import kernel_schemes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("chw", "kivi"))
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--options", default="{}", help="chw: the kernel's options (chw_config keywords), JSON")
    args = parser.parse_args()
    batch, length = 8, 32768
    with_lineinfo()
    if args.kind == "chw":
        codec, layout, chunk = encoded(f"chw:kw={mixed_widths()},vbits=2,vstep=1.15,order=lane")
        scheme, levers = layer_schemes(codec, layout)
        pages, books, plans, dense, qs, _ = batch_of(chunk, layout, batch, length)
        for _ in range(args.launches):
            chw_decode(qs[0], pages, books, dense, scheme, plans[0], levers=levers, mma=True,
                       mma_options=json.loads(args.options))
    else:
        codec, layout, chunk = encoded_pages("kivi:bits=2,group=64", 8, 128, 64)
        schemes = kernel_schemes(codec, layout)
        pages, books, plans, dense, qs, _ = batch_of(chunk, layout, batch, length)
        for _ in range(args.launches):
            paged_decode(qs[0], pages, books, dense, schemes, plans[0], mma=True, target_programs=528)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
