"""The Pareto table and plot of every spec measured through the paged cache, per text and prefix.

    .venv/bin/python perf/pareto.py            # reads perf/results/eval*.json, writes perf/results/pareto.{md,png}

Inputs are `kvbackend eval --json` files (each names its text and settings). Only figures measured through
the paged cache are used (`path` "paged" or "both"; older simulation-only files are skipped), for the three
evaluation texts below. A spec measured in several files keeps its latest figures (the highest eval
number): code changed between sessions, and the latest run is the one the current code reproduces. A point
is on the frontier when no other point of the same text and prefix has both fewer bits per value and a
lower KL. The exact command of every point is `kvbackend eval --text TEXT --prefix PREFIX --codec SPEC`.

Runs of one spec over several k-means seeds (`seed=N` in the spec, or in an ``auto:`` plan's base; e.g. from
`kvbackend eval --seeds N`) become one point: the mean of their figures, the KL range beside it, since one seed's
KL can sit 1.4x from another's.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

TEXTS = {
    "/usr/share/common-licenses/GPL-3": "legal (GPL-3)",
    "/root/.pyenv/versions/3.12.1/lib/python3.12/argparse.py": "code (argparse.py)",
    "/usr/share/doc/dpkg/spec/triggers.txt": "technical (dpkg triggers)",
    # held out: never used to choose a spec (eval23 onwards)
    "/usr/share/common-licenses/GFDL-1.3": "held-out legal (GFDL-1.3)",
    "/root/.pyenv/versions/3.12.1/lib/python3.12/subprocess.py": "held-out code (subprocess.py)",
    "/usr/share/doc/git/contrib/subtree/git-subtree.txt": "held-out technical (git-subtree.txt)",
}


def eval_number(path: str) -> int:
    match = re.match(r"eval(\d+)_", os.path.basename(path))
    return int(match.group(1)) if match else -1


def collect(folder: str) -> dict[tuple[str, int], dict[str, dict]]:
    """(text, prefix) -> spec -> the latest row measured through the paged cache."""
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "eval*.json")), key=eval_number):
        with open(path) as f:
            data = json.load(f)
        text, prefix = data.get("text"), data.get("settings", {}).get("prefix")
        if text not in TEXTS or prefix is None or data.get("skip"):  # (a --skip run scores another continuation)
            continue
        for row in data["codecs"]:
            if row.get("path") not in ("paged", "both"):
                continue
            out.setdefault((text, prefix), {})[row["spec"]] = {**row, "file": os.path.basename(path),
                                                               "calibration": data.get("calibration")}
    return {key: merge_seeds(specs) for key, specs in out.items()}


_SEED = re.compile(r"[,;]seed=\d+")
_MEAN = ("bpv", "kl", "top1_agree", "attn_out_err", "k_nrmse")


def merge_seeds(specs: dict[str, dict]) -> dict[str, dict]:
    """``specs`` with the runs of one spec over two or more k-means seeds replaced by their mean (a row whose spec
    says how many seeds, with ``kl_min``/``kl_max``); single runs as they are."""
    groups: dict[str, list[dict]] = {}
    for spec, row in specs.items():
        groups.setdefault(_SEED.sub("", spec) if _SEED.search(spec) else spec, []).append(row)
    out = {}
    for spec, rows in groups.items():
        seeded = [r for r in rows if _SEED.search(r["spec"])]
        if len(seeded) < 2:
            out.update({r["spec"]: r for r in rows})
            continue
        out.update({r["spec"]: r for r in rows if not _SEED.search(r["spec"])})
        name = f"{spec} (mean of {len(seeded)} seeds)"
        mean = {key: sum(r[key] for r in seeded) / len(seeded) for key in _MEAN}
        out[name] = {**mean, "spec": name, "kl_min": min(r["kl"] for r in seeded), "kl_max": max(r["kl"] for r in seeded),
                     "file": ", ".join(sorted({r["file"] for r in seeded}))}
    return out


def frontier(rows: list[dict]) -> set[str]:
    """Specs no other row beats on both bpv and KL."""
    return {r["spec"] for r in rows
            if not any(o["bpv"] <= r["bpv"] and o["kl"] < r["kl"] or o["bpv"] < r["bpv"] and o["kl"] <= r["kl"]
                       for o in rows)}


def table(points: dict[tuple[str, int], dict[str, dict]]) -> str:
    lines = ["# Quality per byte through the paged cache (SmolLM2-135M, 512 teacher-forced tokens)", "",
             "Written by `perf/pareto.py` from `perf/results/eval*.json`; `*` marks the Pareto frontier (bpv",
             "against KL). Command of a row: `kvbackend eval --text TEXT --prefix PREFIX --codec SPEC`; a row",
             "\"(mean of N seeds)\": the same with `--seeds N` (its KL range in brackets); a row \"with",
             "`--calibration FILE`\": the same with that option (the text its plan was fitted on).", ""]
    for (text, prefix), specs in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows = sorted(specs.values(), key=lambda r: r["bpv"])
        best = frontier(rows)
        lines += [f"## {TEXTS[text]}, {prefix}-token prefix (`{text}`)", "",
                  "| | spec | bpv | KL | top-1 | attn-out err | k NRMSE | file |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            kl = f"{r['kl']:.4f}" + (f" ({r['kl_min']:.4f}-{r['kl_max']:.4f})" if "kl_min" in r else "")
            calib = f" with `--calibration {r['calibration']}`" if r.get("calibration") else ""
            lines.append(f"| {'*' if r['spec'] in best else ''} | `{r['spec']}`{calib} | {r['bpv']:.3f} | {kl} | "
                         f"{100 * r['top1_agree']:.1f}% | {r['attn_out_err']:.3f} | {r['k_nrmse']:.3f} | {r['file']} |")
        lines.append("")
    return "\n".join(lines)


def plot(points: dict[tuple[str, int], dict[str, dict]], path: str, prefix: int = 1536) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("kl", "next-token KL (log scale)"), ("top1_agree", "top-1 agreement"),
               ("attn_out_err", "attention-output error"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for (text, pre), specs in sorted(points.items()):
        if pre != prefix:
            continue
        rows = sorted((r for r in specs.values() if r["bpv"] <= 6), key=lambda r: r["bpv"])
        best = [r for r in rows if r["spec"] in frontier(rows)]
        for ax, (key, label) in zip(axes, metrics):
            line, = ax.plot([r["bpv"] for r in rows], [r[key] for r in rows], "o", alpha=0.35, label=None)
            ax.plot([r["bpv"] for r in best], [r[key] for r in best], "-o", color=line.get_color(), label=TEXTS[text])
            ax.set_xlabel("bits per value (measured from stored bytes)")
            ax.set_ylabel(label)
            if key == "kl":
                ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"Quality per byte through the paged cache, {prefix}-token prefix (lines: the bpv-KL frontier)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(folder: str = "perf/results") -> None:
    points = collect(folder)
    if not points:
        raise SystemExit(f"no paged-path eval JSON of the three texts under {folder}")
    with open(os.path.join(folder, "pareto.md"), "w") as f:
        f.write(table(points) + "\n")
    plot(points, os.path.join(folder, "pareto.png"))
    print(f"{sum(len(v) for v in points.values())} points, {len(points)} text/prefix pairs -> "
          f"{folder}/pareto.md, {folder}/pareto.png")


if __name__ == "__main__":
    main(*sys.argv[1:2])
