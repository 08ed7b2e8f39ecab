"""Where a 2.6-bit spec's KL differs between k-means seeds: per layer, the attention output error of the last
queries and the key error weighed three ways (plain, by the queries' logits, by the logits and the attention mass
each key receives), from the paged cache's reconstruction of a prefix of a text on SmolLM2.

    python3 perf/experiments/attention_importance.py TEXT SPEC OUT.json [--prefix 1536] [--seeds 0,1,2]

Prints per seed the totals and the layers whose attention error moves most between seeds.
"""
import argparse
import json
import math
import pathlib

import torch  # noqa: E402

from kvbackend.depth import layer_specs as depth_layer_specs  # noqa: E402
from kvbackend.geometry import Geometry  # noqa: E402
from kvbackend.rope import rotary_from_config  # noqa: E402
from kvbackend.tools.evaluate import EvalSettings, capture_exact, paged_reconstruction  # noqa: E402
from kvbackend.tools.models import load_model  # noqa: E402
from kvbackend.tools.seeds import seeded  # noqa: E402


def layer_figures(q, k, v, kh, vh, queries):
    """q [Hq, T, D], k/v/kh/vh [H, T, D] (T the prefix): figures over the last ``queries`` queries."""
    hq, t, d = q.shape
    group = hq // k.shape[0]
    qs = q[:, t - queries:].float()
    positions = torch.arange(t - queries, t)
    mask = torch.arange(t)[None, :] > positions[:, None]
    kr, khr = k.float().repeat_interleave(group, 0), kh.float().repeat_interleave(group, 0)
    s = (qs @ kr.transpose(1, 2)) / math.sqrt(d)
    sh = (qs @ khr.transpose(1, 2)) / math.sqrt(d)
    p = s.masked_fill(mask, float("-inf")).softmax(-1)  # [Hq, Q, T]
    ph = sh.masked_fill(mask, float("-inf")).softmax(-1)
    vr, vhr = v.float().repeat_interleave(group, 0), vh.float().repeat_interleave(group, 0)
    out, out_h = p @ vr, ph @ vhr
    ds = (sh - s).masked_fill(mask, 0.0)  # logit errors
    return {
        "out_err2": float(((out - out_h) ** 2).sum()), "out_norm2": float((out ** 2).sum()),
        "key_err2": float(((k.float() - kh.float()) ** 2).sum()),
        "logit_err2": float((ds ** 2).sum()),
        "mass_logit_err2": float((p * ds ** 2).sum()),  # each query's logit errors weighed by its attention
        "kl_attn": float((p * (p.clamp_min(1e-30).log() - ph.clamp_min(1e-30).log())).sum()),
        "top1_shift": int((s.masked_fill(mask, -1e30).argmax(-1) != sh.masked_fill(mask, -1e30).argmax(-1)).sum()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    spec = pathlib.Path(args.spec).read_text().strip() if pathlib.Path(args.spec).exists() else args.spec
    model, tokenizer = load_model()
    ids = tokenizer(pathlib.Path(args.text).read_text(), return_tensors="pt").input_ids[:, : args.prefix]
    exact = capture_exact(model, ids)
    layers = len(exact.k)
    heads, _, dim = exact.k[0].shape
    geometry = Geometry(layers, heads, dim, exact.k[0].dtype)
    rotary = rotary_from_config(model.config)
    settings = EvalSettings(prefix=args.prefix, tokens=args.prefix)
    result = {"spec": spec, "text": args.text, "prefix": args.prefix, "seeds": {}}
    for seed in [int(x) for x in args.seeds.split(",")]:
        specs = depth_layer_specs(seeded(spec, seed), layers)
        ks, vs, _ = paged_reconstruction(specs, exact, geometry, settings, args.prefix, rotary)
        rows = [layer_figures(exact.q[i], exact.k[i], exact.v[i], ks[i].transpose(0, 1), vs[i].transpose(0, 1),
                              args.queries) for i in range(layers)]
        result["seeds"][seed] = rows
        tot = {key: sum(r[key] for r in rows) for key in rows[0]}
        print(f"seed {seed}: out err {math.sqrt(tot['out_err2'] / tot['out_norm2']):.4f}  key err2 {tot['key_err2']:.1f}  "
              f"logit err2 {tot['logit_err2']:.1f}  mass-weighted {tot['mass_logit_err2']:.3f}  attn KL "
              f"{tot['kl_attn']:.3f}  top-1 shifts {tot['top1_shift']}", flush=True)
    seeds = list(result["seeds"])
    rel = [[math.sqrt(result["seeds"][s][i]["out_err2"] / result["seeds"][s][i]["out_norm2"]) for s in seeds]
           for i in range(layers)]
    spread = sorted(range(layers), key=lambda i: -(max(rel[i]) - min(rel[i])))
    for i in spread[:8]:
        print(f"layer {i:2d}: out err " + " / ".join(f"{x:.4f}" for x in rel[i]) + "  mass-weighted "
              + " / ".join(f"{result['seeds'][s][i]['mass_logit_err2']:.4f}" for s in seeds) + "  attn KL "
              + " / ".join(f"{result['seeds'][s][i]['kl_attn']:.4f}" for s in seeds))
    pathlib.Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
