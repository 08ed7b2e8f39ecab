"""Registers, stack, shared memory and resident blocks per SM of the tensor-core decode kernel
(`kernels/mma_decode.cu`) on the recipe's layouts, compiled for sm_90 by nvcc on a machine without a GPU
(`ptxas -v`). Blocks per SM are the smaller of the register file's (64K registers, allocated per warp in units
of 256) and shared memory's (228 KiB per SM, 1 KiB kept per block) limits on an H100/H200.

    .venv/bin/python perf/mma_resources.py

Static counts only: they say which resource bounds occupancy, not how fast a variant runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from kvbackend.kernels import mma_decode
from kvbackend.kernels.mma_decode import Config

BASE = dict(head_dim=128, page=64, kg=1, vg=2, k_kind=0, v_kind=0, k_sym=False, v_sym=False, q_kind=2, dense_kind=2,
            k_chan=True, centroids=32)
LEVERS = dict(sink=4, outliers=16, vrot=True)
VARIANTS = {  # the bench's lever rows (Llama-8B geometry, bf16 queries and dense pages, fp8 centroids)
    "recipe layout, no levers, no PSAC": {},
    "+ sinks, rotated values, 16 outliers, page-relative keys": dict(LEVERS, page_rope=True),
    "+ ... pre-RoPE keys instead": dict(LEVERS, rope_token=True),
    "+ ... pre-RoPE keys, PSAC rows (the recommended spec)": dict(LEVERS, rope_token=True, psac_rank=4, psac_rows=4,
                                                                 psac_sparse=True),
    "+ ... PSAC rows folded into the centroid table": dict(LEVERS, rope_token=True, psac_rank=4, psac_rows=4,
                                                         psac_sparse=True, psac_fold=True),
    "+ ... and the outliers folded into it too": dict(LEVERS, rope_token=True, psac_rank=4, psac_rows=4,
                                                    psac_sparse=True, psac_fold=True, out_fold=True),
}


def resources(config: Config) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from ptxas."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([mma_decode.nvcc(), "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-use_fast_math",
                               "-Xptxas", "-v", *config.defines(), str(mma_decode.SOURCE), "-o", f"{tmp}/k.cubin"],
                              capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    line = re.findall(r"Used \d+ registers[^\n]*", done.stderr)[-1]  # the kernel's line (the last one)
    stack = re.search(r"(\d+) bytes cumulative stack size", line)  # named only when not empty
    return int(re.search(r"Used (\d+) registers", line).group(1)), int(stack.group(1)) if stack else 0


def main() -> None:
    if mma_decode.nvcc() is None:
        sys.exit("nvcc not found")
    print(f"{'variant':58s} {'stages':>6s} {'regs':>5s} {'stack':>6s} {'smem':>7s}  blocks/SM (regs, smem)")
    for name, extra in VARIANTS.items():
        for stages in (1, 2):
            config = Config(**BASE, **extra, stages=stages)
            regs, stack = resources(config)
            per_warp = -(-regs * 32 // 256) * 256
            by_regs = 65536 // (per_warp * config.warps)
            by_smem = 228 * 1024 // (config.smem_bytes + 1024)
            print(f"{name:58s} {stages:6d} {regs:5d} {stack:6d} {config.smem_bytes:7d}  {min(by_regs, by_smem)} "
                  f"({by_regs}, {by_smem})")


if __name__ == "__main__":
    main()
