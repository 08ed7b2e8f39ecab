"""Gather-dequant: packed and dense pages of a batch -> contiguous K/V per request, for any attention.

One program per (work page, KV head) reconstructs the page's tokens and writes them at the
request's rows (cu_seqlens layout). Packed pages leave in the original frame: PSAC rows added,
key outliers added, pre-RoPE and page-relative keys rotated, rotated values rotated back and sink tokens written over (`kernels/levers.py`).
That is the Triton kernel here; on a CUDA GPU with nvcc, `gather_dequant` hands the layouts it reads to the CUDA
kernel (`gather_cuda`, one block per work page), which writes the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbackend.batch import BatchPlan
from kvbackend.rope import Rotary
from kvbackend.scheme import LeverScheme, TensorScheme

from kvbackend.kernels import gather_cuda
from kvbackend.kernels.dequant import UNPACK_MODES, dequant_tile, load_dense, pool_views, scheme_constants
from kvbackend.kernels.levers import (halves, hadamard_apply, join_halves, lever_args, lever_constants, lever_tables,
                                      load_hadamard, outlier_rows, outlier_tile, page_rotation, psac_fix, rope_tables, rotate_halves,
                                      sink_tile, whole_tile)


@triton.jit
def _gather_dequant_kernel(u8, i16, i32, book_i16, dense, page_ids, slots, kinds, valid, rows, positions,
                           local_cos, local_sin, base_cos, base_sin, hadamard_ptr, k_out, v_out,
                           PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                           D: tl.constexpr, UNPACK: tl.constexpr,
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
    w = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(page_ids + w).to(tl.int64)
    slot = tl.load(slots + w).to(tl.int64)
    kind = tl.load(kinds + w)
    n = tl.load(valid + w)
    row = tl.load(rows + w).to(tl.int64)
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    if kind == 0:
        k = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, K_MODE, K_BITS,
                         K_GROUP, K_SYMMETRIC, K_KIND, K_ESIZE, K_CODES, K_SCALES, K_ZEROS, K_ASSIGN, K_STAGES, K_C, K_BOOK,
                         UNPACK, CSCALE=K_CSCALE)
        v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                         V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C, V_BOOK,
                         UNPACK, CSCALE=V_CSCALE)
        # Packed pages are stored in the levers' frame (`kvbackend.frames`); dense pages as appended.
        if PSAC_R:
            k += psac_fix(u8, i16, book_i16, page, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, PSAC_R, PSAC_N, PSAC_NP,
                          PSAC_SPARSE, PSAC_CODES, PSAC_SCALE, PSAC_TOKEN, PSAC_BASIS)
        if OUT_N:  # key outliers, in the stored frame like the rest of the key
            onehot, channel, value = outlier_rows(i16, page, h, t, PAGE_BYTES, H, D, OUT_N, OUT_NP, OUT_INDEX, OUT_VALUE)
            k += outlier_tile(onehot, channel, value, 0, D)
        if WHOLE_N:  # whole key rows, in the stored frame too
            k += whole_tile(u8, i16, page, h, t, PAGE_BYTES, H, D, WHOLE_N, WHOLE_CODES, WHOLE_SCALE, WHOLE_TOKEN, 0, D)
        if ROPE:  # R(p0 + t) = R(p0) R(t)
            cos_t, sin_t = rope_tables(local_cos, local_sin, P, D)
            cos_0, sin_0 = page_rotation(base_cos, base_sin, tl.load(positions + w) // P, D)
            lo, hi = halves(k, P, D)
            lo, hi = rotate_halves(lo, hi, cos_t, sin_t)
            lo, hi = rotate_halves(lo, hi, cos_0[None, :], sin_0[None, :])
            k = join_halves(lo, hi, P, D)
        if PAGE_ROPE:  # stored as R(t) k: R(p0) remains (the RoPE's scaling is in the base table)
            cos_0, sin_0 = page_rotation(base_cos, base_sin, tl.load(positions + w) // P, D)
            lo, hi = halves(k, P, D)
            k = join_halves(*rotate_halves(lo, hi, cos_0[None, :], sin_0[None, :]), P, D)
        if VROT:
            v = hadamard_apply(v, load_hadamard(hadamard_ptr, D), D)
        if SINK:
            if tl.load(positions + w) == 0:  # the sequence's first page: its first tokens are exact
                first = (t < SINK)[:, None]
                k = tl.where(first, sink_tile(book_i16, slot, h, SINK_K, BOOK_BYTES, H, D, SINK, P, SINK_KIND), k)
                v = tl.where(first, sink_tile(book_i16, slot, h, SINK_V, BOOK_BYTES, H, D, SINK, P, SINK_KIND), v)
    else:
        k = load_dense(dense, page, h, 0, H, P, D).to(tl.float32)
        v = load_dense(dense, page, h, 1, H, P, D).to(tl.float32)
    out = ((row + t[:, None]) * H + h) * D + d[None, :]
    mask = t[:, None] < n
    tl.store(k_out + out, k.to(k_out.dtype.element_ty), mask=mask)
    tl.store(v_out + out, v.to(v_out.dtype.element_ty), mask=mask)


def _check(pages: torch.Tensor, dense: torch.Tensor, plan: BatchPlan) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 2 or not pages.is_contiguous():
        raise ValueError(f"packed pages must be a contiguous uint8 [pages, page_bytes] tensor, got {pages.dtype} {tuple(pages.shape)}")
    if dense.dim() != 5 or dense.shape[1] != 2 or not dense.is_contiguous():
        raise ValueError(f"dense pages must be a contiguous [pages, 2, P, H, D] tensor, got {tuple(dense.shape)}")
    if dense.device != pages.device or plan.page_ids.device != pages.device:
        raise ValueError("pages, dense pages and the plan must be on one device")
    p, _, d = dense.shape[2:]
    for name, value in (("page_size", p), ("head_dim", d)):
        if value & (value - 1):
            raise ValueError(f"kernels need a power-of-two {name}, got {value}")


def _check_launch(num_warps: int | None, unpack: int) -> None:
    if unpack not in UNPACK_MODES:
        raise ValueError(f"unpack must be one of {UNPACK_MODES}, got {unpack!r}")
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1) or num_warps > 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")


def default_warps(k: TensorScheme, v: TensorScheme) -> int:
    """8 warps a program, or 4 where centroid stages add a one-hot product per page (H200, B=8, L=32K,
    perf/NOTES.md gather v1/v2: with 8 warps rtn-2 1.2-1.4x and kivi-2 1.1-1.15x faster than with 4,
    qvg 15% slower; float layouts were not measured and follow the stage-free rule)."""
    return 4 if k.stages or v.stages else 8


def gather_dequant(pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor, schemes: tuple[TensorScheme, TensorScheme],
                   plan: BatchPlan, out_dtype: torch.dtype = torch.bfloat16,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int | None = None,
                   unpack: int = 0, levers: LeverScheme | None = None,
                   rotary: Rotary | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruct every token of the planned requests, ``[total_tokens, H, D]`` each for K and V.

    Args:
        pages: one layer's packed pages ``[num_pages, page_bytes]`` (uint8).
        codebooks: one layer's codebook slots ``[num_slots, codebook_bytes]`` (uint8).
        dense: one layer's dense pages ``[num_pages, 2, P, H, D]``.
        levers: the layer's levers and PSAC rows (`kvbackend.scheme.lever_scheme`), None for none.
        rotary: the model's RoPE, for pre-RoPE and page-relative keys.
        out: optional caller buffers to write into.
        num_warps, unpack: launch configuration (``unpack`` as in `dequant_tile`: 0 loads packed words
            once and broadcasts them, 1 has each element load its own word, 2/3 those with codes made
            float without an integer conversion). num_warps None = `default_warps`.
        backend: ``"auto"`` takes the CUDA kernel (`kvbackend.kernels.gather_cuda`: plain layouts, centroid
            stages and the recipe's levers, fp16/bf16 outputs) where it reads the layout and no Triton launch option
            is named, and the Triton kernel otherwise (also when the CUDA variant fails to compile or load);
            ``"triton"`` or ``"cuda"`` insist.
    """
    _check(pages, dense, plan)
    _check_launch(num_warps, unpack)
    _, _, p, h, d = dense.shape
    if plan.page_size != p:
        raise ValueError(f"plan page_size {plan.page_size} != dense pages' {p}")
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    total = plan.num_tokens
    k_out, v_out = out if out is not None else (torch.empty(total, h, d, dtype=out_dtype, device=pages.device),
                                                torch.empty(total, h, d, dtype=out_dtype, device=pages.device))
    for buffer in (k_out, v_out) if out is not None else ():
        if buffer.shape != (total, h, d) or not buffer.is_contiguous() or buffer.device != pages.device:
            raise ValueError(f"output buffers must be contiguous [{total}, {h}, {d}] on {pages.device}, got "
                             f"{tuple(buffer.shape)} on {buffer.device}")
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    lv = levers if levers is not None and levers.active else None
    cuda = backend == "cuda" or (backend == "auto" and num_warps is None and unpack == 0 and gather_cuda.preferred(
        *schemes, p, d, k_out.dtype, dense.dtype, lv, pages.device, h))
    if cuda:
        tables = lever_tables(lv, rotary, p, d, plan.max_pages, pages.device) if lv is not None else None
        try:
            gather_cuda.launch(pages, codebooks, dense, schemes, plan, k_out, v_out, lv, tables)
            return k_out, v_out
        except RuntimeError:  # the variant did not compile or load (`preferred` says no from now on)
            if backend == "cuda":
                raise
    work = plan.page_ids.numel()
    if work == 0:
        return k_out, v_out
    ropes = lever_args(levers, rotary, p, d, plan.max_pages, k_out)
    k_scheme, v_scheme = schemes
    num_warps = num_warps or default_warps(k_scheme, v_scheme)
    _gather_dequant_kernel[(work, h)](
        u8, i16, i32, book_i16, dense, plan.page_ids, plan.slots, plan.kinds, plan.valid, plan.rows, plan.positions,
        *ropes, k_out, v_out, PAGE_BYTES=pages.shape[1], BOOK_BYTES=max(codebooks.shape[-1], 0), H=h, P=p, D=d,
        UNPACK=unpack, **scheme_constants("K", k_scheme), **scheme_constants("V", v_scheme), **lever_constants(levers),
        num_warps=num_warps)
    return k_out, v_out
