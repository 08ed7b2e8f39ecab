"""Session 46: A/B of the tensor-core decode's codebook-slot table build (this tree's kernel against ``git:REV``'s) on
the recipe's lever layouts with a codebook slot per 32-page chunk (`bench_kernels.lever_case` since session 46), and
the same kernel on the layout before (every page on slot 0), CUDA graphs, beside SDPA BF16; sources alternate.

    python3 perf/results/s46/ab_codebooks.py OUT.json REV|PATH [B ...]
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_kernels as bk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s31"))
from ab_decode import use as _use  # noqa: E402  (session 31's A/B: switch the source, clear the caches)

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402


def use(path: str) -> None:
    _use("new", path)  # this tree's shared-memory count for either source (both have it)


VARIANTS = tuple(os.environ.get("AB_VARIANTS", "").split("|")) if os.environ.get("AB_VARIANTS") else (
    "recipe", "recipe, 3-bit keys", "recipe without PSAC, page-relative keys", "recipe, no levers, no PSAC")


def main():
    out, rev = sys.argv[1], sys.argv[2]
    batches = [int(b) for b in sys.argv[3:]] or [8]
    if Path(rev).is_file():  # a source file (the device machine has no git history)
        text = Path(rev).read_text()
    else:
        text = subprocess.run(["git", "show", f"{rev}:kernels/mma_decode.cu"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[3]).stdout
    old = Path(tempfile.mkdtemp()) / "mma_decode.cu"  # the name the launcher's includes and messages expect
    old.write_text(text)
    sources = [("new", str(mma_decode.SOURCE)), ("old", str(old))]
    hq, heads, dim, p, length = 32, 8, 128, 64, 32768
    rotary = Rotary.default(dim, 500000.0)
    rows = []
    for batch in batches:
        sdpa_us = bk.sdpa_time(batch, hq, heads, length, dim, 2 if batch * length <= 262144 else 1, graphs=True) * 1e3
        print(f"B={batch} SDPA BF16 (graphs): {sdpa_us:.1f} us", flush=True)
        for name, spec in bk.LEVER_VARIANTS:
            if name not in VARIANTS:
                continue
            case = bk.lever_case(spec, batch, length, hq, heads, dim, p, rotary)
            one_book = [dataclasses.replace(plan, slots=torch.zeros_like(plan.slots)) for plan in case.plans]
            for rnd in range(2):
                for source, path in sources:
                    use(path)
                    for layout, plans in (("slot per chunk", case.plans), ("one slot", one_book)):
                        if layout == "one slot" and (source == "old" or rnd):
                            continue

                        def call(j, plans=plans):
                            return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, plans[j],
                                                mma=True, levers=case.levers, rotary=rotary)
                        us = bk.graph_time([lambda j=j: call(j) for j in range(case.rotations)]) * 1e3
                        rows.append({"variant": name, "B": batch, "source": source, "layout": layout, "round": rnd,
                                     "graph_us": us, "sdpa_graph_us": sdpa_us})
                        print(f"B={batch} {name:42s} {source} {layout:14s} round {rnd}: {us:7.1f} us "
                              f"({sdpa_us / us:.2f}x SDPA)", flush=True)
            # the new kernel against the old on the same pages: the same outputs
            use(sources[0][1])
            a = paged_decode(case.qs[0], case.pages, case.books, case.dense, case.schemes, case.plans[0], mma=True,
                             levers=case.levers, rotary=rotary)[0]
            use(sources[1][1])
            b = paged_decode(case.qs[0], case.pages, case.books, case.dense, case.schemes, case.plans[0], mma=True,
                             levers=case.levers, rotary=rotary)[0]
            diff = (a.float() - b.float()).abs().max().item()
            rows.append({"variant": name, "B": batch, "max_diff_new_vs_old": diff})
            print(f"B={batch} {name}: new vs old max |diff| {diff:.3e}", flush=True)
            case = None
            torch.cuda.empty_cache()
    use(sources[0][1])
    Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
