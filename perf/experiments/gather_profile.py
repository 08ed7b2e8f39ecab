"""Three CUDA gathers of the recommended spec's layout (B=8, L=32K, Llama-8B geometry), for a profiler to catch the
third (`ncu --kernel-name regex:gather_dequant --launch-skip 2 --launch-count 1 ...`).

    python3 perf/experiments/gather_profile.py [SPEC]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_kernels as bk  # noqa: E402

from kvbackend.kernels.gather_dequant import gather_dequant  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else RECOMMENDED_PAGE_SPEC
    batch, length, hq, heads, dim, p = 8, 32768, 32, 8, 128, 64
    rotary = Rotary.default(dim, 500000.0)
    case = bk.lever_case(spec, batch, length, hq, heads, dim, p, rotary)
    out = tuple(torch.empty(batch * length, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        gather_dequant(case.pages, case.books, case.dense, case.schemes, case.plans[0], out=out, levers=case.levers,
                       rotary=rotary, backend="cuda")
    torch.cuda.synchronize()
    print("gathered", spec, float(out[0].float().abs().mean()), float(out[1].float().abs().mean()))


if __name__ == "__main__":
    main()
