"""Encode a completed chunk on the GPU: k-means stages (Triton assignment), then the encode kernel
writes every packed page in place and the centroids go to the chunk's codebook slot."""

from __future__ import annotations

import torch

from kvbackend.codecs.base import CodecState
from kvbackend.codecs.kmeans import kmeanspp_init, random_init
from kvbackend.layout import PageLayout
from kvbackend.scheme import FLOAT, kernel_schemes

from kvbackend.kernels.encode import encode_into_pages
from kvbackend.kernels.kmeans import kmeans

_INITS = {"kmeans++": kmeanspp_init, "random": random_init}


def encode_chunk(codec, layout: PageLayout, k: torch.Tensor, v: torch.Tensor, state: CodecState,
                 pages: torch.Tensor, page_ids: torch.Tensor, codebook: torch.Tensor) -> None:
    """Encode ``k, v [N, H, D]`` (N = pages * P) into ``pages[page_ids]`` and the slot row ``codebook``.

    Args:
        pages: one layer's packed pool [num_pages, page_bytes], written in place.
        page_ids: int32 [N / P] destination pages.
        codebook: the chunk's codebook slot [codebook_bytes] of this layer, written in place.

    ``k, v`` arrive in the levers' stored frame and the caller writes the sink fields, so the codec's
    own fields are all this writes (PSAC codecs encode on the reference).
    """
    schemes = kernel_schemes(codec, layout, levers_read=True)
    quantized = []
    for prefix, x, scheme in (("k", k, schemes[0]), ("v", v, schemes[1])):
        if scheme.mode == FLOAT:
            dtype = layout.page.fields[prefix].dtype
            big = torch.finfo(dtype).max
            rows = pages[page_ids.long()]  # gather, fill this field, scatter back: the other field survives
            layout.page.view(rows, prefix).copy_(x.float().clamp(-big, big).to(dtype).reshape(
                -1, layout.page_size, *x.shape[1:]))
            pages[page_ids.long()] = rows
        else:
            quantized.append((prefix, x, scheme))
    staged = [item for item in quantized if item[2].stages]
    centroids, assign = _cluster(codec.spec, staged, state, k.shape[1]) if staged else ({}, {})
    for prefix, x, scheme in quantized:
        if prefix in centroids:
            layout.codebook.view(codebook, f"{prefix}_centroids").copy_(centroids[prefix])
            encode_into_pages(x.contiguous(), scheme, pages, page_ids, assign[prefix], centroids[prefix])
        else:
            encode_into_pages(x.contiguous(), scheme, pages, page_ids)


def _cluster(spec, staged, state: CodecState, heads: int):
    """k-means stages for K and V together (one batch of 2H problems), warm-started from ``state``.

    Returns per prefix the bf16 centroids [S, H, C, D] and int32 assignments [S, N, H].
    """
    prefixes = [prefix for prefix, _, _ in staged]
    stages, count = staged[0][2].stages, staged[0][2].centroids
    residual = torch.cat([x.float().transpose(0, 1) for _, x, _ in staged]).contiguous()  # [len * H, N, D]
    generator = torch.Generator().manual_seed(spec.seed)
    stored, assigns = [], []
    for stage in range(stages):
        if all(p in state.centroids for p in prefixes):
            init = torch.cat([state.centroids[p][stage] for p in prefixes]).to(residual.device)
        else:  # K's heads then V's, as the reference seeds them (same draws for one stage)
            init = torch.cat([_INITS[spec.init](part.cpu(), count, generator)
                              for part in residual.split(heads)]).to(residual.device)
        # CUDA: fixed steps, no host sync (a CUDA graph of them held 864 MiB per chunk shape for the process's life);
        # the interpreter: stop once assignments settle, as the reference does
        result = kmeans(residual, init, spec.iters, early_stop=not residual.is_cuda)
        state.iterations.append(result.iterations)
        cents = result.centroids.to(torch.bfloat16)
        residual -= torch.gather(cents.float(), 1, result.assign.unsqueeze(-1).expand(-1, -1, residual.shape[2]))
        stored.append(cents)
        assigns.append(result.assign)
    all_cents = torch.stack(stored)  # [S, len * H, C, D]
    all_assign = torch.stack(assigns).transpose(1, 2).to(torch.int32)  # [S, N, len * H]
    centroids, assign = {}, {}
    for i, prefix in enumerate(prefixes):
        centroids[prefix] = all_cents[:, i * heads : (i + 1) * heads].contiguous()
        assign[prefix] = all_assign[:, :, i * heads : (i + 1) * heads].contiguous()
        state.centroids[prefix] = centroids[prefix].float()
    return centroids, assign
