"""A/B of two sources of the tensor-core decode kernel on the recipe's lever layouts (B=8, L=32K, Llama-8B geometry),
CUDA graphs, beside SDPA BF16 in the same run; the sources alternate over rounds. The base source kept each lane's
key scale and zero pairs in shared memory (SZ_BYTES), so its launcher's shared-memory count adds them back.

    python3 perf/results/s32/ab_decode.py OUT.json NAME=PATH|NAME=git:REV... (NAME base: session 30's shared-memory
    count)

A source ``git:REV`` is ``kernels/mma_decode.cu`` at commit REV (the session's first kernel: ``base=git:644be22``;
call 5's: ``v2=git:bcf117e``; call 4's is that one with ``perf/results/s31/mma_decode_v1.patch`` applied).
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

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402

VARIANTS = ("recipe", "recipe, 3-bit keys", "recipe without PSAC", "recipe without PSAC, page-relative keys",
            "recipe, no levers, no PSAC")
NEW_SMEM = mma_decode.Config.smem_bytes


def _base_smem(self) -> int:  # `Config.smem_bytes` as the base source counts it (session 30's launcher)
    d, p, n = self.head_dim, self.page, 8
    kes = 1 if self.k_kind == 0 else 2
    extra = ((2 * d * kes if self.k_chan else 0) + (-(-8 * self.outliers // 16) * 16 if self.outliers else 0)
             + (4 * d if self.page_rope or self.rope_token else 0)
             + (-(-(self.psac_rows * self.psac_rank + 8 * self.psac_rows) // 16) * 16 if self.psac_rank else 0))
    stage = p * (d * self.k_bits // 8 + d // 4) + 4 * p * 4 + extra
    sp = self.vg * p * n * 2
    if self.rope_token:
        rows = 32 + (self.psac_rows if self.psac_fold else 0) + (self.centroids >= 32)
        table = rows * d * 2 if self.centroids else 0
        table += 2 * 8 * (d // 64) * 32 * 4
    else:
        table = 32 * n * 4 + 2 * (d // 64) * 4 * 4 * 32 * 4 if self.centroids else 0
    if self.psac_rank:
        table += d * self.psac_rank * 2 + (0 if self.psac_fold else self.psac_rows * d * 2) + -(-p // 16) * 16
    ring = self.warps * (self.stages * stage + sp + table)
    rot = 2 * p * d if self.rope_token else 0
    merge = self.warps * n * d * 4 + 2 * self.warps * n * 4
    in_ring = self.stages * stage >= n * d * 4
    return ring + rot + merge if self.vrot and not in_ring else max(ring + rot, merge)


def _source(name: str, where: str) -> tuple[str, str]:
    """(name, path of the source): ``git:REV`` is written out from the repository into a temporary file."""
    if not where.startswith("git:"):
        return name, where
    text = subprocess.run(["git", "show", f"{where[4:]}:kernels/mma_decode.cu"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[3]).stdout
    path = Path(tempfile.mkdtemp()) / "mma_decode.cu"  # the name the launcher's includes and messages expect
    path.write_text(text)
    return name, str(path)


def use(source: str, path: str) -> None:
    mma_decode.SOURCE = Path(path)
    mma_decode.Config.smem_bytes = property(_base_smem) if source == "base" else NEW_SMEM
    mma_decode.config_for.cache_clear()
    mma_decode._default_stages.cache_clear()
    mma_decode._wave_programs.cache_clear()
    mma_decode._functions.clear()
    mma_decode._failed.clear()


def main():
    out = sys.argv[1]
    rounds = 2
    # new: this tree's kernel at its default stage count; the others at theirs
    sources = [("new", str(mma_decode.SOURCE))] + [_source(*x.split("=", 1)) for x in sys.argv[2:]]
    hq, heads, dim, p, batch, length = 32, 8, 128, 64, 8, 32768
    rotary = Rotary.default(dim, 500000.0)
    sdpa_us = bk.sdpa_time(batch, hq, heads, length, dim, 2, graphs=True) * 1e3
    print(f"SDPA BF16 (graphs): {sdpa_us:.1f} us", flush=True)
    rows = []
    for name, spec in bk.LEVER_VARIANTS:
        if name not in VARIANTS:
            continue
        case = bk.lever_case(spec, batch, length, hq, heads, dim, p, rotary)
        for rnd in range(rounds):
            for source, path in sources:
                use(source, path)
                stages = mma_decode.default_stages(*case.schemes, p, dim, torch.bfloat16, torch.bfloat16, 4,
                                                   case.levers, torch.device("cuda"))

                def call(j):
                    return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                        num_warps=4, num_stages=stages, mma=True, levers=case.levers, rotary=rotary)
                us = bk.graph_time([lambda j=j: call(j) for j in range(case.rotations)]) * 1e3
                rows.append({"variant": name, "source": source, "round": rnd, "stages": stages, "graph_us": us,
                             "sdpa_graph_us": sdpa_us})
                print(f"{name:42s} {source:5s} round {rnd}: {us:7.1f} us ({sdpa_us / us:.2f}x SDPA, stages {stages})",
                      flush=True)
        case = None
        torch.cuda.empty_cache()
    use("new", sources[0][1])
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
