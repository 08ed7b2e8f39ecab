"""KL range and least top-1 over seeds 0-2 of a spec's eval JSONs, per text and prefix, and the 6144/1536 ratios of
the mean KL (plain prefixes and the same continuation, `TEXT:1536s4608`):

    python3 perf/results/s35/figures.py p45 [p27]
"""
import json
import os
import sys

TEXTS = ["legal", "code", "tech", "pyenv", "gfdl", "subprocess", "subtree", "idlenews"]
FOLDERS = ["perf/results/s41", "perf/results/s40", "perf/results/s39", "perf/results/s37", "perf/results/s36", "perf/results/s35", "perf/results/s34", "perf/results/s33", "perf/results/s32", "perf/results/s30"]


def load(name, text, n):
    for folder in FOLDERS:
        path = f"{folder}/{name}_{text}_{n}.json"
        if os.path.exists(path):
            return json.load(open(path))["codecs"]
    return None


for name in sys.argv[1:]:
    print(f"== {name}")
    for n in ("1536", "6144", "1536s4608"):
        for text in TEXTS:
            rows = load(name, text, n)
            if rows is None:
                continue
            kl = [r["kl"] for r in rows]
            top = [r["top1_agree"] for r in rows]
            print(f"{n:>9} {text:>10}: bpv {rows[0]['bpv']:.4f}  KL {min(kl):.4f}-{max(kl):.4f} (mean "
                  f"{sum(kl) / len(kl):.4f})  top-1 >= {100 * min(top):.1f}%")
    for text in TEXTS:
        short, long, same = (load(name, text, n) for n in ("1536", "6144", "1536s4608"))
        if long is None or (short is None and same is None):
            continue
        mean = lambda rows: sum(r["kl"] for r in rows) / len(rows)  # noqa: E731
        parts = [f"6144 / 1536 {mean(long) / mean(short):.2f}"] if short is not None else []
        if same is not None:
            parts.append(f"6144 / 1536s4608 (the same continuation) {mean(long) / mean(same):.2f}")
        print(f"ratio {text:>10}: " + ", ".join(parts))

if len(sys.argv) == 3:  # the first spec's mean KL against the second's
    a, b = sys.argv[1:]
    print(f"== {a} against {b}: mean KL change")
    for n in ("1536", "6144", "1536s4608"):
        for text in TEXTS:
            x, y = load(a, text, n), load(b, text, n)
            if x is None or y is None:
                continue
            mx, my = (sum(r["kl"] for r in rows) / len(rows) for rows in (x, y))
            print(f"{n:>9} {text:>10}: {mx:.4f} against {my:.4f} ({100 * (mx / my - 1):+.1f}%)")
