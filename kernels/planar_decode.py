"""Paged decode attention with tokens along the tensor-core product's M and codes read as bit planes.

The folded kernel (`folded_decode`) multiplies ``q [ROWS, D]`` by ``codes^T``: the codes are the
product's B operand, so every page's codes go through shared memory as fp16 (8x the packed bytes) and
the profiler finds that kernel bound by shared-memory and L1 traffic (perf/NOTES.md, v16). Here the
products are turned around so the packed bytes are what crosses shared memory:

    keys:    s^T[t, r] = sum_g scale[t, g] * sum_k plane_k[t, :] . qplane_gk[:, r] + zero[t, g] * sum(q_g[r])
    values:  o^T[c, r] += codes^T[c, t] @ (p^T[t, r] * scale[t, g]);    z[t, r] += p^T[t, r] * zero[t, g]

A byte holds ``8 / bits`` codes; plane k of a row's channel-group bytes is the codes at one bit
offset, i.e. channels ``per_byte * b + k``. A plane is an elementwise function of the loaded bytes, so
the compiler stages the bytes (not fp16 codes) through shared memory and unpacks them in the product's
operand registers; the query planes (channels ``per_byte * b + k`` of q) are loop-invariant. Value
codes are read as ``[channels, tokens]`` in plane order (each byte read once per plane), and the
output's channels come out in the same plane order, which the final store undoes. A symmetric
layout's value zero is subtracted from the codes (exact); asymmetric zeros are summed per token slot.

Serves per-token channel groups for keys and values (RTN-style layouts), 2/4/8-bit codes, with or
without zeros, no centroid stages; groups of at least 64 channels whose plane is at least 16 codes
wide, at most two groups per head, pages of at least 64 tokens. `supports` says which layouts;
`paged_decode` falls back to the other kernels for the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvbackend.scheme import TOKEN_GROUPS, TensorScheme

from kvbackend.kernels.decode_split import VARYING as _VARYING, program_pages
from kvbackend.kernels.dequant import magic_fp16, scale_zero
from kvbackend.kernels.folded_decode import MIN_PAGES_PER_PROGRAM


@triton.jit
def _q_plane(q, q_rows, live, scale_log2, g, k, G: tl.constexpr, GB: tl.constexpr, PER: tl.constexpr):
    """Query channels ``g * G + PER * b + k`` (b < GB) times the softmax scale, as fp16 [GB, ROWS]."""
    cols = g * G + PER * tl.arange(0, GB) + k
    x = tl.load(q + q_rows[None, :] + cols[:, None], mask=live[None, :], other=0.0).to(tl.float32)
    return (x * scale_log2).to(tl.float16)


@triton.jit
def _plane(b, k, BITS: tl.constexpr):
    """Plane k (codes at bits ``8 - BITS * (k + 1)``) of int32 bytes ``b``, as fp16."""
    return magic_fp16((b >> (8 - BITS * (k + 1))) & ((1 << BITS) - 1))


@triton.jit
def _key_bytes(u8, page, rows, g, PAGE_BYTES: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
               CODES: tl.constexpr):
    """Packed key bytes [P, GB] (uint8) of channel group g."""
    GB: tl.constexpr = G * BITS // 8
    return tl.load(u8 + page * PAGE_BYTES + CODES + rows[:, None] * (D * BITS // 8) + g * GB + tl.arange(0, GB)[None, :])


@triton.jit
def _value_bytes(u8, page, rows, g, PAGE_BYTES: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 CODES: tl.constexpr):
    """Packed value bytes [G, P] (uint8) of channel group g, row c holding the byte of plane-order
    channel c (each byte read once per plane)."""
    GB: tl.constexpr = G * BITS // 8
    c = tl.arange(0, G)
    return tl.load(u8 + page * PAGE_BYTES + CODES + rows[None, :] * (D * BITS // 8) + g * GB + (c % GB)[:, None])


@triton.jit
def _key_scores(q, q_rows, live, scale_log2, b, scale, zero, g, P: tl.constexpr, ROWS: tl.constexpr,
                BITS: tl.constexpr, G: tl.constexpr):
    """Scores^T [P, ROWS] (log2 units) of key channel group g from its bytes, scales and zeros."""
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = G * BITS // 8
    b = b.to(tl.int32)
    acc = tl.zeros((P, ROWS), tl.float32)
    q_sum = tl.zeros((ROWS,), tl.float32)
    for k in tl.static_range(PER):
        q_k = _q_plane(q, q_rows, live, scale_log2, g, k, G, GB, PER)
        acc = tl.dot(_plane(b, k, BITS), q_k, acc)
        q_sum += tl.sum(q_k.to(tl.float32), 0)
    return acc * scale[:, None] + zero[:, None] * q_sum[None, :]


@triton.jit
def _values(b, scale, zero, p, o, z, BITS: tl.constexpr, G: tl.constexpr, SYMMETRIC: tl.constexpr):
    """(o^T [G, ROWS] + codes^T @ (p^T * scale), z [P, ROWS] + p^T * zero) for one value channel group.
    A symmetric layout's zero, -(2^(bits-1) - 1) * scale, is subtracted from the codes instead (exact)."""
    GB: tl.constexpr = G * BITS // 8
    c = tl.arange(0, G)
    codes = ((b.to(tl.int32) >> (8 - BITS * (c // GB + 1))[:, None]) & ((1 << BITS) - 1)) | 0x6400
    codes = codes.to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + code
    if SYMMETRIC:
        codes -= 1024.0 + ((1 << (BITS - 1)) - 1)
    else:
        codes -= 1024.0
        z += p * zero[:, None]
    return tl.dot(codes, (p * scale[:, None]).to(tl.float16), o), z


@triton.jit
def _dense_values(dense, page, h, g, n, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr):
    """Dense values^T [G, P] fp16 of channel group g, channels in the same plane order as `_values`; tokens past
    the page's ``n`` read as zero (another request's leftovers: p = 0 there, and 0 x inf is NaN)."""
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = G * BITS // 8
    c = tl.arange(0, G)
    channel = g * G + PER * (c % GB) + c // GB
    t = tl.arange(0, P)
    return tl.load(dense + ((page * 2 + 1) * P + t[None, :]) * (H * D) + h * D + channel[:, None],
                   mask=t[None, :] < n, other=0.0).to(tl.float16)


@triton.jit
def _page_data(u8, i16, i32, page_ids, at, h, PAGE_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
               D: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SYMMETRIC: tl.constexpr,
               K_KIND: tl.constexpr, K_ESIZE: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr,
               K_ZEROS: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
               V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr,
               V_ZEROS: tl.constexpr):
    """Everything one packed page contributes, loaded: key bytes, scales and zeros of up to two channel
    groups, and the same for values (a second group repeats the first where there is one group)."""
    page = tl.load(page_ids + at).to(tl.int64)
    rows = tl.arange(0, P) * H + h
    KNG: tl.constexpr = D // K_GROUP
    VNG: tl.constexpr = D // V_GROUP
    kb0 = _key_bytes(u8, page, rows, 0, PAGE_BYTES, D, K_BITS, K_GROUP, K_CODES)
    ks0, kz0 = scale_zero(u8, i16, i32, page, rows * KNG, PAGE_BYTES, K_BITS, K_SYMMETRIC, K_KIND, K_ESIZE, K_SCALES,
                           K_ZEROS)
    vb0 = _value_bytes(u8, page, rows, 0, PAGE_BYTES, D, V_BITS, V_GROUP, V_CODES)
    vs0, vz0 = scale_zero(u8, i16, i32, page, rows * VNG, PAGE_BYTES, V_BITS, V_SYMMETRIC, V_KIND, V_ESIZE, V_SCALES,
                           V_ZEROS)
    kb1, ks1, kz1, vb1, vs1, vz1 = kb0, ks0, kz0, vb0, vs0, vz0
    if KNG > 1:
        kb1 = _key_bytes(u8, page, rows, 1, PAGE_BYTES, D, K_BITS, K_GROUP, K_CODES)
        ks1, kz1 = scale_zero(u8, i16, i32, page, rows * KNG + 1, PAGE_BYTES, K_BITS, K_SYMMETRIC, K_KIND, K_ESIZE,
                               K_SCALES, K_ZEROS)
    if VNG > 1:
        vb1 = _value_bytes(u8, page, rows, 1, PAGE_BYTES, D, V_BITS, V_GROUP, V_CODES)
        vs1, vz1 = scale_zero(u8, i16, i32, page, rows * VNG + 1, PAGE_BYTES, V_BITS, V_SYMMETRIC, V_KIND, V_ESIZE,
                               V_SCALES, V_ZEROS)
    return kb0, ks0, kz0, vb0, vs0, vz0, kb1, ks1, kz1, vb1, vs1, vz1


@triton.jit(do_not_specialize=_VARYING)
def _planar_decode_kernel(q, o_part, m_part, l_part, u8, i16, i32, dense, page_ids, valid, req_start, req_pages,
                          req_packed, scale_log2, pages_per_split, num_splits,
                          PAGE_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                          GROUP: tl.constexpr, ROWS: tl.constexpr,
                          K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SYMMETRIC: tl.constexpr, K_KIND: tl.constexpr,
                          K_ESIZE: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr, K_ZEROS: tl.constexpr,
                          V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr, V_KIND: tl.constexpr,
                          V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr, V_ZEROS: tl.constexpr):
    r, h, s, start, first, last, packed = program_pages(req_start, req_pages, req_packed, pages_per_split)
    KNG: tl.constexpr = D // K_GROUP
    VNG: tl.constexpr = D // V_GROUP
    VG: tl.constexpr = V_GROUP

    i = tl.arange(0, ROWS)
    heads = h * GROUP + i
    q_rows = (r * (H * GROUP) + heads) * D
    live = i < GROUP
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_acc = tl.zeros((P, ROWS), tl.float32)  # softmax denominators per token slot: summed once at the end
    o0 = tl.zeros((VG, ROWS), tl.float32)  # output^T per value channel group, channels in plane order
    o1 = tl.zeros((VG, ROWS), tl.float32)
    z0 = tl.zeros((P, ROWS), tl.float32)  # probabilities times value zeros per token slot (asymmetric values)
    z1 = tl.zeros((P, ROWS), tl.float32)

    for j in range(first, tl.minimum(last, packed)):
        kb0, ks0, kz0, vb0, vs0, vz0, kb1, ks1, kz1, vb1, vs1, vz1 = _page_data(
            u8, i16, i32, page_ids, start + j, h, PAGE_BYTES, H, P, D, K_BITS, K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE,
            K_CODES, K_SCALES, K_ZEROS, V_BITS, V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS)
        scores = _key_scores(q, q_rows, live, scale_log2, kb0, ks0, kz0, 0, P, ROWS, K_BITS, K_GROUP)
        if KNG > 1:
            scores += _key_scores(q, q_rows, live, scale_log2, kb1, ks1, kz1, 1, P, ROWS, K_BITS, K_GROUP)
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp2(m_i - m_new)
        m_i = m_new
        p = tl.exp2(scores - m_i[None, :])  # [P, ROWS]
        l_acc = l_acc * alpha[None, :] + p
        o0, z0 = _values(vb0, vs0, vz0, p, o0 * alpha[None, :], z0 * alpha[None, :], V_BITS, VG, V_SYMMETRIC)
        if VNG > 1:
            o1, z1 = _values(vb1, vs1, vz1, p, o1 * alpha[None, :], z1 * alpha[None, :], V_BITS, VG, V_SYMMETRIC)

    # Dense (BF16) pages: the request's active tail.
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    q_t = (tl.load(q + q_rows[None, :] + d[:, None], mask=live[None, :], other=0.0).to(tl.float32)
           * scale_log2).to(tl.float16)  # [D, ROWS]
    for j in range(tl.maximum(first, packed), last):
        page = tl.load(page_ids + start + j).to(tl.int64)
        n = tl.load(valid + start + j)
        keys = tl.load(dense + ((page * 2) * P + t[:, None]) * (H * D) + h * D + d[None, :]).to(tl.float16)
        scores = tl.where(t[:, None] < n, tl.dot(keys, q_t), float("-inf"))  # [P, ROWS]
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp2(m_i - m_new)
        m_i = m_new
        p = tl.exp2(scores - m_i[None, :])
        l_acc = l_acc * alpha[None, :] + p
        z0 = z0 * alpha[None, :]
        z1 = z1 * alpha[None, :]
        o0 = tl.dot(_dense_values(dense, page, h, 0, n, H, P, D, V_BITS, VG), p.to(tl.float16), o0 * alpha[None, :])
        if VNG > 1:
            o1 = tl.dot(_dense_values(dense, page, h, 1, n, H, P, D, V_BITS, VG), p.to(tl.float16), o1 * alpha[None, :])

    part = (r * (H * GROUP) + heads) * num_splits + s
    tl.store(m_part + part, m_i, mask=live)
    tl.store(l_part + part, tl.sum(l_acc, 0), mask=live)
    PER: tl.constexpr = 8 // V_BITS
    GB: tl.constexpr = VG * V_BITS // 8
    c = tl.arange(0, VG)
    channel = PER * (c % GB) + c // GB
    out = o_part + part[None, :] * D + channel[:, None]
    tl.store(out, o0 + tl.sum(z0, 0)[None, :], mask=live[None, :])
    if VNG > 1:
        tl.store(out + VG, o1 + tl.sum(z1, 0)[None, :], mask=live[None, :])


MIN_PAGE_SIZE = 64  # tokens along the product's M: 64 is one warp group's tile


def supports(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int) -> bool:
    """Whether the planar kernel reads this pair of schemes."""
    def pow2(x: int) -> bool:
        return x > 0 and x & (x - 1) == 0

    def ok(x: TensorScheme) -> bool:
        return (x.mode == TOKEN_GROUPS and x.bits in (2, 4, 8) and not x.stages and pow2(x.group)
                and 64 <= x.group <= head_dim and head_dim // x.group <= 2 and x.group * x.bits // 8 >= 16)

    return ok(k) and ok(v) and pow2(page_size) and page_size >= MIN_PAGE_SIZE and pow2(head_dim)


def preferred(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, pages_per_program: int) -> bool:
    """Whether `paged_decode` picks this kernel by default: where it reads the layout and each program
    walks enough pages (as for the folded kernel). H200, perf/NOTES.md v16: faster than the folded
    kernel at every bench shape for rtn-2 (fp8 and fp16 scales) and rtn-4, 1.09-1.31x at B=8."""
    return supports(k, v, page_size, head_dim) and pages_per_program >= MIN_PAGES_PER_PROGRAM


def launch(q, o_part, m_part, l_part, views, dense, plan, scale_log2, per_split, splits, grid, constants: dict,
           num_warps: int, num_stages: int) -> None:
    """Launch the planar kernel (arguments as prepared by `paged_decode`; ``constants`` as for the
    other decode kernels, of which it takes what it reads)."""
    u8, i16, i32 = views
    names = ("BITS", "GROUP", "SYMMETRIC", "KIND", "ESIZE", "CODES", "SCALES", "ZEROS")
    own = {f"{x}_{n}": constants[f"{x}_{n}"] for x in ("K", "V") for n in names}
    own.update({n: constants[n] for n in ("PAGE_BYTES", "H", "P", "D", "GROUP", "ROWS")})
    _planar_decode_kernel[grid](
        q, o_part, m_part, l_part, u8, i16, i32, dense, plan.page_ids, plan.valid, plan.req_start, plan.req_pages,
        plan.req_packed, scale_log2, per_split, splits, **own, num_warps=num_warps, num_stages=num_stages)
