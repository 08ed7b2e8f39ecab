"""Does a compressed prefix get less attention than the exact one, and does a variance bias give it back?

Given its decoded key k^, a key's true logit is q.k^ plus a rounding error -q.e; when the reconstruction is the
mean of the keys it stands for (k-means centroids, the MSE-optimal clipped step), the error is centred given k^,
and E[exp(q.k)] = exp(q.k^) E[exp(-q.e)] > exp(q.k^): a compressed key's attention weight is too small by about
exp(s^2 q^T S q / 2) (S the error's covariance, s the attention scale) against the exact keys around it (the sinks,
the tokens not yet in a chunk). The longer the compressed prefix, the more mass this moves: one candidate for the
growth of KL with context that the keys carry (perf/NOTES.md, session 35).

For one text and spec: the continuation's queries, every layer and head; the mass on the compressed positions
(past the sinks) with exact keys, with decoded keys, and with decoded keys plus the bias
``alpha * s^2 * sum_d q_d^2 var_d / 2``, var_d the mean squared key error of channel d over the key's 64-token group
(what a codec could store, or estimate from its steps); then the next-token KL of the continuation for each alpha
(eager attention with the bias added to the compressed positions' logits; alpha=0 is the plain decoded cache).

    .venv/bin/python -P perf/experiments/attention_mass.py TEXT SPEC PREFIX SKIP OUT.json [ALPHA ...]
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoded_prefix import decoded_prefix  # noqa: E402

from kvbackend.tools.evaluate import _next_token_metrics  # noqa: E402

GROUP = 64


def group_variance(error: torch.Tensor) -> torch.Tensor:
    """[H, T, D] squared error averaged over each GROUP-token run of each channel, expanded back to [H, T, D]."""
    h, t, d = error.shape
    full = t - t % GROUP
    out = torch.empty_like(error)
    sq = error.float() ** 2
    out[:, :full] = sq[:, :full].reshape(h, -1, GROUP, d).mean(2, keepdim=True).expand(-1, -1, GROUP, -1).reshape(
        h, full, d)
    if full < t:
        out[:, full:] = sq[:, full:].mean(1, keepdim=True)
    return out


def main(text: str, spec: str, prefix: int, skip: int, out: str, alphas: list[float]) -> None:
    run = decoded_prefix(text, spec, prefix, skip)
    model, ids, exact, pre_k, pre_v = run.model, run.ids, run.exact, run.pre_k, run.pre_v
    layers, heads, dim, sink = len(exact.k), run.heads, run.dim, run.sink
    scale = 1 / math.sqrt(dim)
    variance = []
    per_layer = []
    for layer in range(layers):
        k = exact.k[layer].float()  # [H, T, D]
        dec = torch.cat([pre_k[layer].transpose(0, 1).float(), k[:, prefix:]], 1)
        var = group_variance(k[:, :prefix] - dec[:, :prefix])
        var[:, :sink] = 0
        variance.append(var)
        q = exact.q[layer][:, prefix:].float()  # [Hq, CONT, D]
        group = q.shape[0] // heads
        t = k.shape[1]
        mask = torch.arange(t)[None, :] > (prefix + torch.arange(q.shape[1]))[:, None]

        def mass(keys, bias=None):
            s = (q @ keys.repeat_interleave(group, 0).transpose(1, 2)) * scale
            if bias is not None:
                s[..., :prefix] += bias
            p = s.masked_fill(mask, float("-inf")).softmax(-1)
            return p[..., sink:prefix].sum(-1)  # [Hq, CONT]

        bias = 0.5 * scale**2 * (q**2 @ var.repeat_interleave(group, 0).transpose(1, 2))
        m_exact, m_dec, m_fix = mass(k), mass(dec), mass(dec, bias)
        per_layer.append(dict(layer=layer, exact=float(m_exact.mean()), decoded=float(m_dec.mean()),
                              corrected=float(m_fix.mean()), mean_bias=float(bias.mean()),
                              log_ratio=float((m_dec.clamp_min(1e-9) / m_exact.clamp_min(1e-9)).log().mean()),
                              log_ratio_corrected=float((m_fix.clamp_min(1e-9) / m_exact.clamp_min(1e-9)).log().mean())))
        print(f"layer {layer:2d}: mass exact {per_layer[-1]['exact']:.4f} decoded {per_layer[-1]['decoded']:.4f} "
              f"corrected {per_layer[-1]['corrected']:.4f} (mean bias {per_layer[-1]['mean_bias']:.4f})", flush=True)

    from transformers import AttentionInterface, DynamicCache

    from kvbackend.tools.models import cache_argument

    state = {"alpha": 0.0}

    def biased(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        s = scaling if scaling is not None else scale
        b, hq, tq, _ = query.shape
        group = hq // key.shape[1]
        keys = key.repeat_interleave(group, 1)
        vals = value.repeat_interleave(group, 1)
        w = (query.float() @ keys.float().transpose(2, 3)) * s
        tk = keys.shape[2]
        if state["alpha"]:
            var = variance[module.layer_idx].repeat_interleave(group, 0)[None]  # [1, Hq, prefix, D]
            w[..., :prefix] += state["alpha"] * 0.5 * s**2 * (query.float() ** 2 @ var.transpose(2, 3))
        causal = torch.arange(tk)[None, :] > (tk - tq + torch.arange(tq))[:, None]
        w = w.masked_fill(causal, float("-inf")).softmax(-1)
        return (w @ vals.float()).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvbackend_biased", biased)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvbackend_biased")
    cont_ids = ids[:, prefix:]
    targets = ids[0, prefix + 1 :]

    def logits(ks, vs):
        cache = DynamicCache(config=model.config)
        for layer, (k, v) in enumerate(zip(ks, vs)):
            cache.update(k[None], v[None], layer)
        return model(cont_ids, **cache_argument(model, cache)).logits[0].float()

    ref = logits([k[:, :prefix] for k in exact.k], [v[:, :prefix] for v in exact.v])
    runs = []
    for alpha in alphas:
        state["alpha"] = alpha
        test = logits([k.transpose(0, 1) for k in pre_k], [v.transpose(0, 1) for v in pre_v])
        kl, agree, ppl, ppl_ref = _next_token_metrics(ref, test, targets)
        runs.append(dict(alpha=alpha, kl=kl, top1_agree=agree, ppl=ppl))
        print(f"alpha {alpha}: KL {kl:.5f} top-1 {agree:.4f}", flush=True)
    model.set_attn_implementation(previous)
    with open(out, "w") as f:
        json.dump(dict(text=text, spec=spec, prefix=prefix, skip=skip, layers=per_layer, runs=runs), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         [float(a) for a in sys.argv[6:]] or [0.0, 0.5, 1.0, 2.0])
