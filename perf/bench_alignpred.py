"""AlignPred against SZ3, zstd, FP8 and the INT2 codecs on real KV, one CPU core.

    .venv/bin/pip install -e '.[baselines]'   # SZ3 (pysz) and zstd, the baselines
    .venv/bin/python perf/bench_alignpred.py --json perf/results/bench_alignpred.json \
        --plot perf/results/bench_alignpred.png

Data: the keys (post-RoPE) and values of the shipped SmolLM2-135M on three shipped texts, first
``--tokens`` tokens, K and V measured separately. NRMSE is ||x - x^|| / ||x|| over the whole text.
Every codec's bpv comes from the bytes it stored. For each error multiplier m, AlignPred runs with
``error=mx`` (the budget per page group of 64 tokens across all layers) and SZ3 is given the largest
absolute error bound whose NRMSE stays within m x FP8's NRMSE on the same data (bisection), in two
data layouts: the same page groups ``[L, 64, H*D]`` and each layer's whole sequence ``[T, H*D]``
(SZ3's better layout here). Frozen AlignPred predictors are fitted on another text than the one coded.
Speeds are values per second of one core (threads pinned to 1), best of ``--repeat`` passes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, for every library, before any import
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvbackend import codecs  # noqa: E402
from kvbackend.alignpred import AlignPredCodec, Calibration, fp8_nrmse  # noqa: E402
from kvbackend.alignpred.stream import unpack  # noqa: E402
from kvbackend.tools.evaluate import capture_exact  # noqa: E402
from kvbackend.geometry import Geometry  # noqa: E402
from kvbackend.tools.models import load_model  # noqa: E402
from kvbackend.tools.reconstruct import reconstruct_sequence  # noqa: E402

TEXTS = {"legal": "/usr/share/common-licenses/GPL-3", "code": argparse.__file__,
         "technical": "/usr/share/doc/dpkg/spec/triggers.txt"}
MULTIPLIERS = (1, 2, 4, 8)
PAGE = 64


def nrmse(x: np.ndarray, y: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return math.sqrt(float(np.square(x64 - y).sum()) / float(np.square(x64).sum()))


def capture(model, tokenizer, path: str, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    with open(path, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, :tokens]
    cap = capture_exact(model, ids)
    k = torch.stack([x.transpose(0, 1) for x in cap.k]).float().numpy()  # [L, T, H, D]
    v = torch.stack([x.transpose(0, 1) for x in cap.v]).float().numpy()
    return k, v


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# -- AlignPred ------------------------------------------------------------------------------------
def alignpred_point(codec: AlignPredCodec, k: np.ndarray, v: np.ndarray) -> dict:
    """bpv and NRMSE per kind; a kind's bytes are its own arrays plus half the container overhead."""
    L, T = k.shape[:2]
    kh, vh = np.empty_like(k), np.empty_like(v)
    kind_bytes = {"k": 0, "v": 0}
    worst = {"k": 0.0, "v": 0.0}  # the largest group NRMSE as a fraction of that group's budget
    for start in range(0, T, PAGE):
        part = slice(start, start + PAGE)
        blob = codec.encode(k[:, part], v[:, part])
        for kd, report in zip("kv", codec.last_report):
            worst[kd] = max(worst[kd], report.nrmse / report.target)
        kh[:, part], vh[:, part] = codec.decode(blob)
        arrays = unpack(blob)
        own = {kd: sum(a.nbytes for n, a in arrays.items() if n.startswith(kd + ".")) for kd in "kv"}
        shared = len(blob) - own["k"] - own["v"]
        for kd in "kv":
            kind_bytes[kd] += own[kd] + shared / 2
    return {kd: {"bpv": 8 * kind_bytes[kd] / x.size, "nrmse": nrmse(x, xh), "worst_group_of_budget": worst[kd]}
            for kd, x, xh in (("k", k, kh), ("v", v, vh))}


def alignpred_speed(codec: AlignPredCodec, k: np.ndarray, v: np.ndarray, repeat: int) -> dict:
    groups = [(k[:, s : s + PAGE], v[:, s : s + PAGE]) for s in range(0, k.shape[1], PAGE)]
    blobs = [codec.encode(a, b) for a, b in groups]
    enc = best_time(lambda: [codec.encode(a, b) for a, b in groups], repeat)
    dec = best_time(lambda: [codec.decode(b) for b in blobs], repeat)
    values = 2 * k.size
    return {"encode_mvals_s": values / enc / 1e6, "decode_mvals_s": values / dec / 1e6}


# -- SZ3 ------------------------------------------------------------------------------------------
def sz_units(x: np.ndarray, layout: str) -> list[np.ndarray]:
    L, T, H, D = x.shape
    if layout == "layer":
        return [np.ascontiguousarray(x[layer].reshape(T, H * D)) for layer in range(L)]
    return [np.ascontiguousarray(x[:, s : s + PAGE].reshape(L, -1, H * D)) for s in range(0, T, PAGE)]


def sz_round_trip(units: list[np.ndarray], eb: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from pysz import sz, szConfig, szErrorBoundMode

    streams, outs = [], []
    for u in units:
        config = szConfig()
        config.errorBoundMode = szErrorBoundMode.ABS
        config.absErrorBound = eb
        stream, _ = sz.compress(u, config)
        streams.append(stream)
        outs.append(sz.decompress(stream, u.dtype, u.shape)[0])
    return streams, outs


def sz_point(units: list[np.ndarray], target: float) -> dict:
    """The largest absolute bound whose NRMSE is within ``target`` (bisection on a log scale)."""
    flat = np.concatenate([u.ravel() for u in units])
    rms = math.sqrt(float(np.square(flat.astype(np.float64)).mean()))
    lo, hi = 1e-4 * rms, 2.0 * rms
    best = None
    for _ in range(22):
        eb = math.sqrt(lo * hi)
        streams, outs = sz_round_trip(units, eb)
        err = nrmse(flat, np.concatenate([o.ravel() for o in outs]))
        if err <= target:
            lo, best = eb, (eb, streams, err)
        else:
            hi = eb
    eb, streams, err = best
    return {"bpv": 8 * sum(s.nbytes for s in streams) / flat.size, "nrmse": err, "abs_error_bound": eb}


def sz_speed(units: list[np.ndarray], eb: float, repeat: int) -> dict:
    from pysz import sz, szConfig, szErrorBoundMode

    def config():
        c = szConfig()
        c.errorBoundMode = szErrorBoundMode.ABS
        c.absErrorBound = eb
        return c

    streams = [sz.compress(u, config())[0] for u in units]
    enc = best_time(lambda: [sz.compress(u, config()) for u in units], repeat)
    dec = best_time(lambda: [sz.decompress(s, u.dtype, u.shape) for s, u in zip(streams, units)], repeat)
    values = sum(u.size for u in units)
    return {"encode_mvals_s": values / enc / 1e6, "decode_mvals_s": values / dec / 1e6}


# -- other baselines ------------------------------------------------------------------------------
def zstd_fp16(x: np.ndarray) -> dict:
    import zstandard

    half = x.astype(np.float16)
    stored = zstandard.ZstdCompressor(level=3).compress(half.tobytes())
    return {"bpv": 8 * len(stored) / x.size, "nrmse": nrmse(x, half.astype(np.float32))}


def packed_codec(spec: str, k: np.ndarray, v: np.ndarray) -> dict:
    """A GPU page codec over the same text (chunks of 2048 tokens), per layer; bpv over K and V."""
    codec = codecs.get(spec)
    L, T, H, D = k.shape
    geometry = Geometry(L, H, D, torch.float32)
    stored, kh, vh = 0, np.empty_like(k), np.empty_like(v)
    for layer in range(L):
        rec = reconstruct_sequence(codec, torch.from_numpy(k[layer]), torch.from_numpy(v[layer]), geometry, PAGE, 2048)
        stored += rec.stored_bytes
        kh[layer], vh[layer] = rec.k.float().numpy(), rec.v.float().numpy()
    bpv = 8 * stored / (2 * k.size)
    return {"k": {"bpv": bpv, "nrmse": nrmse(k, kh)}, "v": {"bpv": bpv, "nrmse": nrmse(v, vh)}}


def plot(path: str, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, kind in zip(axes, ("k", "v")):
        for text, r in results["texts"].items():
            for name, style in (("alignpred", "o-"), ("alignpred_frozen", "s--"), ("alignpred_frozen_lattice", "x:"),
                                ("sz3_layer", "^-"),
                                ("sz3_group", "v:")):
                pts = [r[name][str(m)][kind] for m in MULTIPLIERS]
                ax.plot([p["nrmse"] for p in pts], [p["bpv"] for p in pts], style, label=f"{name} ({text})",
                        alpha=0.8)
        r = results["texts"]["legal"]
        for name, marker in (("fp8", "*"), ("zstd_fp16", "X")):
            ax.plot(r[name][kind]["nrmse"], r[name][kind]["bpv"], marker, markersize=11, label=f"{name} (legal)")
        for spec, point in r["int2"].items():
            ax.plot(point[kind]["nrmse"], point[kind]["bpv"], "d", label=f"{spec} (legal)")
        ax.set_xscale("log")
        ax.set_xlabel("NRMSE (log)")
        ax.set_ylabel("bits per value (stored bytes)")
        ax.set_title("keys" if kind == "k" else "values")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle("AlignPred vs SZ3 on SmolLM2-135M KV: rate-distortion (multipliers 1, 2, 4, 8 of FP8's NRMSE)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default="perf/results/bench_alignpred.json")
    parser.add_argument("--plot", default="perf/results/bench_alignpred.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    model, tokenizer = load_model()
    kv = {name: capture(model, tokenizer, path, args.tokens) for name, path in TEXTS.items()}
    calibrated_on = {"legal": "code", "code": "technical", "technical": "legal"}
    results: dict = {"tokens": args.tokens, "page_tokens": PAGE, "multipliers": list(MULTIPLIERS), "texts": {}}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("texts x multipliers", total=len(kv) * len(MULTIPLIERS))
        for name, (k, v) in kv.items():
            calibration = Calibration.fit(*kv[calibrated_on[name]])
            r = {"fp8": {kd: {"bpv": 8.0, "nrmse": fp8_nrmse(x)} for kd, x in (("k", k), ("v", v))},
                 "zstd_fp16": {kd: zstd_fp16(x) for kd, x in (("k", k), ("v", v))},
                 "alignpred": {}, "alignpred_frozen": {}, "alignpred_frozen_lattice": {}, "sz3_layer": {},
                 "sz3_group": {},
                 "calibrated_on": calibrated_on[name]}
            for m in MULTIPLIERS:
                r["alignpred"][str(m)] = alignpred_point(AlignPredCodec(f"alignpred:error={m}x"), k, v)
                r["alignpred_frozen"][str(m)] = alignpred_point(
                    AlignPredCodec(f"alignpred:error={m}x,align=layers,fit=frozen", calibration), k, v)
                r["alignpred_frozen_lattice"][str(m)] = alignpred_point(  # the quantizer before the trellis
                    AlignPredCodec(f"alignpred:error={m}x,align=layers,fit=frozen,quant=lattice", calibration), k, v)
                for layout in ("layer", "group"):
                    r[f"sz3_{layout}"][str(m)] = {kd: sz_point(sz_units(x, layout), m * r["fp8"][kd]["nrmse"])
                                                  for kd, x in (("k", k), ("v", v))}
                progress.advance(task)
            r["int2"] = {spec: packed_codec(spec, k, v) for spec in ("kivi:bits=2,group=32", "rtn:bits=2,group=64",
                                                                      "qvg")}
            results["texts"][name] = r
    k, v = kv["legal"]
    speed = {"alignpred_1x": alignpred_speed(AlignPredCodec("alignpred:error=1x"), k, v, args.repeat),
             "alignpred_frozen_1x": alignpred_speed(AlignPredCodec(
                 "alignpred:error=1x,align=layers,fit=frozen", Calibration.fit(*kv["code"])), k, v, args.repeat),
             "alignpred_frozen_lattice_1x": alignpred_speed(AlignPredCodec(
                 "alignpred:error=1x,align=layers,fit=frozen,quant=lattice", Calibration.fit(*kv["code"])), k, v,
                 args.repeat)}
    for layout in ("layer", "group"):
        per_kind = [sz_speed(sz_units(x, layout), results["texts"]["legal"][f"sz3_{layout}"]["1"][kd]["abs_error_bound"],
                             args.repeat) for kd, x in (("k", k), ("v", v))]
        speed[f"sz3_{layout}_1x"] = {key: 2 / sum(1 / s[key] for s in per_kind) for key in per_kind[0]}
    results["speed_legal"] = speed
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    plot(args.plot, results)

    from rich.table import Table

    table = Table(title=f"bpv at m x FP8's NRMSE ({args.tokens} tokens, one core)")
    for col in ("text", "kind", "m", "alignpred", "frozen", "sz3 layer", "sz3 group", "vs best sz3"):
        table.add_column(col, justify="right")
    for name, r in results["texts"].items():
        for kd in "kv":
            for m in MULTIPLIERS:
                a, fz = r["alignpred"][str(m)][kd]["bpv"], r["alignpred_frozen"][str(m)][kd]["bpv"]
                sl, sg = r["sz3_layer"][str(m)][kd]["bpv"], r["sz3_group"][str(m)][kd]["bpv"]
                table.add_row(name, kd, str(m), f"{a:.3f}", f"{fz:.3f}", f"{sl:.3f}", f"{sg:.3f}",
                              f"{min(a, fz) / min(sl, sg) - 1:+.1%}")
    console.print(table)
    for name, r in results["texts"].items():  # K and V together, at FP8-level error (the persistent format's target)
        for label in ("alignpred", "alignpred_frozen", "alignpred_frozen_lattice"):
            point = r[label]["1"]
            console.print(f"{name} {label} 1x: {(point['k']['bpv'] + point['v']['bpv']) / 2:.3f} bpv (K+V), worst "
                          f"group at {max(point['k']['worst_group_of_budget'], point['v']['worst_group_of_budget']):.4f} "
                          "of its budget")
    for key, s in speed.items():
        console.print(f"{key}: encode {s['encode_mvals_s']:.1f} M values/s, decode {s['decode_mvals_s']:.1f} M values/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
