"""Fused paged decode attention over packed low-bit pages and dense pages (flash-decoding).

Grid (request, KV head, split): each program walks its share of the request's pages, dequantizes
K and V in registers, and keeps an online softmax for the GQA group of query heads (padded to 16
rows so `tl.dot` runs on tensor cores). A second kernel merges the splits. No BF16 K/V is ever
written to memory. The plain kernel also reads a layer's levers and PSAC rows (`kernels/levers.py`):
PSAC rows, pre-RoPE and page-relative keys per page, rotated values once per program, sink tokens in the merge.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from kvbackend.batch import BatchPlan
from kvbackend.rope import Rotary
from kvbackend.scheme import LeverScheme, TensorScheme

from kvbackend.kernels import folded_decode, mma_decode, planar_decode
from kvbackend.kernels.decode_split import VARYING as _VARYING, program_pages
from kvbackend.kernels.dequant import dequant_tile, load_dense, pool_views, scheme_constants
from kvbackend.kernels.gather_dequant import _check, _check_launch
from kvbackend.kernels.levers import (hadamard_apply, lever_args, lever_constants, lever_tables, load_hadamard,
                                      outlier_rows, outlier_tile, page_rotation, psac_basis, psac_rows,
                                      query_and_partner, query_to_page, rope_tables, rotate_halves, sink_tile,
                                      whole_tile)

_LOG2E = 1.4426950408889634
MERGE_SPLITS = 128  # the merge kernel reads at least this many splits (masked), so it rarely recompiles as requests grow


@triton.jit
def _softmax_step(scores, v, n, m_i, l_i, acc, P: tl.constexpr):
    """One page of online softmax over scores [ROWS, P] (log2 units), masked past the page's ``n``
    tokens. A fully masked block (sinks may mask a whole page) leaves the state as it was."""
    t = tl.arange(0, P)
    scores = tl.where(t[None, :] < n, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc


@triton.jit
def _attend(q_tile, k, v, n, m_i, l_i, acc, scale_log2, P: tl.constexpr):
    """One page of online softmax: scores in log2 units, masked past the page's ``n`` tokens."""
    scores = tl.dot(q_tile, tl.trans(k.to(tl.float16))) * scale_log2  # [ROWS, P]
    return _softmax_step(scores, v, n, m_i, l_i, acc, P)


@triton.jit(do_not_specialize=_VARYING)
def _paged_decode_kernel(q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, page_ids, slots, valid,
                         req_start, req_pages, req_packed, scale_log2, pages_per_split, num_splits,
                         local_cos, local_sin, base_cos, base_sin, hadamard_ptr,
                         PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                         D: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, UNPACK: tl.constexpr,
                         PAIR: tl.constexpr,
                         K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SYMMETRIC: tl.constexpr,
                         K_KIND: tl.constexpr, K_ESIZE: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr, K_ZEROS: tl.constexpr,
                         K_ASSIGN: tl.constexpr, K_STAGES: tl.constexpr, K_C: tl.constexpr, K_BOOK: tl.constexpr, K_CSCALE: tl.constexpr,
                         V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
                         V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr, V_ZEROS: tl.constexpr,
                         V_ASSIGN: tl.constexpr, V_STAGES: tl.constexpr, V_C: tl.constexpr, V_BOOK: tl.constexpr, V_CSCALE: tl.constexpr,
                         SINK: tl.constexpr, SINK_K: tl.constexpr, SINK_V: tl.constexpr, SINK_KIND: tl.constexpr,
                         SINK_ROWS: tl.constexpr, ROPE: tl.constexpr, PAGE_ROPE: tl.constexpr, VROT: tl.constexpr,
                         PSAC_R: tl.constexpr, PSAC_N: tl.constexpr, PSAC_NP: tl.constexpr, PSAC_SPARSE: tl.constexpr,
                         PSAC_CODES: tl.constexpr, PSAC_SCALE: tl.constexpr, PSAC_TOKEN: tl.constexpr,
                         PSAC_BASIS: tl.constexpr, OUT_N: tl.constexpr, OUT_NP: tl.constexpr,
                         OUT_INDEX: tl.constexpr, OUT_VALUE: tl.constexpr, WHOLE_N: tl.constexpr,
                         WHOLE_CODES: tl.constexpr, WHOLE_SCALE: tl.constexpr, WHOLE_TOKEN: tl.constexpr):
    r, h, s, start, first, last, packed = program_pages(req_start, req_pages, req_packed, pages_per_split)
    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    t = tl.arange(0, P)
    heads = h * GROUP + i
    q_rows = (r * (H * GROUP) + heads) * D
    q_tile = tl.load(q + q_rows[:, None] + d[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float16)
    LEVERS: tl.constexpr = ROPE or PAGE_ROPE or PSAC_R > 0 or SINK > 0 or OUT_N > 0 or WHOLE_N > 0
    if PAGE_ROPE:  # the query and its RoPE partners, rotated by R(p0)^T once per page
        q_x, q_partner = query_and_partner(q, q_rows, i < GROUP, D)
    if ROPE:  # query halves in float32, rotated by R(p0) each page; keys by the loop-invariant R(t) (fp16)
        half = tl.arange(0, D // 2)
        q_lo = tl.load(q + q_rows[:, None] + half[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float32)
        q_hi = tl.load(q + q_rows[:, None] + D // 2 + half[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float32)
        cos_t, sin_t = rope_tables(local_cos, local_sin, P, D)
        cos_t, sin_t = cos_t.to(tl.float16), sin_t.to(tl.float16)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    # Packed pages and dense pages in two branch-free loops, so each can be software-pipelined.
    # PAIR: two packed pages per iteration, both pages' loads issued before either is used (more
    # memory requests in flight per program); a missing second page repeats the first, fully masked.
    end_packed = tl.minimum(last, packed)
    if LEVERS:  # one page per iteration, in the levers' frame (`kernels/levers.py`)
        for j in range(first, end_packed):
            page = tl.load(page_ids + start + j).to(tl.int64)
            slot = tl.load(slots + start + j).to(tl.int64)
            v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                             V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C,
                             V_BOOK, UNPACK, tl.float16, CSCALE=V_CSCALE)
            if PSAC_R:
                coef = psac_rows(u8, i16, page, h, t, PAGE_BYTES, H, PSAC_R, PSAC_N, PSAC_NP, PSAC_SPARSE, PSAC_CODES,
                                 PSAC_SCALE, PSAC_TOKEN)
            if ROPE:  # q . R(p0) R(t) k = (R(p0)^T q) . (R(t) k), keys dequantized as RoPE's two halves
                k_lo = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE,
                                    K_BITS, K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN,
                                    K_STAGES, K_C, K_BOOK, UNPACK, tl.float16, 0, D // 2, CSCALE=K_CSCALE)
                k_hi = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE,
                                    K_BITS, K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN,
                                    K_STAGES, K_C, K_BOOK, UNPACK, tl.float16, D // 2, D // 2, CSCALE=K_CSCALE)
                if PSAC_R:
                    k_lo += tl.dot(coef, psac_basis(book_i16, slot, h, BOOK_BYTES, D, PSAC_R, PSAC_BASIS, 0,
                                                    D // 2)).to(tl.float16)
                    k_hi += tl.dot(coef, psac_basis(book_i16, slot, h, BOOK_BYTES, D, PSAC_R, PSAC_BASIS, D // 2,
                                                    D // 2)).to(tl.float16)
                if OUT_N:
                    onehot, channel, value = outlier_rows(i16, page, h, t, PAGE_BYTES, H, D, OUT_N, OUT_NP, OUT_INDEX,
                                                          OUT_VALUE)
                    k_lo += outlier_tile(onehot, channel, value, 0, D // 2).to(tl.float16)
                    k_hi += outlier_tile(onehot, channel, value, D // 2, D // 2).to(tl.float16)
                if WHOLE_N:
                    k_lo += whole_tile(u8, i16, page, h, t, PAGE_BYTES, H, D, WHOLE_N, WHOLE_CODES, WHOLE_SCALE,
                                       WHOLE_TOKEN, 0, D // 2).to(tl.float16)
                    k_hi += whole_tile(u8, i16, page, h, t, PAGE_BYTES, H, D, WHOLE_N, WHOLE_CODES, WHOLE_SCALE,
                                       WHOLE_TOKEN, D // 2, D // 2).to(tl.float16)
                cos_0, sin_0 = page_rotation(base_cos, base_sin, j, D)
                qb_lo = (q_lo * cos_0[None, :] + q_hi * sin_0[None, :]).to(tl.float16)
                qb_hi = (q_hi * cos_0[None, :] - q_lo * sin_0[None, :]).to(tl.float16)
                k_lo, k_hi = rotate_halves(k_lo, k_hi, cos_t, sin_t)
                scores = (tl.dot(qb_lo, tl.trans(k_lo)) + tl.dot(qb_hi, tl.trans(k_hi))) * scale_log2
            else:
                k = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE, K_BITS,
                                 K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN, K_STAGES,
                                 K_C, K_BOOK, UNPACK, tl.float16, CSCALE=K_CSCALE)
                if PSAC_R:
                    k += tl.dot(coef, psac_basis(book_i16, slot, h, BOOK_BYTES, D, PSAC_R, PSAC_BASIS, 0, D)).to(tl.float16)
                if OUT_N:
                    onehot, channel, value = outlier_rows(i16, page, h, t, PAGE_BYTES, H, D, OUT_N, OUT_NP, OUT_INDEX,
                                                          OUT_VALUE)
                    k += outlier_tile(onehot, channel, value, 0, D).to(tl.float16)
                if WHOLE_N:
                    k += whole_tile(u8, i16, page, h, t, PAGE_BYTES, H, D, WHOLE_N, WHOLE_CODES, WHOLE_SCALE,
                                    WHOLE_TOKEN, 0, D).to(tl.float16)
                if PAGE_ROPE:  # q . R(p0) k_stored = (R(p0)^T q) . k_stored: one query rotation per page
                    q_page = query_to_page(q_x, q_partner, base_cos, base_sin, j, D).to(tl.float16)
                    scores = tl.dot(q_page, tl.trans(k)) * scale_log2
                else:
                    scores = tl.dot(q_tile, tl.trans(k)) * scale_log2
            if SINK:  # the merge kernel attends to the exact sink tokens
                scores = tl.where((j == 0) & (t[None, :] < SINK), float("-inf"), scores)
            m_i, l_i, acc = _softmax_step(scores, v, P, m_i, l_i, acc, P)
    else:
        for j in range(first, end_packed, 1 + PAIR):
            page = tl.load(page_ids + start + j).to(tl.int64)
            slot = tl.load(slots + start + j).to(tl.int64)
            if PAIR:
                j2 = tl.minimum(j + 1, end_packed - 1)
                page2 = tl.load(page_ids + start + j2).to(tl.int64)
                slot2 = tl.load(slots + start + j2).to(tl.int64)
            k = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE, K_BITS,
                             K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN, K_STAGES, K_C,
                             K_BOOK, UNPACK, tl.float16, CSCALE=K_CSCALE)
            v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                             V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C,
                             V_BOOK, UNPACK, tl.float16, CSCALE=V_CSCALE)
            if PAIR:
                k2 = dequant_tile(u8, i16, i32, page2, book_i16, slot2, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE,
                                  K_BITS, K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN,
                                  K_STAGES, K_C, K_BOOK, UNPACK, tl.float16, CSCALE=K_CSCALE)
                v2 = dequant_tile(u8, i16, i32, page2, book_i16, slot2, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE,
                                  V_BITS, V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN,
                                  V_STAGES, V_C, V_BOOK, UNPACK, tl.float16, CSCALE=V_CSCALE)
            m_i, l_i, acc = _attend(q_tile, k, v, P, m_i, l_i, acc, scale_log2, P)
            if PAIR:  # after a full page m_i is finite, so a fully masked second page changes nothing
                m_i, l_i, acc = _attend(q_tile, k2, v2, tl.where(j + 1 < end_packed, P, 0), m_i, l_i, acc, scale_log2, P)
    if VROT:  # packed values were summed in the rotated frame: rotate back once, before the dense pages
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        acc = hadamard_apply(acc / l_safe[:, None], load_hadamard(hadamard_ptr, D), D) * l_safe[:, None]
    for j in range(tl.maximum(first, packed), last):
        page = tl.load(page_ids + start + j).to(tl.int64)
        n = tl.load(valid + start + j)
        k = load_dense(dense, page, h, 0, H, P, D)
        # the page's rows past n are another request's leftovers: masked scores give them p = 0, but 0 x inf is NaN
        v = tl.where(tl.arange(0, P)[:, None] < n, load_dense(dense, page, h, 1, H, P, D), 0.0)
        m_i, l_i, acc = _attend(q_tile, k, v, n, m_i, l_i, acc, scale_log2, P)
    part = (r * (H * GROUP) + heads) * num_splits + s
    mask = i < GROUP
    tl.store(m_part + part, m_i, mask=mask)
    tl.store(l_part + part, l_i, mask=mask)
    tl.store(o_part + part[:, None] * D + d[None, :], acc, mask=mask[:, None])


@functools.lru_cache(maxsize=256)
def _sink_constants(levers: LeverScheme | None) -> Mapping[str, int]:
    """The merge kernel's share of `lever_constants` (the exact sink tokens)."""
    return MappingProxyType({n: v for n, v in lever_constants(levers).items() if n.startswith("SINK")})


@triton.jit(do_not_specialize=("num_splits",))
def _merge_kernel(o_part, m_part, l_part, out, lse, num_splits, q, book_i16, slots, req_start, req_packed, scale_log2,
                  D: tl.constexpr, SPLITS: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
                  BOOK_BYTES: tl.constexpr, SINK: tl.constexpr, SINK_K: tl.constexpr, SINK_V: tl.constexpr,
                  SINK_KIND: tl.constexpr, SINK_ROWS: tl.constexpr):
    row = tl.program_id(0)  # one (request, query head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    live = s < num_splits
    m = tl.load(m_part + row * num_splits + s, mask=live, other=float("-inf"))
    l_s = tl.load(l_part + row * num_splits + s, mask=live, other=0.0)
    m_max = tl.max(m, 0)
    if SINK:  # the exact sink tokens of a request whose first page is packed (the kernels masked them)
        r = row // (H * GROUP)
        h = (row % (H * GROUP)) // GROUP
        has = tl.load(req_packed + r) > 0
        slot = tl.load(slots + tl.load(req_start + r)).to(tl.int64)
        sk = sink_tile(book_i16, slot, h, SINK_K, BOOK_BYTES, H, D, SINK, SINK_ROWS, SINK_KIND)
        # a request without packed pages reads some other chunk's slot here: its sinks must not reach the sum
        sv = tl.where(has, sink_tile(book_i16, slot, h, SINK_V, BOOK_BYTES, H, D, SINK, SINK_ROWS, SINK_KIND), 0.0)
        qv = tl.load(q + row * D + d).to(tl.float32)
        ts = tl.arange(0, SINK_ROWS)
        sink_scores = tl.where(has & (ts < SINK), tl.sum(sk * qv[None, :], 1) * scale_log2, float("-inf"))
        m_max = tl.maximum(m_max, tl.max(sink_scores, 0))
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(weight * l_s, 0)
    o = tl.load(o_part + (row * num_splits + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    o_sum = tl.sum(o * weight[:, None], 0)
    if SINK:
        p_sink = tl.where(sink_scores > float("-inf"), tl.exp2(sink_scores - m_max), 0.0)
        total += tl.sum(p_sink, 0)
        o_sum += tl.sum(sv * p_sink[:, None], 0)
    tl.store(out + row * D + d, (o_sum / total).to(out.dtype.element_ty))
    tl.store(lse + row, (m_max + tl.log2(total)) / 1.4426950408889634)


def paged_decode(q: torch.Tensor, pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor,
                 schemes: tuple[TensorScheme, TensorScheme], plan: BatchPlan, scale: float | None = None,
                 target_programs: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                 unpack: int = 0, pair: int = 0, fold: bool | None = None,
                 fold_options: dict | None = None, planar: bool | None = None, levers: LeverScheme | None = None,
                 rotary: Rotary | None = None, mma: bool | None = None,
                 mma_options: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per request.

    Args:
        q: [B, Hq, D] queries (bf16/fp16/fp32), B = len(plan.request_ids), Hq a multiple of the KV heads.
        pages, codebooks, dense: one layer's pools, as for `gather_dequant`.
        target_programs: about how many programs the split-K grid should have (fill every SM), at least 1;
            None = 1024 for the Triton kernels; for the tensor-core kernel the split count that fills its last
            wave best (`BatchPlan.wave_splits` over `mma_decode.wave_programs`).
        num_stages: software-pipelining stages; None = 1 for the planar kernel and for the plain kernel
            with levers (4x faster than 2 there: 1.8 against 7.4 ms at B=9, L=32K), 2 for the others (the
            fastest measured on the H200, perf/NOTES.md).
        pair: 1 = two packed pages per loop iteration (more loads in flight per program; in the
            folded kernel, two pages per softmax block).
        fold: use the kernel with scales folded out of the per-element path (`folded_decode`);
            None = where it supports the layout and each program has enough pages
            (`folded_decode.preferred`).
            ``unpack`` applies to the plain kernel; ``pair`` to both (in the folded kernel: two pages
            per softmax block, for per-token-group keys without centroids).
        fold_options: extra keywords of `folded_decode.launch` (``lazy``, ``vfold``, ``asm``), for
            tests and probes of the folded kernel's variants.
        planar: use the kernel with tokens along the tensor-core product's M and codes read as bit
            planes (`planar_decode`); None = where `planar_decode.preferred` says so, unless ``fold``
            is given (then the plain or folded kernel, as ``fold`` says). True takes precedence over
            ``fold``.
        levers: the layer's levers and PSAC rows (`kvbackend.scheme.lever_scheme`); the plain kernel
            reads them all, the folded one those `folded_decode.supports_levers` names, the planar
            one none (``planar=True`` with levers raises).
        rotary: the model's RoPE, for pre-RoPE and page-relative keys.
        mma: use the CUDA tensor-core kernel (`mma_decode`: 2-bit layouts with per-token value groups, keys
            per token group or per channel with centroids; sinks, key outliers, rotated values, pre-RoPE and
            page-relative keys, PSAC rows);
            None = where `mma_decode.preferred` says so, unless ``fold`` or ``planar`` is given. True
            takes precedence over ``planar`` and ``fold`` and raises where the kernel cannot run or does
            not read the layout.
        mma_options: extra keywords of `mma_decode.launch` (``min_blocks``, ``prerope``, ``psac``, ``whole``,
            ``k4``), for probes and tests.
    Returns:
        (output [B, Hq, D] in q's dtype, log-sum-exp [B, Hq] float32, natural log).
    """
    _check(pages, dense, plan)
    _check_launch(num_warps, unpack)
    _, _, p, h, d = dense.shape
    b, hq, dq = q.shape
    if dq != d or hq % h or b != len(plan.request_ids):
        raise ValueError(f"q {tuple(q.shape)} does not fit {len(plan.request_ids)} requests of {h} KV heads x {d}")
    if not q.is_contiguous() or q.device != pages.device:
        raise ValueError("q must be contiguous and on the pools' device")
    if b and plan.min_pages == 0:
        raise ValueError("every request in a decode batch needs at least one token")
    if target_programs is not None:  # any integer type (numpy's, torch's), not a float or a bool
        try:
            programs = operator.index(target_programs)
        except TypeError:
            programs = 0
        if isinstance(target_programs, bool) or programs < 1:
            raise ValueError(f"target_programs must be a positive int or None (the default grid), not "
                             f"{target_programs!r}")
        target_programs = programs
    group = hq // h
    per_split, splits = plan.splits(h, target_programs if target_programs is not None else 1024)
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    k_scheme, v_scheme = schemes
    levers = levers if levers is not None and levers.active else None
    if mma is None:  # a Triton kernel named by ``fold`` or ``planar`` is what runs
        mma = (fold is None and planar is None
               and mma_decode.preferred(k_scheme, v_scheme, p, d, group, q.device, q.dtype, dense.dtype, levers,
                                           num_stages, num_warps))
    elif mma:
        usable, why = mma_decode.available(q.device)
        if not usable:
            raise ValueError(f"the tensor-core decode kernel cannot run here: {why}")
        options = mma_options or {}
        if not mma_decode.supports(k_scheme, v_scheme, p, d, group):  # before a variant of it is compiled
            raise ValueError(f"the tensor-core decode kernel does not read this layout ({k_scheme}, {v_scheme}; page "
                             f"{p}, head_dim {d}, {group} query heads per KV head); the Triton kernels do (mma=False)")
        if not mma_decode.supports_levers(k_scheme, levers, p, d, options.get("prerope"), options.get("psac"),
                                           options.get("whole"), options.get("k4")):
            raise ValueError(f"the tensor-core decode kernel does not read these levers ({levers}) with "
                             f"{k_scheme.bits}-bit keys (3-bit keys: on the pre-RoPE path alone; 4-bit ones there "
                             "too, unless KVBACKEND_CUDA_K4=0 turns them off); the plain kernel does (mma=False)")
    if levers is not None and not mma:  # the plain kernel reads every lever, the folded one most (`supports_levers`)
        if planar:
            raise ValueError("levers and PSAC rows are read by the plain and folded decode kernels, not the planar one")
        folds = folded_decode.supports(k_scheme, v_scheme, p, d) and folded_decode.supports_levers(k_scheme, levers)
        if fold and not folds:
            raise ValueError(f"the folded decode kernel does not read these levers on this layout ({levers}); "
                             "the plain kernel does (fold=False)")
        planar = False
        if fold is None:  # keys rebuilt for per-token RoPE measured slower in the folded kernel (NOTES, levers v3)
            fold = folds and per_split >= folded_decode.MIN_PAGES_PER_PROGRAM and not levers.prerope
        if levers.prerope:  # RoPE's halves are read as channel windows, which UNPACK 0 and 3 do not take
            unpack = {0: 1, 3: 2}.get(unpack, unpack)
    if planar is None:
        planar = fold is None and planar_decode.preferred(k_scheme, v_scheme, p, d, per_split)
    elif planar and not planar_decode.supports(k_scheme, v_scheme, p, d):
        raise ValueError(f"the planar decode kernel does not read this layout ({k_scheme}, {v_scheme})")
    if fold is None:
        fold = folded_decode.preferred(k_scheme, v_scheme, p, d, per_split)
    elif fold and not folded_decode.supports(k_scheme, v_scheme, p, d):
        raise ValueError(f"the folded decode kernel does not read this layout ({k_scheme}, {v_scheme})")
    if num_stages is None and mma:
        num_stages = mma_decode.default_stages(k_scheme, v_scheme, p, d, q.dtype, dense.dtype, num_warps, levers,
                                               q.device)
    elif num_stages is None:
        num_stages = 1 if planar or (levers is not None and not fold) else 2
    if mma and target_programs is None:
        # a codebook layout's splits start at chunk boundaries (each chunk reads a codebook slot of its own)
        books = k_scheme.centroids > 0 or v_scheme.centroids > 0 or (levers is not None and levers.psac_rank > 0)
        per_split, splits = plan.wave_splits(h, mma_decode.wave_programs(
            k_scheme, v_scheme, p, d, q.dtype, dense.dtype, num_stages, num_warps, levers, q.device,
            (mma_options or {}).get("min_blocks")), align=max(plan.chunk_pages, 1) if books else 1)
    o_part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    if not mma:  # the Triton kernels' constants (host work on every call of every layer: skipped for the CUDA kernel)
        constants = dict(PAGE_BYTES=pages.shape[1], BOOK_BYTES=max(codebooks.shape[-1], 0), H=h, P=p, D=d, GROUP=group,
                         ROWS=max(16, triton.next_power_of_2(group)), **scheme_constants("K", k_scheme),
                         **scheme_constants("V", v_scheme))
        ropes = lever_args(levers, rotary, p, d, plan.max_pages, q)
    if mma:
        tables = lever_tables(levers, rotary, p, d, plan.max_pages, q.device) if levers is not None else None
        mma_decode.launch(q, o_part, m_part, l_part, pages, dense, plan, scale * _LOG2E, per_split, splits,
                          (k_scheme, v_scheme), stages=num_stages, warps=num_warps, codebooks=codebooks,
                          levers=levers, tables=tables, **(mma_options or {}))
    elif planar:
        planar_decode.launch(q, o_part, m_part, l_part, (u8, i16, i32), dense, plan, scale * _LOG2E, per_split, splits,
                             (b, h, splits), constants, num_warps=num_warps, num_stages=num_stages)
    elif fold:
        folded_decode.launch(q, o_part, m_part, l_part, (u8, i16, i32), book_i16, dense, plan, scale * _LOG2E,
                             per_split, splits, (b, h, splits), constants, num_warps=num_warps, num_stages=num_stages,
                             pages=1 + pair, tables=ropes, lever_constants=lever_constants(levers),
                             **{"asm": q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1",
                                **(fold_options or {})})  # no PTX in the interpreter
    else:
        _paged_decode_kernel[(b, h, splits)](
            q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, plan.page_ids, plan.slots, plan.valid,
            plan.req_start, plan.req_pages, plan.req_packed, scale * _LOG2E, per_split, splits, *ropes, UNPACK=unpack,
            PAIR=pair if levers is None else 0, **constants, **lever_constants(levers), num_warps=num_warps,
            num_stages=num_stages)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    sinks = _sink_constants(levers)
    _merge_kernel[(b * hq,)](o_part, m_part, l_part, out, lse, splits, q, book_i16, plan.slots, plan.req_start,
                             plan.req_packed, scale * _LOG2E, D=d, SPLITS=max(MERGE_SPLITS, triton.next_power_of_2(splits)), H=h,
                             GROUP=group, BOOK_BYTES=max(codebooks.shape[-1], 0), **sinks)
    return out, lse
