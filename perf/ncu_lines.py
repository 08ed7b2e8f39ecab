"""Stall samples and instructions per source line, from the CSV that ``perf/ncu_source.sh`` writes.

    python3 perf/ncu_lines.py perf/results/s21/call1/recipe_source.csv.gz [--top 40] [--source kernels/mma_decode.cu]

Each row: file, line, share of all warp-stall samples, share of executed instructions, the three largest stall
reasons, and the line's text (from ``--source`` for the kernel's own file). The last line sums the stall reasons
over the kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _num(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def read_lines(path: str) -> tuple[list[str], dict[tuple[str, int], dict[str, str]]]:
    """The header and one row per (file, line) of the source page (SASS rows are skipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    header: list[str] = []
    per: dict[tuple[str, int], dict[str, str]] = {}
    current = ""
    with opener(path, "rt") as f:
        for row in csv.reader(f):
            if not row or row[0] == "Function Name":
                continue
            if row[0] == "File Path":
                current = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif row[0]:
                per[(current, int(row[0]))] = dict(zip(header, row))
    return header, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--source", default="kernels/mma_decode.cu")
    args = parser.parse_args()
    header, per = read_lines(args.csv)
    samples = "Warp Stall Sampling (All Samples)"
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(d[samples]) for d in per.values()) or 1
    total_ins = sum(_num(d["Instructions Executed"]) for d in per.values()) or 1
    try:
        with open(args.source) as f:
            text = f.read().splitlines()
    except OSError:
        text = []
    own = args.source.rsplit("/", 1)[-1]
    print(f"stall samples {total}, instructions executed {total_ins}")
    for (name, line), d in sorted(per.items(), key=lambda kv: -_num(kv[1][samples]))[:args.top]:
        top = sorted(((_num(d[h]), h[6:]) for h in stalls), reverse=True)[:3]
        reasons = ", ".join(f"{h} {n}" for n, h in top if n)
        src = text[line - 1].strip()[:90] if name == own and 0 < line <= len(text) else ""
        print(f"{name[:16]:16s} {line:5d} {100 * _num(d[samples]) / total:5.1f}% "
              f"ins {100 * _num(d['Instructions Executed']) / total_ins:5.1f}%  [{reasons}]  {src}")
    reasons = collections.Counter()
    for d in per.values():
        for h in stalls:
            reasons[h[6:]] += _num(d[h])
    whole = sum(reasons.values()) or 1
    print("stall reasons: " + ", ".join(f"{k} {100 * v / whole:.1f}%" for k, v in reasons.most_common(12)))


if __name__ == "__main__":
    main()
