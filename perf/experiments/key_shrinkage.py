"""Do decoded keys spread their logits less than the exact ones, and does widening them back help?

Mean-like reconstructions (k-means centroids, clipped steps) pull keys toward their chunk: the decoded logits
q.k^ vary less over the compressed positions than the exact ones, so the keys a query should single out stand out
less, and more compressed keys compete. For one text and spec: per layer, the variance of the continuation queries'
logits over the compressed positions (past the sinks) with decoded keys against exact keys; then the next-token KL
with each compressed key widened about its head's mean decoded key, ``m + gamma * (k^ - m)`` (what a decoder could
do with one stored factor), for each gamma (1: the plain decoded cache).

    .venv/bin/python -P perf/experiments/key_shrinkage.py TEXT SPEC PREFIX SKIP OUT.json [GAMMA ...]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoded_prefix import decoded_prefix  # noqa: E402

from kvbackend.tools.evaluate import _continuation_logits, _next_token_metrics  # noqa: E402


def main(text: str, spec: str, prefix: int, skip: int, out: str, gammas: list[float]) -> None:
    run = decoded_prefix(text, spec, prefix, skip)
    model, ids, exact, pre_k, pre_v = run.model, run.ids, run.exact, run.pre_k, run.pre_v
    layers, heads, sink = len(exact.k), run.heads, run.sink
    per_layer = []
    for layer in range(layers):
        q = exact.q[layer][:, prefix:].float()  # [Hq, CONT, D]
        group = q.shape[0] // heads
        k = exact.k[layer][:, sink:prefix].float().repeat_interleave(group, 0)
        kh = pre_k[layer].transpose(0, 1)[:, sink:].float().repeat_interleave(group, 0)
        var_exact = (q @ k.transpose(1, 2)).var(-1)  # [Hq, CONT]: over the compressed positions
        var_dec = (q @ kh.transpose(1, 2)).var(-1)
        per_layer.append(dict(layer=layer, logit_var_ratio=float((var_dec / var_exact.clamp_min(1e-12)).mean())))
        print(f"layer {layer:2d}: decoded / exact logit variance {per_layer[-1]['logit_var_ratio']:.4f}", flush=True)
    cont_ids = ids[:, prefix:]
    targets = ids[0, prefix + 1 :]
    ref = _continuation_logits(model, [k[:, :prefix] for k in exact.k], [v[:, :prefix] for v in exact.v], cont_ids)
    runs = []
    for gamma in gammas:
        keys = []
        for layer in range(layers):
            kh = pre_k[layer].transpose(0, 1).clone()  # [H, prefix, D]
            body = kh[:, sink:].float()
            mean = body.mean(1, keepdim=True)
            kh[:, sink:] = (mean + gamma * (body - mean)).to(kh.dtype)
            keys.append(kh)
        test = _continuation_logits(model, keys, [v.transpose(0, 1) for v in pre_v], cont_ids)
        kl, agree, ppl, _ = _next_token_metrics(ref, test, targets)
        runs.append(dict(gamma=gamma, kl=kl, top1_agree=agree, ppl=ppl))
        print(f"gamma {gamma}: KL {kl:.5f} top-1 {agree:.4f}", flush=True)
    with open(out, "w") as f:
        json.dump(dict(text=text, spec=spec, prefix=prefix, skip=skip, layers=per_layer, runs=runs), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         [float(a) for a in sys.argv[6:]] or [1.0, 1.02, 1.05, 1.1])
