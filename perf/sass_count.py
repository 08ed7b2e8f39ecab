"""Static SASS of the paged decode kernel, compiled for sm_90 on a machine without a GPU.

    .venv/bin/python perf/sass_count.py "rtn:bits=2,group=64,scale=fp8;kivi:bits=2,group=64;identity"

Prints, per codec and configuration, the kernel's SASS instruction count, local-memory spill
instructions (LDL/STL), byte permutes (PRMT), global loads and shared-memory traffic. The decode
loop dominates the kernel, so the total is a proxy for instructions per page and head: a way to try
kernel changes before spending device time. (This machine's Triton may be newer than the GPU's.)
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from kvbackend import Geometry, codecs
from kvbackend.kernels import folded_decode as fd
from kvbackend.kernels import paged_decode as pd
from kvbackend.kernels.dequant import scheme_constants
from kvbackend.scheme import kernel_schemes

POINTERS = {"q": "*bf16", "o_part": "*fp32", "m_part": "*fp32", "l_part": "*fp32", "u8": "*u8", "i16": "*i16",
            "i32": "*i32", "book_i16": "*i16", "dense": "*bf16", "page_ids": "*i32", "slots": "*i32", "valid": "*i32",
            "req_start": "*i32", "req_pages": "*i32", "req_packed": "*i32", "scale_log2": "fp32",
            "pages_per_split": "i32", "num_splits": "i32"}


def sass_counts(spec: str, num_warps: int, unpack: int, num_stages: int = 1, heads: int = 8, dim: int = 128,
                group: int = 4, pair: int = 0, fold: int = 0, asm: int = 1, vfold: int = int(fd.VFOLD_DEFAULT)) -> collections.Counter:
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, heads, dim, torch.bfloat16), 64)
    k_scheme, v_scheme = kernel_schemes(codec, layout)
    consts = dict(PAGE_BYTES=layout.page_bytes, BOOK_BYTES=layout.codebook_bytes, H=heads, P=64, D=dim, GROUP=group,
                  ROWS=max(16, group), **scheme_constants("K", k_scheme), **scheme_constants("V", v_scheme))
    if fold:
        consts.update(ASM=asm, LAZY=0, PAGES=1 + pair, VFOLD=vfold)
        fn = fd._folded_decode_kernel
    else:
        consts.update(UNPACK=unpack, PAIR=pair)
        fn = pd._paged_decode_kernel
    signature = {name: "constexpr" for name in fn.arg_names if name in consts}
    signature.update(POINTERS)
    source = triton.compiler.ASTSource(fn=fn, signature=signature,
                                       constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                                       attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                                              for k, v in POINTERS.items() if v.startswith("*")})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                               "num_stages": num_stages})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvbackend_decode_{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    os.remove(cubin)
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))


def main() -> None:
    specs = (sys.argv[1] if len(sys.argv) > 1 else "rtn:bits=2,group=64,scale=fp8;kivi:bits=2,group=64;qvg;identity")
    print(f"{'codec':34s} kernel  warps unpack pair  total  spills  PRMT  LDG  smem  MMA")
    configs = [("plain", w, u, p) for w in (4, 8) for u in (0, 1) for p in (0, 1)]
    configs += [("folded", w, a, 0) for w in (4, 8) for a in (0, 1)]  # unpack column = inline-PTX unpack
    for spec in specs.split(";"):
        for kernel, warps, unpack, pair in configs:
            fold = kernel == "folded"
            ops = sass_counts(spec, warps, unpack, pair=pair, fold=fold, asm=unpack)
            print(f"{spec:34s} {kernel:7s} {warps:5d} {unpack:6d} {pair:4d} {sum(ops.values()):6d} "
                  f"{ops['LDL'] + ops['STL']:7d} {ops['PRMT']:5d} {ops['LDG']:4d} {ops['STS'] + ops['LDS']:5d} "
                  f"{ops['HMMA']:4d}")


if __name__ == "__main__":
    main()
