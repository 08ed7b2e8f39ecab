"""Ideal coding cost of AlignPred's residuals (error=1x, 64-token page groups) under its class split, as whole values,
and with context-conditioned tables (the previous token's residual in the same channel; the token's mean residual
over the layer's channels). An estimate for the stream, not a codec.

    .venv/bin/python perf/experiments/alignpred_context_entropy.py TEXT TOKENS
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_alignpred import capture  # noqa: E402

import kvbackend.alignpred.codec as C  # noqa: E402
from kvbackend.alignpred import AlignPredCodec  # noqa: E402
from kvbackend.alignpred.entropy import class_of, low_bits  # noqa: E402
from kvbackend.tools.models import load_model  # noqa: E402

model, tok = load_model()
k, v = capture(model, tok, sys.argv[1], int(sys.argv[2]))
caught = []
orig = C._tokenwise
def wrapped(m, predict):
    r, mu = orig(m, predict)
    caught.append(r.copy())
    return r, mu
C._tokenwise = wrapped
codec = AlignPredCodec("alignpred:error=1x")
L, T, H, D = k.shape
total_bytes = 0
for t0 in range(0, T - 63, 64):
    blob = codec.encode(k[:, t0:t0+64], v[:, t0:t0+64])
    total_bytes += len(blob)
nvals = 2 * L * (T // 64 * 64) * H * D
print(f"actual {8*total_bytes/nvals:.4f} bpv over {nvals} values, {len(caught)} residual blocks")

def H_of(x):
    if x.size == 0: return 0.0
    _, c = np.unique(x, return_counts=True)
    p = c / c.sum()
    return float(-(c * np.log2(p)).sum())

bits = {"split": 0.0, "whole": 0.0, "split_ctx_prev": 0.0, "whole_ctx_prev": 0.0, "split_ctx_tok": 0.0, "whole_ctx_tok": 0.0}
n_all = 0
for r in caught:
    L_, T_, H_, D_ = r.shape
    rows = r.reshape(L_, T_, H_ * D_).transpose(0, 2, 1)  # [L, C, T]
    cmap = class_of(rows.std(-1)).astype(np.int32)
    # contexts: |previous token's residual| in the same channel (class-relative), and token energy
    prev = np.zeros_like(rows); prev[:, :, 1:] = np.abs(rows[:, :, :-1])
    tokE = np.abs(rows).mean(1, keepdims=True) * np.ones_like(rows)  # mean |r| of the token over the layer's channels
    for c in np.unique(cmap):
        sel = cmap == c
        vals = rows[sel]  # [n, T]
        kk = low_bits(int(c))
        hi = vals >> kk
        n = vals.size; n_all += n
        bits["split"] += H_of(hi.ravel()) + kk * n
        bits["whole"] += H_of(vals.ravel())
        spread = 2.0 ** (c / 2.0)
        for name, ctx in (("prev", prev[sel]), ("tok", tokE[sel])):
            q = np.clip(np.floor(np.log2(ctx / spread + 1e-3) * 2) , -4, 4).astype(int).ravel()
            sh = sw = 0.0
            for b in np.unique(q):
                m = q == b
                sh += H_of(hi.ravel()[m]) + kk * m.sum()
                sw += H_of(vals.ravel()[m])
            bits["split_ctx_" + name] += sh
            bits["whole_ctx_" + name] += sw
for key, b in bits.items():
    print(f"{key:16s} {b / nvals:.4f} bpv (residual part, ideal)")
