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

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from kvbackend.codecs.base import CodecState
from kvbackend.codecs.quantwm import QuantWMCodec, psac_products
from kvbackend.codecs.qvg import BATCHED_INITS, QVGCodec
from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.scheme import FLOAT, kernel_schemes

from kvbackend.kernels.encode import PACKED_WIDTHS, encode_units_into_pages
from kvbackend.kernels.kmeans import kmeans


def supports(codec, layout: PageLayout, states: Sequence[CodecState]) -> bool:
    """Whether `encode_units` encodes these chunks (else the reference does)."""
    if not isinstance(codec, QVGCodec) or not codec._units_encodable(states):
        return False
    if codec._qsac("k", states[0].query_moment):  # QSAC: the reference chooses the centroids
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
    _encode_parts([Part(codec, layout, pages, codebooks, None)], k, v, states)
    return True


@dataclass
class Part:
    """Chunks of one codec and layout within a mixed pass: ``index`` names their units in the pass's K/V and
    states (None: all of them); ``pages`` [len(index) * n, page_bytes] and ``codebooks`` [len(index), bytes]."""

    codec: object
    layout: PageLayout
    pages: torch.Tensor
    codebooks: torch.Tensor
    index: list[int] | None


def clustering_key(codec) -> tuple | None:
    """What chunks of different layouts must share to be clustered in one pass (`encode_mixed`): everything of the
    codec's spec but the key code width and the key outlier count, which only the pages' packing and the outlier
    fields read (a `depth:` spec's layers differ in those). None for codecs `encode_units` does not encode."""
    if not isinstance(codec, QVGCodec):
        return None
    spec = codec.spec
    changes = {"kbits": 0}
    if isinstance(codec, QuantWMCodec):
        changes.update(outliers=0, whole=0)
    return (type(codec).__name__, repr(dataclasses.replace(spec, **changes)))


def encode_mixed(parts: Sequence[Part], k: torch.Tensor, v: torch.Tensor, states: Sequence[CodecState]) -> bool:
    """One pass over chunks of several codecs that share a `clustering_key` (a `depth:` spec's layers): the
    k-means, the PSAC bases and the query statistics over all chunks at once, then each part's packing, outliers
    and PSAC rows, the bytes each part's own `encode_units` writes. K/V ``[U*n*P, H, D]`` as `encode_units` takes
    them; every unit in exactly one part. Returns False, before writing anything, where a part is not encoded by
    `encode_units` or the parts do not share one clustering. Each state's `iterations` records the pass's Lloyd
    steps: with early stopping (the CPU) the pass stops once every part's units have settled, so a part that
    settles sooner records more steps than its own pass would (a settled unit's further steps change nothing)."""
    states = list(states)
    units = len(states)
    seen = sorted(u for part in parts for u in part.index)
    if seen != list(range(units)):
        raise ValueError(f"encode_mixed: the parts' units {seen} are not each of the {units} chunks once")
    keys = {clustering_key(part.codec) for part in parts}
    if len(keys) != 1 or None in keys:
        return False
    if not all(supports(part.codec, part.layout, [states[u] for u in part.index]) for part in parts):
        return False
    if not supports(parts[0].codec, parts[0].layout, states):  # the states alike across the parts too
        return False
    _encode_parts(parts, k, v, states)
    return True


def _encode_parts(parts: Sequence[Part], k: torch.Tensor, v: torch.Tensor, states: list[CodecState]) -> None:
    """The pass of `encode_units` (one part, ``index`` None) and `encode_mixed`: clustering and the PSAC bases of
    all units by the first part's codec, packing, outliers and PSAC rows per part."""
    codec = parts[0].codec
    s = codec.spec
    units, h = len(states), k.shape[1]
    n = k.shape[0] // units
    quantwm = isinstance(codec, QuantWMCodec)
    moments = codec._stacked_moments(states, k.device) if quantwm else None
    means = codec._stacked_means(states, k.device) if quantwm else None
    psac = quantwm and bool(s.rank) and moments is not None
    # first: the basis solve reads the device once (its failure check), which here waits for little; after the
    # encode launches it would wait for all of them, and the rest would be launched to an idle GPU
    basis = codec.psac_basis(moments) if psac else None
    generator = torch.Generator().manual_seed(s.seed)
    index = [_unit_index(part.index, k.device) for part in parts]
    errors: list[torch.Tensor | None] = [None] * len(parts)
    for prefix, x in (("k", k), ("v", v)):
        x = x.float().contiguous()
        clustered = codec._clustered(prefix)
        if clustered:
            every, assign = _cluster(codec, prefix, x.view(units, n, h, -1), states, generator, moments)
            for u, st in enumerate(states):
                st.centroids[prefix] = every[:, u * h : (u + 1) * h].clone()
        for i, (part, at) in enumerate(zip(parts, index)):
            ps = part.codec.spec
            scheme = dict(zip("kv", kernel_schemes(part.codec, part.layout, levers_read=True)))[prefix]
            clip = ps.clip if prefix == "k" and ps.kchannel else ps.clip and not ps.symmetric
            extra = {"error": prefix == "k" and quantwm and (bool(ps.outliers) or bool(ps.whole) or psac)}
            xp = x if at is None else x.view(units, n, h, -1)[at].view(-1, h, x.shape[-1])
            count = units if at is None else len(part.index)
            if clustered:
                e = every if at is None else every.view(s.stages, units, h, *every.shape[2:])[:, at].flatten(1, 2).contiguous()
                a = assign if at is None else assign.view(s.stages, units, n, h)[:, at].flatten(1, 2).contiguous()
                by_unit = e.reshape(s.stages, count, h, *e.shape[2:]).transpose(0, 1)
                part.codec._write_centroids(part.layout, part.codebooks, prefix, by_unit)
                extra.update(assign=a, centroids=e)
            out = encode_units_into_pages(xp, scheme, part.pages, count, clip=clip, widen=part.codec.widen(prefix),
                                          **extra)
            if prefix == "k":
                errors[i] = out
    for part, at, error in zip(parts, index, errors):
        if error is None:
            continue
        kp = k if at is None else k.view(units, n, h, -1)[at].view(-1, h, k.shape[-1])
        mp = moments if at is None or moments is None else moments[at]
        qp = means if at is None or means is None else means[at]
        bp = basis if at is None or basis is None else (basis[0][at], basis[1][at])
        _key_fields(part.codec, part.layout, part.pages, part.codebooks, kp, error, mp,
                    units if at is None else len(part.index), bp, qp)


def _unit_index(index: list[int] | None, device: torch.device):
    """A part's units as an indexer of the pass's unit axis: None (all), a slice where they are consecutive (as
    `KVCache` lays parts out: no tensor from host data, which a CUDA graph capture would refuse), else a tensor."""
    if index is None:
        return None
    if index == list(range(index[0], index[0] + len(index))):
        return slice(index[0], index[0] + len(index))
    return torch.tensor(index, dtype=torch.long, device=device)


def _key_fields(codec, layout: PageLayout, pages, codebooks, k, error, moments, units: int, basis,
                means: torch.Tensor | None = None) -> None:
    """QuantWM's key outliers, whole rows and PSAC rows (``basis``: `QuantWMCodec.psac_basis`, or None without them)
    from what the codes leave of the keys, ``error`` [pages, H, P, D] (the kernel's; the reference decodes its pages
    for it), the chunks' mean queries ``means`` [U, H, D] choosing the heavy keys that take them first (`heavy`):
    `QuantWMCodec.key_fields` where the spec has whole rows, else the same steps here."""
    count, h, p, d = error.shape
    heavy = codec.heavy_rows(k, means, units)
    if codec.spec.whole:
        codec.key_fields(layout, pages, codebooks, k, error, moments, units, heavy, basis)
        return
    flat = error.view(count, h, p * d)
    if codec.spec.outliers:
        index, value = codec.write_outliers(layout, pages, flat, *codec.outlier_inputs(k, p, moments, units),
                                            heavy=heavy)
        flat.scatter_add_(2, index, -value.float())  # what is left once the outliers are added back
    if basis is not None:
        codec._encode_psac(k, layout, pages, codebooks, moments, basis=basis, both=psac_products(error, basis, units),
                           heavy=heavy)


def _cluster(codec, prefix: str, x: torch.Tensor, states, generator,
             moments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each stage's k-means over the chunks' heads (``x`` [U, N, H, D]), warm-started as the reference does, in
    the space the codec measures distances in (`_cluster_scale`, from the chunks' query ``moments`` [U, H, D, D]).
    Returns the centroids as stored [S, U*H, C, D] (float32) and the ids [S, U*N, H] (int32)."""
    s = codec.spec
    units, n, h, d = x.shape
    residual = x.transpose(1, 2).reshape(units * h, n, d)  # [U*H, N, D], chunk by chunk
    warm = None
    if prefix in states[0].centroids:
        warm = torch.cat([st.centroids[prefix] for st in states], 1)  # [S, U*H, C, D]
    scale = codec._cluster_scale(prefix, None if moments is None else moments.flatten(0, 1))
    scale = None if scale is None else scale.to(residual.device, torch.float32).unsqueeze(1)  # [U*H, 1, D]
    stored, assigns = [], []
    for stage in range(s.stages):
        space = residual if scale is None else residual * scale
        if warm is not None:
            init = warm[stage].to(residual.device) if scale is None else warm[stage].to(residual.device) * scale
        else:
            init = BATCHED_INITS[s.init](space, s.centroids, generator, repeat=units)  # `_units_encodable`: batched
        # CUDA: fixed steps, no host sync (a CUDA graph of them held 864 MiB per chunk shape for the process's life);
        # the interpreter: stop once assignments settle, as the reference does
        result = kmeans(space, init, s.iters, early_stop=not residual.is_cuda)
        for st in states:
            st.iterations.append(result.iterations)
        centroids = result.centroids if scale is None else result.centroids / scale
        cents = codec._store_centroids(centroids)  # as decoding will see them
        if stage + 1 < s.stages:
            residual = residual - torch.gather(cents, 1, result.assign.unsqueeze(-1).expand(-1, -1, d))
        stored.append(cents)
        assigns.append(result.assign.view(units, h, n).transpose(1, 2).reshape(units * n, h))
    return torch.stack(stored), torch.stack(assigns).to(torch.int32)
