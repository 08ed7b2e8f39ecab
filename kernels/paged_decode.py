"""Fused paged decode attention over packed low-bit pages and dense pages (flash-decoding).

Grid (request, KV head, split): each program walks its share of the request's pages, dequantizes
K and V in registers, and keeps an online softmax for the GQA group of query heads (padded to 16
rows so `tl.dot` runs on tensor cores). A second kernel merges the splits. No BF16 K/V is ever
written to memory.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvbackend.batch import BatchPlan
from kvbackend.scheme import TensorScheme

from kvbackend.kernels import folded_decode, planar_decode
from kvbackend.kernels.decode_split import program_pages
from kvbackend.kernels.dequant import dequant_tile, load_dense, pool_views, scheme_constants
from kvbackend.kernels.gather_dequant import _check, _check_launch

_LOG2E = 1.4426950408889634


@triton.jit
def _attend(q_tile, k, v, n, m_i, l_i, acc, scale_log2, P: tl.constexpr):
    """One page of online softmax: scores in log2 units, masked past the page's ``n`` tokens."""
    t = tl.arange(0, P)
    scores = tl.dot(q_tile, tl.trans(k.to(tl.float16))) * scale_log2  # [ROWS, P]
    scores = tl.where(t[None, :] < n, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, page_ids, slots, valid,
                         req_start, req_pages, req_packed, scale_log2, pages_per_split, num_splits,
                         PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                         D: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, UNPACK: tl.constexpr,
                         PAIR: tl.constexpr,
                         K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SYMMETRIC: tl.constexpr,
                         K_KIND: tl.constexpr, K_ESIZE: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr, K_ZEROS: tl.constexpr,
                         K_ASSIGN: tl.constexpr, K_STAGES: tl.constexpr, K_C: tl.constexpr, K_BOOK: tl.constexpr,
                         V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
                         V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr, V_ZEROS: tl.constexpr,
                         V_ASSIGN: tl.constexpr, V_STAGES: tl.constexpr, V_C: tl.constexpr, V_BOOK: tl.constexpr):
    r, h, s, start, first, last, packed = program_pages(req_start, req_pages, req_packed, pages_per_split)
    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    heads = h * GROUP + i
    q_rows = (r * (H * GROUP) + heads) * D
    q_tile = tl.load(q + q_rows[:, None] + d[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float16)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    # Packed pages and dense pages in two branch-free loops, so each can be software-pipelined.
    # PAIR: two packed pages per iteration, both pages' loads issued before either is used (more
    # memory requests in flight per program); a missing second page repeats the first, fully masked.
    end_packed = tl.minimum(last, packed)
    for j in range(first, end_packed, 1 + PAIR):
        page = tl.load(page_ids + start + j).to(tl.int64)
        slot = tl.load(slots + start + j).to(tl.int64)
        if PAIR:
            j2 = tl.minimum(j + 1, end_packed - 1)
            page2 = tl.load(page_ids + start + j2).to(tl.int64)
            slot2 = tl.load(slots + start + j2).to(tl.int64)
        k = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE, K_BITS,
                         K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN, K_STAGES, K_C, K_BOOK,
                         UNPACK, tl.float16)
        v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                         V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C, V_BOOK,
                         UNPACK, tl.float16)
        if PAIR:
            k2 = dequant_tile(u8, i16, i32, page2, book_i16, slot2, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE, K_BITS,
                              K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN, K_STAGES, K_C,
                              K_BOOK, UNPACK, tl.float16)
            v2 = dequant_tile(u8, i16, i32, page2, book_i16, slot2, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                              V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C,
                              V_BOOK, UNPACK, tl.float16)
        m_i, l_i, acc = _attend(q_tile, k, v, P, m_i, l_i, acc, scale_log2, P)
        if PAIR:  # after a full page m_i is finite, so a fully masked second page changes nothing
            m_i, l_i, acc = _attend(q_tile, k2, v2, tl.where(j + 1 < end_packed, P, 0), m_i, l_i, acc, scale_log2, P)
    for j in range(tl.maximum(first, packed), last):
        page = tl.load(page_ids + start + j).to(tl.int64)
        n = tl.load(valid + start + j)
        k = load_dense(dense, page, h, 0, H, P, D)
        v = load_dense(dense, page, h, 1, H, P, D)
        m_i, l_i, acc = _attend(q_tile, k, v, n, m_i, l_i, acc, scale_log2, P)
    part = (r * (H * GROUP) + heads) * num_splits + s
    mask = i < GROUP
    tl.store(m_part + part, m_i, mask=mask)
    tl.store(l_part + part, l_i, mask=mask)
    tl.store(o_part + part[:, None] * D + d[None, :], acc, mask=mask[:, None])


@triton.jit
def _merge_kernel(o_part, m_part, l_part, out, lse, num_splits, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)  # one (request, query head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    live = s < num_splits
    m = tl.load(m_part + row * num_splits + s, mask=live, other=float("-inf"))
    l_s = tl.load(l_part + row * num_splits + s, mask=live, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(weight * l_s, 0)
    o = tl.load(o_part + (row * num_splits + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    result = tl.sum(o * weight[:, None], 0) / total
    tl.store(out + row * D + d, result.to(out.dtype.element_ty))
    tl.store(lse + row, (m_max + tl.log2(total)) / 1.4426950408889634)


def paged_decode(q: torch.Tensor, pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor,
                 schemes: tuple[TensorScheme, TensorScheme], plan: BatchPlan, scale: float | None = None,
                 target_programs: int = 1024, num_warps: int = 4, num_stages: int | None = None,
                 unpack: int = 0, pair: int = 0, fold: bool | None = None,
                 fold_options: dict | None = None, planar: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per request.

    Args:
        q: [B, Hq, D] queries (bf16/fp16/fp32), B = len(plan.request_ids), Hq a multiple of the KV heads.
        pages, codebooks, dense: one layer's pools, as for `gather_dequant`.
        target_programs: about how many programs the split-K grid should have (fill every SM).
        num_stages: software-pipelining stages; None = 1 for the planar kernel, 2 for the others (the
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
    group = hq // h
    per_split, splits = plan.splits(h, target_programs)
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    o_part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    k_scheme, v_scheme = schemes
    if planar is None:
        planar = fold is None and planar_decode.preferred(k_scheme, v_scheme, p, d, per_split)
    elif planar and not planar_decode.supports(k_scheme, v_scheme, p, d):
        raise ValueError(f"the planar decode kernel does not read this layout ({k_scheme}, {v_scheme})")
    if fold is None:
        fold = folded_decode.preferred(k_scheme, v_scheme, p, d, per_split)
    elif fold and not folded_decode.supports(k_scheme, v_scheme, p, d):
        raise ValueError(f"the folded decode kernel does not read this layout ({k_scheme}, {v_scheme})")
    constants = dict(PAGE_BYTES=pages.shape[1], BOOK_BYTES=max(codebooks.shape[-1], 0), H=h, P=p, D=d, GROUP=group,
                     ROWS=max(16, triton.next_power_of_2(group)), **scheme_constants("K", k_scheme),
                     **scheme_constants("V", v_scheme))
    if num_stages is None:
        num_stages = 1 if planar else 2
    if planar:
        planar_decode.launch(q, o_part, m_part, l_part, (u8, i16, i32), dense, plan, scale * _LOG2E, per_split, splits,
                             (b, h, splits), constants, num_warps=num_warps, num_stages=num_stages)
    elif fold:
        folded_decode.launch(q, o_part, m_part, l_part, (u8, i16, i32), book_i16, dense, plan, scale * _LOG2E,
                             per_split, splits, (b, h, splits), constants, num_warps=num_warps, num_stages=num_stages,
                             pages=1 + pair, **{"asm": q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1",
                                                **(fold_options or {})})  # no PTX in the interpreter
    else:
        _paged_decode_kernel[(b, h, splits)](
            q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, plan.page_ids, plan.slots, plan.valid,
            plan.req_start, plan.req_pages, plan.req_packed, scale * _LOG2E, per_split, splits, UNPACK=unpack,
            PAIR=pair, **constants, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    _merge_kernel[(b * hq,)](o_part, m_part, l_part, out, lse, splits, D=d, SPLITS=triton.next_power_of_2(splits))
    return out, lse
