"""Upper bound of keeping a few heavily attended keys (and or their values) exact: a spec's paged reconstruction of a text's prefix on
SmolLM2, then per layer and KV head the N keys chosen by a score replaced by the exact ones, and the continuation's
KL against the exact cache measured as `kvbackend eval` does (1536-token prefix, 512 teacher-forced tokens).

Scores: "mass" = the attention each key receives from the prefix's own queries (causal, GQA groups summed; what an
encoder holding the chunk's queries could compute), "mean" = the key's logit under the mean query of the prefix,
"mean_pre" = the same with queries and keys before RoPE (what a `prerope` codec sees), "none" = the spec alone. Sink tokens are never chosen (the spec keeps them).

    python3 perf/experiments/heavy_keys.py TEXT SPEC OUT.json [--seeds 0,1] [--n 4,8] [--kinds mass,mean,mean_pre]
        [--what k,v,kv]
"""
import argparse
import json
import math
import pathlib

import torch

from kvbackend.depth import layer_specs as depth_layer_specs
from kvbackend.geometry import Geometry
from kvbackend.rope import rotary_from_config
from kvbackend.tools.evaluate import (EvalSettings, _continuation_logits, _next_token_metrics, capture_exact,
                                      paged_reconstruction)
from kvbackend.tools.models import load_model
from kvbackend.tools.seeds import seeded


def scores(q: torch.Tensor, k: torch.Tensor, kind: str, sink: int, rotary) -> torch.Tensor:
    """q [Hq, T, D], k [H, T, D] (post-RoPE): a score per KV head and token [H, T]."""
    hq, t, d = q.shape
    if kind == "mean_pre":  # the frame a `prerope` codec sees: both de-rotated by their own positions
        positions = torch.arange(t)
        q = rotary.derotate(q.float(), positions)
        k = rotary.derotate(k.float(), positions)
    h = k.shape[0]
    g = hq // h
    if kind == "mass":
        s = q.float() @ k.float().repeat_interleave(g, 0).transpose(1, 2) / math.sqrt(d)
        p = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")).softmax(-1)
        out = p.sum(1).view(h, g, t).sum(1)
    else:
        mu = q.float().reshape(h, g * t, d).mean(1)  # [H, D]
        out = torch.einsum("htd,hd->ht", k.float(), mu)
    out[:, :sink] = float("-inf")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--cont", type=int, default=512)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n", default="4,8")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--kinds", default="mass,mean,mean_pre")
    ap.add_argument("--what", default="k", help="which rows to keep exact: k, v or kv, comma-separated")
    args = ap.parse_args()
    spec = pathlib.Path(args.spec).read_text().strip() if pathlib.Path(args.spec).exists() else args.spec
    model, tokenizer = load_model()
    ids = tokenizer(pathlib.Path(args.text).read_text(), return_tensors="pt").input_ids[:, : args.prefix + args.cont]
    exact = capture_exact(model, ids)
    layers = len(exact.k)
    heads, _, dim = exact.k[0].shape
    geometry = Geometry(layers, heads, dim, exact.k[0].dtype)
    rotary = rotary_from_config(model.config)
    n = args.prefix
    settings = EvalSettings(prefix=n, tokens=n)
    cont_ids = ids[:, n : n + args.cont]
    targets = ids[0, n + 1 : n + args.cont]
    ref = _continuation_logits(model, [k[:, :n] for k in exact.k], [v[:, :n] for v in exact.v], cont_ids)
    chosen = {kind: [scores(exact.q[i][:, :n], exact.k[i][:, :n], kind, args.sink, rotary) for i in range(layers)]
              for kind in args.kinds.split(",")}
    rows = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        ks, vs, stored = paged_reconstruction(depth_layer_specs(seeded(spec, seed), layers), exact, geometry, settings,
                                              n, rotary)
        for kind, counts in [("none", [0])] + [(kind, [int(x) for x in args.n.split(",")]) for kind in chosen]:
            for count in counts:
                for what in (["k"] if not count else args.what.split(",")):
                    keys, values = [], []
                    for i in range(layers):
                        kh, vh = ks[i].transpose(0, 1).clone(), vs[i].transpose(0, 1).clone()  # [H, T, D]
                        if count:
                            top = chosen[kind][i].topk(count, -1).indices  # [H, N]
                            for h in range(heads):
                                if "k" in what:
                                    kh[h, top[h]] = exact.k[i][h, top[h]].to(kh.dtype)
                                if "v" in what:
                                    vh[h, top[h]] = exact.v[i][h, top[h]].to(vh.dtype)
                        keys.append(kh)
                        values.append(vh)
                    test = _continuation_logits(model, keys, values, cont_ids)
                    kl, agree, _, _ = _next_token_metrics(ref, test, targets)
                    extra = len(what) * count * heads * layers * dim * 2  # fp16 rows; positions not counted
                    bpv = 8.0 * (stored + extra) / (n * layers * geometry.values_per_token)
                    rows.append({"seed": seed, "kind": kind, "n": count, "exact": what, "kl": kl, "top1": agree,
                                 "bpv_rows_fp16": bpv})
                    print(f"seed {seed} {kind:>8} N={count} exact {what:>2}: KL {kl:.4f} top-1 {100 * agree:.1f}%  "
                          f"bpv {bpv:.4f}", flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"spec": spec, "text": args.text, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
