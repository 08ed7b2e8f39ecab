"""Paged decode attention with the scales folded out of the per-element path.

The plain kernel (`paged_decode`) rebuilds every K and V element as ``code * scale + zero`` before
its tensor-core products; with 2-bit codes that per-element work, not memory, sets its speed. Here
the tensor cores consume the integer-valued codes themselves (exact in fp16) and the scales act on
the small side of each product:

    keys, per-token channel groups g:   s[q, t] = sum_g scale[t, g] * (q_g . codes[t, g]) + zero[t, g] * sum(q_g)
    keys, per-channel token groups:     s[q, t] = (q * scale) . codes[t] + q . zero
    values, per-token channel groups:   o[q, g] += p @ (codes[:, g] * scale[:, g] + zero[:, g])  (default), or
                                        o[q, g] += (p * scale[:, g]) @ codes[:, g];   z[q, g] += p @ zero[:, g]
    centroids (every stage):            s[q, t] += (q @ C^T)[q, a[t]];               o[q] += (p @ onehot(a)) @ C

so per key code only an unpack remains: shift, mask and a float conversion (on the GPU, two codes per
32-bit register through a magic-number conversion; in the interpreter, plain Triton). For values the
per-token scale and zero are broadcast along each row in registers (one fp16 multiply-add per code, no
reshape), which lets every channel group share one staged probability operand and drops the
cross-warp sums of ``p @ zero``: measured 1.2-1.3x faster than scaling the probabilities. Channel groups
are unrolled, each a 2-D product of its own (a 3-D batched product was tried first: its reductions
across the batch crossed warps and it ran 2x slower). ``lazy=True`` rescales the online softmax's
accumulators only when a row's maximum grows by more than 2^8 (measured no faster, so off by default).

Serves keys in either scale mode and values with per-token channel groups, 2/4/8-bit codes, with or
without zeros and centroid stages; `supports` says which layouts, and `paged_decode` falls back to
the plain kernel for the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvbackend.scheme import CHANNEL_GROUPS, FLOAT, TOKEN_GROUPS, TensorScheme

from kvbackend.kernels.decode_split import VARYING as _VARYING, program_pages
from kvbackend.kernels.dequant import centroid_rows, load_elements, magic_fp16, scale_zero
from kvbackend.kernels.levers import (hadamard_apply, lever_constants as levers_off, outlier_rows, outlier_tile,
                                      page_rotation, psac_basis, psac_rows, query_and_partner, query_to_page,
                                      rotate_halves)

RESCALE_LOG2 = tl.constexpr(8.0)  # rescale accumulators only when a row's running maximum grows by more than this
VFOLD_DEFAULT = False  # values: scales on the probabilities (True) or on the codes in registers (False, measured faster)
_TOKEN_GROUPS = tl.constexpr(TOKEN_GROUPS)
_CHANNEL_GROUPS = tl.constexpr(CHANNEL_GROUPS)

# Four bytes of 2-bit codes (first code in the top bits of each byte) -> four pairs of fp16 per
# output: output k holds the codes of shift 6 - 2k of bytes (0, 1) in its first register and of
# bytes (2, 3) in its second. prmt spreads bytes into 16-bit lanes; or-ing a code into the mantissa of
# 1024.0 (0x6400) and subtracting 1024.0 gives the code as fp16 without an integer conversion.
_UNPACK2 = tl.constexpr("""
{
.reg .b32 lo, hi, t, m;
mov.b32 m, 0x64006400;
prmt.b32 lo, $8, 0, 0x4140;
prmt.b32 hi, $8, 0, 0x4342;
shr.b32 t, lo, 6; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $0, t, m;
shr.b32 t, hi, 6; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $1, t, m;
shr.b32 t, lo, 4; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $2, t, m;
shr.b32 t, hi, 4; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $3, t, m;
shr.b32 t, lo, 2; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $4, t, m;
shr.b32 t, hi, 2; and.b32 t, t, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $5, t, m;
and.b32 t, lo, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $6, t, m;
and.b32 t, hi, 0x00030003; or.b32 t, t, 0x64006400; sub.f16x2 $7, t, m;
}
""")


@triton.jit
def unpack_fp16(b, BITS: tl.constexpr, ASM: tl.constexpr):
    """Codes as fp16 in channel order from packed bytes ``b`` (uint8 [..., N]) -> [..., N * 8 // BITS].

    A byte holds its first code in the top bits. ASM (GPU only) converts two codes per instruction."""
    if BITS == 8:
        return b.to(tl.float16)
    elif BITS == 4:
        x = b.to(tl.int32)
        return tl.interleave(magic_fp16(x >> 4), magic_fp16(x & 15))
    else:
        if ASM:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _UNPACK2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            x = b.to(tl.int32)
            c0 = magic_fp16((x >> 6) & 3)
            c1 = magic_fp16((x >> 4) & 3)
            c2 = magic_fp16((x >> 2) & 3)
            c3 = magic_fp16(x & 3)
        return tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))


@triton.jit
def _centroid_ids(u8, page, t, h, stage, PAGE_BYTES: tl.constexpr, ASSIGN: tl.constexpr, H: tl.constexpr,
                  P: tl.constexpr, CP: tl.constexpr):
    """One-hot [BT, CP] fp16 of the tokens' centroid ids in one stage."""
    ids = tl.load(u8 + page * PAGE_BYTES + ASSIGN + (stage * P + t) * H + h).to(tl.int32)
    return (ids[:, None] == tl.arange(0, CP)[None, :]).to(tl.float16)


@triton.jit
def _centroids(book_i16, slot, h, stage, BOOK_BYTES: tl.constexpr, BOOK: tl.constexpr, CSCALE: tl.constexpr,
               H: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, D: tl.constexpr):
    """One stage's centroids as (values [CP, D] fp16, rows past C zero; scale): `centroid_rows`."""
    return _centroid_cols(book_i16, slot, h, stage, 0, BOOK_BYTES, BOOK, CSCALE, H, C, CP, D, D)


@triton.jit
def _centroid_cols(book_i16, slot, h, stage, g, BOOK_BYTES: tl.constexpr, BOOK: tl.constexpr, CSCALE: tl.constexpr,
                   H: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """Columns g*G..(g+1)*G of one stage's centroids as (values [CP, G] fp16, rows past C zero; scale)."""
    c = tl.arange(0, CP)
    x, scale = centroid_rows(book_i16, slot, h, stage, tl.minimum(c, C - 1)[:, None], g * G + tl.arange(0, G)[None, :],
                             BOOK_BYTES, BOOK, CSCALE, H, C, D)
    return tl.where((c < C)[:, None], x, 0.0).to(tl.float16), scale


@triton.jit
def _centroid_values(acc, p_c, book_i16, slot, h, stage, g, BOOK_BYTES: tl.constexpr, BOOK: tl.constexpr,
                     CSCALE: tl.constexpr, H: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr):
    """``acc`` [ROWS, G] plus the probabilities per centroid ``p_c`` [ROWS, CP] times channel group g of
    one stage's centroids (accumulated in the product for bf16 centroids, scaled after it for fp8)."""
    cols, scale = _centroid_cols(book_i16, slot, h, stage, g, BOOK_BYTES, BOOK, CSCALE, H, C, CP, G, D)
    if CSCALE >= 0:
        return acc + tl.dot(p_c, cols) * scale
    return tl.dot(p_c, cols, acc)


@triton.jit
def _load_q(q, q_rows, live, col0, scale_log2, W: tl.constexpr):
    """Queries [ROWS, W] (columns col0..col0+W) times the softmax scale, fp16."""
    cols = col0 + tl.arange(0, W)
    x = tl.load(q + q_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    return (x * scale_log2).to(tl.float16)


@triton.jit
def _group_codes(u8, page, rows, g, PAGE_BYTES: tl.constexpr, ASM: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BITS: tl.constexpr, CODES: tl.constexpr):
    """fp16 codes [BT, G] of channel group g; ``page`` [BT] (int64) and ``rows`` [BT] say where each
    token lives."""
    GB: tl.constexpr = G * BITS // 8
    return unpack_fp16(tl.load(u8 + page[:, None] * PAGE_BYTES + CODES + rows[:, None] * (D * BITS // 8) + g * GB
                               + tl.arange(0, GB)[None, :]), BITS, ASM)


@triton.jit
def _key_group(u8, i16, i32, page, rows, q_g, q_g_sum, g, PAGE_BYTES: tl.constexpr, ASM: tl.constexpr,
               NG: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
               KIND: tl.constexpr, ESIZE: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr):
    """Scores [ROWS, BT] of channel group g of per-token-group keys: s * (q_g . codes) + z * sum(q_g)."""
    codes = _group_codes(u8, page, rows, g, PAGE_BYTES, ASM, G, D, BITS, CODES)
    scale, zero = scale_zero(u8, i16, i32, page, rows * NG + g, PAGE_BYTES, BITS, SYMMETRIC, KIND, ESIZE, SCALES, ZEROS)
    return tl.dot(q_g, tl.trans(codes)) * scale[None, :] + q_g_sum[:, None] * zero[None, :]


@triton.jit
def _value_group(u8, i16, i32, page, rows, p, acc, zacc, g, PAGE_BYTES: tl.constexpr, ASM: tl.constexpr,
                 NG: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                 KIND: tl.constexpr, ESIZE: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr,
                 ZEROS: tl.constexpr, VFOLD: tl.constexpr):
    """Accumulate channel group g of per-token-group values. VFOLD: acc += (p * s) @ codes and
    zacc += p @ z (scales on the probabilities); else acc += p @ (codes * s + z) with the per-token
    scale and zero broadcast along the row in registers (fp16), so every group shares one p operand."""
    codes = _group_codes(u8, page, rows, g, PAGE_BYTES, ASM, G, D, BITS, CODES)
    scale, zero = scale_zero(u8, i16, i32, page, rows * NG + g, PAGE_BYTES, BITS, SYMMETRIC, KIND, ESIZE, SCALES, ZEROS)
    if VFOLD:
        acc = tl.dot((p * scale[None, :]).to(tl.float16), codes, acc)
        zacc += tl.sum(p * zero[None, :], 1)
    else:
        acc = tl.dot(p.to(tl.float16), codes * scale.to(tl.float16)[:, None] + zero.to(tl.float16)[:, None], acc)
    return acc, zacc


@triton.jit
def _channel_keys(u8, i16, i32, book_i16, page, slot, h, blk, rows, t, coef, C0: tl.constexpr, W: tl.constexpr,
                  PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, ASM: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr,
                  ESIZE: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr,
                  STAGES: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, BOOK: tl.constexpr, ASSIGN: tl.constexpr,
                  P: tl.constexpr, PSAC_R: tl.constexpr, PSAC_BASIS: tl.constexpr, CSCALE: tl.constexpr):
    """Channels C0..C0+W-1 of per-channel-group keys [BT, W] fp16, rebuilt in the stored frame: codes
    times the channel's step plus its zero, every centroid stage, and the PSAC rows (``coef``), for
    levers that act on whole keys (pre-RoPE rotation)."""
    codes = unpack_fp16(tl.load(u8 + page * PAGE_BYTES + CODES + rows[:, None] * (D * BITS // 8) + C0 * BITS // 8
                                + tl.arange(0, W * BITS // 8)[None, :]), BITS, ASM)  # [BT, W]
    ks, kz = scale_zero(u8, i16, i32, page, (blk * H + h) * D + C0 + tl.arange(0, W), PAGE_BYTES, BITS, SYMMETRIC,
                        KIND, ESIZE, SCALES, ZEROS)
    k = codes * ks.to(tl.float16)[None, :] + kz.to(tl.float16)[None, :]
    for stage in tl.static_range(STAGES):
        onehot = _centroid_ids(u8, page, t, h, stage, PAGE_BYTES, ASSIGN, H, P, CP)
        cols, scale = _centroid_cols(book_i16, slot, h, stage, C0 // W, BOOK_BYTES, BOOK, CSCALE, H, C, CP, W, D)
        k += (tl.dot(onehot, cols) * scale).to(tl.float16)
    if PSAC_R:
        k += tl.dot(coef, psac_basis(book_i16, slot, h, BOOK_BYTES, D, PSAC_R, PSAC_BASIS, C0, W)).to(tl.float16)
    return k


@triton.jit
def _rotate_back(a0, a1, a2, a3, z0, z1, z2, z3, l_acc, hadamard_ptr, VNG: tl.constexpr, VG: tl.constexpr,
                 D: tl.constexpr):
    """Value accumulators (channel groups of VG) summed in the Hadamard-rotated frame, rotated back:
    group g' = sum_g (a_g + z_g) @ H[g, g'] (blocks of the ±1 matrix; `hadamard_apply` per block),
    on the normalised sums (fp16 range), zeros folded in."""
    l_i = tl.sum(l_acc, 1)
    l_safe = tl.where(l_i > 0, l_i, 1.0)[:, None]
    x0 = (a0 + z0[:, None]) / l_safe
    x1 = (a1 + z1[:, None]) / l_safe
    x2 = (a2 + z2[:, None]) / l_safe
    x3 = (a3 + z3[:, None]) / l_safe
    vi = tl.arange(0, VG)
    out0 = tl.zeros_like(a0)
    out1 = tl.zeros_like(a0)
    out2 = tl.zeros_like(a0)
    out3 = tl.zeros_like(a0)
    for g in tl.static_range(VNG):
        xg = x0
        if g == 1:
            xg = x1
        if g == 2:
            xg = x2
        if g == 3:
            xg = x3
        rows = (g * VG + vi)[:, None] * D
        out0 += hadamard_apply(xg, tl.load(hadamard_ptr + rows + vi[None, :]), D)
        if VNG > 1:
            out1 += hadamard_apply(xg, tl.load(hadamard_ptr + rows + VG + vi[None, :]), D)
        if VNG > 2:
            out2 += hadamard_apply(xg, tl.load(hadamard_ptr + rows + 2 * VG + vi[None, :]), D)
            out3 += hadamard_apply(xg, tl.load(hadamard_ptr + rows + 3 * VG + vi[None, :]), D)
    zero = tl.zeros_like(z0)
    return out0 * l_safe, out1 * l_safe, out2 * l_safe, out3 * l_safe, zero, zero, zero, zero


@triton.jit
def _rescale(m_i, m_new, l_acc, a0, a1, a2, a3, z0, z1, z2, z3):
    """Move the online softmax's reference maximum from m_i to m_new: every accumulator times 2^(m_i - m_new)."""
    alpha = tl.exp2(m_i - m_new)
    return (m_new, l_acc * alpha[:, None], a0 * alpha[:, None], a1 * alpha[:, None], a2 * alpha[:, None],
            a3 * alpha[:, None], z0 * alpha, z1 * alpha, z2 * alpha, z3 * alpha)


@triton.jit(do_not_specialize=_VARYING)
def _folded_decode_kernel(q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, page_ids, slots, valid,
                          req_start, req_pages, req_packed, scale_log2, pages_per_split, num_splits,
                          local_cos, local_sin, base_cos, base_sin, hadamard_ptr,
                          PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                          D: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, ASM: tl.constexpr,
                          LAZY: tl.constexpr, PAGES: tl.constexpr, VFOLD: tl.constexpr,
                          K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SYMMETRIC: tl.constexpr,
                          K_KIND: tl.constexpr, K_ESIZE: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr,
                          K_ZEROS: tl.constexpr, K_ASSIGN: tl.constexpr, K_STAGES: tl.constexpr, K_C: tl.constexpr,
                          K_BOOK: tl.constexpr, K_CSCALE: tl.constexpr,
                          V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
                          V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr,
                          V_ZEROS: tl.constexpr, V_ASSIGN: tl.constexpr, V_STAGES: tl.constexpr, V_C: tl.constexpr,
                          V_BOOK: tl.constexpr, V_CSCALE: tl.constexpr,
                          SINK: tl.constexpr, SINK_K: tl.constexpr, SINK_V: tl.constexpr, SINK_KIND: tl.constexpr,
                          SINK_ROWS: tl.constexpr, ROPE: tl.constexpr, PAGE_ROPE: tl.constexpr, VROT: tl.constexpr,
                          PSAC_R: tl.constexpr, PSAC_N: tl.constexpr, PSAC_NP: tl.constexpr, PSAC_SPARSE: tl.constexpr,
                          PSAC_CODES: tl.constexpr, PSAC_SCALE: tl.constexpr, PSAC_TOKEN: tl.constexpr,
                          PSAC_BASIS: tl.constexpr, OUT_N: tl.constexpr, OUT_NP: tl.constexpr,
                          OUT_INDEX: tl.constexpr, OUT_VALUE: tl.constexpr, WHOLE_N: tl.constexpr,
                          WHOLE_CODES: tl.constexpr, WHOLE_SCALE: tl.constexpr,
                          WHOLE_TOKEN: tl.constexpr):  # WHOLE_N is 0 here: whole key rows take the plain kernel
    r, h, s, start, first, last, packed = program_pages(req_start, req_pages, req_packed, pages_per_split)
    # Levers (`kernels/levers.py`; `supports_levers`): per-channel keys are rebuilt explicitly when
    # each key must be rotated (pre-RoPE), in RoPE's two halves; page-relative keys take the query
    # rotated once per page; PSAC rows add (q . basis) . coefficients per token, key outliers (q at their
    # channels times their values) per token, or join rebuilt keys; sinks are masked here
    # and attended in the merge; rotated values are rotated back once, after the packed pages.
    EXPLICIT: tl.constexpr = ROPE

    # Channel groups are unrolled (at most 4 for keys and 4 for values: `supports` checks), each a
    # 2-D product of its own, so no reduction ever crosses warps. Keys per-token: KNG groups of KG
    # channels; keys per-channel: softmax blocks of K_GROUP tokens. Values: VNG groups of VG channels.
    KNG: tl.constexpr = D // K_GROUP if K_MODE == _TOKEN_GROUPS else 1
    KG: tl.constexpr = K_GROUP if K_MODE == _TOKEN_GROUPS else D
    # tokens per softmax block: a token group of per-channel keys, else PAGES whole pages
    BT: tl.constexpr = K_GROUP if K_MODE == _CHANNEL_GROUPS else P * PAGES
    BLOCKS: tl.constexpr = P // K_GROUP if K_MODE == _CHANNEL_GROUPS else 1  # blocks per loop step
    VNG: tl.constexpr = D // V_GROUP
    VG: tl.constexpr = V_GROUP
    K_ROW: tl.constexpr = D * K_BITS // 8
    KCP: tl.constexpr = max(16, K_C)
    VCP: tl.constexpr = max(16, V_C)

    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    heads = h * GROUP + i
    q_rows = (r * (H * GROUP) + heads) * D
    live = i < GROUP
    # Queries carry the softmax scale (log2 units), rounded to fp16 once: every product uses the same q.
    q_f16 = _load_q(q, q_rows, live, 0, scale_log2, D)
    q_f32 = q_f16.to(tl.float32)
    q0 = _load_q(q, q_rows, live, 0, scale_log2, KG)
    q0_sum = tl.sum(q0.to(tl.float32), 1)
    q1, q2, q3 = q0, q0, q0
    q1_sum, q2_sum, q3_sum = q0_sum, q0_sum, q0_sum
    if KNG > 1:
        q1 = _load_q(q, q_rows, live, KG, scale_log2, KG)
        q1_sum = tl.sum(q1.to(tl.float32), 1)
    if KNG > 2:
        q2 = _load_q(q, q_rows, live, 2 * KG, scale_log2, KG)
        q2_sum = tl.sum(q2.to(tl.float32), 1)
        q3 = _load_q(q, q_rows, live, 3 * KG, scale_log2, KG)
        q3_sum = tl.sum(q3.to(tl.float32), 1)
    HALF: tl.constexpr = D // 2
    if PAGE_ROPE:  # the query's RoPE partners [q_hi, -q_lo], rounded as q_f16 is
        _, q_partner = query_and_partner(q, q_rows, live, D)
        q_partner = (q_partner * scale_log2).to(tl.float16).to(tl.float32)
    if ROPE:
        q_lo = _load_q(q, q_rows, live, 0, scale_log2, HALF)
        q_hi = _load_q(q, q_rows, live, HALF, scale_log2, HALF)
        q_lo32 = q_lo.to(tl.float32)
        q_hi32 = q_hi.to(tl.float32)
        half = tl.arange(0, HALF)
        t_all = tl.arange(0, BT)
        cos_t = tl.load(local_cos + t_all[:, None] * HALF + half[None, :]).to(tl.float16)  # block 0's R(t)
        sin_t = tl.load(local_sin + t_all[:, None] * HALF + half[None, :]).to(tl.float16)

    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_acc = tl.zeros((ROWS, BT), tl.float32)  # softmax denominators per column: summed once at the end
    # Per value channel group: codes times scaled probabilities, and probabilities times zeros.
    a0 = tl.zeros((ROWS, VG), tl.float32)
    a1 = tl.zeros((ROWS, VG), tl.float32)
    a2 = tl.zeros((ROWS, VG), tl.float32)
    a3 = tl.zeros((ROWS, VG), tl.float32)
    z0 = tl.zeros((ROWS,), tl.float32)
    z1 = tl.zeros((ROWS,), tl.float32)
    z2 = tl.zeros((ROWS,), tl.float32)
    z3 = tl.zeros((ROWS,), tl.float32)

    end_packed = tl.minimum(last, packed)
    for j in range(first, end_packed, PAGES):
        page = tl.load(page_ids + start + j).to(tl.int64)
        slot = tl.load(slots + start + j).to(tl.int64)
        q_page32 = q_f32  # the query in the page's stored frame
        if PAGE_ROPE:
            q_page32 = query_to_page(q_f32, q_partner, base_cos, base_sin, j, D)
        q_page16 = q_page32.to(tl.float16)
        if PSAC_R and not EXPLICIT:  # (q . basis) [ROWS, 16], once per page
            q_basis = tl.dot(q_page16, tl.trans(psac_basis(book_i16, slot, h, BOOK_BYTES, D, PSAC_R, PSAC_BASIS, 0,
                                                           D))).to(tl.float16)
        for blk in tl.static_range(BLOCKS):
            if PAGES == 2:  # two pages in one block; a missing second page repeats the first, masked
                page2 = tl.load(page_ids + start + tl.minimum(j + 1, end_packed - 1)).to(tl.int64)
                tt = tl.arange(0, BT)
                t = tt % P
                page_t = tl.where(tt < P, page, page2)
                present = (tt < P) | (j + 1 < end_packed)
            else:
                t = blk * BT + tl.arange(0, BT)
                page_t = tl.zeros((BT,), tl.int64) + page
            rows = t * H + h
            # ---- scores [ROWS, BT], log2 units
            if K_MODE == _TOKEN_GROUPS:
                scores = _key_group(u8, i16, i32, page_t, rows, q0, q0_sum, 0, PAGE_BYTES, ASM, KNG, KG, D, K_BITS,
                                    K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS)
                if KNG > 1:
                    scores += _key_group(u8, i16, i32, page_t, rows, q1, q1_sum, 1, PAGE_BYTES, ASM, KNG, KG, D, K_BITS,
                                         K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS)
                if KNG > 2:
                    scores += _key_group(u8, i16, i32, page_t, rows, q2, q2_sum, 2, PAGE_BYTES, ASM, KNG, KG, D, K_BITS,
                                         K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS)
                    scores += _key_group(u8, i16, i32, page_t, rows, q3, q3_sum, 3, PAGE_BYTES, ASM, KNG, KG, D, K_BITS,
                                         K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS)
            elif EXPLICIT:
                coef = q_lo  # unused without PSAC rows
                if PSAC_R:
                    coef = psac_rows(u8, i16, page, h, t, PAGE_BYTES, H, PSAC_R, PSAC_N, PSAC_NP, PSAC_SPARSE,
                                     PSAC_CODES, PSAC_SCALE, PSAC_TOKEN)
                k_lo = _channel_keys(u8, i16, i32, book_i16, page, slot, h, blk, rows, t, coef, 0, HALF, PAGE_BYTES,
                                     BOOK_BYTES, ASM, H, D, K_BITS, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES,
                                     K_ZEROS, K_STAGES, K_C, KCP, K_BOOK, K_ASSIGN, P, PSAC_R, PSAC_BASIS, K_CSCALE)
                k_hi = _channel_keys(u8, i16, i32, book_i16, page, slot, h, blk, rows, t, coef, HALF, HALF, PAGE_BYTES,
                                     BOOK_BYTES, ASM, H, D, K_BITS, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES,
                                     K_ZEROS, K_STAGES, K_C, KCP, K_BOOK, K_ASSIGN, P, PSAC_R, PSAC_BASIS, K_CSCALE)
                if OUT_N:  # key outliers join the rebuilt keys before their rotation
                    onehot_o, channel_o, value_o = outlier_rows(i16, page, h, t, PAGE_BYTES, H, D, OUT_N, OUT_NP,
                                                                OUT_INDEX, OUT_VALUE)
                    k_lo += outlier_tile(onehot_o, channel_o, value_o, 0, HALF).to(tl.float16)
                    k_hi += outlier_tile(onehot_o, channel_o, value_o, HALF, HALF).to(tl.float16)
                # q . R(p0) R(t) k = (R(p0)^T q) . (R(t) k)  (EXPLICIT is pre-RoPE keys)
                cos_0, sin_0 = page_rotation(base_cos, base_sin, j, D)
                qb_lo = (q_lo32 * cos_0[None, :] + q_hi32 * sin_0[None, :]).to(tl.float16)
                qb_hi = (q_hi32 * cos_0[None, :] - q_lo32 * sin_0[None, :]).to(tl.float16)
                if blk == 0:
                    c_t, s_t = cos_t, sin_t
                else:
                    c_t = tl.load(local_cos + t[:, None] * HALF + half[None, :]).to(tl.float16)
                    s_t = tl.load(local_sin + t[:, None] * HALF + half[None, :]).to(tl.float16)
                k_lo, k_hi = rotate_halves(k_lo, k_hi, c_t, s_t)
                scores = tl.dot(qb_lo, tl.trans(k_lo)) + tl.dot(qb_hi, tl.trans(k_hi))
            else:
                codes = unpack_fp16(tl.load(u8 + page * PAGE_BYTES + K_CODES + rows[:, None] * K_ROW
                                            + tl.arange(0, K_ROW)[None, :]), K_BITS, ASM)  # [BT, D]
                ks, kz = scale_zero(u8, i16, i32, page, (blk * H + h) * D + d, PAGE_BYTES, K_BITS, K_SYMMETRIC, K_KIND,
                                     K_ESIZE, K_SCALES, K_ZEROS)
                scores = tl.dot((q_page32 * ks[None, :]).to(tl.float16), tl.trans(codes))
                scores += tl.sum(q_page32 * kz[None, :], 1)[:, None]
            for stage in tl.static_range(0 if EXPLICIT and K_MODE == _CHANNEL_GROUPS else K_STAGES):
                cents, scale = _centroids(book_i16, slot, h, stage, BOOK_BYTES, K_BOOK, K_CSCALE, H, K_C, KCP, D)
                q_c = tl.dot(q_page16, tl.trans(cents)) * scale  # [ROWS, KCP]
                onehot = _centroid_ids(u8, page, t, h, stage, PAGE_BYTES, K_ASSIGN, H, P, KCP)
                scores += tl.dot(q_c.to(tl.float16), tl.trans(onehot))
            if PSAC_R and not EXPLICIT:  # the PSAC rows' score correction (q . basis) . coefficients
                coef = psac_rows(u8, i16, page, h, t, PAGE_BYTES, H, PSAC_R, PSAC_N, PSAC_NP, PSAC_SPARSE, PSAC_CODES,
                                 PSAC_SCALE, PSAC_TOKEN)
                scores += tl.dot(q_basis, tl.trans(coef))
            if OUT_N and not EXPLICIT:  # key outliers' score term: q at each outlier's channel times its value
                onehot_o, channel_o, value_o = outlier_rows(i16, page, h, t, PAGE_BYTES, H, D, OUT_N, OUT_NP, OUT_INDEX,
                                                            OUT_VALUE)  # onehot [BT, NP]
                spread = tl.where(channel_o[:, None] == d[None, :], value_o[:, None], 0.0).to(tl.float16)  # [NP, D]
                q_out = tl.dot(q_page16, tl.trans(spread))  # [ROWS, NP]
                scores += tl.dot(q_out.to(tl.float16), tl.trans(onehot_o))
            if PAGES == 2:
                scores = tl.where(present[None, :], scores, float("-inf"))
            if SINK:  # the merge kernel attends to the exact sink tokens
                scores = tl.where((j == 0) & (t[None, :] < SINK), float("-inf"), scores)
            # ---- online softmax (LAZY: rescale only when a row's maximum grows by more than 2^8)
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            if SINK:  # a block of sinks only: a finite floor keeps 2^(-inf - -inf) out
                m_new = tl.maximum(m_new, -1e30)
            if LAZY:
                if tl.max(m_new - m_i, 0) > RESCALE_LOG2:
                    m_i, l_acc, a0, a1, a2, a3, z0, z1, z2, z3 = _rescale(m_i, m_new, l_acc, a0, a1, a2, a3, z0, z1, z2, z3)
            else:
                m_i, l_acc, a0, a1, a2, a3, z0, z1, z2, z3 = _rescale(m_i, m_new, l_acc, a0, a1, a2, a3, z0, z1, z2, z3)
            p = tl.exp2(scores - m_i[:, None])  # [ROWS, BT]
            l_acc += p
            # ---- values
            a0, z0 = _value_group(u8, i16, i32, page_t, rows, p, a0, z0, 0, PAGE_BYTES, ASM, VNG, VG, D, V_BITS,
                                  V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, VFOLD)
            if VNG > 1:
                a1, z1 = _value_group(u8, i16, i32, page_t, rows, p, a1, z1, 1, PAGE_BYTES, ASM, VNG, VG, D, V_BITS,
                                      V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, VFOLD)
            if VNG > 2:
                a2, z2 = _value_group(u8, i16, i32, page_t, rows, p, a2, z2, 2, PAGE_BYTES, ASM, VNG, VG, D, V_BITS,
                                      V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, VFOLD)
                a3, z3 = _value_group(u8, i16, i32, page_t, rows, p, a3, z3, 3, PAGE_BYTES, ASM, VNG, VG, D, V_BITS,
                                      V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, VFOLD)
            for stage in tl.static_range(V_STAGES):
                onehot = _centroid_ids(u8, page, t, h, stage, PAGE_BYTES, V_ASSIGN, H, P, VCP)
                p_c = tl.dot(p.to(tl.float16), onehot).to(tl.float16)  # [ROWS, VCP]
                a0 = _centroid_values(a0, p_c, book_i16, slot, h, stage, 0, BOOK_BYTES, V_BOOK, V_CSCALE, H, V_C, VCP, VG, D)
                if VNG > 1:
                    a1 = _centroid_values(a1, p_c, book_i16, slot, h, stage, 1, BOOK_BYTES, V_BOOK, V_CSCALE, H, V_C, VCP, VG, D)
                if VNG > 2:
                    a2 = _centroid_values(a2, p_c, book_i16, slot, h, stage, 2, BOOK_BYTES, V_BOOK, V_CSCALE, H, V_C, VCP, VG, D)
                    a3 = _centroid_values(a3, p_c, book_i16, slot, h, stage, 3, BOOK_BYTES, V_BOOK, V_CSCALE, H, V_C, VCP, VG, D)

    if VROT:
        a0, a1, a2, a3, z0, z1, z2, z3 = _rotate_back(a0, a1, a2, a3, z0, z1, z2, z3, l_acc, hadamard_ptr, VNG, VG, D)
    # Dense (BF16) pages: the request's active tail.
    t = tl.arange(0, P)
    vj = tl.arange(0, VG)
    for j in range(tl.maximum(first, packed), last):
        page = tl.load(page_ids + start + j).to(tl.int64)
        n = tl.load(valid + start + j)
        keys = tl.load(dense + ((page * 2) * P + t[:, None]) * (H * D) + h * D + d[None, :]).to(tl.float16)
        scores = tl.dot(q_f16, tl.trans(keys))
        scores = tl.where(t[None, :] < n, scores, float("-inf"))
        m_i, l_acc, a0, a1, a2, a3, z0, z1, z2, z3 = _rescale(m_i, tl.maximum(m_i, tl.max(scores, 1)), l_acc, a0, a1, a2,
                                                              a3, z0, z1, z2, z3)
        p = tl.exp2(scores - m_i[:, None]).to(tl.float16)
        if BT == P:
            l_acc += p.to(tl.float32)
        else:
            l_acc += tl.where(tl.arange(0, BT)[None, :] == 0, tl.sum(p.to(tl.float32), 1)[:, None], 0.0)
        values = dense + ((page * 2 + 1) * P + t[:, None]) * (H * D) + h * D + vj[None, :]
        rows = t[:, None] < n  # rows past n are another request's leftovers: p = 0 there, and 0 x inf is NaN
        a0 = tl.dot(p, tl.load(values, mask=rows, other=0.0).to(tl.float16), a0)
        if VNG > 1:
            a1 = tl.dot(p, tl.load(values + VG, mask=rows, other=0.0).to(tl.float16), a1)
        if VNG > 2:
            a2 = tl.dot(p, tl.load(values + 2 * VG, mask=rows, other=0.0).to(tl.float16), a2)
            a3 = tl.dot(p, tl.load(values + 3 * VG, mask=rows, other=0.0).to(tl.float16), a3)

    part = (r * (H * GROUP) + heads) * num_splits + s
    tl.store(m_part + part, m_i, mask=live)
    tl.store(l_part + part, tl.sum(l_acc, 1), mask=live)
    out = o_part + part[:, None] * D + vj[None, :]
    tl.store(out, a0 + z0[:, None], mask=live[:, None])
    if VNG > 1:
        tl.store(out + VG, a1 + z1[:, None], mask=live[:, None])
    if VNG > 2:
        tl.store(out + 2 * VG, a2 + z2[:, None], mask=live[:, None])
        tl.store(out + 3 * VG, a3 + z3[:, None], mask=live[:, None])


def supports(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int) -> bool:
    """Whether the folded kernel reads this pair of schemes (else the plain kernel serves them)."""
    def pow2(x: int) -> bool:
        return x > 0 and x & (x - 1) == 0

    def groups_ok(x: TensorScheme) -> bool:
        # Channel groups are unrolled: 1, 2 or 4 of them, each at least 32 channels (16-channel groups
        # gave wrong results on the H200 under Triton 3.6 although the interpreter agrees: kernels v7).
        return pow2(x.group) and 32 <= x.group <= head_dim and head_dim // x.group <= 4

    if not all(x.mode != FLOAT and x.bits in (2, 4, 8) for x in (k, v)) or not (pow2(page_size) and pow2(head_dim)):
        return False
    k_ok = groups_ok(k) if k.mode == TOKEN_GROUPS else pow2(k.group) and 32 <= k.group <= page_size
    v_ok = v.mode == TOKEN_GROUPS and groups_ok(v)
    # 16-token pages: wrong results on the H200 under Triton 3.6 with the default value path (two GPU
    # test cases, 2026-11-30; the interpreter agrees with the reference), so they take the plain kernel.
    return k_ok and v_ok and page_size >= 32


MIN_PAGES_PER_PROGRAM = 16  # below this the plain kernel measured faster (B=1, L=32K: 4 pages a program)


def preferred(k: TensorScheme, v: TensorScheme, page_size: int, head_dim: int, pages_per_program: int) -> bool:
    """Whether `paged_decode` picks this kernel by default: where it reads the layout and each program
    walks enough pages to amortise its longer prologue (H200, perf/NOTES.md kernels v9/v10: at B=8,
    L=32K, 32 pages a program, folded 299-440 us vs plain 351-586 us; at B=1, 4 pages a program,
    plain 93-112 us vs folded 117-325 us)."""
    return supports(k, v, page_size, head_dim) and pages_per_program >= MIN_PAGES_PER_PROGRAM


def supports_levers(k: TensorScheme, levers) -> bool:
    """Whether the folded kernel reads these levers (with `supports` for the layout): sinks, rotated
    values and PSAC rows with any keys; pre-RoPE keys (rebuilt in RoPE's halves) and page-relative keys
    (the query rotated per page) with per-channel keys."""
    if levers is None or not levers.active:
        return True
    if levers.whole:  # whole key rows: the plain kernel reads them
        return False
    return k.mode == CHANNEL_GROUPS or not (levers.prerope or levers.pagerope)


def launch(q, o_part, m_part, l_part, views, book_i16, dense, plan, scale_log2, per_split, splits, grid,
           constants: dict, asm: bool, num_warps: int, num_stages: int, lazy: bool = False, pages: int = 1,
           vfold: bool = VFOLD_DEFAULT, tables: tuple = None, lever_constants: dict | None = None) -> None:
    """Launch the folded kernel (arguments as prepared by `paged_decode`). ``pages=2`` takes two packed
    pages per softmax block (per-token-group keys without centroids only; else one). ``tables`` and
    ``lever_constants``: the levers' tables and constants (`kernels/levers.py`), all off by default."""
    if constants["K_MODE"] != TOKEN_GROUPS or constants["K_STAGES"] or constants["V_STAGES"]:
        pages = 1
    lever_constants = lever_constants if lever_constants is not None else levers_off(None)
    if any(lever_constants.get(name) for name in ("SINK", "ROPE", "PAGE_ROPE", "PSAC_R", "OUT_N")):
        pages = 1  # the lever paths walk one page per block
    u8, i16, i32 = views
    _folded_decode_kernel[grid](
        q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, plan.page_ids, plan.slots, plan.valid,
        plan.req_start, plan.req_pages, plan.req_packed, scale_log2, per_split, splits, *(tables or (q,) * 5),
        ASM=asm, LAZY=lazy, PAGES=pages, VFOLD=vfold, **constants, **lever_constants, num_warps=num_warps,
        num_stages=num_stages)
