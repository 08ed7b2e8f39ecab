"""Measure one fixed per-layer plan (a JSON list of 30 layer specs, or a depth rule) through the paged path, over
seeds, as `kvbackend eval` measures an `auto:` plan (the same `evaluate`, with the plan given instead of searched).

    .venv/bin/python perf/experiments/static_plan_eval.py PLAN.json TEXT PREFIX SEEDS OUT.json
"""
import json
import re
import sys
import types
from dataclasses import asdict

import torch

import kvbackend.tools.evaluate as ev
from kvbackend.tools.models import load_model


def main(plan_path, text_path, prefix, seeds, out):
    plan = json.load(open(plan_path))
    torch.set_num_threads(1)
    model, tok = load_model()
    ids = tok(open(text_path, encoding="utf-8").read(), return_tensors="pt").input_ids
    settings = ev.EvalSettings(prefix=prefix, queries=128)
    rows = []
    for seed in range(seeds):
        layer_specs = [re.sub(r"seed=\d+", f"seed={seed}", s) if "seed=" in s else s + f",seed={seed}" for s in plan]
        ev.parse_auto = lambda spec: types.SimpleNamespace(kl=0, calib=256)
        ev.plan_widths = lambda *a, **k: types.SimpleNamespace(specs=layer_specs, calib_kl=None)
        ev.check_specs = lambda *a, **k: None
        r = ev.evaluate(model, ids, ["static"], settings)[0]
        rows.append({"seed": seed, "bpv": r.bpv, "kl": r.kl, "top1": r.top1_agree, "k_nrmse": r.k_nrmse})
        print(rows[-1], flush=True)
    json.dump({"plan": plan, "text": text_path, "prefix": prefix, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
