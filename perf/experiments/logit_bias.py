"""Does quantization noise in the attention logits bias the softmax toward compressed keys, and does subtracting
its expected lognormal inflation help? (A question for #18's same-continuation ratio.)

For a key with error e, the logit s + q.e/sqrt(D) has E[exp] = exp(s) exp(sigma^2 / 2), sigma^2 = sum_c q_c^2 var(e_c)
/ D: every compressed key gains weight against the exact ones (sinks, the dense continuation), and more compressed
keys gain more in total. Variants of the continuation's attention over the reconstructed prefix:
- none: plain attention (the eval's KL);
- page{alpha}: logits of prefix keys plus alpha sigma^2 (-1/2: the additive-noise model's inflation taken out;
  +1/2: the shrinkage model's, where the error is independent of the reconstruction, put back), with var(e_c) the mean squared error of channel c over the key's
  64-token page (per head): an oracle statistic (it could be stored, 1 byte a channel a page);

    .venv/bin/python -P perf/experiments/logit_bias.py TEXT PREFIX SKIP SPECFILE SEED OUT.json [ALPHAS, default -0.5,0.5,1]
"""
import json
import sys

import torch

from kvbackend.depth import layer_specs as depth_layer_specs
from kvbackend.geometry import Geometry
from kvbackend.rope import rotary_from_config
from kvbackend.tools.evaluate import EvalSettings, _next_token_metrics, capture_exact, paged_reconstruction
from kvbackend.tools.models import cache_argument, load_model
from kvbackend.tools.seeds import seeded

text, prefix, skip, specfile, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
    int(sys.argv[5]), sys.argv[6]
CONT, PAGE = 512, 64
spec = seeded(open(specfile).read().strip(), seed)
model, tok = load_model(device="cpu")
ids = tok(open(text, encoding="utf-8").read(), return_tensors="pt").input_ids[:, skip:][:, : prefix + CONT]
settings = EvalSettings(tokens=prefix + CONT, prefix=prefix, cont=CONT, queries=128, chunk_tokens=2048, device="cpu")
exact = capture_exact(model, ids)
layers = len(exact.k)
heads, _, dim = exact.k[0].shape
geometry = Geometry(layers, heads, dim, exact.k[0].dtype)
pre_k, pre_v, stored = paged_reconstruction(depth_layer_specs(spec, layers), exact, geometry, settings, prefix,
                                            rotary_from_config(model.config))
pre_k = [k.transpose(0, 1) for k in pre_k]  # [H, T, D]
pre_v = [v.transpose(0, 1) for v in pre_v]
err2 = [(pk.float() - ek[:, :prefix].float()) ** 2 for pk, ek in zip(pre_k, exact.k)]  # [H, T, D]
pages = -(-prefix // PAGE)
page_var = []
for e in err2:
    padded = torch.nn.functional.pad(e, (0, 0, 0, pages * PAGE - prefix))
    per_page = padded.reshape(heads, pages, PAGE, dim).mean(2, keepdim=True).expand(-1, -1, PAGE, -1)
    page_var.append(per_page.reshape(heads, pages * PAGE, dim)[:, :prefix])
cont_ids = ids[:, prefix:]
targets = ids[0, prefix + 1 :]
MODE = {"var": None, "alpha": 0.0}


def biased(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query [1, Hq, Q, D], key/value [1, H, T, D] (the prefix first): eager attention plus the bias on prefix keys
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, 1).float()
    v = value.repeat_interleave(group, 1).float()
    q = query.float()
    scale = scaling if scaling is not None else dim ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]].float()
    var = MODE["var"]
    if var is not None:
        vl = var[module.layer_idx].repeat_interleave(group, 0)[None]  # [1, Hq, P, D]
        sigma2 = (q * q) @ vl.transpose(-1, -2) * scale * scale  # [1, Hq, Q, P]
        scores[..., :prefix] += MODE["alpha"] * sigma2
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

AttentionInterface.register("kvb_bias", biased)
AttentionMaskInterface.register("kvb_bias", eager_mask)


def logits(ks, vs, var, alpha=0.0):
    MODE["var"], MODE["alpha"] = var, alpha
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k[None], v[None], layer)
    with torch.no_grad():
        return model(cont_ids, **cache_argument(model, cache)).logits[0].float()


model.set_attn_implementation("kvb_bias")
ref = logits([k[:, :prefix] for k in exact.k], [v[:, :prefix] for v in exact.v], None)
result = {"text": text, "prefix": prefix, "skip": skip, "spec": spec, "bpv": 8 * stored / (prefix * layers * 2 * heads * dim)}
ALPHAS = [float(a) for a in (sys.argv[7] if len(sys.argv) > 7 else "-0.5,0.5,1").split(",")]
for name, var, alpha in [("none", None, 0.0)] + [(f"page{a:+g}", page_var, a) for a in ALPHAS]:
    kl, agree, _, _ = _next_token_metrics(ref, logits(pre_k, pre_v, var, alpha), targets)
    result[name] = {"kl": kl, "top1": agree}
    print(name, f"KL {kl:.5f} top-1 {agree:.4f}", flush=True)
json.dump(result, open(out, "w"), indent=1)
