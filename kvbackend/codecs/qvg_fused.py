"""QVG and QuantWM pages decoded on the CPU in one fused loop per tensor (`kvbackend.fastdecode`), into bf16.

`decode_units_bf16` gives what `Codec.decode_units` gives, rounded to bf16, followed by the Hadamard value
rotation of ``vrot=hadamard`` where asked (`kvbackend.frames.LeverFrame.from_stored`), bit for bit, in two passes
over the output instead of a dozen. The codec's torch decode stays the reference: this module only reads the
same fields, and takes its key correction (PSAC rows and whole keys) from the codec (`QuantWMCodec.key_fix`) unless
it has no whole keys and every stored PSAC byte is zero. Where it does not serve (no numba, another device or dtype, widths without a byte table, damaged
indices that torch's indexing should report) it returns None and the caller takes the torch path.
"""

from __future__ import annotations

import math

import torch

from kvbackend import fastdecode, fastquant
from kvbackend.layout import PageLayout
from kvbackend.codecs.qvg import QVGCodec
from kvbackend.codecs.quantwm import QuantWMCodec


def _tensor_pages(codec: QVGCodec, layout: PageLayout, pages: torch.Tensor, books: torch.Tensor,
                  prefix: str) -> fastdecode.TensorPages | None:
    """The fields of ``prefix`` ("k" or "v") of ``pages [U, page_bytes]`` with their codebook slots ``books``."""
    s, page, book = codec.spec, layout.page, layout.codebook
    units, p = pages.shape[0], layout.page_size
    bits = codec._bits(prefix)
    channels = prefix == "k" and bool(s.kchannel)
    zero = page.view(pages, f"{prefix}_zeros").float() if f"{prefix}_zeros" in page else None
    assign = fp8 = centroid_scale = float_centroids = None
    if codec._clustered(prefix):
        assign = page.view(pages, f"{prefix}_assign")  # [U, S, P, H]
        if int(assign.max()) >= s.centroids:  # damaged ids: torch's indexing raises
            return None
        raw = book.view(books, f"{prefix}_centroids")  # [U, S, H, C, D]
        if s.cdtype == "fp8":
            fp8 = raw.view(torch.uint8)
            centroid_scale = book.view(books, f"{prefix}_centroid_scales").float()
        else:
            float_centroids = raw.float()
    outlier_index = outlier_value = fix = None
    zero_fix = False
    if prefix == "k" and isinstance(codec, QuantWMCodec):
        if s.outliers:
            outlier_index = page.view(pages, "k_out_index")  # [U, n, H]
            d = layout.geometry.head_dim
            if int(outlier_index.min()) < 0 or int(outlier_index.max()) >= p * d:
                return None
            outlier_value = page.view(pages, "k_out_value").float()
        if s.rank or s.whole:  # the PSAC rows and whole keys, as the torch decode adds them: one correction
            zero_fix = not s.whole and codec.psac_is_zero(layout, pages, books)
            if not zero_fix:
                fix = codec.key_fix(layout, pages, books).reshape(units, p, layout.geometry.num_kv_heads, -1)
    return fastdecode.TensorPages(
        codes=page.view(pages, f"{prefix}_codes"), bits=bits, channels=channels,
        group=s.kchannel if channels else s.group, scale=page.view(pages, f"{prefix}_scales").float(), zero=zero,
        assign=assign, fp8_centroids=fp8, centroid_scale=centroid_scale, float_centroids=float_centroids,
        outlier_index=outlier_index, outlier_value=outlier_value, fix=fix, zero_fix=zero_fix)


def decode_units_bf16(codec, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor,
                      rotate_values: bool, groups: int) -> torch.Tensor | None:
    """`Codec.decode_units` of ``pages [U, page_bytes]`` with their slots ``codebooks [U, codebook_bytes]``, then the
    values' Hadamard rotation where ``rotate_values``, as bf16 ``[groups, 2, U / groups * P, H, D]`` (K, then V, of
    each group of consecutive units: a storage blob's layers); None where the fused loop does not serve."""
    if type(codec) not in (QVGCodec, QuantWMCodec) or layout.geometry.dtype != torch.bfloat16:
        return None
    if pages.device.type != "cpu" or pages.dim() != 2 or codebooks.dim() != 2 or pages.shape[0] != codebooks.shape[0]:
        return None
    units, g = pages.shape[0], layout.geometry
    if not units or units % groups or units * layout.page_size * g.num_kv_heads * g.head_dim < fastquant.MIN_VALUES \
            or not fastquant._usable():
        return None
    parts = [_tensor_pages(codec, layout, pages, codebooks, prefix) for prefix in ("k", "v")]
    if any(part is None for part in parts):
        return None
    out = torch.empty(groups, 2, units // groups * layout.page_size, g.num_kv_heads, g.head_dim, dtype=torch.bfloat16)
    scale = torch.tensor(1.0 / math.sqrt(g.head_dim), dtype=torch.float32)
    for kv, part in enumerate(parts):
        if not fastdecode.decode_into(part, out, kv, units // groups, scale if kv == 1 and rotate_values else None):
            return None
    return out
