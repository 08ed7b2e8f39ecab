"""What the kernels do for a layer's levers and PSAC rows (`kvbackend.scheme.LeverScheme`).

- PSAC: each packed page adds its rows' correction ``(codes * scale) @ basis^T`` to the keys, in the
  stored frame, before anything else: one-hot ``[P, rows]`` x coefficients ``[rows, rank]`` and then
  x ``basis^T [rank, D]``, both on tensor cores (rank and rows padded to 16).
- Pre-RoPE keys: a key at position ``p0 + t`` (``p0`` the page's first position) is rotated by
  ``R(p0 + t) = R(p0) R(t)``. ``R(t)`` uses one ``[P, D/2]`` table the program loads once; ``R(p0)``
  is one ``[D/2]`` row per page. Decode moves ``R(p0)`` onto the query (``q . R(p0) x = R(p0)^T q . x``),
  so a page costs one rotation of its keys by the loop-invariant table.
- Page-relative keys (``pagerope``): keys are stored as ``R(t) k``, so only ``R(p0)`` remains; decode
  rotates the query once per page (``R(p0)^T q``, the RoPE's scaling folded into the ``base`` tables)
  and reads the keys as stored; gather rotates each page by ``R(p0)``.
- Hadamard-rotated values: decode accumulates packed pages' values in the stored frame and rotates
  the accumulator back once per program (``acc @ H``; H is symmetric), gather rotates each page.
  The ±1 matrix is exact in fp16; the operand is split into two fp16 halves, so the product keeps
  about 22 bits, and ``1/sqrt(D)`` is applied in float32.
- Whole key rows: each packed page adds its rows (``codes * scale`` at their tokens) to the keys in the stored
  frame, beside the PSAC correction and the outliers (`whole_tile`, one row at a time).
- Sinks: decode masks the first ``sink`` tokens of a request's first packed page and the merge
  kernel attends to the exact sink tokens in the codebook slot; gather writes them over the page.

`lever_tables` builds the constant tables on the device once per (RoPE, page size, head size).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from kvbackend.rope import Rotary
from kvbackend.scheme import LeverScheme, NONE
from kvbackend.levers import hadamard


@dataclass(frozen=True)
class LeverTables:
    """Device tables of the lever paths (float32 RoPE tables with the RoPE's scaling in the local one)."""

    local_cos: torch.Tensor  # [P, D/2] cos(t * theta) * scaling
    local_sin: torch.Tensor  # [P, D/2]
    base_cos: torch.Tensor  # [pages, D/2] cos(j * P * theta) (times the scaling for page-relative keys)
    base_sin: torch.Tensor  # [pages, D/2]
    hadamard: torch.Tensor  # [D, D] fp16, entries +-1


@functools.lru_cache(maxsize=32)
def _tables(inv_freq: tuple, scaling: float, page_size: int, head_dim: int, pages: int, device: str,
            page_relative: bool) -> LeverTables:
    # Angles in float32, as `Rotary` and the model compute them (position times frequency, one rounding),
    # so a page-relative key is rotated back by exactly the angle it was de-rotated by.
    theta = torch.tensor(inv_freq, dtype=torch.float32)
    t = torch.arange(page_size, dtype=torch.float32)[:, None] * theta[None, :]
    base = (torch.arange(pages) * page_size).to(torch.float32)[:, None] * theta[None, :]
    h = (hadamard(head_dim).double() * math.sqrt(head_dim)).round()
    dev = torch.device(device)

    def f32(x):
        return x.to(torch.float32).to(dev).contiguous()

    base_scale = scaling if page_relative else 1.0
    return LeverTables(f32(t.cos() * scaling), f32(t.sin() * scaling), f32(base.cos() * base_scale),
                       f32(base.sin() * base_scale), h.to(torch.float16).to(dev).contiguous())


def lever_tables(levers: LeverScheme, rotary: Rotary | None, page_size: int, head_dim: int, pages: int,
                 device: torch.device) -> LeverTables | None:
    """The tables ``levers`` need for requests of up to ``pages`` pages (None when none are needed).

    Raises:
        ValueError: pre-RoPE keys without the model's RoPE, or a RoPE of another head size.
    """
    if not (levers.prerope or levers.pagerope or levers.vrot):
        return None
    inv_freq, scaling = (1.0,) * (head_dim // 2), 1.0
    if levers.prerope or levers.pagerope:
        if rotary is None:
            raise ValueError("keys stored before RoPE need the model's RoPE (rotary=...) to be read")
        if rotary.inv_freq.numel() != head_dim // 2:
            raise ValueError(f"the RoPE has {rotary.inv_freq.numel()} frequencies, head_dim {head_dim} needs {head_dim // 2}")
        inv_freq, scaling = rotary.frequencies(), float(rotary.scaling)
    rounded = max(64, triton.next_power_of_2(max(pages, 1)))  # few distinct sizes, so the cache hits
    return _tables(inv_freq, scaling, page_size, head_dim, rounded, str(device), levers.pagerope)


def lever_args(levers: LeverScheme | None, rotary: Rotary | None, page_size: int, head_dim: int, pages: int,
               unused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The five table arguments of a kernel's lever paths (``unused`` in their place when no lever needs them)."""
    tables = lever_tables(levers or LeverScheme(), rotary, page_size, head_dim, pages, unused.device)
    if tables is None:
        return (unused,) * 5
    return tables.local_cos, tables.local_sin, tables.base_cos, tables.base_sin, tables.hadamard


@functools.lru_cache(maxsize=256)
def lever_constants(levers: LeverScheme | None) -> Mapping[str, int]:
    """Keyword constants of the kernels' lever paths (all off for None); read-only, computed once per scheme."""
    lv = levers or LeverScheme()
    rows = lv.psac_rows
    return MappingProxyType({
        "SINK": lv.sink, "SINK_K": max(lv.sink_k, 0), "SINK_V": max(lv.sink_v, 0), "SINK_KIND": lv.sink_kind,
        "SINK_ROWS": triton.next_power_of_2(max(lv.sink, 1)), "ROPE": lv.prerope, "PAGE_ROPE": lv.pagerope,
        "VROT": lv.vrot,
        "PSAC_R": lv.psac_rank, "PSAC_N": rows, "PSAC_NP": max(16, triton.next_power_of_2(max(rows, 1))),
        "PSAC_SPARSE": lv.psac_token != NONE, "PSAC_CODES": max(lv.psac_codes, 0),
        "PSAC_SCALE": max(lv.psac_scale, 0), "PSAC_TOKEN": max(lv.psac_token, 0), "PSAC_BASIS": max(lv.psac_basis, 0),
        "OUT_N": lv.outliers, "OUT_NP": max(16, triton.next_power_of_2(max(lv.outliers, 1))),
        "OUT_INDEX": max(lv.out_index, 0), "OUT_VALUE": max(lv.out_value, 0),
        "WHOLE_N": lv.whole, "WHOLE_CODES": max(lv.whole_codes, 0), "WHOLE_SCALE": max(lv.whole_scale, 0),
        "WHOLE_TOKEN": max(lv.whole_token, 0),
    })


@triton.jit
def outlier_rows(i16, page, h, t, PAGE_BYTES: tl.constexpr, H: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
                 NP: tl.constexpr, INDEX: tl.constexpr, VALUE: tl.constexpr):
    """The key outliers of head ``h`` of packed page ``page``: a token one-hot [BT, NP] fp16 for tokens
    ``t`` [BT], and each outlier's channel [NP] and value [NP] fp16 (padding rows match no token)."""
    i = tl.arange(0, NP)
    live = i < N
    index = tl.load(i16 + page * (PAGE_BYTES // 2) + INDEX // 2 + i * H + h, mask=live, other=0).to(tl.int32)
    value = tl.load(i16 + page * (PAGE_BYTES // 2) + VALUE // 2 + i * H + h, mask=live, other=0)
    token = tl.where(live, index // D, -1)
    return (t[:, None] == token[None, :]).to(tl.float16), index % D, value.to(tl.float16, bitcast=True)


@triton.jit
def outlier_tile(onehot, channel, value, C0: tl.constexpr, W: tl.constexpr):
    """Channels C0 .. C0 + W - 1 of the outliers `outlier_rows` read: [BT, W] float32, zero where none
    sits. The token one-hot times the outliers spread over their channels: every element has at most
    one term, so the product is exact."""
    c = C0 + tl.arange(0, W)
    spread = tl.where(channel[:, None] == c[None, :], value[:, None], 0.0).to(tl.float16)  # [NP, W]
    return tl.dot(onehot, spread)


@triton.jit
def whole_tile(u8, i16, page, h, t, PAGE_BYTES: tl.constexpr, H: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
               CODES: tl.constexpr, SCALE: tl.constexpr, TOKEN: tl.constexpr, C0: tl.constexpr, W: tl.constexpr):
    """Channels C0 .. C0 + W - 1 of what the whole key rows of head ``h`` of packed page ``page`` add to tokens
    ``t`` [BT]: [BT, W] float32, each row ``codes * scale`` (exact in float32) added at its token, one row after
    another from zero, as the torch reference sums them."""
    c = C0 + tl.arange(0, W)
    fix = tl.zeros((t.shape[0], W), tl.float32)
    for i in tl.static_range(N):
        token = tl.load(u8 + page * PAGE_BYTES + TOKEN + i * H + h).to(tl.int32)
        scale = tl.load(i16 + page * (PAGE_BYTES // 2) + SCALE // 2 + i * H + h).to(tl.float16, bitcast=True)
        codes = tl.load(u8 + page * PAGE_BYTES + CODES + (i * H + h) * D + c).to(tl.int8, bitcast=True)
        row = codes.to(tl.float32) * scale.to(tl.float32)
        fix += tl.where(t[:, None] == token, row[None, :], 0.0)
    return fix


@triton.jit
def psac_rows(u8, i16, page, h, t, PAGE_BYTES: tl.constexpr, H: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
              NP: tl.constexpr, SPARSE: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr, TOKEN: tl.constexpr):
    """The PSAC coefficients ``codes * scale`` [BT, 16] fp16 of tokens ``t`` [BT] (rank padded with
    zeros; zeros for tokens without a row) of head ``h`` of packed page ``page``."""
    r = tl.arange(0, 16)
    if SPARSE:
        i = tl.arange(0, NP)
        live = i < N
    else:  # row i corrects token i
        i = t
        live = t >= 0
    codes = tl.load(u8 + page * PAGE_BYTES + CODES + (i[:, None] * H + h) * R + r[None, :],
                    mask=live[:, None] & (r[None, :] < R), other=0).to(tl.int8, bitcast=True).to(tl.float32)
    scale = tl.load(i16 + page * (PAGE_BYTES // 2) + SCALE // 2 + i * H + h, mask=live, other=0)
    coef = (codes * scale.to(tl.float16, bitcast=True).to(tl.float32)[:, None]).to(tl.float16)
    if SPARSE:
        token = tl.load(u8 + page * PAGE_BYTES + TOKEN + i * H + h, mask=live, other=0).to(tl.int32)
        token = tl.where(live, token, -1)
        onehot = (t[:, None] == token[None, :]).to(tl.float16)  # [BT, NP]
        coef = tl.dot(onehot, coef).to(tl.float16)  # [BT, 16]: a one-hot pick, exact
    return coef


@triton.jit
def psac_basis(book_i16, slot, h, BOOK_BYTES: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BASIS: tl.constexpr,
               C0: tl.constexpr, W: tl.constexpr):
    """Channels ``C0 .. C0 + W - 1`` of the slot's PSAC basis, transposed: [16, W] fp16 (rank padded)."""
    r = tl.arange(0, 16)
    d = C0 + tl.arange(0, W)
    basis_t = tl.load(book_i16 + slot * (BOOK_BYTES // 2) + BASIS // 2 + (h * D + d[None, :]) * R + r[:, None],
                      mask=r[:, None] < R, other=0)
    return basis_t.to(tl.bfloat16, bitcast=True).to(tl.float16)


@triton.jit
def psac_fix(u8, i16, book_i16, page, slot, h, PAGE_BYTES: tl.constexpr, BOOK_BYTES: tl.constexpr,
             H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
             NP: tl.constexpr, SPARSE: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr,
             TOKEN: tl.constexpr, BASIS: tl.constexpr):
    """PSAC correction [P, D] float32 of head ``h`` of packed page ``page`` (slot ``slot``)."""
    coef = psac_rows(u8, i16, page, h, tl.arange(0, P), PAGE_BYTES, H, R, N, NP, SPARSE, CODES, SCALE, TOKEN)
    return tl.dot(coef, psac_basis(book_i16, slot, h, BOOK_BYTES, D, R, BASIS, 0, D))


@triton.jit
def halves(x, P: tl.constexpr, D: tl.constexpr):
    """Channels [0, D/2) and [D/2, D) of a [P, D] tile (RoPE's pairs)."""
    return tl.split(tl.permute(tl.reshape(x, (P, 2, D // 2)), (0, 2, 1)))


@triton.jit
def rotate_halves(lo, hi, cos, sin):
    """RoPE of the pair halves (``x1 cos - x2 sin``, ``x2 cos + x1 sin``); cos/sin broadcast."""
    return lo * cos - hi * sin, hi * cos + lo * sin


@triton.jit
def join_halves(lo, hi, P: tl.constexpr, D: tl.constexpr):
    """Inverse of `halves`."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (P, D))


@triton.jit
def rope_tables(local_cos, local_sin, P: tl.constexpr, D: tl.constexpr):
    """The loop-invariant R(t) tables [P, D/2] (scaling included)."""
    t = tl.arange(0, P)
    half = tl.arange(0, D // 2)
    at = t[:, None] * (D // 2) + half[None, :]
    return tl.load(local_cos + at), tl.load(local_sin + at)


@triton.jit
def page_rotation(base_cos, base_sin, j, D: tl.constexpr):
    """cos/sin [D/2] of R(p0) for the request's page ``j`` (p0 = j * P)."""
    half = tl.arange(0, D // 2)
    return tl.load(base_cos + j * (D // 2) + half), tl.load(base_sin + j * (D // 2) + half)


@triton.jit
def query_and_partner(q, q_rows, live, D: tl.constexpr):
    """The query rows [ROWS, D] float32 and their RoPE partners ``[q_hi, -q_lo]``, for `query_to_page`."""
    d = tl.arange(0, D)
    x = tl.load(q + q_rows[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    partner = tl.load(q + q_rows[:, None] + ((d + D // 2) % D)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    return x, tl.where(d[None, :] < D // 2, partner, -partner)


@triton.jit
def query_to_page(x, partner, base_cos, base_sin, j, D: tl.constexpr):
    """``R(p0)^T q`` [ROWS, D] float32 for the request's page ``j``: ``q cos + partner sin`` channel-wise
    (`query_and_partner`), with no reshaping of the tile."""
    at = j * (D // 2) + tl.arange(0, D) % (D // 2)
    return x * tl.load(base_cos + at)[None, :] + partner * tl.load(base_sin + at)[None, :]


@triton.jit
def hadamard_apply(x, hmat, D: tl.constexpr):
    """``x @ H / sqrt(D)`` for a float32 [M, D] tile and the ±1 fp16 ``hmat`` [D, D]: x is split into
    two fp16 parts (about 22 bits kept) whose products are exact in float32 accumulation."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return (tl.dot(hi, hmat) + tl.dot(lo, hmat)) * (1.0 / tl.sqrt(D * 1.0))


@triton.jit
def load_hadamard(hadamard_ptr, D: tl.constexpr):
    d = tl.arange(0, D)
    return tl.load(hadamard_ptr + d[:, None] * D + d[None, :])


@triton.jit
def sink_tile(book_i16, slot, h, FIELD: tl.constexpr, BOOK_BYTES: tl.constexpr, H: tl.constexpr,
              D: tl.constexpr, SINK: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr):
    """The exact sink tokens ``[ROWS, D]`` float32 of head ``h`` (rows past SINK are zero)."""
    t = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    at = slot * (BOOK_BYTES // 2) + FIELD // 2 + (t[:, None] * H + h) * D + d[None, :]
    x = tl.load(book_i16 + at, mask=(t < SINK)[:, None], other=0)
    if KIND == 1:
        return x.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x.to(tl.bfloat16, bitcast=True).to(tl.float32)
