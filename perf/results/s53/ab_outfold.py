"""Session 53: A/B of the tensor-core decode with key outliers folded into the centroid-value table (`OUT_FOLD`)
against the score term after the key loop, on the recipe's lever layouts with outliers (B=8, L=32K, CUDA graphs), each at its
default stage count and at the other one, beside SDPA BF16 and the recipe's layout without levers; rounds alternate.

    python3 perf/results/s53/ab_outfold.py OUT.json [B ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_kernels as bk  # noqa: E402

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402

VARIANTS = ("recipe", "recipe without PSAC", "recipe, no levers, no PSAC")


def switch(fold: bool) -> None:
    mma_decode.OUT_FOLD = fold
    mma_decode.config_for.cache_clear()
    mma_decode._default_stages.cache_clear()
    mma_decode._wave_programs.cache_clear()


def main():
    out = sys.argv[1]
    batches = [int(b) for b in sys.argv[2:]] or [8]
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
            outs = {}
            for rnd in range(2):
                for fold in (True, False):
                    switch(fold)
                    for stages in (None, 1, 2):
                        options = {} if stages is None else {"num_stages": stages}
                        if stages is not None and rnd:
                            continue

                        def call(j, options=options):
                            return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes,
                                                case.plans[j], mma=True, levers=case.levers, rotary=rotary, **options)
                        try:
                            us = bk.graph_time([lambda j=j: call(j) for j in range(case.rotations)]) * 1e3
                        except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is reported
                            print(f"B={batch} {name} fold={fold} stages={stages}: {type(exc).__name__}: {exc}")
                            continue
                        if stages is None and not rnd:
                            outs[fold] = call(0)[0].float()
                        rows.append({"variant": name, "B": batch, "fold": fold, "stages": stages, "round": rnd,
                                     "graph_us": us, "sdpa_graph_us": sdpa_us})
                        print(f"B={batch} {name:30s} fold={int(fold)} stages={stages or 'default'}: round {rnd}: "
                              f"{us:7.1f} us ({sdpa_us / us:.2f}x SDPA)", flush=True)
            if len(outs) == 2:
                rel = float((outs[True] - outs[False]).norm() / outs[False].norm())
                rows.append({"variant": name, "B": batch, "rel_diff_fold_vs_term": rel})
                print(f"B={batch} {name}: fold vs score term, relative difference {rel:.2e}", flush=True)
            case = None
            torch.cuda.empty_cache()
    switch(True)
    Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
