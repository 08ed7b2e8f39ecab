"""bpv of AlignPred's frozen cross-layer predictor at reduced rank (reduced-rank regression), one text pair.

    .venv/bin/python perf/experiments/alignpred_lowrank.py [--ranks 0,4,8,16,32,192]

Rank 0 stands for no cross-layer prediction (plain per-group means). Each reduced map is W P_r, P_r the projector onto
the top-r right singular vectors of the calibration's fitted values A W, used as a full map by today's codec: the bytes
a factored decoder would store and read, at the cost of r instead of C multiply-adds per value and rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
import argparse, json, sys, time  # noqa: E401,E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_alignpred import TEXTS, alignpred_point, capture  # noqa: E402

from kvbackend.alignpred import AlignPredCodec, Calibration  # noqa: E402
from kvbackend.tools.models import load_model  # noqa: E402


def reduced(cal_k, cal_v, full: Calibration, rank: int) -> Calibration:
    maps = {}
    for kind, x in (("k", cal_k), ("v", cal_v)):
        x = np.asarray(x, np.float64)
        L, T = x.shape[:2]
        c = (x - x.mean(1, keepdims=True)).reshape(L, T, -1)
        out = []
        for layer in range(1, L):
            w = full.maps[kind][layer - 1].astype(np.float64)
            fitted = c[layer - 1] @ w
            _, _, vt = np.linalg.svd(fitted, full_matrices=False)
            p = vt[:rank].T @ vt[:rank]
            out.append((w @ p).astype(np.float32))
        maps[kind] = np.stack(out)
    return Calibration(maps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="0,8,16,32,192")
    ap.add_argument("--texts", default="legal,code")
    ap.add_argument("--tokens", type=int, default=1536)
    args = ap.parse_args()
    model, tok = load_model()
    kv = {n: capture(model, tok, p, args.tokens) for n, p in TEXTS.items()}
    other = {"legal": "code", "code": "technical", "technical": "legal"}
    rows = []
    for name in args.texts.split(","):
        k, v = kv[name]
        ck, cv = kv[other[name]]
        full = Calibration.fit(ck, cv)
        for r in (int(s) for s in args.ranks.split(",")):
            t = time.perf_counter()
            if r == 0:
                codec = AlignPredCodec("alignpred:error=1x")
            else:
                codec = AlignPredCodec("alignpred:error=1x,align=layers,fit=frozen", reduced(ck, cv, full, r))
            p = alignpred_point(codec, k, v)
            bpv = (p["k"]["bpv"] + p["v"]["bpv"]) / 2
            rows.append({"text": name, "rank": r, "bpv": bpv, "k": p["k"]["bpv"], "v": p["v"]["bpv"]})
            print(f"{name:10s} rank {r:4d}: bpv {bpv:.3f} (K {p['k']['bpv']:.3f}, V {p['v']['bpv']:.3f}) "
                  f"[{time.perf_counter() - t:.0f} s]", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
