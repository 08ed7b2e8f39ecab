"""chw: layers (klt's page form) in a CUDA paged cache, served by the torch reference: its decode attention against
float32 attention over the cache's own reads, its bytes against the CPU's, and its decode step timed beside BF16
SDPA over the same tokens (Llama-8B geometry: 8 KV heads, 32 query heads, head_dim 128; one layer).

    python perf/results/s56/gpu_chw.py OUT.json
"""

import json
import os
import sys
import time

import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.rope import Rotary

DEV = os.environ.get("DEV", "cuda")  # DEV=cpu: a small dry run of the same steps
B, L, H, HQ, D = (8, 4096, 8, 32, 128) if DEV == "cuda" else (2, 2112, 2, 8, 64)


def timed(fn, reps=20):
    if DEV != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def main(out: str) -> None:
    gen = torch.Generator().manual_seed(0)
    widths = "".join(str(int(w)) for w in torch.randint(1, 5, (H * D,), generator=gen))  # mean about 2.5
    spec = f"chw:kw={widths},vbits=2,vclip=true,vstep=1.15,sink=4,prerope=true,vrot=hadamard"
    geometry = Geometry(1, H, D, torch.bfloat16)
    rotary = Rotary.default(D, 500000.0)
    result = {"spec_widths_mean": sum(map(int, widths)) / len(widths), "B": B, "L": L, "H": H, "HQ": HQ, "D": D,
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"}
    # the CPU's bytes: one chunk encoded on both devices
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 64)
    k = torch.randn(2048, H, D, generator=gen).bfloat16() * 2
    v = torch.randn(2048, H, D, generator=gen).bfloat16()
    host, dev = codec.encode(k, v, layout), codec.encode(k.to(DEV), v.to(DEV), layout)
    result["bytes_equal_cpu_cuda"] = bool(torch.equal(host.pages, dev.pages.cpu())
                                          and torch.equal(host.codebook, dev.codebook.cpu()))
    ks = torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16) * 2
    vs = torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16)
    kd = ks.transpose(1, 2).repeat_interleave(HQ // H, 1)  # [B, HQ, L, D] BF16, as a dense cache holds them
    vd = vs.transpose(1, 2).repeat_interleave(HQ // H, 1)
    qd = q[:, :, None]
    result["sdpa_bf16_us"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd))
    # the chw layer, and a KIVI-2 layer with the same levers on the same torch backend (what the backend costs)
    for name, layer_spec in (("chw", spec), ("kivi2_torch", "kivi:bits=2,group=64,sink=4,prerope=true,vrot=hadamard")):
        cache = KVCache(geometry, CacheConfig(codec=layer_spec, page_size=64, chunk_pages=32,
                                              dense_pages=B * L // 64 + 40 * B, packed_pages=B * L // 64,
                                              device=DEV, backend="torch"), rotary=rotary)
        rids = []
        for b in range(B):
            rid, _ = cache.add_request(list(range(b * L, (b + 1) * L)))
            cache.append(rid, 0, ks[b], vs[b])
            rids.append(rid)
        plan = cache.plan(rids, 0)
        out_cache, _ = cache.decode(plan, 0, q)
        errs = []
        for b, rid in enumerate(rids):
            rk, rv = cache.read(rid, 0)  # [T, H, D], what the pages hold
            kk = rk.float().transpose(0, 1).repeat_interleave(HQ // H, 0)
            vv = rv.float().transpose(0, 1).repeat_interleave(HQ // H, 0)
            ref = torch.softmax(q[b].float()[:, None] @ kk.transpose(1, 2) / D ** 0.5, -1) @ vv
            errs.append(float((out_cache[b].float() - ref[:, 0]).abs().max()))
        result[f"{name}_backend"] = type(cache.backends[0]).__name__
        result[f"{name}_decode_vs_read_max_abs"] = max(errs)
        result[f"{name}_packed_tokens"] = cache.stats().packed_tokens
        result[f"{name}_decode_us"] = timed(lambda: cache.decode(plan, 0, q), reps=5)
        result[f"{name}_over_sdpa"] = result[f"{name}_decode_us"] / result["sdpa_bf16_us"]
        lay = cache.layouts[0]
        pages = torch.zeros(B * L // 64, lay.page_bytes, dtype=torch.uint8, device=DEV)
        book = torch.zeros(lay.codebook_bytes, dtype=torch.uint8, device=DEV)
        codec_of = codecs.get(layer_spec)
        result[f"{name}_decode_pages_us"] = timed(lambda: codec_of.decode_pages(lay, pages, book), reps=5)
        del cache
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
