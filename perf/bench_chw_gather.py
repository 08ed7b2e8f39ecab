"""The ``chw:`` gather kernel at Llama-8B geometry (Hq 32, Hkv 8, D 128, 64-token pages, B=8, L=32K) beside the
copy ceiling, rtn-2's gather (the generic kernel) and BF16 SDPA, in one run on the GPU.

Checks first (each layout's gathered K/V against the codec's torch decode on the device, the levers' frames
included; the fused decode against float32 attention over the gathered rows), then times: the gather alone (GB/s
of compressed read plus BF16 write, and its share of the copy ceiling), the gather then SDPA on what it wrote, the
fused decode (`kvbackend.kernels.chw_decode`, what `ChwBackend` runs), and SDPA over BF16 K/V of the same length.
Writes one JSON.

    PYTHONPATH=. python perf/bench_chw_gather.py OUT.json
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_kernels import (CHUNK_PAGES, DEV, bench, ceiling, chunks_per_req, encoded_pages,  # noqa: E402
                           rotation_plans, sdpa_time, RESULTS)
from kvbackend import Geometry, codecs  # noqa: E402
from kvbackend.attention import decode_attention  # noqa: E402
from kvbackend.codecs.base import CodecState  # noqa: E402
from kvbackend.frames import lever_layout  # noqa: E402
from kvbackend.kernels.chw_decode import chw_decode  # noqa: E402
from kvbackend.kernels.chw_gather import chw_gather, layer_schemes  # noqa: E402
from kvbackend.kernels.gather_dequant import gather_dequant  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.scheme import kernel_schemes  # noqa: E402

HQ, HEADS, DIM, PAGE, BATCH, LENGTH = 32, 8, 128, 64, 8, 32768


def mixed_widths(seed: int = 0) -> str:
    """Widths 0-8 spread as a 2.6-bit klt plan spreads them (mostly 2-3, some 0, 1, 4 and 6), 2.66 bits a key."""
    rng = random.Random(seed)
    choices = [0, 1, 2, 2, 2, 3, 3, 3, 4, 6, 3, 3, 4, 2]
    return "".join(str(rng.choice(choices)) for _ in range(HEADS * DIM))


def chw_pages(spec: str):
    """(codec, layout, pages [B*L/P, bytes], codebooks, plan) of a batch of one chunk's pages repeated."""
    codec = codecs.get(spec)
    layout = lever_layout(codec.layout(Geometry(1, HEADS, DIM, torch.bfloat16), PAGE), codec.levers)
    gen = torch.Generator(device=DEV).manual_seed(0)
    k = torch.randn(4096, HEADS, DIM, device=DEV, generator=gen).bfloat16()
    v = torch.randn(4096, HEADS, DIM, device=DEV, generator=gen).bfloat16()
    chunk = codec.encode(k, v, layout, CodecState())
    per_req = LENGTH // PAGE
    pages = chunk.pages.repeat(-(-BATCH * per_req // chunk.pages.shape[0]), 1)[: BATCH * per_req].contiguous()
    books, (plan,) = rotation_plans(BATCH, per_req, PAGE, 1, chunk.codebook, dense_tokens=0)
    return codec, layout, pages, books, plan, chunk


def main(path: str) -> None:
    ceiling()  # (a section of bench_kernels: its figure lands in RESULTS)
    copy = RESULTS["sections"]["ceiling"]["copy_GBps"]
    rotary = Rotary.default(DIM, 500000.0)
    dense = torch.zeros(1, 2, PAGE, HEADS, DIM, device=DEV).bfloat16()
    q = torch.randn(BATCH, HQ, DIM, device=DEV).bfloat16()
    sdpa_us = 1e3 * sdpa_time(BATCH, HQ, HEADS, LENGTH, DIM, 1)
    result = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "sdpa_bf16_us": sdpa_us, "rows": []}
    kw = mixed_widths()
    specs = [f"chw:kw={kw},vbits=2,vstep=1.15", f"chw:kw={kw},vbits=2,vstep=1.15,sink=4,prerope=true,vrot=hadamard",
             "chw:kbits=2,vbits=2"]
    for spec in specs:
        codec, layout, pages, books, plan, chunk = chw_pages(spec)
        scheme, levers = layer_schemes(codec, layout)
        args = (pages, books, dense, scheme, plan)
        kwargs = dict(levers=levers, rotary=rotary)
        k, v = chw_gather(*args, **kwargs)
        # check: the first request's first chunk (64 pages, its own slot) against the codec's torch decode, in the
        # stored frame (levers off: the frames' own tests cover them) where the layout has none
        rk, rv = codec.decode_pages(layout, chunk.pages, chunk.codebook)
        plain = chw_gather(*args, levers=None, rotary=rotary) if levers.active else (k, v)
        n = rk.shape[0]
        err_k = float((plain[0][:n].float() - rk.float()).abs().max() / rk.float().abs().max())
        err_v_raw = float((plain[1][:n].float() - rv.float()).abs().max() / rv.float().abs().max())
        moved = pages.numel() + books.numel() + 2 * k.numel() * 2

        def gathered_sdpa():
            kk, vv = chw_gather(*args, **kwargs)
            kk = kk.view(BATCH, LENGTH, HEADS, DIM).transpose(1, 2)
            vv = vv.view(BATCH, LENGTH, HEADS, DIM).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True)

        # the fused decode against float32 attention over the gathered rows (the first two requests)
        two = plan.cu_seqlens[2].item()
        out, lse = chw_decode(q, pages, books, dense, scheme, plan, **kwargs)
        want, want_lse = decode_attention(q[:2], [k[:LENGTH], k[LENGTH:two]], [v[:LENGTH], v[LENGTH:two]])
        err_decode = float((out[:2].float() - want).norm() / want.norm())
        err_lse = float((lse[:2] - want_lse).abs().max())
        try:
            tiled = chw_decode(q, pages, books, dense, scheme, plan, tile=True, **kwargs)
            tiled_same = {"decode_rel_diff": float((tiled[0].float() - out.float()).norm() / out.float().norm()),
                          "gather_equal": bool(torch.equal(chw_gather(*args, tile=True, **kwargs)[0], k))}
        except Exception as exc:  # (a Triton without tl.gather): recorded, the direct variant still runs
            tiled_same = f"{type(exc).__name__}: {exc}"[:300]
        both_ms = bench(gathered_sdpa)
        bpv = (layout.page_bytes * 64 + layout.codebook_bytes) * 8 / (4096 * HEADS * DIM * 2)
        row = {"spec": spec.replace(kw, "<mixed 2.66-bit widths>"), "bpv": bpv, "max_rel_err_k": err_k,
               "max_rel_err_v_stored_frame": err_v_raw, "decode_rel_err": err_decode, "decode_lse_err": err_lse,
               "tile_against_direct": tiled_same, "gather_plus_sdpa_us": both_ms * 1e3, "sdpa_bf16_us": sdpa_us,
               "speedup_gather_sdpa_vs_sdpa": sdpa_us / (both_ms * 1e3)}
        for tile in (False, True) if isinstance(tiled_same, dict) else (False,):
            name = "tile" if tile else "direct"
            gather_ms = bench(lambda: chw_gather(*args, tile=tile, **kwargs))
            decode_ms = bench(lambda: chw_decode(q, pages, books, dense, scheme, plan, tile=tile, **kwargs))
            row.update({f"gather_{name}_us": gather_ms * 1e3, f"gather_{name}_GBps": moved / gather_ms / 1e6,
                        f"gather_{name}_pct_of_copy": moved / gather_ms / 1e6 / copy * 100,
                        f"decode_{name}_us": decode_ms * 1e3, f"speedup_decode_{name}_vs_sdpa": sdpa_us / (decode_ms * 1e3),
                        f"decode_{name}_GBps_compressed": (pages.numel() + books.numel()) / decode_ms / 1e6})
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    # the generic gather of rtn-2 (Triton and the CUDA kernel `auto` picks), same batch
    codec, layout, chunk = encoded_pages("rtn:bits=2,group=32", HEADS, DIM, PAGE)
    per_req = LENGTH // PAGE
    pages = chunk.pages.repeat(-(-BATCH * per_req // chunk.pages.shape[0]), 1)[: BATCH * per_req].contiguous()
    books, (plan,) = rotation_plans(BATCH, per_req, PAGE, 1, chunk.codebook, dense_tokens=0)
    schemes = kernel_schemes(codec, layout)
    moved = pages.numel() + BATCH * chunks_per_req(per_req, CHUNK_PAGES) * layout.codebook_bytes \
        + 2 * BATCH * LENGTH * HEADS * DIM * 2
    for backend in ("triton", "auto"):
        ms = bench(lambda: gather_dequant(pages, books, dense, schemes, plan, backend=backend))
        row = {"spec": f"rtn:bits=2,group=32 ({backend})", "gather_us": ms * 1e3, "gather_GBps": moved / ms / 1e6,
               "gather_pct_of_copy": moved / ms / 1e6 / copy * 100}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    result["errors"] = RESULTS["errors"]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
