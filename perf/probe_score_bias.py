"""Does the "quantized keys steal attention" correction help?

    .venv/bin/python perf/probe_score_bias.py SPEC TEXT

Key noise adds variance to each score, and E[exp(s + n)] = exp(s + var/2), so noisy keys gain weight
over exact ones. The correction subtracts var/2 from each quantized key's score, with var = sum_c
q_c^2 sigma_{t,c}^2 / d. Here sigma^2 is the key error's mean square per (64-token group, channel):
the actual error averaged over the group, an upper bound on what stored steps could predict. Prints
attention output error and top-1 shift (last 128 queries of 2048 tokens, every layer and head) with
and without the correction.
"""
import math
import sys

import torch

from kvbackend import codecs
from kvbackend.evaluate import capture_exact
from kvbackend.geometry import Geometry
from kvbackend.models import load_model
from kvbackend.reconstruct import reconstruct_sequence

spec = sys.argv[1]
text = open(sys.argv[2], encoding="utf-8").read()
model, tok = load_model()
ids = tok(text, return_tensors="pt").input_ids[:, :2048]
exact = capture_exact(model, ids)
cfg = model.config
geometry = Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, torch.float32)
codec = codecs.get(spec)
Q = 128
tot = {"base": [0.0, 0.0, 0], "bias": [0.0, 0.0, 0]}
for layer in range(geometry.num_layers):
    q, k, v = exact.q[layer], exact.k[layer], exact.v[layer]  # [Hq,T,D], [H,T,D]
    hq, t, d = q.shape
    rec = reconstruct_sequence(codec, k.transpose(0, 1), v.transpose(0, 1), geometry, 64, 2048, None, q)
    kh, vh = rec.k.transpose(0, 1).float(), rec.v.transpose(0, 1).float()
    err2 = (k.float() - kh) ** 2  # [H, T, D]
    # expected error power per (64-token group, channel): what per-group steps predict
    g = err2.reshape(err2.shape[0], t // 64, 64, d).mean(2, keepdim=True).expand(-1, -1, 64, -1).reshape_as(err2)
    group = hq // k.shape[0]
    qs = q[:, t - Q:].float()
    pos = torch.arange(t - Q, t)
    mask = torch.arange(t)[None, :] > pos[:, None]
    def attend(keys, values, bias=None):
        keys = keys.float().repeat_interleave(group, 0)
        s = qs @ keys.transpose(1, 2) / math.sqrt(d)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(mask, float("-inf"))
        return s.softmax(-1) @ values.float().repeat_interleave(group, 0), s.argmax(-1)
    out, top = attend(k, v)
    var = (qs ** 2) @ g.repeat_interleave(group, 0).transpose(1, 2) / d  # [Hq, Q, T] score noise variance
    for name, bias in (("base", None), ("bias", -0.5 * var)):
        o, tp = attend(kh, vh, bias)
        tot[name][0] += float(((out - o) ** 2).sum()); tot[name][1] += float((out ** 2).sum()); tot[name][2] += int((tp != top).sum())
for name, (e, n, sh) in tot.items():
    print(name, "attn_out_err", round(math.sqrt(e / n), 4), "top1_shift", round(sh / (geometry.num_layers * exact.q[0].shape[0] * Q), 4))
