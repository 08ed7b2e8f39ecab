"""Gather-dequant of ``chw:`` pages (keys at a width per channel): packed and dense pages of a batch -> contiguous K/V
per request, for any attention.

The ``chw:`` key layout (`kvbackend.codecs.chw`) is one bit string per page and KV head (`BitLayout`: token after
token, every coded channel of the head at its own width, most significant bit first, each head's string padded to
32-bit words), with an fp16 absmax per page and coded channel and the chunk's fp16 channel means in its codebook slot.
A per-layer table (`chw_table`, int32 ``[4, H*D]``: each channel's width, the bit of its first code, the bits between
its codes, its index among the coded channels) turns that into per-value addressing: each code is read from the two
bytes its bits start in. Values are per-token groups
(`kvbackend.kernels.dequant.dequant_tile`). Packed pages leave in the original frame as `gather_dequant` leaves
them: pre-RoPE keys rotated, rotated values rotated back, sink tokens written over (`kernels/levers.py`).

One program per (work page, KV head), as `gather_dequant`; the torch reference is the codec's own decode
(`Codec.decode_pages` and the cache's frames), which `tests/test_chw_gather.py` holds the kernel to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvbackend.batch import BatchPlan
from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.rope import Rotary
from kvbackend.scheme import TOKEN_GROUPS, LeverScheme, TensorScheme, kind_of, lever_scheme

from kvbackend.kernels.dequant import dequant_tile, load_dense, pool_views, scheme_constants
from kvbackend.kernels.gather_dequant import _check
from kvbackend.kernels.levers import (halves, hadamard_apply, join_halves, lever_args, load_hadamard, page_rotation,
                                      rope_tables, rotate_halves, sink_tile)


@dataclass(frozen=True)
class ChwScheme:
    """What the kernel needs of one ``chw:`` layer: byte offsets and sizes, and the widths (one digit a channel)."""

    widths: str  # H*D digits 0-8, heads in order
    codes: int  # offset of the key bit strings (``k_hcodes``), -1 where no channel is coded
    scales: int  # offset of the fp16 absmaxes (``k_wscales``), -1 where no channel is coded
    mean: int  # offset of the fp16 channel means [H, D] in the codebook slot (``k_mean``)
    values: TensorScheme  # the values: per-token groups
    heads: int  # the layout's KV heads, page size, page and codebook slot bytes (another layout's scheme is refused)
    page_size: int
    page_bytes: int
    book_bytes: int
    order: str = "natural"  # each token's channels in the bit string (`kvbackend.codecs.chw.ORDERS`)


def chw_scheme(codec, layout: PageLayout) -> ChwScheme:
    """The kernel's view of a ``chw:`` layer (levers apart: `kvbackend.scheme.lever_scheme`).

    Raises:
        UnsupportedLayout: another codec, a page or head size that is not a power of two, or a field the kernel
            does not read.
    """
    from kvbackend.codecs.chw import ChwCodec

    if not isinstance(codec, ChwCodec):
        raise UnsupportedLayout(f"{codec.spec_string!r} is not a chw: layout")
    p, h, d = layout.page_size, layout.geometry.num_kv_heads, layout.geometry.head_dim
    if p & (p - 1) or d & (d - 1) or p < 16 or d < 16:
        raise UnsupportedLayout(f"the chw gather needs power-of-two pages and heads of at least 16, got {p} and {d}")
    page, book = layout.page.fields, layout.codebook.fields
    known = {"k_hcodes", "k_lcodes", "k_wscales", "v_codes", "v_scales", "v_zeros"}
    unread = sorted(set(page) - known) + sorted(set(book) - {"k_mean", "sink_k", "sink_v"})
    if unread:
        raise UnsupportedLayout(f"the chw gather does not read the fields {', '.join(unread)}")
    widths = "".join(str(int(w)) for w in codec._widths(layout.geometry).tolist())
    field = "k_lcodes" if "k_lcodes" in page else "k_hcodes"
    if field in page:
        codes = page[field]
        # the last code's second byte is read past the bit string: it must lie inside the page
        if codes.offset + codes.nbytes >= layout.page_bytes:
            raise UnsupportedLayout("the chw key codes must not end the page (a code's two bytes are read)")
    scales = page["v_scales"]
    values = TensorScheme(mode=TOKEN_GROUPS, bits=codec.spec.vbits, group=d // scales.shape[-1], symmetric=False,
                          kind=kind_of(scales.dtype), codes=page["v_codes"].offset, scales=scales.offset,
                          zeros=page["v_zeros"].offset)
    return ChwScheme(widths, page[field].offset if field in page else -1,
                     page["k_wscales"].offset if "k_wscales" in page else -1, book["k_mean"].offset, values, h, p,
                     layout.page_bytes, layout.codebook_bytes, codec.spec.order)


def check_pools(scheme: ChwScheme, pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor) -> None:
    """Raise ValueError where ``scheme`` is not the layout of these pools (another geometry's offsets would read
    other fields, or past a page)."""
    _, _, p, heads, dim = dense.shape
    if len(scheme.widths) != heads * dim or scheme.heads != heads or scheme.page_size != p:
        raise ValueError(f"the scheme is a layout of {scheme.heads} KV heads x {len(scheme.widths) // scheme.heads} "
                         f"channels on pages of {scheme.page_size} tokens; the pools hold {heads} x {dim} on {p}")
    if pages.shape[1] != scheme.page_bytes or (codebooks.numel() and codebooks.shape[-1] != scheme.book_bytes):
        raise ValueError(f"the pools' pages of {pages.shape[1]} bytes and slots of {codebooks.shape[-1]} are not the "
                         f"scheme's layout ({scheme.page_bytes} and {scheme.book_bytes})")


@functools.lru_cache(maxsize=64)
def chw_table(widths: str, heads: int, page_size: int, device: str, order: str = "natural") -> torch.Tensor:
    """int32 ``[6, H*D]``: each channel's width, the bit of its first code in the page's key bytes, the bits between
    its codes, its index among the coded channels, its head's block's first byte and size (an uncoded channel: width,
    stride and index 0, its first bit its block's first); ``order``: the codes' order within a token."""
    from kvbackend.codecs.chw import bit_layout

    w = torch.tensor([int(c) for c in widths], dtype=torch.int32)
    bits = bit_layout(w.to(torch.uint8), heads, page_size, order)
    coded = w > 0
    block = torch.tensor(bits.block, dtype=torch.int64)
    first = block[:-1].repeat_interleave(w.numel() // heads)
    table = torch.zeros(6, w.numel(), dtype=torch.int64)
    table[0] = w
    table[1] = 8 * first
    table[1, coded] = bits.start
    table[2, coded] = bits.stride
    table[3, coded] = torch.arange(int(coded.sum()))
    table[4] = first
    table[5] = (block[1:] - block[:-1]).repeat_interleave(w.numel() // heads)
    return table.to(torch.int32).to(device).contiguous()


def tile_bytes(widths: str, heads: int, page_size: int) -> int:
    """The register tile a program loads its head's key block into (`chw_keys`' TILE): a power of two above the
    largest block (the last code's second byte is read from it too)."""
    w = torch.tensor([int(c) for c in widths], dtype=torch.int64).reshape(heads, -1)
    return triton.next_power_of_2(int((4 * ((page_size * w.sum(1) + 31) // 32)).max()) + 1)


@triton.jit
def chw_keys(u8, i16, book_i16, page, slot, h, table, PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr,
             H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr,
             MEAN: tl.constexpr, CODED: tl.constexpr, C0: tl.constexpr = 0, W: tl.constexpr = 0,
             TILE: tl.constexpr = 0):
    """Keys [P, D] float32 of head ``h`` of packed page ``page`` (int64): ``mean + ((code + 0.5) * step - amax)``
    with ``step = 2 * amax / 2^w`` per coded channel, the mean for a channel of width 0. ``C0``/``W``: only
    channels ``C0 .. C0 + W - 1`` ([P, W]; W 0 = all D: RoPE's halves). TILE 0: each code's two bytes loaded from
    memory; else the head's block loaded once into a register tile of TILE bytes (`tile_bytes`) and each code's
    two bytes gathered from it."""
    WD: tl.constexpr = D if W == 0 else W
    t = tl.arange(0, P)
    ch = h * D + C0 + tl.arange(0, WD)
    mean = tl.load(book_i16 + slot * (BOOK_BYTES // 2) + MEAN // 2 + ch).to(tl.float16, bitcast=True).to(tl.float32)
    if not CODED:  # no channel coded
        k = tl.broadcast_to(mean[None, :], (P, WD))  # (a -0 mean stays -0, as the reference reads it)
    else:
        w = tl.load(table + ch)
        start = tl.load(table + H * D + ch)
        stride = tl.load(table + 2 * H * D + ch)
        index = tl.load(table + 3 * H * D + ch)
        bit = start[None, :] + t[:, None] * stride[None, :]
        if TILE:
            first = tl.load(table + 4 * H * D + h * D)  # the head's block: its first byte and size
            size = tl.load(table + 5 * H * D + h * D)
            kb = tl.arange(0, TILE)
            block = tl.load(u8 + page * PAGE_BYTES + CODES + first + kb, mask=kb < size, other=0).to(tl.int32)
            byte = tl.reshape((bit >> 3) - first, (P * WD,))
            window = tl.reshape((tl.gather(block, byte, 0) << 8) | tl.gather(block, byte + 1, 0), (P, WD))
        else:
            at = page * PAGE_BYTES + CODES + (bit >> 3)
            window = (tl.load(u8 + at).to(tl.int32) << 8) | tl.load(u8 + at + 1).to(tl.int32)
        code = (window >> (16 - (bit & 7) - w[None, :])) & ((1 << w) - 1)[None, :]
        amax = tl.load(i16 + page * (PAGE_BYTES // 2) + SCALES // 2 + index, mask=w > 0, other=0)
        amax = amax.to(tl.float16, bitcast=True).to(tl.float32)
        step = 2.0 * amax / (1 << w).to(tl.float32)
        level = (code.to(tl.float32) + 0.5) * step[None, :] - amax[None, :]
        k = tl.where((w > 0)[None, :], mean[None, :] + level, mean[None, :])
    return k


@triton.jit
def _chw_gather_kernel(u8, i16, i32, book_i16, dense, table, page_ids, slots, kinds, valid, rows, positions,
                       local_cos, local_sin, base_cos, base_sin, hadamard_ptr, k_out, v_out,
                       PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr, P: tl.constexpr,
                       D: tl.constexpr, K_CODES: tl.constexpr, K_SCALES: tl.constexpr, K_MEAN: tl.constexpr,
                       CODED: tl.constexpr, TILE: tl.constexpr,
                       V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYMMETRIC: tl.constexpr,
                       V_KIND: tl.constexpr, V_ESIZE: tl.constexpr, V_CODES: tl.constexpr, V_SCALES: tl.constexpr,
                       V_ZEROS: tl.constexpr, V_ASSIGN: tl.constexpr, V_STAGES: tl.constexpr, V_C: tl.constexpr,
                       V_BOOK: tl.constexpr, V_CSCALE: tl.constexpr,
                       SINK: tl.constexpr, SINK_K: tl.constexpr, SINK_V: tl.constexpr, SINK_KIND: tl.constexpr,
                       ROPE: tl.constexpr, PAGE_ROPE: tl.constexpr, VROT: tl.constexpr):
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
        k = chw_keys(u8, i16, book_i16, page, slot, h, table, PAGE_BYTES, BOOK_BYTES, H, P, D, K_CODES, K_SCALES,
                     K_MEAN, CODED, TILE=TILE)
        v = dequant_tile(u8, i16, i32, page, book_i16, slot, h, PAGE_BYTES, BOOK_BYTES, H, P, D, V_MODE, V_BITS,
                         V_GROUP, V_SYMMETRIC, V_KIND, V_ESIZE, V_CODES, V_SCALES, V_ZEROS, V_ASSIGN, V_STAGES, V_C,
                         V_BOOK, 0, CSCALE=V_CSCALE)
        if ROPE:  # R(p0 + t) = R(p0) R(t)
            cos_t, sin_t = rope_tables(local_cos, local_sin, P, D)
            cos_0, sin_0 = page_rotation(base_cos, base_sin, tl.load(positions + w) // P, D)
            lo, hi = halves(k, P, D)
            lo, hi = rotate_halves(lo, hi, cos_t, sin_t)
            lo, hi = rotate_halves(lo, hi, cos_0[None, :], sin_0[None, :])
            k = join_halves(lo, hi, P, D)
        if PAGE_ROPE:  # stored as R(t) k: R(p0) remains
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


def chw_gather(pages: torch.Tensor, codebooks: torch.Tensor, dense: torch.Tensor, scheme: ChwScheme, plan: BatchPlan,
               out_dtype: torch.dtype = torch.bfloat16, levers: LeverScheme | None = None,
               rotary: Rotary | None = None, num_warps: int = 4, tile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the planned requests, ``[total_tokens, H, D]`` each for K and V (`gather_dequant`'s contract
    for ``chw:`` layers).

    Args:
        pages: one layer's packed pages ``[num_pages, page_bytes]`` (uint8, contiguous).
        codebooks: one layer's codebook slots ``[num_slots, codebook_bytes]`` (uint8).
        dense: one layer's dense pages ``[num_pages, 2, P, H, D]``.
        scheme: `chw_scheme` of the layer; levers: its `lever_scheme` (None for none); rotary: the model's RoPE, for
            pre-RoPE and page-relative keys.
        tile: each program loads its head's key block once and gathers the codes from registers (`chw_keys`).
    """
    _check(pages, dense, plan)  # (`gather_dequant`'s checks of the pools and the plan)
    _, _, p, h, d = dense.shape
    if plan.page_size != p:
        raise ValueError(f"plan page_size {plan.page_size} != dense pages' {p}")
    check_pools(scheme, pages, codebooks, dense)
    lv = levers if levers is not None else LeverScheme()
    if lv.psac_rank or lv.outliers or lv.whole:
        raise UnsupportedLayout("chw: layers carry no PSAC rows, key outliers or whole key rows")
    total = plan.num_tokens
    k_out = torch.empty(total, h, d, dtype=out_dtype, device=pages.device)
    v_out = torch.empty(total, h, d, dtype=out_dtype, device=pages.device)
    work = plan.page_ids.numel()
    if work == 0:
        return k_out, v_out
    u8, i16, i32 = pool_views(pages)
    _, book_i16, _ = pool_views(codebooks)
    ropes = lever_args(lv, rotary, p, d, plan.max_pages, k_out)
    _chw_gather_kernel[(work, h)](
        u8, i16, i32, book_i16, dense, chw_table(scheme.widths, h, p, str(pages.device), scheme.order), plan.page_ids, plan.slots,
        plan.kinds, plan.valid, plan.rows, plan.positions, *ropes, k_out, v_out,
        PAGE_BYTES=pages.shape[1], BOOK_BYTES=max(codebooks.shape[-1], 0), H=h, P=p, D=d,
        K_CODES=max(scheme.codes, 0), K_SCALES=max(scheme.scales, 0), K_MEAN=scheme.mean, CODED=scheme.codes >= 0,
        TILE=tile_bytes(scheme.widths, h, p) if tile and scheme.codes >= 0 else 0,
        **scheme_constants("V", scheme.values), SINK=lv.sink, SINK_K=max(lv.sink_k, 0), SINK_V=max(lv.sink_v, 0),
        SINK_KIND=lv.sink_kind, ROPE=lv.prerope, PAGE_ROPE=lv.pagerope, VROT=lv.vrot, num_warps=num_warps)
    return k_out, v_out


def layer_schemes(codec, layout: PageLayout) -> tuple[ChwScheme, LeverScheme]:
    """(`chw_scheme`, `lever_scheme`) of a layer, raising `UnsupportedLayout` where the kernel cannot read it."""
    return chw_scheme(codec, layout), lever_scheme(codec, layout)
