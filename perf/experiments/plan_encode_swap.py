"""A plan chosen with one k-means seed, encoded with another (`kvbackend eval`'s figures otherwise): is a seed's
miss in its per-layer plan or in its encode?

    .venv/bin/python perf/experiments/plan_encode_swap.py EVAL_SEEDS_JSON TEXT OUT_JSON
"""
import json
import re
import sys

import torch

from kvbackend.tools import evaluate as ev
from kvbackend.tools.auto import Plan
from kvbackend.tools.models import load_model

src, text, out = sys.argv[1], sys.argv[2], sys.argv[3]
d = json.load(open(src))
plans = [r["plan"] for r in d["codecs"]]


def reseed(plan, s):
    return [re.sub(r"seed=\d+", f"seed={s}", p) for p in plan]


combos = [(0, 1), (1, 0), (2, 1), (1, 1)]  # (plan's seed, encode's seed)
queue = [reseed(plans[a], b) for a, b in combos]


def fake_plan(*args, **kw):  # the evaluator's planner, answering with the queued plans in order
    return Plan(queue.pop(0), 0.0, 0.0)


ev.plan_widths = fake_plan
torch.manual_seed(0)
model, tok = load_model(device="cpu")
ids = tok(open(text, encoding="utf-8").read(), return_tensors="pt").input_ids
spec = d["codecs"][0]["spec"]
settings = ev.EvalSettings(tokens=2048, prefix=1536, cont=512, queries=128, chunk_tokens=2048, device="cpu", path="paged")
res = ev.evaluate(model, ids, [spec] * len(combos), settings)
rows = [{"plan_seed": a, "encode_seed": b, "kl": r.kl, "top1": r.top1_agree, "bpv": r.bpv} for (a, b), r in zip(combos, res)]
for row in rows: print(row, flush=True)
json.dump(rows, open(out, "w"), indent=1)
