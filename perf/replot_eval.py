"""Redraw the Pareto plot of a `kvbackend eval --json` file (after a change to the plot only).

    .venv/bin/python perf/replot_eval.py perf/results/eval9_legal.json perf/results/eval9_legal.png
"""

import json
import sys

from kvbackend.tools.evaluate import CodecResult, pareto_plot


def main(source: str, target: str) -> None:
    with open(source) as f:
        data = json.load(f)
    pareto_plot(target, [CodecResult(**row) for row in data["codecs"]], f"{data['text']}: quality per byte")


if __name__ == "__main__":
    main(*sys.argv[1:3])
