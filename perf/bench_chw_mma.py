"""The tensor-core decode over ``chw:...,order=lane`` pages (keys at a width per channel, after RoPE) beside BF16 SDPA,
KIVI-2 through the same kernel family (`paged_decode`, its CUDA kernel) and the chw Triton kernel, at Llama-8B
geometry (Hq 32, Hkv 8, D 128, 64-token pages), every side replayed from CUDA graphs, inputs rotated past L2.

Checks first (each chw layout's decode through the kernel against float32 attention over the Triton gather's keys
and values, the first two requests), then times. Writes one JSON.

    PYTHONPATH=. python perf/bench_chw_mma.py OUT.json [B,L ...]
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_chw_gather import mixed_widths  # noqa: E402
from bench_kernels import (DEV, L2_BYTES, ceiling, encoded_pages, graph_time, rotation_plans,  # noqa: E402
                           sdpa_time, RESULTS)
from kvbackend import Geometry, codecs  # noqa: E402
from kvbackend.klt import word_widths  # noqa: E402
from kvbackend.attention import decode_attention  # noqa: E402
from kvbackend.codecs.base import CodecState  # noqa: E402
from kvbackend.frames import lever_layout  # noqa: E402
from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.kernels.chw_decode import chw_decode  # noqa: E402
from kvbackend.kernels.chw_gather import chw_gather, layer_schemes  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.scheme import kernel_schemes  # noqa: E402

HQ, HEADS, DIM, PAGE = 32, 8, 128, 64
WORDS = "chw mixed, rows of whole words"  # the mixed widths moved to whole 32-bit rows (`word_widths`)

S59 = {"fold": False, "subn": False}  # session 59's key loop: every variant below states its switches against it

VARIANTS = [  # (label, chw_decode keywords): timed on the first layout at B=8, L=32K beside the default ("mma")
    ("mma_s59", {"mma": True, "mma_options": S59}),
    ("mma_shared_fold", {"mma": True, "mma_options": {**S59, "fold": True}}),
    ("mma_qsmem", {"mma": True, "mma_options": {**S59, "qsmem": True}}),
    ("mma_swap", {"mma": True, "mma_options": {**S59, "swap": True}}),
    ("mma_3ctas", {"mma": True, "mma_options": {**S59, "min_blocks": 3}}),
    ("mma_qsmem_3ctas", {"mma": True, "mma_options": {**S59, "qsmem": True, "min_blocks": 3}}),
    ("mma_all_3ctas", {"mma": True, "mma_options": {**S59, "qsmem": True, "fold": True, "swap": True,
                                                    "min_blocks": 3}}),
    ("mma_subn", {"mma": True, "mma_options": {**S59, "subn": True}}),
    ("mma_subn_fold", {"mma": True, "mma_options": {"subn": True, "fold": True}}),
    ("mma_subn_fold_pref", {"mma": True, "mma_options": {"subn": True, "fold": True, "pref": True}}),
    ("mma_subn_fold_qsmem_3ctas", {"mma": True, "mma_options": {"subn": True, "fold": True, "qsmem": True,
                                                                "min_blocks": 3}}),
    ("mma_subn_fold_vsubn", {"mma": True, "mma_options": {"subn": True, "fold": True, "vsubn": True}}),
    ("mma_subn_fold_vsubn_qsmem_3ctas", {"mma": True, "mma_options": {"subn": True, "fold": True, "vsubn": True,
                                                                      "qsmem": True, "min_blocks": 3}}),
    ("mma_tab", {"mma": True, "mma_options": {"tab": True}}),  # the default with a tile's shifts from the table
    ("mma_tab_vsubn", {"mma": True, "mma_options": {"tab": True, "vsubn": True}}),
    ("triton_tile", {"mma": False, "tile": True}),
    # timing probes, wrong scores on purpose (shared-memory bank conflicts of the key loop's loads): the key rows read
    # are token 5 r mod 64 (1.47-way conflicts on the mixed layout instead of 2.42), or token 0 for every row (none)
    ("probe_rows_5r", {"mma": True, "mma_options": {"probe": 1}}),
    ("probe_row_0", {"mma": True, "mma_options": {"probe": 2}}),
]
WORD_VARIANTS = [  # timed on the whole-word layout (each head's row moved to whole 32-bit words) beside its default
    ("mma_w32", {"mma": True, "mma_options": {"w32": True}}),
    ("mma_w32_tab", {"mma": True, "mma_options": {"w32": True, "tab": True}}),
]
if os.environ.get("CHW_VARIANTS"):  # a comma list of the labels to time
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["CHW_VARIANTS"].split(",")]
    WORD_VARIANTS = [v for v in WORD_VARIANTS if v[0] in os.environ["CHW_VARIANTS"].split(",")]
os.environ["KVBACKEND_MMA_TIMING_PROBES"] = "1"  # this process only: the probes above


def whole_words(kw: str) -> str:
    """``kw`` with each head's row moved to whole 32-bit words (`kvbackend.klt.word_widths`, equal variances)."""
    w = torch.tensor([int(c) for c in kw]).reshape(HEADS, -1)
    return "".join(str(int(x)) for x in word_widths(torch.ones(w.shape), w).flatten())


def encoded(spec: str):
    codec = codecs.get(spec)
    layout = lever_layout(codec.layout(Geometry(1, HEADS, DIM, torch.bfloat16), PAGE), codec.levers)
    gen = torch.Generator(device=DEV).manual_seed(0)
    k = (torch.randn(4096, HEADS, DIM, device=DEV, generator=gen)
         + torch.randn(1, HEADS, DIM, device=DEV, generator=gen)).bfloat16()
    v = torch.randn(4096, HEADS, DIM, device=DEV, generator=gen).bfloat16()
    return codec, layout, codec.encode(k, v, layout, CodecState())


def batch_of(chunk, layout, batch: int, length: int):
    """(pages, books, plans, dense, queries, rotations): ``rotations`` copies of the batch past L2, each request
    ``length // PAGE - 1`` packed pages and one dense page."""
    packed = length // PAGE - 1
    per_rot = batch * packed * layout.page_bytes
    rotations = max(1, min(4, math.ceil(4 * L2_BYTES / per_rot)))
    total = rotations * batch * packed
    pages = chunk.pages.repeat(-(-total // chunk.pages.shape[0]), 1)[:total].contiguous()
    books, plans = rotation_plans(batch, packed, PAGE, rotations, chunk.codebook)
    dense = torch.randn(rotations * batch, 2, PAGE, HEADS, DIM, device=DEV).bfloat16()
    qs = [torch.randn(batch, HQ, DIM, device=DEV).bfloat16() for _ in range(rotations)]
    return pages, books, plans, dense, qs, rotations


def precompile(built, kivi) -> None:
    """Every variant the bench times compiled at once on the host's cores (nvcc runs one variant a core; the disk
    cache then serves the timed calls)."""
    major, minor = torch.cuda.get_device_capability()
    configs = set()
    for i, (name, (codec, layout, _)) in enumerate(built.items()):
        scheme, levers = layer_schemes(codec, layout)
        lv = levers if levers is not None and levers.active else None
        extra = VARIANTS if i == 0 else WORD_VARIANTS if name == WORDS else []
        for opts in [{}] + [dict(o.get("mma_options", {})) for _, o in extra if o.get("mma")]:
            configs.add(mma_decode.chw_config(scheme, DIM, torch.bfloat16, torch.bfloat16, lv, **opts))
    codec, layout, _ = kivi
    k, v = kernel_schemes(codec, layout)[:2]
    for vsubn in (False, True):
        mma_decode.V_SUBN = vsubn
        mma_decode.config_for.cache_clear()
        configs.add(mma_decode.config_for(k, v, PAGE, DIM, torch.bfloat16, torch.bfloat16))
    mma_decode.V_SUBN = False
    mma_decode.config_for.cache_clear()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(lambda c: mma_decode.compile_cubin(c, f"sm_{major}{minor}"), configs))
    print(f"compiled {len(configs)} variants", flush=True)


def main(path: str, shapes: list[tuple[int, int]]) -> None:
    ceiling()
    copy = RESULTS["sections"]["ceiling"]["copy_GBps"]
    result = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "rows": []}
    kw = mixed_widths()
    chw_specs = {"chw mixed 2.66-bit widths": f"chw:kw={kw},vbits=2,vstep=1.15,order=lane",
                 "chw mixed, sinks + rotated values": f"chw:kw={kw},vbits=2,vstep=1.15,order=lane,sink=4,vrot=hadamard",
                 "chw every width 2": "chw:kbits=2,vbits=2,order=lane",
                 WORDS: f"chw:kw={whole_words(kw)},vbits=2,vstep=1.15,order=lane"}
    built = {name: encoded(spec) for name, spec in chw_specs.items()}
    kivi = encoded_pages("kivi:bits=2,group=64", HEADS, DIM, PAGE)
    try:
        precompile(built, kivi)
    except Exception as exc:  # the timed calls compile what is missing
        print(f"precompile: {type(exc).__name__}: {exc}"[:300], flush=True)
    if path == "--precompile":
        return
    for batch, length in shapes:
        sdpa_us = 1e3 * sdpa_time(batch, HQ, HEADS, length, DIM, 2 if length * batch <= 262144 else 1, graphs=True)
        print(f"B={batch} L={length}: SDPA BF16 {sdpa_us:.1f} us", flush=True)
        for name, (codec, layout, chunk) in built.items():
            scheme, levers = layer_schemes(codec, layout)
            pages, books, plans, dense, qs, rot = batch_of(chunk, layout, batch, length)
            row = {"layout": name, "B": batch, "L": length, "sdpa_bf16_us": sdpa_us,
                   "bpv": (layout.page_bytes * 64 + layout.codebook_bytes) * 8 / (4096 * HEADS * DIM * 2)}
            # check: the kernel against float32 attention over the Triton gather's rows (first two requests)
            k, v = chw_gather(pages, books, dense, scheme, plans[0], levers=levers)
            cut = plans[0].cu_seqlens.tolist()[:3]
            n = len(cut) - 1  # the first two requests (one where the batch has one)
            want, want_lse = decode_attention(qs[0][:n], [k[a:b] for a, b in zip(cut, cut[1:])],
                                              [v[a:b] for a, b in zip(cut, cut[1:])])
            out, lse = chw_decode(qs[0], pages, books, dense, scheme, plans[0], levers=levers, mma=True)
            row["mma_rel_err"] = float((out[:n].float() - want).norm() / want.norm())
            row["mma_lse_err"] = float((lse[:n] - want_lse).abs().max())
            variants = [("mma", {"mma": True})]
            if batch == 8 and length == 32768 and name == next(iter(built)):  # the variants: one layout, one shape
                variants += VARIANTS
            if batch == 8 and length == 32768 and name == WORDS:
                variants += WORD_VARIANTS
            for label, kwargs in variants:
                try:
                    us = 1e3 * graph_time([lambda j=j: chw_decode(qs[j], pages, books, dense, scheme, plans[j],
                                                                  levers=levers, **kwargs) for j in range(rot)])
                    row[f"{label}_us"] = us
                    row[f"{label}_speedup_vs_sdpa"] = sdpa_us / us
                    row[f"{label}_pct_of_copy"] = (batch * (length // PAGE - 1) * layout.page_bytes) / us / 1e3 / copy * 100
                    print(f"  {name} {label}: {us:.1f} us ({sdpa_us / us:.2f}x SDPA)", flush=True)
                except Exception as exc:
                    row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        codec, layout, chunk = kivi
        schemes = kernel_schemes(codec, layout)
        pages, books, plans, dense, qs, rot = batch_of(chunk, layout, batch, length)
        for vsubn in (False, True):  # the value codes as the default reads them, then as fp16 subnormals (`V_SUBN`)
            mma_decode.V_SUBN = vsubn
            mma_decode.config_for.cache_clear()
            best = None
            for tp in (264, 528, 2112):
                try:
                    us = 1e3 * graph_time([lambda j=j: paged_decode(qs[j], pages, books, dense, schemes, plans[j],
                                                                    mma=True, target_programs=tp) for j in range(rot)])
                except Exception as exc:
                    print(f"kivi-2 {tp}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                best = us if best is None else min(best, us)
            row = {"layout": "kivi:bits=2,group=64 (paged_decode, CUDA kernel, best of 3 split targets)"
                             + (", value codes as subnormals" if vsubn else ""), "B": batch,
                   "L": length, "sdpa_bf16_us": sdpa_us, "mma_us": best,
                   "mma_speedup_vs_sdpa": sdpa_us / best if best else None}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        mma_decode.V_SUBN = False
        mma_decode.config_for.cache_clear()
    result["errors"] = RESULTS["errors"]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[2:]] or [(8, 32768)]
    main(sys.argv[1], shapes)
