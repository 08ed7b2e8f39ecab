"""Does a `chw:` plan lose KL when both channels of each RoPE pair (d, d + D/2) share one width (what a kernel that
rotates pre-RoPE keys in registers would like)? The bases' channel variances are replaced by each pair's geometric
mean (the pair's rate at one shared width), then `klt:...,axes=channels,paged=true` is measured through the paged
cache as `kvbackend eval` measures it, beside the per-channel plan.

    .venv/bin/python -P perf/experiments/chw_pairs.py TEXT CALIB_TEXT SPEC... > OUT.json
"""

import dataclasses
import json
import sys

import torch

from kvbackend.tools.evaluate import EvalSettings, evaluate, key_bases_from_text
from kvbackend.tools.models import load_model


def paired(bases):
    half = bases.var.shape[-1] // 2
    gm = (bases.var[..., :half] * bases.var[..., half:]).sqrt()
    return dataclasses.replace(bases, var=torch.cat([gm, gm], -1))


def main(text: str, calib: str, specs: list[str]) -> None:
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    ids = tokenizer(open(text).read(), return_tensors="pt").input_ids
    bases = key_bases_from_text(model, tokenizer(open(calib).read(), return_tensors="pt").input_ids)
    settings = EvalSettings(tokens=2048, prefix=1536, cont=512, queries=128, chunk_tokens=2048)
    out = {"text": text, "calib": calib, "rows": []}
    for name, b in (("per_channel", bases), ("per_pair", paired(bases))):
        for r in evaluate(model, ids, specs, settings, key_bases=b):
            out["rows"].append({"widths": name, "spec": r.spec, "bpv": r.bpv, "kl": r.kl, "top1": r.top1_agree})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
