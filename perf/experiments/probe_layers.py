"""Which layers' compression changes a recall probe's answer: the probe's rows (`kvbackend probe`'s prompts)
answered with the exact cache, the spec on every layer, and the spec with one band of layers made (nearly)
exact: ``identity`` pages (with the spec's sink), or 8-bit keys (``kbits=8``) or values (``vbits=8``) in the band only (``--halves``),
or other options of the spec in the band only (``--options``, in place of the exact copy).

    .venv/bin/python -P perf/experiments/probe_layers.py --seed 0 --questions 8 --rows 4 --out OUT.json
    .venv/bin/python -P perf/experiments/probe_layers.py --seed 0 --questions 8 --rows 4 --band 1 --span 20 25 \
        --halves --out OUT.json
    .venv/bin/python -P perf/experiments/probe_layers.py --seed 0 --questions 8 --rows 4 --band 1 --span 23 24 \
        --options "kbits=3" "centroids=64" --out OUT.json

A band whose exact copy restores the exact answer carries the failure; keys against values says which half.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvbackend import codecs
from kvbackend.depth import layer_specs
from kvbackend.spec import RECOMMENDED_SPEC, split_spec
from kvbackend.tools.models import load_model
from kvbackend.tools.probe import probe_rows, run_probe


def with_option(spec: str, option: str) -> str:
    """``spec`` with ``option`` (``key=value``) set, replacing the key's value where the spec has one."""
    name, options = split_spec(spec)
    key, _, value = option.partition("=")
    options[key] = value
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in options.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--prefix", type=int, default=6144)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, nargs="+", required=True, help="row indices of the probe to answer")
    ap.add_argument("--codec", default=RECOMMENDED_SPEC)
    ap.add_argument("--band", type=int, default=5, help="layers per band")
    ap.add_argument("--span", type=int, nargs=2, default=None, metavar=("FIRST", "END"),
                    help="bands only over layers FIRST..END-1 (default: every layer)")
    ap.add_argument("--halves", action="store_true", help="also keys-only and values-only 8-bit bands")
    ap.add_argument("--options", nargs="*", default=(),
                    help="spec options (key=value, several joined by ';') tried in each band instead of the band's exact copy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    n = model.config.num_hidden_layers
    with open(args.text, encoding="utf-8") as f:
        filler = f.read()
    rows = probe_rows(tokenizer, filler, args.prefix, args.questions, args.seed)
    rows = [rows[i] for i in args.rows]
    base = layer_specs(args.codec, n)
    plans = {"spec": base}
    sink = codecs.get(base[0]).levers.sink  # one cache keeps one sink for every layer
    exact = f"identity:sink={sink}" if sink else "identity"
    first, end = args.span or (0, n)
    for lo in range(first, end, args.band):
        band = range(lo, min(end, lo + args.band))
        if not args.options:
            plans[f"exact L{lo}-{band[-1]}"] = [exact if i in band else s for i, s in enumerate(base)]
        for options in args.options:
            changed = list(base)
            for i in band:
                for option in options.split(";"):
                    changed[i] = with_option(changed[i], option)
            plans[f"{options} L{lo}-{band[-1]}"] = changed
        if args.halves:
            plans[f"k8 L{lo}-{band[-1]}"] = [with_option(s, "kbits=8") if i in band else s for i, s in enumerate(base)]
            plans[f"v8 L{lo}-{band[-1]}"] = [with_option(s, "vbits=8") if i in band else s for i, s in enumerate(base)]
    start = time.perf_counter()
    results = run_probe(model, tokenizer, rows, list(plans), plans=plans)
    out = {"text": args.text, "prefix": args.prefix, "seed": args.seed, "questions": args.questions,
           "rows": args.rows, "truth": [r.truth for r in rows], "codec": args.codec,
           "results": [{"cache": r.cache, "answers": r.answers, "agree": r.agree} for r in results],
           "seconds": time.perf_counter() - start}
    for r in results:
        print(f"{r.cache:>24}: {' '.join(r.answers)}  agree {r.agree:.2f}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
