"""What do kernel-friendly constraints on a `chw:` plan cost in KL? Widths restricted to a set a kernel unpacks as
uniform runs ({0,1,2,3,4,8}, {0,2,3,4,8}) and both channels of each RoPE pair at one width, measured through the paged
cache as `kvbackend eval` measures `klt:...,axes=channels,paged=true`, beside the unconstrained plan.

    .venv/bin/python -P perf/experiments/chw_width_sets.py TEXT CALIB_TEXT SPEC... [--lagrangian] > OUT.json
"""

import dataclasses
import json
import math
import sys

import torch

import kvbackend.klt as klt
from kvbackend.tools.evaluate import EvalSettings, evaluate, key_bases_from_text
from kvbackend.tools.models import load_model

FREE = klt.widths


def _fitted(lam, kbits, tokens, group, choose, lo, hi, steps):
    """Widths ``choose(flat, x)`` of the bisected ``x`` in [lo, hi] whose codes and scales (one fp16 per coded channel
    and group) meet ``kbits`` bits per value; a larger ``x`` spends fewer bits."""
    groups = math.ceil(tokens / group)
    flat = lam.double().flatten()

    def spent(x):
        b = choose(flat, x)
        return (float(b.sum()) * tokens + float((b > 0).sum()) * groups * 16) / (flat.numel() * tokens), b

    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if spent(mid)[0] > kbits:
            lo = mid
        else:
            hi = mid
    return spent(hi)[1].to(torch.uint8).reshape(lam.shape)


def restricted(allowed: tuple[int, ...]):
    """`kvbackend.klt.widths` with each width rounded to the nearest of ``allowed`` (the rate 0.5 log2(lam / level))."""
    table = torch.tensor(allowed, dtype=torch.float64)

    def nearest(flat, level):
        rate = (0.5 * torch.log2(flat / level)).clamp(0, klt.MAX_WIDTH)
        return table[(rate[:, None] - table[None, :]).abs().argmin(1)]

    def widths(lam, kbits, tokens, group=klt.GROUP):
        return _fitted(lam, kbits, tokens, group, nearest, float(lam.min()) * 1e-6,
                       float(lam.max()) * 4.0 ** klt.MAX_WIDTH, 100)

    return widths


def lagrangian(allowed: tuple[int, ...]):
    """`kvbackend.klt.widths` over a set by a Lagrangian choice: each channel takes the width b of ``allowed`` that
    minimises lam * 4**-b + mult * (b + 16 / group * [b > 0]) (its high-rate distortion plus the bits of its codes
    and scale), ``mult`` bisected to the budget: the lower convex hull a greedy marginal-return allocation walks."""
    table = torch.tensor(allowed, dtype=torch.float64)

    def widths(lam, kbits, tokens, group=klt.GROUP):
        cost = table + (table > 0).double() * 16 * math.ceil(tokens / group) / tokens  # bits per value of each width

        def cheapest(flat, mult):
            return table[(flat[:, None] * 4.0 ** -table[None, :] + mult * cost[None, :]).argmin(1)]

        return _fitted(lam, kbits, tokens, group, cheapest, float(lam.min()) * 1e-12, float(lam.max()) * 10.0, 200)

    return widths


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
    variants = [("0-8", None, False, None), ("0,1,2,3,4,8 pairs", (0, 1, 2, 3, 4, 8), True, restricted),
                ("0,2,3,4,8 pairs", (0, 2, 3, 4, 8), True, restricted), ("0,2,4,8 pairs", (0, 2, 4, 8), True, restricted)]
    if "--lagrangian" in sys.argv:  # the same sets (and 0-8) by the Lagrangian choice
        variants = [(f"lagrangian {name}", allowed, pairs, lagrangian) for name, allowed, pairs in (
            ("0-8", tuple(range(9)), False), ("0-8 pairs", tuple(range(9)), True),
            ("0,1,2,4,8 pairs", (0, 1, 2, 4, 8), True), ("0,2,4,8 pairs", (0, 2, 4, 8), True))]
    for name, allowed, pairs, rule in variants:
        klt.widths = FREE if allowed is None else rule(allowed)
        try:
            rows = evaluate(model, ids, specs, settings, key_bases=paired(bases) if pairs else bases)
        finally:
            klt.widths = FREE
        for r in rows:
            kw = [int(c) for p in r.plan for c in p.split("kw=")[1].split(",")[0]]
            out["rows"].append({"widths": name, "spec": r.spec, "bpv": r.bpv, "kl": r.kl, "top1": r.top1_agree,
                                "used": sorted(set(kw))})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--lagrangian"]
    main(args[0], args[1], args[2:])
