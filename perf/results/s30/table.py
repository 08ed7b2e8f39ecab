"""Print KL and top-1 per seed of eval JSONs: python3 table.py NAME... (files perf/results/s30/ or s31/NAME_<text>_<n>.json,
with P7's rows from perf/results/s27 as the reference)."""
import json
import os
import sys

JOBS = [("code", 1536), ("code", 6144), ("tech", 1536), ("pyenv", 1536), ("legal", 1536), ("legal", 6144),
        ("tech", 6144), ("gfdl", 1536), ("subprocess", 1536), ("subtree", 1536), ("idlenews", 1536), ("pyenv", 6144),
        ("subprocess", 6144), ("idlenews", 6144)] + [(t, "1536s4608") for t in ("code", "tech", "pyenv", "legal",
                                                                                 "subprocess", "idlenews")]


def path(name, text, n):
    if name == "p7":
        return f"perf/results/s27/p7_{text}_{n}.json"
    for folder in ("perf/results/s30", "perf/results/s31", "perf/results/s32", "perf/results/s33", "perf/results/s34"):  # the first that holds it
        if os.path.exists(f"{folder}/{name}_{text}_{n}.json"):
            return f"{folder}/{name}_{text}_{n}.json"
    return f"perf/results/s30/{name}_{text}_{n}.json"


for text, n in JOBS:
    for name in ["p7"] + sys.argv[1:]:
        p = path(name, text, n)
        if not os.path.exists(p):
            continue
        rows = json.load(open(p))["codecs"]
        kl = " / ".join(f"{r['kl']:.4f}" for r in rows)
        top = " / ".join(f"{100 * r['top1_agree']:.1f}" for r in rows)
        print(f"{text:>10} {n:>9} {name:>6} bpv {rows[0]['bpv']:.4f}  KL {kl}  top-1 {top}  mean KL {sum(r['kl'] for r in rows) / len(rows):.4f}")
