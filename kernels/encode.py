"""Encode: subtract the assigned centroids, compute group scales (and zeros), quantize, pack.

One program per (page, KV head) writes that head's slice of every field of one of K or V straight
into the packed pool, in the layout's places. The arithmetic mirrors `kvbackend.quant` step by step
(IEEE division, round-half-even, scales rounded up and zeros down to their storage type), so for
the same assignments the bytes equal the torch reference's (clipped steps: up to the order of their
float32 sums). One launch may cover the pages of several chunks of equal length, each with its own
centroids (`encode_units_into_pages`), and write what the codes leave of the input (its error).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbackend.quant import clipped_step
from kvbackend.scheme import FLOAT, TensorScheme

from kvbackend.kernels.dequant import pool_views

PACKED_WIDTHS = (2, 3, 4, 8)  # code widths the kernel packs (3: 8 codes in 3 bytes, the first in the top bits)


@triton.jit
def _rne(y):
    """Round half to even, as torch.round does."""
    a = tl.abs(y)
    f = tl.floor(a)
    r = a - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (r > 0.5) | ((r == 0.5) & odd)
    q = f + up.to(tl.float32)
    return tl.where(y < 0, -q, q)


@triton.jit
def _to_kind(x, KIND: tl.constexpr):
    """Round float32 ``x`` to the nearest value of kind KIND (saturating), returned as float32."""
    if KIND == 0:  # e4m3fn: 3 mantissa bits, normal exponents from -6, max 448
        a = tl.minimum(tl.abs(x), 448.0)
        exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        q = _rne(a / step) * step  # division by a power of two is exact
        return tl.where(x < 0, -q, q)
    elif KIND == 1:
        return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    elif KIND == 2:  # by bits, round half to even (the CPU interpreter's own bf16 cast truncates)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _tiny_like(x, KIND: tl.constexpr):
    """KIND's smallest positive step (`quant._limits`) as a float32 tensor shaped like ``x``. The
    bf16 and fp32 steps (2^-133, 2^-149) are float32 subnormals, which Triton types as float64
    literals (and Triton 3.6 then fails to compile the bitcasts), so they are made from their bits."""
    if KIND == 0:
        return tl.zeros_like(x) + 0.001953125
    elif KIND == 1:
        return tl.zeros_like(x) + 5.960464477539063e-08
    elif KIND == 2:
        return (tl.zeros_like(x).to(tl.int32, bitcast=True) + 65536).to(tl.float32, bitcast=True)
    else:
        return (tl.zeros_like(x).to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _round_dir(x, KIND: tl.constexpr, UP: tl.constexpr):
    """`kvbackend.quant.round_to`: representable in KIND and >= x (UP) or <= x."""
    if KIND == 0:
        eps: tl.constexpr = 0.125
        big: tl.constexpr = 448.0
    elif KIND == 1:
        eps: tl.constexpr = 0.0009765625
        big: tl.constexpr = 65504.0
    else:
        eps: tl.constexpr = 0.0078125
        big: tl.constexpr = 3.3895313892515355e38
    if KIND == 3:  # saturates at the largest finite float, as the reference (an infinite scale decodes to NaN)
        return tl.minimum(tl.maximum(x, -3.4028234663852886e38), 3.4028234663852886e38)
    x = tl.minimum(tl.maximum(x, -big), big)
    y = _to_kind(x, KIND)
    step = tl.maximum(tl.abs(x) * eps, _tiny_like(x, KIND))
    if UP:
        nudged = _to_kind(tl.minimum(tl.maximum(x + step, -big), big), KIND)
        return tl.where(y < x, nudged, y)
    else:
        nudged = _to_kind(tl.minimum(tl.maximum(x - step, -big), big), KIND)
        return tl.where(y > x, nudged, y)


@triton.jit
def _store_kind(u8, i16, i32, byte_offset, value, KIND: tl.constexpr):
    """Store float32 values already representable in KIND."""
    if KIND == 0:
        a = tl.abs(value)
        bits = a.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        normal = ((exponent + 7) << 3) | ((bits >> 20) & 0x7)
        subnormal = (a * 512.0).to(tl.int32)  # multiples of 2^-9
        negative = value.to(tl.int32, bitcast=True) < 0  # the sign bit: -0 stores 0x80, as torch's cast
        code = tl.where(exponent < -6, subnormal, normal) | tl.where(negative, 0x80, 0)
        tl.store(u8 + byte_offset, code.to(tl.uint8))
    elif KIND == 1:
        tl.store(i16 + byte_offset // 2, value.to(tl.float16).to(tl.int16, bitcast=True))
    elif KIND == 2:  # value is a bf16 already: its top 16 bits
        tl.store(i16 + byte_offset // 2, (value.to(tl.int32, bitcast=True) >> 16).to(tl.int16))
    else:
        tl.store(i32 + byte_offset // 4, value.to(tl.int32, bitcast=True))


@triton.jit
def _element_size(KIND: tl.constexpr):
    if KIND == 0:
        return 1
    elif KIND == 3:
        return 4
    else:
        return 2


@triton.jit
def _encode_kernel(x_ptr, assign_ptr, cent_ptr, page_ids, u8, i16, i32, err_ptr, N: tl.constexpr,
                   PAGE_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   MODE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
                   KIND: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr,
                   ASSIGN: tl.constexpr, STAGES: tl.constexpr, C: tl.constexpr, UNIT_PAGES: tl.constexpr,
                   CLIP: tl.constexpr, GSTEP: tl.constexpr, ERROR: tl.constexpr):
    j = tl.program_id(0)  # page of the chunks (UNIT_PAGES pages per chunk, each with its own centroids)
    h = tl.program_id(1)
    page = tl.load(page_ids + j).to(tl.int64)
    base = page * PAGE_BYTES
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    token = j * P + t
    x = tl.load(x_ptr + (token[:, None].to(tl.int64) * H + h) * D + d[None, :]).to(tl.float32)
    heads = (N // (UNIT_PAGES * P)) * H  # centroid rows per stage: one set of H per chunk
    for stage in tl.static_range(STAGES):
        ids = tl.load(assign_ptr + (stage * N + token) * H + h)  # int32 [P]
        row = stage * heads + (j // UNIT_PAGES) * H + h
        x -= tl.load(cent_ptr + (row * C + ids[:, None]) * D + d[None, :]).to(tl.float32)
        tl.store(u8 + base + ASSIGN + (stage * P + t) * H + h, ids.to(tl.uint8))
    esize: tl.constexpr = _element_size(KIND)
    if MODE == 1:
        NG: tl.constexpr = D // GROUP
        grouped = tl.reshape(x, (P, NG, GROUP))
        hi = tl.max(grouped, 2)
        lo = tl.min(grouped, 2)
        where = base + ((t[:, None] * H + h) * NG + tl.arange(0, NG)[None, :]) * esize
    else:
        NT: tl.constexpr = P // GROUP
        grouped = tl.reshape(x, (NT, GROUP, D))
        hi = tl.max(grouped, 1)
        lo = tl.min(grouped, 1)
        where = base + ((tl.arange(0, NT)[:, None] * H + h) * D + d[None, :]) * esize
    if SYMMETRIC:
        qmax: tl.constexpr = (1 << (BITS - 1)) - 1
        step = tl.math.div_rn(tl.maximum(tl.abs(hi), tl.abs(lo)), qmax * 1.0)
        scale = _round_dir(tl.maximum(step, _tiny_like(step, KIND)), KIND, True)
        zero = scale * 0.0
    elif CLIP:  # `kvbackend.quant.quantize(..., clip=True)`: the smaller of the min/max and the Gaussian step
        levels: tl.constexpr = (1 << BITS) - 1
        if MODE == 1:
            mean = tl.sum(grouped, 2) / GROUP
            deviation = grouped - mean[:, :, None]
            variance = tl.sum(deviation * deviation, 2) / GROUP
        else:
            mean = tl.sum(grouped, 1) / GROUP
            deviation = grouped - mean[:, None, :]
            variance = tl.sum(deviation * deviation, 1) / GROUP
        gaussian = GSTEP * tl.sqrt_rn(variance)
        minmax = tl.math.div_rn(hi - lo, levels * 1.0)
        finite = (tl.abs(gaussian) < float("inf")) & (tl.abs(mean) < float("inf"))  # False for NaN too
        use_minmax = (minmax <= gaussian) | ~finite
        step = tl.where(use_minmax, minmax, gaussian)
        centred = tl.maximum(lo, mean - gaussian * levels / 2.0)  # never below the minimum
        zero = _round_dir(tl.where(use_minmax, lo, centred) + 0.0, KIND, False)  # -0 -> +0, as the reference
        scale = _round_dir(tl.maximum(step, _tiny_like(step, KIND)), KIND, True)
        _store_kind(u8, i16, i32, where + ZEROS, zero, KIND)
    else:
        levels: tl.constexpr = (1 << BITS) - 1
        zero = _round_dir(lo + 0.0, KIND, False)  # -0 -> +0, as the reference (`quant.group_params`)
        step = tl.math.div_rn(hi - zero, levels * 1.0)
        scale = _round_dir(tl.maximum(step, _tiny_like(step, KIND)), KIND, True)
        _store_kind(u8, i16, i32, where + ZEROS, zero, KIND)
    _store_kind(u8, i16, i32, where + SCALES, scale, KIND)
    if MODE == 1:
        full_scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (P, NG, GROUP)), (P, D))
        full_zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (P, NG, GROUP)), (P, D))
    else:
        full_scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (NT, GROUP, D)), (P, D))
        full_zero = tl.reshape(tl.broadcast_to(zero[:, None, :], (NT, GROUP, D)), (P, D))
    if SYMMETRIC:
        q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x, full_scale)), -qmax * 1.0), qmax * 1.0) + qmax
    else:
        q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x - full_zero, full_scale)), 0.0), levels * 1.0)
    if ERROR:  # what decoding leaves of x (its residual after the centroids), by page and head: [pages, H, P, D]
        if SYMMETRIC:
            approx = (q - qmax) * full_scale
        else:
            approx = q * full_scale + full_zero
        tl.store(err_ptr + ((j.to(tl.int64) * H + h) * P + t[:, None]) * D + d[None, :], x - approx)
    if BITS == 3:  # 8 codes in 3 bytes, the first in the top bits (`kvbackend.bitpack`)
        G: tl.constexpr = D // 8
        codes = tl.reshape(q.to(tl.int32), (P, G, 8))
        shifts = (7 - tl.arange(0, 8)) * 3
        word = tl.sum(codes << shifts[None, None, :], 2)  # [P, G] 24-bit numbers
        at = u8 + base + CODES + (t[:, None] * H + h) * (3 * G) + 3 * tl.arange(0, G)[None, :]
        tl.store(at, ((word >> 16) & 0xFF).to(tl.uint8))
        tl.store(at + 1, ((word >> 8) & 0xFF).to(tl.uint8))
        tl.store(at + 2, (word & 0xFF).to(tl.uint8))
    else:
        PER: tl.constexpr = 8 // BITS
        DP: tl.constexpr = D // PER
        codes = tl.reshape(q.to(tl.int32), (P, DP, PER))
        shifts = (PER - 1 - tl.arange(0, PER)) * BITS
        packed = tl.sum(codes << shifts[None, None, :], 2)
        tl.store(u8 + base + CODES + (t[:, None] * H + h) * DP + tl.arange(0, DP)[None, :], packed.to(tl.uint8))


def encode_into_pages(x: torch.Tensor, scheme: TensorScheme, pages: torch.Tensor, page_ids: torch.Tensor,
                      assign: torch.Tensor | None = None, centroids: torch.Tensor | None = None) -> None:
    """Quantize one of K or V of a chunk into the packed pages ``page_ids`` of ``pages``.

    Args:
        x: [N, H, D] chunk (N a multiple of the page size, padded), bf16/fp16/fp32, contiguous.
        scheme: the layout's scheme for this tensor (TOKEN_GROUPS or CHANNEL_GROUPS).
        pages: one layer's packed pool [num_pages, page_bytes] (uint8), written in place.
        page_ids: int32 [N / P] destination pages.
        assign: int32 [S, N, H] centroid ids per stage (when the scheme has stages).
        centroids: bf16 [S, H, C, D], exactly as stored in the codebook.
    """
    if scheme.mode == FLOAT or scheme.bits not in PACKED_WIDTHS:
        raise ValueError(f"encode kernel handles 2/3/4/8-bit group schemes, not {scheme}")
    n, h, d = x.shape
    p = n // page_ids.numel()
    if p * page_ids.numel() != n or p & (p - 1) or d & (d - 1):
        raise ValueError(f"chunk of {n} tokens does not fill {page_ids.numel()} power-of-two pages (head_dim {d})")
    if not x.is_contiguous() or x.device != pages.device or page_ids.dtype != torch.int32:
        raise ValueError("x must be contiguous on the pool's device and page_ids int32")
    if scheme.stages:
        if assign is None or centroids is None or assign.shape != (scheme.stages, n, h):
            raise ValueError(f"scheme has {scheme.stages} stages: give assign [S, N, H] and centroids [S, H, C, D]")
        assign, centroids = assign.to(torch.int32).contiguous(), centroids.contiguous()
    else:
        assign = centroids = x  # never read
    _launch(x, scheme, pages, page_ids, assign, centroids, page_ids.numel(), False, None)


def encode_units_into_pages(x: torch.Tensor, scheme: TensorScheme, pages: torch.Tensor, units: int,
                            assign: torch.Tensor | None = None, centroids: torch.Tensor | None = None,
                            clip: bool = False, error: bool = False, widen: float = 1.0) -> torch.Tensor | None:
    """Quantize one of K or V of ``units`` chunks of equal length into ``pages`` (their pages in order).

    Args:
        x: [U*N, H, D] float32, contiguous: chunk u is rows u*N..(u+1)*N (N a multiple of the page size).
        pages: [U*N/P, page_bytes] uint8, written in place (only this tensor's fields).
        assign: int32 [S, U*N, H] centroid ids per stage (schemes with stages).
        centroids: float32 [S, U*H, C, D] as stored (chunk u's heads are rows u*H..(u+1)*H).
        clip: asymmetric steps clipped as `kvbackend.quant.quantize(..., clip=True, widen=widen)`.
        error: also return what decoding leaves of the residual, float32 [U*N/P, H, P, D].

    The bytes are the reference's for the same assignments, except where float32 sums in another order (the
    clipped steps' means and variances) round a stored scale or zero to a neighbouring value.
    """
    if scheme.mode == FLOAT or scheme.bits not in PACKED_WIDTHS:
        raise ValueError(f"encode kernel handles 2/3/4/8-bit group schemes, not {scheme}")
    n, h, d = x.shape
    count = pages.shape[0]
    p = n // count
    if units < 1 or count % units or p * count != n or p & (p - 1) or d & (d - 1):
        raise ValueError(f"{n} tokens of {units} chunks do not fill {count} power-of-two pages (head_dim {d})")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.device != pages.device:
        raise ValueError("x must be contiguous float32 on the pool's device")
    if scheme.stages:
        shape = (scheme.stages, units * h, scheme.centroids, d)
        if assign is None or centroids is None or assign.shape != (scheme.stages, n, h) or centroids.shape != shape:
            raise ValueError(f"scheme has {scheme.stages} stages: give assign [S, N, H] and centroids {list(shape)}")
        assign, centroids = assign.to(torch.int32).contiguous(), centroids.float().contiguous()
    else:
        assign = centroids = x  # never read
    page_ids = torch.arange(count, dtype=torch.int32, device=pages.device)
    out = torch.empty(count, h, p, d, device=x.device) if error else None
    _launch(x, scheme, pages, page_ids, assign, centroids, count // units, clip, out, widen)
    return out


def _launch(x, scheme: TensorScheme, pages, page_ids, assign, centroids, unit_pages: int, clip: bool, error,
            widen: float = 1.0) -> None:
    n, h, d = x.shape
    u8, i16, i32 = pool_views(pages)
    clip = clip and not scheme.symmetric
    _encode_kernel[(page_ids.numel(), h)](
        x, assign, centroids, page_ids, u8, i16, i32, x if error is None else error, N=n, PAGE_BYTES=pages.shape[1],
        H=h, P=n // page_ids.numel(), D=d, MODE=scheme.mode, BITS=scheme.bits, GROUP=scheme.group,
        SYMMETRIC=scheme.symmetric, KIND=scheme.kind, CODES=scheme.codes, SCALES=max(scheme.scales, 0),
        ZEROS=max(scheme.zeros, 0), ASSIGN=max(scheme.assign, 0), STAGES=scheme.stages, C=max(scheme.centroids, 1),
        UNIT_PAGES=unit_pages, CLIP=clip, GSTEP=clipped_step(1 << scheme.bits, widen) if clip else 0.0,
        ERROR=error is not None)
