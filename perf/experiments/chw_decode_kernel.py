"""Can a decode kernel read keys with a width per channel fast? A standalone experiment (not wired into the cache).

Layout (the channel-major one `perf/NOTES.md` session 56 proposes for `chw:` pages): per page and KV head, channel c's
64 tokens packed consecutively at its width w_c (most significant bit first, 8 * w_c bytes, byte-aligned), at byte
offset 8 * sum_{c' < c} w_c'; one fp16 absmax per page, head and channel, one fp16 mean per head and channel; values
2-bit per token with fp16 scale and zero. No RoPE (keys in the query's frame): this measures the mixed-width unpack
alone. `decode` is the Triton flash-decoding kernel (grid: request, KV head, split; a merge kernel after), `reference`
the torch one. Timed beside BF16 SDPA over the same tokens and beside the same kernel with every width 2.

    python perf/experiments/chw_decode_kernel.py OUT.json     (a CUDA device; TRITON_INTERPRET=1 for a CPU check)
"""

from __future__ import annotations

import json
import math
import sys

import torch
import triton
import triton.language as tl

P = 64  # tokens per page


def pack(codes: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, H, P, D] at widths [H, D] -> (uint8 [N, H, KB], int32 byte offsets [H, D])."""
    n, h, p, d = codes.shape
    offsets = torch.zeros(h, d, dtype=torch.int32)
    offsets[:, 1:] = (8 * width[:, :-1].long()).cumsum(1).int()
    kb = int((8 * width.long()).sum(1).max()) + 1  # one spare byte: the kernel reads two bytes per code
    out = torch.zeros(n, h, kb, dtype=torch.uint8)
    for head in range(h):
        for c in range(d):
            w = int(width[head, c])
            if w == 0:
                continue
            shifts = torch.arange(w - 1, -1, -1)
            bits = (codes[:, head, :, c, None] >> shifts) & 1  # [N, P, w], most significant first
            flat = bits.reshape(n, p * w // 8, 8)
            byte = (flat << torch.arange(7, -1, -1)).sum(-1).to(torch.uint8)
            start = int(offsets[head, c])
            out[:, head, start : start + 8 * w] = byte
    return out, offsets


def make(pages: int, heads: int, dim: int, width: torch.Tensor, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = width.long()
    codes = (torch.rand(pages, heads, P, dim, generator=gen) * (2.0 ** w)[None, :, None, :]).floor().long()
    kcodes, boff = pack(codes, width)
    return {
        "codes": codes,
        "kcodes": kcodes, "boff": boff, "width": width.int(),
        "kscale": (torch.rand(pages, heads, dim, generator=gen) * 2 + 0.1).half(),
        "kmean": (torch.randn(heads, dim, generator=gen) * 0.5).half(),
        "vcodes": (torch.randint(0, 256, (pages, heads, P, dim // 4), generator=gen)).to(torch.uint8),
        "vscale": (torch.rand(pages, heads, P, generator=gen) * 0.5 + 0.1).half(),
        "vzero": (torch.randn(pages, heads, P, generator=gen) * 0.2 - 0.5).half(),
    }


def dequant_reference(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys and values [N, H, P, D]."""
    w = t["width"].long()
    levels = (2.0 ** w).float()[None, :, None, :]
    amax = t["kscale"].float()[:, :, None, :]
    y = -amax + (t["codes"].float() + 0.5) * 2 * amax / levels
    k = t["kmean"].float()[None, :, None, :] + torch.where(w[None, :, None, :] > 0, y, torch.zeros_like(y))
    v_codes = torch.stack([(t["vcodes"].long() >> (2 * j)) & 3 for j in range(4)], -1).flatten(-2)
    v = v_codes.float() * t["vscale"].float()[..., None] + t["vzero"].float()[..., None]
    return k, v


def reference(q: torch.Tensor, t: dict, pages_per_request: int) -> torch.Tensor:
    """q [B, HQ, D] -> [B, HQ, D] float32."""
    k, v = dequant_reference({key: x.to(q.device) if torch.is_tensor(x) else x for key, x in t.items()})
    b, hq, d = q.shape
    h = k.shape[1]
    k = k.view(b, pages_per_request, h, P, d).permute(0, 2, 1, 3, 4).reshape(b, h, -1, d)
    v = v.view(b, pages_per_request, h, P, d).permute(0, 2, 1, 3, 4).reshape(b, h, -1, d)
    k = k.repeat_interleave(hq // h, 1)
    v = v.repeat_interleave(hq // h, 1)
    att = torch.softmax(q.float()[:, :, None] @ k.transpose(2, 3) / math.sqrt(d), -1)
    return (att @ v)[:, :, 0]


@triton.jit
def _decode(q, kcodes, boff, width, kscale, kmean, vcodes, vscale, vzero, o_part, m_part, l_part,
            pages_per_request, pages_per_split, num_splits, scale_log2,
            H: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
            P: tl.constexpr, KBP: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    t = tl.arange(0, P)
    rows = (r * H + h) * GROUP + i
    q_tile = tl.load(q + rows[:, None] * D + d[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float16)
    w = tl.load(width + h * D + d)
    bo = tl.load(boff + h * D + d)
    mean = tl.load(kmean + h * D + d).to(tl.float32)
    levels = (1 << w).to(tl.float32)
    bit = t[:, None] * w[None, :]
    byte = bo[None, :] + (bit >> 3)
    shift = 16 - (bit & 7) - w[None, :]
    mask_w = (1 << w[None, :]) - 1
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    first = s * pages_per_split
    last = tl.minimum(first + pages_per_split, pages_per_request)
    for j in range(first, last):
        page = (r * pages_per_request + j).to(tl.int64)
        base = kcodes + (page * H + h) * KB
        if TILE:  # the page-head block loaded once, contiguous; each code's two bytes gathered from registers
            kb = tl.arange(0, KBP)
            block = tl.load(base + kb, mask=kb < KB, other=0).to(tl.int32)
            flat = tl.reshape(byte, (P * D,))
            b0 = tl.reshape(tl.gather(block, flat, 0), (P, D))
            b1 = tl.reshape(tl.gather(block, flat + 1, 0), (P, D))
        else:  # each code's two bytes gathered from memory
            b0 = tl.load(base + byte).to(tl.int32)
            b1 = tl.load(base + byte + 1).to(tl.int32)
        code = (((b0 << 8) | b1) >> shift) & mask_w
        amax = tl.load(kscale + (page * H + h) * D + d).to(tl.float32)
        y = -amax[None, :] + (code.to(tl.float32) + 0.5) * (2.0 * amax / levels)[None, :]
        k = mean[None, :] + tl.where(w[None, :] > 0, y, 0.0)
        vrow = (page * H + h) * P + t
        if TILE:  # [P, D/4] contiguous bytes, four codes each, interleaved back into channel order
            vb = tl.load(vcodes + vrow[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :]).to(tl.int32)
            vc = tl.reshape(tl.join(tl.join(vb & 3, (vb >> 4) & 3), tl.join((vb >> 2) & 3, (vb >> 6) & 3)), (P, D))
        else:
            vb = tl.load(vcodes + vrow[:, None] * (D // 4) + (d // 4)[None, :]).to(tl.int32)
            vc = (vb >> ((d % 4) * 2)[None, :]) & 3
        v = vc.to(tl.float32) * tl.load(vscale + vrow).to(tl.float32)[:, None] \
            + tl.load(vzero + vrow).to(tl.float32)[:, None]
        scores = tl.dot(q_tile, tl.trans(k.to(tl.float16))) * scale_log2
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    live = i < GROUP
    part = rows * num_splits + s
    tl.store(o_part + part[:, None] * D + d[None, :], acc, mask=live[:, None])
    tl.store(m_part + part, m_i, mask=live)
    tl.store(l_part + part, l_i, mask=live)


@triton.jit
def _merge(o_part, m_part, l_part, out, num_splits, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    live = s < num_splits
    m = tl.load(m_part + row * num_splits + s, mask=live, other=float("-inf"))
    l_s = tl.load(l_part + row * num_splits + s, mask=live, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    o = tl.load(o_part + (row * num_splits + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    tl.store(out + row * D + d, tl.sum(o * weight[:, None], 0) / tl.sum(weight * l_s, 0))


def decode(q: torch.Tensor, t: dict, pages_per_request: int, splits: int, tile: bool = True) -> torch.Tensor:
    b, hq, d = q.shape
    h = t["width"].shape[0]
    group = hq // h
    per_split = -(-pages_per_request // splits)
    splits = -(-pages_per_request // per_split)
    o_part = torch.empty(b * hq * splits, d, device=q.device, dtype=torch.float32)
    m_part = torch.empty(b * hq * splits, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    _decode[(b, h, splits)](q, t["kcodes"], t["boff"], t["width"], t["kscale"], t["kmean"], t["vcodes"], t["vscale"],
                            t["vzero"], o_part, m_part, l_part, pages_per_request, per_split, splits,
                            1.4426950408889634 / math.sqrt(d), H=h, GROUP=group, ROWS=max(16, group), D=d,
                            KB=t["kcodes"].shape[-1], P=P, KBP=triton.next_power_of_2(t["kcodes"].shape[-1]),
                            TILE=tile)
    out = torch.empty(b, hq, d, device=q.device, dtype=torch.float32)
    _merge[(b * hq,)](o_part, m_part, l_part, out, splits, D=d, SPLITS=max(16, triton.next_power_of_2(splits)))
    return out


def timed(fn, reps=30):
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


def widths_like_a_plan(heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Widths 0-8 spread as SmolLM2's 2.6-bit plan spreads them (mostly 1-3, a few wide channels, some 0)."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 1, 2, 2, 2, 3, 3, 3, 4, 6])  # mean 2.6
    return choices[torch.randint(0, len(choices), (heads, dim), generator=gen)].int()


def main(out: str) -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    b, hq, h, d, length = (8, 32, 8, 128, 32768) if cuda else (2, 8, 2, 32, 256)
    npr = length // P
    result = {"B": b, "HQ": hq, "H": h, "D": d, "L": length,
              "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)"}
    q = torch.randn(b, hq, d).bfloat16()
    for name, width in (("mixed", widths_like_a_plan(h, d)), ("uniform2", torch.full((h, d), 2, dtype=torch.int32))):
        t = make(b * npr, h, d, width)
        ref = reference(q.to(device), t, npr).cpu()
        dev = {k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items() if k != "codes"}
        result[f"{name}_mean_width"] = float(width.float().mean())
        result[f"{name}_key_bytes_per_value"] = dev["kcodes"].shape[-1] / (P * d)
        for tile in (False, True):  # codes gathered from memory, or from a register tile of the page's block
            label = f"{name}_{'tile' if tile else 'gather'}"
            try:
                got = decode(q.to(device), dev, npr, splits=max(1, npr // 16), tile=tile)
            except Exception as exc:  # (a Triton without tl.gather): recorded, the other variant still runs
                result[f"{label}_error"] = repr(exc)[:300]
                continue
            result[f"{label}_max_abs_vs_reference"] = float((got.cpu() - ref).abs().max())
            if cuda:
                result[f"{label}_us"] = timed(lambda: decode(q.to(device), dev, npr, splits=max(1, npr // 16),
                                                             tile=tile))
        del ref
    if cuda:
        k = torch.randn(b, hq, length, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qd = q.to(device)[:, :, None]
        result["sdpa_bf16_us"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v))
        # the GQA-aware BF16 read: K/V of the 8 KV heads once, what a dense paged cache stores
        kh, vh = k[:, :h].contiguous(), v[:, :h].contiguous()
        result["sdpa_bf16_gqa_us"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kh, vh, enable_gqa=True))
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
