"""Field writers shared by codecs: uniform quantization of one tensor (K or V) into page fields.

Two groupings:
- per token: each token's D channels split into groups of ``group`` channels (RTN, QVG residuals,
  KIVI values);
- per channel: each channel quantized over groups of ``group`` tokens inside a page (KIVI keys).
"""

from __future__ import annotations

import torch

from kvbackend import bitpack, fastquant
from kvbackend.layout import PageLayout
from kvbackend.quant import clipped_params, dequantize, group_params, quantize
from kvbackend.codecs.base import FieldSpecs, from_pages, to_pages


def token_group_fields(prefix: str, page_size: int, heads: int, dim: int, bits: int, group: int,
                       symmetric: bool, store: torch.dtype) -> FieldSpecs:
    specs: FieldSpecs = [
        (f"{prefix}_codes", torch.uint8, (page_size, heads, bitpack.packed_size(dim, bits))),
        (f"{prefix}_scales", store, (page_size, heads, dim // group)),
    ]
    if not symmetric:
        specs.append((f"{prefix}_zeros", store, (page_size, heads, dim // group)))
    return specs


def encode_token_groups(x: torch.Tensor, layout: PageLayout, pages: torch.Tensor, prefix: str,
                        bits: int, group: int, symmetric: bool, clip: bool = False, widen: float = 1.0) -> None:
    """Quantize float ``x [n*P, H, D]`` per token in channel groups, into ``pages`` (``clip``, ``widen``: as
    `kvbackend.quant.quantize`)."""
    t, h, d = x.shape
    store = layout.page.fields[f"{prefix}_scales"].dtype
    page = layout.page
    p = layout.page_size
    grouped = x.reshape(t, h, d // group, group)
    span = fastquant.group_range(grouped) if bits in fastquant.PACK_BITS and fastquant.enabled(x) else None
    scale, zero = (None, None) if span is None else (
        clipped_params(grouped.float(), *span, bits, store, widen) if clip and not symmetric
        else group_params(*span, bits, symmetric, store))
    packed = fastquant.packed(x, scale, zero, bits, group, symmetric) if span is not None else None
    if packed is not None:  # fused CPU loops: the same parameters and bytes as below, two passes over the values
        page.view(pages, f"{prefix}_codes").copy_(to_pages(packed, p))
        page.view(pages, f"{prefix}_scales").copy_(to_pages(scale.to(store), p))
        if zero is not None:
            page.view(pages, f"{prefix}_zeros").copy_(to_pages(zero.to(store), p))
        return
    q = quantize(grouped, bits, symmetric, store, clip, widen)
    page.view(pages, f"{prefix}_codes").copy_(to_pages(bitpack.pack(q.codes.reshape(t, h, d), bits), p))
    page.view(pages, f"{prefix}_scales").copy_(to_pages(q.scale, p))
    if q.zero is not None:
        page.view(pages, f"{prefix}_zeros").copy_(to_pages(q.zero, p))


def decode_token_groups(layout: PageLayout, pages: torch.Tensor, prefix: str, bits: int, group: int,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[n*P, H, D]`` in float32, or already rounded to ``out_dtype`` where the caller wants that dtype
    (the fused CPU loop then writes it directly; the same values as float32 rounded by torch)."""
    page = layout.page
    packed = page.view(pages, f"{prefix}_codes")
    scale = from_pages(page.view(pages, f"{prefix}_scales"))
    zero = from_pages(page.view(pages, f"{prefix}_zeros")) if f"{prefix}_zeros" in page else None
    if fastquant.decode_enabled(packed, bits, out_dtype):
        fused = fastquant.unpacked_bf16 if out_dtype == torch.bfloat16 else fastquant.unpacked_f32
        out = fused(from_pages(packed), scale, zero, bits, group, packed.shape[-1] * 8 // bits)
        if out is not None:
            return out
    codes = from_pages(bitpack.unpack(packed, bits))
    t, h, d = codes.shape
    return dequantize(codes.reshape(t, h, d // group, group), scale, zero, bits).reshape(t, h, d)


def channel_group_fields(prefix: str, page_size: int, heads: int, dim: int, bits: int, group: int,
                         store: torch.dtype) -> FieldSpecs:
    return [
        (f"{prefix}_codes", torch.uint8, (page_size, heads, bitpack.packed_size(dim, bits))),
        (f"{prefix}_scales", store, (page_size // group, heads, dim)),
        (f"{prefix}_zeros", store, (page_size // group, heads, dim)),
    ]


def encode_channel_groups(x: torch.Tensor, layout: PageLayout, pages: torch.Tensor, prefix: str,
                          bits: int, group: int, clip: bool = False) -> None:
    """Quantize float ``x [n*P, H, D]`` per channel over groups of ``group`` tokens (asymmetric)."""
    t, h, d = x.shape
    store = layout.page.fields[f"{prefix}_scales"].dtype
    page = layout.page
    p = layout.page_size
    span = fastquant.channel_range(x.reshape(t, h * d), group) if (
        bits in fastquant.PACK_BITS and fastquant.enabled(x)) else None
    grouped = x.reshape(t // group, group, h, d).permute(0, 2, 3, 1)  # [tg, H, D, G]
    scale, zero = (None, None) if span is None else (
        clipped_params(grouped.float(), *(r.reshape(-1, h, d) for r in span), bits, store) if clip
        else group_params(*span, bits, False, store))
    if clip and scale is not None:  # as the fused loop takes them: [tg, H * D]
        scale, zero = scale.reshape(-1, h * d), zero.reshape(-1, h * d)
    packed = fastquant.packed_channels(x.reshape(t, h * d), scale, zero, bits, group) if span is not None else None
    if packed is not None:  # fused CPU loops, vectorized over channels: the bytes of the torch path below
        page.view(pages, f"{prefix}_codes").copy_(to_pages(packed.reshape(t, h, -1), p))
        page.view(pages, f"{prefix}_scales").copy_(scale.to(store).reshape(-1, p // group, h, d))
        page.view(pages, f"{prefix}_zeros").copy_(zero.to(store).reshape(-1, p // group, h, d))
        return
    q = quantize(grouped, bits, symmetric=False, store=store, clip=clip)
    codes = q.codes.permute(0, 3, 1, 2).reshape(t, h, d)
    page.view(pages, f"{prefix}_codes").copy_(to_pages(bitpack.pack(codes, bits), p))
    page.view(pages, f"{prefix}_scales").copy_(q.scale.reshape(-1, p // group, h, d))
    page.view(pages, f"{prefix}_zeros").copy_(q.zero.reshape(-1, p // group, h, d))


def decode_channel_groups(layout: PageLayout, pages: torch.Tensor, prefix: str, bits: int, group: int,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[n*P, H, D]`` in float32, or already rounded to ``out_dtype`` (as `decode_token_groups`)."""
    page = layout.page
    packed = from_pages(page.view(pages, f"{prefix}_codes"))
    t, h = packed.shape[:2]
    d = packed.shape[-1] * 8 // bits
    scale = page.view(pages, f"{prefix}_scales").reshape(t // group, h, d)
    zero = page.view(pages, f"{prefix}_zeros").reshape(t // group, h, d)
    if fastquant.decode_enabled(packed, bits, out_dtype):
        fused = fastquant.unpacked_channels_bf16 if out_dtype == torch.bfloat16 else fastquant.unpacked_channels_f32
        out = fused(packed.reshape(t, -1), scale.reshape(t // group, h * d), zero.reshape(t // group, h * d), bits,
                    group, h * d)
        if out is not None:
            return out.reshape(t, h, d)
    codes = bitpack.unpack(packed, bits)
    grouped = codes.reshape(t // group, group, h, d).permute(0, 2, 3, 1)
    return dequantize(grouped, scale, zero, bits).permute(0, 3, 1, 2).reshape(t, h, d)
