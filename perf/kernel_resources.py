"""Registers, spills and SASS instruction counts of the folded decode kernel on the recommended
spec's layout and on that layout without PSAC rows and/or levers, compiled for sm_90 on a machine
without a GPU (Triton's cubin, read by the cuobjdump and nvdisasm that ship with Triton).

    python perf/kernel_resources.py

Static counts only: they say whether a variant spills or adds barriers, not how fast it runs.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvbackend import Geometry, codecs
from kvbackend.frames import lever_layout
from kvbackend.kernels import folded_decode
from kvbackend.kernels.dequant import scheme_constants
from kvbackend.kernels.levers import lever_constants
from kvbackend.scheme import kernel_schemes, lever_scheme
from kvbackend.spec import RECOMMENDED_PAGE_SPEC

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HEADS, DIM, PAGE = 8, 128, 64  # Llama-8B geometry, GQA 4
POINTERS = {"q": "*bf16", "o_part": "*fp32", "m_part": "*fp32", "l_part": "*fp32", "u8": "*u8", "i16": "*i16",
            "i32": "*i32", "book_i16": "*i16", "dense": "*bf16", "page_ids": "*i32", "slots": "*i32",
            "valid": "*i32", "req_start": "*i32", "req_pages": "*i32", "req_packed": "*i32",
            "local_cos": "*fp32", "local_sin": "*fp32", "base_cos": "*fp32", "base_sin": "*fp32",
            "hadamard_ptr": "*fp16", "scale_log2": "fp32", "pages_per_split": "i32", "num_splits": "i32"}
VARIANTS = {
    "recipe": RECOMMENDED_PAGE_SPEC,
    "recipe without PSAC": RECOMMENDED_PAGE_SPEC.replace("rank=4", "rank=0"),
    "PSAC only": "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false",
    "neither": "quantwm:kchannel=64,rank=0,centroids=32,clip=true,vcluster=false",
}


def compile_folded(spec: str, warps: int, stages: int) -> bytes:
    """The folded kernel's cubin for ``spec``'s layout, as `paged_decode` would launch it."""
    codec = codecs.get(spec)
    layout = lever_layout(codec.layout(Geometry(1, HEADS, DIM, torch.bfloat16), PAGE), codec.levers)
    k_scheme, v_scheme = kernel_schemes(codec, layout, levers_read=True)
    constants = dict(PAGE_BYTES=layout.page_bytes, BOOK_BYTES=layout.codebook_bytes, H=HEADS, P=PAGE, D=DIM,
                     GROUP=4, ROWS=16, ASM=True, LAZY=False, PAGES=1, VFOLD=False,
                     **scheme_constants("K", k_scheme), **scheme_constants("V", v_scheme),
                     **lever_constants(lever_scheme(codec, layout)))
    kernel = folded_decode._folded_decode_kernel
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constants else POINTERS[n] for n in names}
    source = ASTSource(kernel, signature, {n: constants[n] for n in names if n in constants})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return compiled.asm["cubin"]


def resources(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    regs = next((line.strip().split(" SHARED")[0] for line in usage.splitlines() if "REG" in line), "?")
    ins = [line for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line]

    def count(op: str) -> int:
        return sum(f" {op}" in line for line in ins)

    ops = " ".join(f"{op.lower()}={count(op)}" for op in ("HMMA", "LDS", "STS", "BAR", "LDG", "SHFL"))
    return f"{regs} sass={len(ins)} {ops}"


def main() -> None:
    for name, spec in VARIANTS.items():
        for warps in (4, 8):
            for stages in (1, 2):
                print(f"{name:20s} warps={warps} stages={stages}: {resources(compile_folded(spec, warps, stages))}",
                      flush=True)


if __name__ == "__main__":
    main()
