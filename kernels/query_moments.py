"""A decode step's query statistics in one kernel: de-rotation into the keys' stored frame, then per KV head the sums
of q q^T and of q over its GQA group (what `LeverFrame.step_queries_to_stored` and `query_moments` do in torch, in
about ten kernels a layer).

One program per (request, KV head) loads its group's G query rows, turns each back by its request's RoPE tables
(``x cos - rotate_half(x) sin``, divided by the RoPE's scaling, then rounded to the queries' dtype as the torch path
stores them) and adds the outer products into a ``[D, D]`` float32 tile. The reference is the torch path:
`kvbackend.frames.LeverFrame.step_queries_to_stored`, then `kvbackend.codecs.base.query_moments`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 128  # a [D, D] float32 tile per program: 64 KiB at 128 (a larger head goes through torch)


@triton.jit
def _step_moments(q_ptr, cos_ptr, sin_ptr, moments_ptr, sums_ptr, parts_ptr, stride_b, stride_h, scaling,
                  H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
                  SCALED: tl.constexpr, TO_PARTS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # (offsets in int64: a large step's buffers pass 2**31 elements)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = d < D
    half = D // 2
    if ROTATE:
        cos = tl.load(cos_ptr + b * D + d, mask=live, other=0.0)
        sin = tl.load(sin_ptr + b * D + d, mask=live, other=0.0)
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
    acc = tl.zeros([BLOCK_D, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for g in tl.static_range(G):
        row = q_ptr + b * stride_b + (h * G + g) * stride_h
        raw = tl.load(row + d, mask=live, other=0.0)
        x = raw.to(tl.float32)
        if ROTATE:
            rotated = (tl.load(row + partner, mask=live, other=0.0).to(tl.float32) * sign) * sin
            x = x * cos - rotated
            if SCALED:
                x = x / scaling  # (a division, as the torch path does it)
            x = x.to(raw.dtype).to(tl.float32)  # stored as the queries' dtype, as the torch path keeps them
        acc += x[:, None] * x[None, :]
        total += x
    tile = live[:, None] & live[None, :]
    if TO_PARTS:  # added to each request's own float32 parts [H, D, D] and [H, D] (addresses in parts_ptr [2, B])
        part = tl.load(parts_ptr + b).to(tl.pointer_type(tl.float32)) + h * D * D
        here = part + d[:, None] * D + d[None, :]
        tl.store(here, tl.load(here, mask=tile, other=0.0) + acc, mask=tile)
        address = tl.load(parts_ptr + tl.num_programs(0) + b)
        if address != 0:  # (0: the chunk's sum of q is not kept)
            summed = address.to(tl.pointer_type(tl.float32)) + h * D + d
            tl.store(summed, tl.load(summed, mask=live, other=0.0) + total, mask=live)
    else:
        out = (b * H + h) * D
        tl.store(moments_ptr + (out + d[:, None]) * D + d[None, :], acc, mask=tile)
        tl.store(sums_ptr + out + d, total, mask=live)


def supports(queries: torch.Tensor) -> bool:
    """Whether the kernel takes these queries ``[B, Hq, D]`` (on CUDA, or on the CPU under Triton's interpreter): a
    head of at most `MAX_HEAD_DIM` channels, an even, non-zero head size and a float dtype."""
    return (queries.dim() == 3 and 0 < queries.shape[-1] <= MAX_HEAD_DIM and queries.shape[-1] % 2 == 0
            and queries.dtype in (torch.float16, torch.bfloat16, torch.float32))


def step_query_moments(queries: torch.Tensor, kv_heads: int, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                       scaling: float, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       parts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Moments ``[B, H, D, D]`` and sums ``[B, H, D]`` (float32, contiguous, written into ``out``) of queries
    ``[B, Hq, D]`` (one token per row) de-rotated by ``cos_sin`` (float32 ``[B, D]`` tables of `Rotary.cos_sin`,
    None for queries already in the stored frame) and divided by ``scaling``.

    ``parts`` instead of ``out``: int64 ``[2, B]`` on the queries' device, the addresses of request b's contiguous
    float32 parts ``[H, D, D]`` (row 0) and ``[H, D]`` (row 1; 0 for none) to which its moments and sums are added
    in place (each part read and written once, no ``[B, H, D, D]`` buffer between; the same float32 additions as
    writing ``out`` and adding it). The caller vouches for the addresses (`kvbackend.codecs.base.step_parts`)."""
    b, hq, d = queries.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads do not split into {kv_heads} KV heads")
    if (out is None) == (parts is None):
        raise ValueError("give one of out (buffers to write) and parts (addresses to add to)")
    if parts is not None:
        if parts.shape != (2, b) or parts.dtype != torch.int64 or parts.device != queries.device \
                or not parts.is_contiguous():
            raise ValueError(f"parts must be a contiguous int64 [2, {b}] on {queries.device}, got "
                             f"{tuple(parts.shape)} {parts.dtype} on {parts.device}")
        moments = sums = parts  # (not written)
    else:
        moments, sums = out
        if moments.shape != (b, kv_heads, d, d) or sums.shape != (b, kv_heads, d) or not moments.is_contiguous() \
                or not sums.is_contiguous() or moments.dtype != torch.float32 or sums.dtype != torch.float32:
            raise ValueError(f"out must be contiguous float32 [{b}, {kv_heads}, {d}, {d}] and [{b}, {kv_heads}, "
                             f"{d}], got {tuple(moments.shape)} {moments.dtype} and {tuple(sums.shape)} {sums.dtype}")
    if not b:
        return out
    if queries.stride(-1) != 1:
        queries = queries.contiguous()
    rotate = cos_sin is not None
    if rotate:
        cos, sin = (t.to(device=queries.device, dtype=torch.float32).contiguous() for t in cos_sin)
        if cos.shape != (b, d) or sin.shape != (b, d):
            raise ValueError(f"RoPE tables must be [{b}, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    else:
        cos = sin = queries  # (not read)
    _step_moments[(b, kv_heads)](queries, cos, sin, moments, sums, parts if parts is not None else moments,
                                 queries.stride(0), queries.stride(1), float(scaling), H=kv_heads, G=hq // kv_heads,
                                 D=d, BLOCK_D=triton.next_power_of_2(d), ROTATE=rotate,
                                 SCALED=rotate and float(scaling) != 1.0, TO_PARTS=parts is not None,
                                 num_warps=4 if d <= 64 else 8)
    return out
