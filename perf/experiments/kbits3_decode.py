"""Decode of the recommended layout with 3-bit keys (a depth: band's layer) against the 2-bit layout, B=8, L=32K,
Llama-8B geometry: each through `paged_decode`'s default kernel choice, then with the tensor-core kernel off on both.

    python3 perf/experiments/kbits3_decode.py OUT.json
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench_kernels import RECOMMENDED_PAGE_SPEC, _with, graph_time, lever_case, sdpa_time  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402


def main(out):
    hq, heads, dim, p, batch, length = 32, 8, 128, 64, 8, 32768
    rotary = Rotary.default(dim, 500000.0)
    rows = {"sdpa_graph_us": sdpa_time(batch, hq, heads, length, dim, 2, graphs=True) * 1e3}
    for name, spec in (("recipe", RECOMMENDED_PAGE_SPEC), ("recipe, 3-bit keys", _with(RECOMMENDED_PAGE_SPEC, kbits=3, outliers=0)),
                       ("recipe, 3-bit keys and outliers", _with(RECOMMENDED_PAGE_SPEC, kbits=3))):
        case = lever_case(spec, batch, length, hq, heads, dim, p, rotary)
        for label, kw in (("default", {}), ("no tensor-core kernel", {"mma": False})):
            def call(j, kw=kw):
                return paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                    levers=case.levers, rotary=rotary, **kw)
            try:
                rows[f"{name} [{label}]"] = graph_time([lambda j=j: call(j) for j in range(case.rotations)]) * 1e3
            except Exception as exc:  # noqa: BLE001
                rows[f"{name} [{label}]"] = f"{type(exc).__name__}: {exc}"[:200]
            print(name, label, rows[f"{name} [{label}]"], flush=True)
        del case
        torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
