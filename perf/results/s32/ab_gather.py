"""A/B of two sources of the CUDA gather kernel on the recipe's layout with its levers (B=8, L=32K, Llama-8B
geometry), alternating over rounds, with the Triton kernel's output as the check.

    python3 perf/results/s32/ab_gather.py OUT.json NAME=PATH|NAME=git:REV...   (``new`` is this tree's source)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_kernels as bk  # noqa: E402

from kvbackend.kernels import gather_cuda  # noqa: E402
from kvbackend.kernels.gather_dequant import gather_dequant  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402


def _source(name: str, where: str) -> tuple[str, str]:
    if not where.startswith("git:"):
        return name, where
    text = subprocess.run(["git", "show", f"{where[4:]}:kernels/gather_dequant.cu"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[3]).stdout
    path = Path(tempfile.mkdtemp()) / "gather_dequant.cu"
    path.write_text(text)
    return name, str(path)


def use(path: str) -> None:
    gather_cuda.SOURCE = Path(path)
    gather_cuda._functions.clear()
    gather_cuda._failed.clear()


def main():
    out_path = sys.argv[1]
    sources = [("new", str(gather_cuda.SOURCE))] + [_source(*x.split("=", 1)) for x in sys.argv[2:]]
    hq, heads, dim, p, batch, length = 32, 8, 128, 64, 8, 32768
    rotary = Rotary.default(dim, 500000.0)
    case = bk.lever_case(RECOMMENDED_PAGE_SPEC, batch, length, hq, heads, dim, p, rotary)
    plan = case.plans[0]
    want = gather_dequant(case.pages, case.books, case.dense, case.schemes, plan, levers=case.levers, rotary=rotary,
                          backend="triton")
    rows = []
    for rnd in range(3):
        for name, path in sources:
            use(path)
            call = lambda: gather_dequant(case.pages, case.books, case.dense, case.schemes, plan,  # noqa: E731
                                          levers=case.levers, rotary=rotary, backend="cuda")
            k, v = call()
            diff = max(float((k.float() - want[0].float()).abs().max()), float((v.float() - want[1].float()).abs().max()))
            us = bk.bench(call) * 1e3
            rows.append({"source": name, "round": rnd, "us": us, "max_abs_diff_vs_triton": diff})
            print(f"gather the recipe [{name}] round {rnd}: {us:.1f} us, max |diff| vs Triton {diff:.3g}", flush=True)
    use(sources[0][1])
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
