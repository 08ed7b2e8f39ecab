"""Triton building blocks that read one head of one page into registers, as the layout says.

Every offset and storage choice arrives as a compile-time constant taken from a
`kvbackend.scheme.TensorScheme`, so one source serves every 2/4/8-bit layout: per-token channel
groups, per-channel token groups (KIVI keys), with or without zeros, centroids and stages, and
plain float pages.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

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
def load_elements(u8, i16, i32, base, index, KIND: tl.constexpr):
    """Float elements of kind KIND (0 fp8 e4m3, 1 fp16, 2 bf16, 3 fp32) at element ``base + index`` of the
    matching typed view, as float32. Offsets stay in element units so Triton sees contiguous runs and
    vectorizes the loads."""
    if KIND == 0:
        return fp8e4m3_to_f32(tl.load(u8 + base + index).to(tl.int32))
    elif KIND == 1:
        return tl.load(i16 + base + index).to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 2:
        return tl.load(i16 + base + index).to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return tl.load(i32 + base + index).to(tl.float32, bitcast=True)


@triton.jit
def unpack_codes(i32, word_base, row, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [P, D] (int32) of one head from packed rows, read as 32-bit words.

    ``row`` is the token-major row index ``t * H + h`` for t in 0..P-1; bytes hold their first code in
    the top bits, and a little-endian word holds bytes 0..3 in bits 0..31.
    """
    PER_BYTE: tl.constexpr = 8 // BITS
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = D // PER_WORD
    w = tl.arange(0, WORDS)
    words = tl.load(i32 + word_base + row[:, None] * WORDS + w[None, :])
    j = tl.arange(0, PER_WORD)
    shifts = 8 * (j // PER_BYTE) + (PER_BYTE - 1 - j % PER_BYTE) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (P, D))


@triton.jit
def mantissa_f32(codes):
    """Non-negative int32 codes below 2^23 as float32, exactly: or-ed into the mantissa of 2^23, then
    2^23 subtracted (no int-to-float conversion, a quarter-rate instruction on NVIDIA GPUs)."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def magic_fp16(c):
    """Small non-negative int32 codes as fp16, through the mantissa of 1024.0 (no integer conversion)."""
    return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def scale_zero(u8, i16, i32, page, where, PAGE_BYTES: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                KIND: tl.constexpr, ESIZE: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr):
    """(scale, zero) float32 at element ``where`` of the page's scale and zero fields (a symmetric
    layout's zero is -(2^(bits-1) - 1) * scale)."""
    scale = load_elements(u8, i16, i32, page * (PAGE_BYTES // ESIZE) + SCALES // ESIZE, where, KIND)
    if SYMMETRIC:
        zero = scale * (-((1 << (BITS - 1)) - 1))
    else:
        zero = load_elements(u8, i16, i32, page * (PAGE_BYTES // ESIZE) + ZEROS // ESIZE, where, KIND)
    return scale, zero


UNPACK_MODES = (0, 1, 2, 3)  # the ``UNPACK`` values `dequant_tile` knows


@triton.jit
def dequant_tile(u8, i16, i32, page, book_i16, slot, h,
                 PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr,
                 H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                 MODE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
                 KIND: tl.constexpr, ESIZE: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr,
                 ZEROS: tl.constexpr, ASSIGN: tl.constexpr, STAGES: tl.constexpr, C: tl.constexpr, BOOK: tl.constexpr,
                 UNPACK: tl.constexpr = 0, XT: tl.constexpr = tl.float32, C0: tl.constexpr = 0,
                 W: tl.constexpr = 0, CSCALE: tl.constexpr = -1):
    """[P, D] in XT (float32, or float16 for attention operands): head ``h`` of packed page ``page``
    (int64), reconstructed.

    UNPACK 0 loads packed words and scales once and broadcasts them in registers (reshapes; 3-bit codes, 8 in 3
    bytes, always take the per-element path with byte loads);
    UNPACK 1 has every element load its own word and scale (more loads, served by L1, no reshapes);
    UNPACK 2 as 1, with codes made float through the mantissa of 2^23 instead of an int-to-float
    conversion (a quarter-rate instruction on NVIDIA GPUs); UNPACK 3 is UNPACK 0 with that conversion.

    ESIZE is the byte size of KIND's elements (passed in: Triton 3.6 cannot divide by a constexpr
    returned from a jit function). ``C0``/``W``: only channels ``C0 .. C0 + W - 1`` ([P, W]; W 0 = all
    D), for plain floats and UNPACK 1 and 2 (RoPE's halves). CSCALE: offset of the fp16 scales of fp8
    centroids (`centroid_rows`), -1 for bf16 centroids."""
    WD: tl.constexpr = D if W == 0 else W
    t = tl.arange(0, P)
    d = C0 + tl.arange(0, WD)
    base = page * (PAGE_BYTES // ESIZE)
    if MODE == 0:  # plain floats [P, H, D]
        x = load_elements(u8, i16, i32, base + CODES // ESIZE, (t[:, None] * H + h) * D + d[None, :], KIND).to(XT)
    elif UNPACK == 1 or UNPACK == 2 or BITS == 3:
        if BITS == 3:  # 8 codes in 3 bytes, the first in the top bits: no word holds whole codes, so bytes are read
            at = page * PAGE_BYTES + CODES + (t[:, None] * H + h) * (D * 3 // 8) + (d[None, :] // 8) * 3
            word = ((tl.load(u8 + at).to(tl.int32) << 16) | (tl.load(u8 + at + 1).to(tl.int32) << 8)
                    | tl.load(u8 + at + 2).to(tl.int32))
            codes = (word >> (21 - 3 * (d % 8))[None, :]) & 7
        else:
            PER_BYTE: tl.constexpr = 8 // BITS
            PER_WORD: tl.constexpr = 32 // BITS
            words = tl.load(i32 + page * (PAGE_BYTES // 4) + CODES // 4 + (t[:, None] * H + h) * (D // PER_WORD)
                            + d[None, :] // PER_WORD)
            j = d % PER_WORD
            shifts = 8 * (j // PER_BYTE) + (PER_BYTE - 1 - j % PER_BYTE) * BITS
            codes = (words >> shifts[None, :]) & ((1 << BITS) - 1)
        if UNPACK == 2:
            codes = mantissa_f32(codes).to(XT)
        else:
            codes = codes.to(XT)
        if MODE == 1:
            where = (t[:, None] * H + h) * (D // GROUP) + d[None, :] // GROUP
        else:
            where = ((t[:, None] // GROUP) * H + h) * D + d[None, :]
        scale = load_elements(u8, i16, i32, base + SCALES // ESIZE, where, KIND).to(XT)
        if SYMMETRIC:
            x = (codes - ((1 << (BITS - 1)) - 1)) * scale
        else:
            x = codes * scale + load_elements(u8, i16, i32, base + ZEROS // ESIZE, where, KIND).to(XT)
    else:
        tl.static_assert(WD == D, "a channel window needs UNPACK 1 or 2")
        codes = unpack_codes(i32, page * (PAGE_BYTES // 4) + CODES // 4, t * H + h, H, P, D, BITS)
        if UNPACK == 3:
            codes = mantissa_f32(codes).to(XT)
        else:
            codes = codes.to(XT)
        if MODE == 1:  # per token, groups of GROUP channels: [P, H, D / GROUP]
            NG: tl.constexpr = D // GROUP
            where = (t[:, None] * H + h) * NG + tl.arange(0, NG)[None, :]
            scale = tl.reshape(tl.broadcast_to(
                load_elements(u8, i16, i32, base + SCALES // ESIZE, where, KIND).to(XT)[:, :, None], (P, NG, GROUP)), (P, D))
            if not SYMMETRIC:
                zero = tl.reshape(tl.broadcast_to(
                    load_elements(u8, i16, i32, base + ZEROS // ESIZE, where, KIND).to(XT)[:, :, None], (P, NG, GROUP)), (P, D))
        else:  # per channel, groups of GROUP tokens: [P / GROUP, H, D]
            NT: tl.constexpr = P // GROUP
            where = (tl.arange(0, NT)[:, None] * H + h) * D + d[None, :]
            scale = tl.reshape(tl.broadcast_to(
                load_elements(u8, i16, i32, base + SCALES // ESIZE, where, KIND).to(XT)[:, None, :], (NT, GROUP, D)), (P, D))
            if not SYMMETRIC:
                zero = tl.reshape(tl.broadcast_to(
                    load_elements(u8, i16, i32, base + ZEROS // ESIZE, where, KIND).to(XT)[:, None, :], (NT, GROUP, D)), (P, D))
        if SYMMETRIC:
            x = (codes - ((1 << (BITS - 1)) - 1)) * scale
        else:
            x = codes * scale + zero
    for stage in tl.static_range(STAGES):
        ids = tl.load(u8 + page * PAGE_BYTES + ASSIGN + (stage * P + t) * H + h).to(tl.int32)
        if C >= 16:  # one-hot [P, C] x centroids [C, D] on tensor cores: a contiguous load, not a gather
            c = tl.arange(0, C)
            onehot = (ids[:, None] == c[None, :]).to(tl.float16)
            cents, scale = centroid_rows(book_i16, slot, h, stage, c[:, None], d[None, :], BOOK_BYTES, BOOK, CSCALE,
                                         H, C, D)
            x += (tl.dot(onehot, cents) * scale).to(XT)
        else:
            # a corrupted id past C reads row C - 1 and adds nothing, as in the one-hot product above
            cents, scale = centroid_rows(book_i16, slot, h, stage, tl.minimum(ids, C - 1)[:, None], d[None, :],
                                         BOOK_BYTES, BOOK, CSCALE, H, C, D)
            x += tl.where((ids < C)[:, None], cents.to(tl.float32) * scale, 0.0).to(XT)
    return x


@triton.jit
def centroid_rows(book_i16, slot, h, stage, rows, cols, BOOK_BYTES: tl.constexpr, BOOK: tl.constexpr,
                  CSCALE: tl.constexpr, H: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
    """(values, scale): centroids ``[rows, cols]`` of one stage and head are ``values * scale``. bf16
    centroids: their values (exact in fp16 within its range) and 1; fp8 e4m3 centroids (CSCALE >= 0):
    the fp8 values (exact in fp16) and the stage and head's fp16 scale at byte offset CSCALE of the
    slot, as float32, to apply after the product (rounding the scaled values to fp16 would lose what
    the residual codes cancel)."""
    at = ((stage * H + h) * C + rows) * D + cols
    if CSCALE >= 0:
        book_u8 = book_i16.to(tl.pointer_type(tl.uint8))
        cents = tl.load(book_u8 + slot * BOOK_BYTES + BOOK + at).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        scale = tl.load(book_i16 + slot * (BOOK_BYTES // 2) + CSCALE // 2 + stage * H + h).to(tl.float16, bitcast=True)
        return cents, scale.to(tl.float32)
    cents = tl.load(book_i16 + slot * (BOOK_BYTES // 2) + BOOK // 2 + at).to(tl.bfloat16, bitcast=True)
    return cents.to(tl.float16), 1.0


@functools.lru_cache(maxsize=256)
def scheme_constants(prefix: str, scheme) -> Mapping[str, int]:
    """Keyword constants for `dequant_tile` from a TensorScheme, names prefixed ``K_`` or ``V_`` (read-only:
    computed once per scheme, as every decode call of every layer asks)."""
    return MappingProxyType({
        f"{prefix}_MODE": scheme.mode, f"{prefix}_BITS": max(scheme.bits, 1), f"{prefix}_GROUP": max(scheme.group, 1),
        f"{prefix}_SYMMETRIC": scheme.symmetric, f"{prefix}_KIND": scheme.kind,
        f"{prefix}_ESIZE": {0: 1, 1: 2, 2: 2, 3: 4}[scheme.kind], f"{prefix}_CODES": scheme.codes,
        f"{prefix}_SCALES": max(scheme.scales, 0), f"{prefix}_ZEROS": max(scheme.zeros, 0),
        f"{prefix}_ASSIGN": max(scheme.assign, 0), f"{prefix}_STAGES": scheme.stages,
        f"{prefix}_C": max(scheme.centroids, 1), f"{prefix}_BOOK": max(scheme.codebook, 0),
        f"{prefix}_CSCALE": scheme.centroid_scales,
    })


def pool_views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8, int16 and int32 views of one layer's packed pages or codebooks (16-byte aligned rows).

    An empty pool (a codec without a codebook) becomes a 16-byte dummy that is never read.
    """
    flat = pages.reshape(-1) if pages.numel() else torch.zeros(16, dtype=torch.uint8, device=pages.device)
    return flat, flat.view(torch.int16), flat.view(torch.int32)


@triton.jit
def load_dense(dense, page, h, is_v: tl.constexpr, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """float32 [P, D] of head ``h`` from dense page ``page`` of a [pages, 2, P, H, D] pool."""
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    return tl.load(dense + ((page * 2 + is_v) * P + t[:, None]) * (H * D) + h * D + d[None, :])
