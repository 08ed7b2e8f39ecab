"""Triton building blocks that read one head of one page into registers, as the layout says.

Every offset and storage choice arrives as a compile-time constant taken from a
`kvbackend.scheme.TensorScheme`, so one source serves every 2/4/8-bit layout: per-token channel
groups, per-channel token groups (KIVI keys), with or without zeros, centroids and stages, and
plain float pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fp8e4m3_to_f32(b):
    """Decode e4m3fn bytes (int32 tensor) by building the float32 bit pattern: no fp8 type needed."""
    sign = (b & 0x80) << 24
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa / 8 * 2^-6
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def load_elements(u8, i16, i32, byte_offset, KIND: tl.constexpr):
    """Load float elements of kind KIND (0 fp8 e4m3, 1 fp16, 2 bf16, 3 fp32) at byte offsets, as float32."""
    if KIND == 0:
        return fp8e4m3_to_f32(tl.load(u8 + byte_offset).to(tl.int32))
    elif KIND == 1:
        return tl.load(i16 + byte_offset // 2).to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 2:
        return tl.load(i16 + byte_offset // 2).to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return tl.load(i32 + byte_offset // 4).to(tl.float32, bitcast=True)


@triton.jit
def element_size(KIND: tl.constexpr):
    if KIND == 0:
        return 1
    elif KIND == 3:
        return 4
    else:
        return 2


@triton.jit
def dequant_tile(u8, i16, i32, page_offset, book_i16, book_offset, h,
                 H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                 MODE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
                 KIND: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr,
                 ASSIGN: tl.constexpr, STAGES: tl.constexpr, C: tl.constexpr, BOOK: tl.constexpr):
    """float32 [P, D]: head ``h`` of the page at byte ``page_offset`` (int64), reconstructed."""
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    esize: tl.constexpr = element_size(KIND)
    if MODE == 0:  # plain floats [P, H, D]
        x = load_elements(u8, i16, i32, page_offset + CODES + ((t[:, None] * H + h) * D + d[None, :]) * esize, KIND)
    else:
        PER: tl.constexpr = 8 // BITS  # codes per byte, first in the top bits
        DP: tl.constexpr = D // PER
        byte = tl.arange(0, DP)
        raw = tl.load(u8 + page_offset + CODES + (t[:, None] * H + h) * DP + byte[None, :]).to(tl.int32)
        shifts = (PER - 1 - tl.arange(0, PER)) * BITS
        codes = (raw[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(codes, (P, D)).to(tl.float32)
        if MODE == 1:  # per token, groups of GROUP channels: [P, H, D / GROUP]
            NG: tl.constexpr = D // GROUP
            g = tl.arange(0, NG)
            where = ((t[:, None] * H + h) * NG + g[None, :]) * esize
            scale = tl.reshape(tl.broadcast_to(
                load_elements(u8, i16, i32, page_offset + SCALES + where, KIND)[:, :, None], (P, NG, GROUP)), (P, D))
            if not SYMMETRIC:
                zero = tl.reshape(tl.broadcast_to(
                    load_elements(u8, i16, i32, page_offset + ZEROS + where, KIND)[:, :, None], (P, NG, GROUP)), (P, D))
        else:  # per channel, groups of GROUP tokens: [P / GROUP, H, D]
            NT: tl.constexpr = P // GROUP
            tg = tl.arange(0, NT)
            where = ((tg[:, None] * H + h) * D + d[None, :]) * esize
            scale = tl.reshape(tl.broadcast_to(
                load_elements(u8, i16, i32, page_offset + SCALES + where, KIND)[:, None, :], (NT, GROUP, D)), (P, D))
            if not SYMMETRIC:
                zero = tl.reshape(tl.broadcast_to(
                    load_elements(u8, i16, i32, page_offset + ZEROS + where, KIND)[:, None, :], (NT, GROUP, D)), (P, D))
        if SYMMETRIC:
            x = (codes - ((1 << (BITS - 1)) - 1)) * scale
        else:
            x = codes * scale + zero
    for stage in tl.static_range(STAGES):
        ids = tl.load(u8 + page_offset + ASSIGN + (stage * P + t) * H + h).to(tl.int32)
        rows = book_offset + BOOK + (((stage * H + h) * C + ids[:, None]) * D + d[None, :]) * 2
        x += tl.load(book_i16 + rows // 2).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return x


def scheme_constants(prefix: str, scheme) -> dict:
    """Keyword constants for `dequant_tile` from a TensorScheme, names prefixed ``K_`` or ``V_``."""
    return {
        f"{prefix}_MODE": scheme.mode, f"{prefix}_BITS": max(scheme.bits, 1), f"{prefix}_GROUP": max(scheme.group, 1),
        f"{prefix}_SYMMETRIC": scheme.symmetric, f"{prefix}_KIND": scheme.kind, f"{prefix}_CODES": scheme.codes,
        f"{prefix}_SCALES": max(scheme.scales, 0), f"{prefix}_ZEROS": max(scheme.zeros, 0),
        f"{prefix}_ASSIGN": max(scheme.assign, 0), f"{prefix}_STAGES": scheme.stages,
        f"{prefix}_C": max(scheme.centroids, 1), f"{prefix}_BOOK": max(scheme.codebook, 0),
    }


def pool_views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8, int16 and int32 views of one layer's packed pages or codebooks (16-byte aligned rows).

    An empty pool (a codec without a codebook) becomes a 16-byte dummy that is never read.
    """
    flat = pages.reshape(-1) if pages.numel() else torch.zeros(16, dtype=torch.uint8, device=pages.device)
    return flat, flat.view(torch.int16), flat.view(torch.int32)


@triton.jit
def load_page(u8, i16, i32, book_i16, dense, page, slot, kind, h, is_v: tl.constexpr,
              PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
              MODE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
              KIND: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr,
              ASSIGN: tl.constexpr, STAGES: tl.constexpr, C: tl.constexpr, BOOK: tl.constexpr):
    """float32 [P, D] of head ``h`` from a packed page (kind 0) or a dense page (kind 1)."""
    if kind == 0:
        x = dequant_tile(u8, i16, i32, page * PAGE_BYTES, book_i16, slot * BOOK_BYTES, h, H, P, D, MODE, BITS,
                         GROUP, SYMMETRIC, KIND, CODES, SCALES, ZEROS, ASSIGN, STAGES, C, BOOK)
    else:
        t = tl.arange(0, P)
        d = tl.arange(0, D)
        x = tl.load(dense + ((page * 2 + is_v) * P + t[:, None]) * (H * D) + h * D + d[None, :]).to(tl.float32)
    return x
