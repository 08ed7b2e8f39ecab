"""Fused paged decode attention over ``chw:`` pages (keys at a width per channel) and dense pages.

The plain decode kernel's flash-decoding loop (`kernels/paged_decode.py`: grid (request, KV head, split), an online
softmax for the GQA group padded to 16 rows so `tl.dot` runs on tensor cores, the splits merged by its merge
kernel, which also attends to the exact sink tokens), with the keys of packed pages read as `chw_gather` reads them
(`chw_keys`: each code from the two bytes its bits start in) and the values through `dequant_tile`. Levers as the
plain kernel reads them: pre-RoPE keys rotated per page in RoPE's halves (the query by the page's first position),
page-relative keys through a rotated query, rotated values summed in their frame and rotated back once per program.
No BF16 K/V is written. The torch reference is the codec's decode and `kvbackend.attention.decode_attention`
(`tests/test_chw_gather.py`).

On a CUDA GPU with ``nvcc``, layers in lane order (``chw:...,order=lane``) with keys after RoPE go to the tensor-core
kernel instead (`kvbackend.kernels.mma_decode`, its ``K_CHW`` path: the per-channel steps folded into the query, the
codes read from one 32-bit window per thread and tile), which writes the same split partials for the same merge.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvbackend.batch import BatchPlan
from kvbackend.errors import UnsupportedLayout
from kvbackend.rope import Rotary
from kvbackend.scheme import LeverScheme

from kvbackend.kernels import mma_decode
from kvbackend.kernels.chw_gather import ChwScheme, check_pools, chw_keys, chw_table, tile_bytes
from kvbackend.kernels.decode_split import VARYING, program_pages
from kvbackend.kernels.dequant import dequant_tile, load_dense, pool_views, scheme_constants
from kvbackend.kernels.gather_dequant import _check
from kvbackend.kernels.levers import (hadamard_apply, lever_args, load_hadamard, page_rotation, query_and_partner,
                                      query_to_page, rope_tables, rotate_halves)
from kvbackend.kernels.paged_decode import MERGE_SPLITS, _attend, _merge_kernel, _sink_constants, _softmax_step

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=VARYING)
def _chw_decode_kernel(q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, table, page_ids, slots, valid,
                       req_start, req_pages, req_packed, scale_log2, pages_per_split, num_splits,
                       local_cos, local_sin, base_cos, base_sin, hadamard_ptr,
                       PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                       D: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                       K_CODES: tl.constexpr, K_SCALES: tl.constexpr, K_MEAN: tl.constexpr, CODED: tl.constexpr,
                       TILE: tl.constexpr,
                       V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
                       V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr,
                       V_ZEROS: tl.constexpr, V_ASSIGN: tl.constexpr, V_STAGES: tl.constexpr, V_C: tl.constexpr,
                       V_BOOK: tl.constexpr, V_CSCALE: tl.constexpr,
                       SINK: tl.constexpr, ROPE: tl.constexpr, PAGE_ROPE: tl.constexpr, VROT: tl.constexpr):
    r, h, s, start, first, last, packed = program_pages(req_start, req_pages, req_packed, pages_per_split)
    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    t = tl.arange(0, P)
    heads = h * GROUP + i
    q_rows = (r * (H * GROUP) + heads) * D
    q_tile = tl.load(q + q_rows[:, None] + d[None, :], mask=(i < GROUP)[:, None], other=0.0).to(tl.float16)
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
    for j in range(first, tl.minimum(last, packed)):
        page = tl.load(page_ids + start + j).to(tl.int64)
        slot = tl.load(slots + start + j).to(tl.int64)
        v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                         V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C,
                         V_BOOK, 0, tl.float16, CSCALE=V_CSCALE)
        if ROPE:  # q . R(p0) R(t) k = (R(p0)^T q) . (R(t) k), keys read as RoPE's two halves
            k_lo = chw_keys(u8, i16, book_i16, page, slot, h, table, PAGE_BYTES, BOOK_BYTES, H, P, D, K_CODES,
                            K_SCALES, K_MEAN, CODED, 0, D // 2, TILE).to(tl.float16)
            k_hi = chw_keys(u8, i16, book_i16, page, slot, h, table, PAGE_BYTES, BOOK_BYTES, H, P, D, K_CODES,
                            K_SCALES, K_MEAN, CODED, D // 2, D // 2, TILE).to(tl.float16)
            cos_0, sin_0 = page_rotation(base_cos, base_sin, j, D)
            qb_lo = (q_lo * cos_0[None, :] + q_hi * sin_0[None, :]).to(tl.float16)
            qb_hi = (q_hi * cos_0[None, :] - q_lo * sin_0[None, :]).to(tl.float16)
            k_lo, k_hi = rotate_halves(k_lo, k_hi, cos_t, sin_t)
            scores = (tl.dot(qb_lo, tl.trans(k_lo)) + tl.dot(qb_hi, tl.trans(k_hi))) * scale_log2
        else:
            k = chw_keys(u8, i16, book_i16, page, slot, h, table, PAGE_BYTES, BOOK_BYTES, H, P, D, K_CODES, K_SCALES,
                         K_MEAN, CODED, TILE=TILE).to(tl.float16)
            if PAGE_ROPE:  # q . R(p0) k_stored = (R(p0)^T q) . k_stored
                q_page = query_to_page(q_x, q_partner, base_cos, base_sin, j, D).to(tl.float16)
                scores = tl.dot(q_page, tl.trans(k)) * scale_log2
            else:
                scores = tl.dot(q_tile, tl.trans(k)) * scale_log2
        if SINK:  # the merge kernel attends to the exact sink tokens
            scores = tl.where((j == 0) & (t[None, :] < SINK), float("-inf"), scores)
        m_i, l_i, acc = _softmax_step(scores, v, P, m_i, l_i, acc, P)
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


def chw_decode(q: torch.Tensor, pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor, scheme: ChwScheme,
               plan: BatchPlan, scale: float | None = None, levers: LeverScheme | None = None,
               rotary: Rotary | None = None, target_programs: int = 1024, num_warps: int = 4,
               num_stages: int = 1, tile: bool = False, mma: bool | None = None,
               mma_options: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per request over a ``chw:`` layer (`paged_decode`'s contract).

    Args:
        q: [B, Hq, D] queries, B = len(plan.request_ids), Hq a multiple of the KV heads.
        pages, codebooks, dense: one layer's pools; scheme: `chw_gather.chw_scheme` of the layer; levers: its
            `lever_scheme` (None for none); rotary: the model's RoPE, for pre-RoPE and page-relative keys.
        target_programs: about how many programs the split-K grid should have.
        tile: each program loads its head's key block once a page and gathers the codes from registers.
        mma: the CUDA tensor-core kernel (`mma_decode.launch_chw`); None: where `mma_decode.chw_preferred` says so
            (then ``target_programs`` gives way to one full wave of it), True insists (ValueError where it cannot).
        mma_options: extra keywords of `mma_decode.launch_chw` (`mma_decode.chw_config`'s: ``stages``, ``warps``,
            ``min_blocks``, ``unroll``, ``fold``, ``qsmem``, ``swap``, ``pref``, ``subn``, ``vsubn``).
    Returns:
        (output [B, Hq, D] in q's dtype, log-sum-exp [B, Hq] float32, natural log).
    """
    _check(pages, dense, plan)  # (`gather_dequant`'s checks of the pools and the plan)
    _, _, p, h, d = dense.shape
    b, hq, dq = q.shape
    if dq != d or hq % h or b != len(plan.request_ids):
        raise ValueError(f"q {tuple(q.shape)} does not fit {len(plan.request_ids)} requests of {h} KV heads x {d}")
    if not q.is_contiguous() or q.device != pages.device:
        raise ValueError("q must be contiguous and on the pools' device")
    if b and plan.min_pages == 0:
        raise ValueError("every request in a decode batch needs at least one token")
    check_pools(scheme, pages, codebooks, dense)
    lv = levers if levers is not None and levers.active else None
    if lv is not None and (lv.psac_rank or lv.outliers or lv.whole):
        raise UnsupportedLayout("chw: layers carry no PSAC rows, key outliers or whole key rows")
    group = hq // h
    options = mma_options or {}
    if mma is None:
        mma = mma_decode.chw_preferred(scheme, lv, d, group, q.device, q.dtype, dense.dtype,
                                       options.get("stages", 2), options.get("warps", 4))
    elif mma:
        usable, why = mma_decode.available(q.device)
        if not usable:
            raise ValueError(f"the tensor-core decode kernel cannot run here: {why}")
        if not mma_decode.supports_chw(scheme, lv, d, group):
            raise ValueError("the tensor-core decode kernel reads chw: layers in lane order (order=lane) with keys "
                             "after RoPE, 2-bit values, head_dim 64 or 128 and up to 8 query heads per KV head; the "
                             "Triton kernel reads this one (mma=False)")
    if mma:
        per_split, splits = plan.wave_splits(h, mma_decode.chw_wave_programs(scheme, d, q.dtype, dense.dtype, lv,
                                                                             q.device, **options))
    else:
        per_split, splits = plan.splits(h, target_programs)
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    o_part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    if mma:
        mma_decode.launch_chw(q, o_part, m_part, l_part, pages, codebooks, dense, plan, scale * _LOG2E, per_split,
                              splits, scheme, lv, **options)
    else:
        _launch_triton(q, o_part, m_part, l_part, pages, codebooks, dense, scheme, plan, scale, lv, rotary, per_split,
                       splits, num_warps, num_stages, tile)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    _merge_kernel[(b * hq,)](o_part, m_part, l_part, out, lse, splits, q, book_i16, plan.slots, plan.req_start,
                             plan.req_packed, scale * _LOG2E, D=d, SPLITS=max(MERGE_SPLITS, triton.next_power_of_2(splits)),
                             H=h, GROUP=group, BOOK_BYTES=max(codebooks.shape[-1], 0), **_sink_constants(lv))
    return out, lse


def _launch_triton(q, o_part, m_part, l_part, pages, codebooks, dense, scheme, plan, scale, lv, rotary, per_split,
                   splits, num_warps, num_stages, tile) -> None:
    _, _, p, h, d = dense.shape
    b, hq, _ = q.shape
    group = hq // h
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    ropes = lever_args(lv, rotary, p, d, plan.max_pages, q)
    flags = lv or LeverScheme()
    _chw_decode_kernel[(b, h, splits)](
        q, o_part, m_part, l_part, u8, i16, i32, book_i16, dense, chw_table(scheme.widths, h, p, str(pages.device), scheme.order),
        plan.page_ids, plan.slots, plan.valid, plan.req_start, plan.req_pages, plan.req_packed, scale * _LOG2E,
        per_split, splits, *ropes, PAGE_BYTES=pages.shape[1], BOOK_BYTES=max(codebooks.shape[-1], 0), H=h, P=p, D=d,
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), K_CODES=max(scheme.codes, 0),
        K_SCALES=max(scheme.scales, 0), K_MEAN=scheme.mean, CODED=scheme.codes >= 0,
        TILE=tile_bytes(scheme.widths, h, p) if tile and scheme.codes >= 0 else 0,
        **scheme_constants("V", scheme.values), SINK=flags.sink, ROPE=flags.prerope, PAGE_ROPE=flags.pagerope,
        VROT=flags.vrot, num_warps=num_warps, num_stages=num_stages)
