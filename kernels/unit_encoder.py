"""Encode U chunks of a QVG-family codec (QVG, QuantWM: the recommended spec) in one pass of GPU kernels.

The reference (`QVGCodec._encode_chunks`, then QuantWM's key outliers and PSAC rows) is a few dozen torch passes
over float32 chunk-sized tensors per stage, and decodes the pages twice more to find what its fields leave of the
keys. Here each stage's k-means is the Triton k-means (fixed steps on CUDA), and one launch of the encode
kernel per tensor subtracts the centroids of every chunk, computes the (clipped) steps, packs the codes and, for
QuantWM's keys, writes what the codes leave of them: the outliers are chosen from that error and the PSAC rows
made from its product with the chunk's basis (`QuantWMCodec.write_outliers`, `_encode_psac(..., both=...)`), with
no decode of the pages.

Same fields and layout as the reference; the bytes match it where the arithmetic is the same and differ where
it is not: the k-means distances (TF32 on CUDA), the clipped steps' float32 sums, the outliers' error (the residual
minus its reconstruction, not the keys minus theirs), and the PSAC products' float32 sums.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvbackend.codecs.base import CodecState
from kvbackend.codecs.kmeans import kmeanspp_init
from kvbackend.codecs.quantwm import QuantWMCodec
from kvbackend.codecs.qvg import QVGCodec
from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.scheme import FLOAT, kernel_schemes

from kvbackend.kernels.encode import PACKED_WIDTHS, encode_units_into_pages
from kvbackend.kernels.kmeans import kmeans


def supports(codec, layout: PageLayout, states: Sequence[CodecState]) -> bool:
    """Whether `encode_units` encodes these chunks (else the reference does)."""
    if not isinstance(codec, QVGCodec) or not codec._units_encodable(states):
        return False
    if not codec._nearest_assigned("k", states[0].query_moment):  # QSAC: the reference chooses the centroids
        return False
    p, d = layout.page_size, layout.geometry.head_dim
    if p & (p - 1) or d & (d - 1):
        return False
    try:
        schemes = kernel_schemes(codec, layout, levers_read=True)
    except UnsupportedLayout:
        return False
    return all(scheme.mode != FLOAT and scheme.bits in PACKED_WIDTHS for scheme in schemes)


def encode_units(codec, k: torch.Tensor, v: torch.Tensor, layout: PageLayout, pages: torch.Tensor,
                 codebooks: torch.Tensor, states: Sequence[CodecState] | None = None) -> bool:
    """`Codec._encode_units` on the kernels: fill ``pages [U*n, page_bytes]`` and ``codebooks [U, codebook_bytes]``
    from float32 K/V ``[U*n*P, H, D]`` (chunk u from ``states[u]``, updated as the reference updates it), or
    return False, before writing anything, where `supports` says no."""
    units = codebooks.shape[0]
    states = [CodecState() for _ in range(units)] if states is None else list(states)
    if not supports(codec, layout, states):
        return False
    s = codec.spec
    h = k.shape[1]
    n = k.shape[0] // units
    schemes = dict(zip("kv", kernel_schemes(codec, layout, levers_read=True)))
    quantwm = isinstance(codec, QuantWMCodec)
    moments = codec._stacked_moments(states, k.device) if quantwm else None
    psac = quantwm and bool(s.rank) and moments is not None
    # first: the basis solve reads the device once (its failure check), which here waits for little; after the
    # encode launches it would wait for all of them, and the rest would be launched to an idle GPU
    basis = codec.psac_basis(moments) if psac else None
    generator = torch.Generator().manual_seed(s.seed)
    error = None
    for prefix, x in (("k", k), ("v", v)):
        x = x.float().contiguous()
        scheme = schemes[prefix]
        clip = s.clip if prefix == "k" and s.kchannel else s.clip and not s.symmetric
        extra = {"error": prefix == "k" and quantwm and (bool(s.outliers) or psac)}
        if codec._clustered(prefix):
            every, assign = _cluster(codec, prefix, x.view(units, n, h, -1), states, generator)
            for u, st in enumerate(states):
                st.centroids[prefix] = every[:, u * h : (u + 1) * h].clone()
            by_unit = every.reshape(s.stages, units, h, *every.shape[2:]).transpose(0, 1)
            codec._write_centroids(layout, codebooks, prefix, by_unit)
            extra.update(assign=assign, centroids=every)
        out = encode_units_into_pages(x, scheme, pages, units, clip=clip, **extra)
        error = out if prefix == "k" else error
    if error is not None:
        _key_fields(codec, layout, pages, codebooks, k, error, moments, units, basis)
    return True


def _key_fields(codec, layout: PageLayout, pages, codebooks, k, error, moments, units: int, basis) -> None:
    """QuantWM's key outliers and PSAC rows (``basis``: `QuantWMCodec.psac_basis`, or None without them) from what
    the codes leave of the keys, ``error`` [pages, H, P, D] (the kernel's; the reference decodes its pages twice)."""
    count, h, p, d = error.shape
    flat = error.view(count, h, p * d)
    if codec.spec.outliers:
        index, value = codec.write_outliers(layout, pages, flat, *codec.outlier_inputs(k, p, moments, units))
        flat.scatter_add_(2, index, -value.float())  # what is left once the outliers are added back
    if basis is not None:
        both = torch.cat([basis[0].float(), basis[1]], -1)  # [U, H, D, 2r]
        # [U, pages of a chunk, H, P, D] x [U, 1, H, D, 2r]: batched over pages and heads, no transpose of the error
        both = error.view(units, count // units, h, p, d) @ both.unsqueeze(1)
        both = both.transpose(1, 2).reshape(units, h, (count // units) * p, -1)  # [U, H, T, 2r]
        codec._encode_psac(k, layout, pages, codebooks, moments, basis=basis, both=both)


def _cluster(codec, prefix: str, x: torch.Tensor, states, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each stage's k-means over the chunks' heads (``x`` [U, N, H, D]), warm-started as the reference does.
    Returns the centroids as stored [S, U*H, C, D] (float32) and the ids [S, U*N, H] (int32)."""
    s = codec.spec
    units, n, h, d = x.shape
    residual = x.transpose(1, 2).reshape(units * h, n, d)  # [U*H, N, D], chunk by chunk
    warm = None
    if prefix in states[0].centroids:
        warm = torch.cat([st.centroids[prefix] for st in states], 1)  # [S, U*H, C, D]
    stored, assigns = [], []
    for stage in range(s.stages):
        if warm is not None:
            init = warm[stage].to(residual.device)
        else:
            init = kmeanspp_init(residual, s.centroids, generator, repeat=units)
        # CUDA: fixed steps, no host sync (a CUDA graph of them held 864 MiB per chunk shape for the process's life);
        # the interpreter: stop once assignments settle, as the reference does
        result = kmeans(residual, init, s.iters, early_stop=not residual.is_cuda)
        for st in states:
            st.iterations.append(result.iterations)
        cents = codec._store_centroids(result.centroids)  # as decoding will see them
        if stage + 1 < s.stages:
            residual = residual - torch.gather(cents, 1, result.assign.unsqueeze(-1).expand(-1, -1, d))
        stored.append(cents)
        assigns.append(result.assign.view(units, h, n).transpose(1, 2).reshape(units * n, h))
    return torch.stack(stored), torch.stack(assigns).to(torch.int32)
