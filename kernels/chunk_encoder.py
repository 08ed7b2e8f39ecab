"""Encode a completed chunk on the GPU: k-means stages (Triton assignment), then the encode kernel
writes every packed page in place and the centroids go to the chunk's codebook slot."""

from __future__ import annotations

import torch

from kvbackend.codecs.base import CodecState
from kvbackend.codecs.kmeans import kmeanspp_init, random_init
from kvbackend.layout import PageLayout
from kvbackend.scheme import FLOAT, kernel_schemes

from .encode import encode_into_pages
from .kmeans import kmeans

_INITS = {"kmeans++": kmeanspp_init, "random": random_init}


def encode_chunk(codec, layout: PageLayout, k: torch.Tensor, v: torch.Tensor, state: CodecState,
                 pages: torch.Tensor, page_ids: torch.Tensor, codebook: torch.Tensor) -> None:
    """Encode ``k, v [N, H, D]`` (N = pages * P) into ``pages[page_ids]`` and the slot row ``codebook``.

    Args:
        pages: one layer's packed pool [num_pages, page_bytes], written in place.
        page_ids: int32 [N / P] destination pages.
        codebook: the chunk's codebook slot [codebook_bytes] of this layer, written in place.
    """
    schemes = kernel_schemes(codec, layout)
    spec = codec.spec
    for prefix, x, scheme in (("k", k, schemes[0]), ("v", v, schemes[1])):
        if scheme.mode == FLOAT:
            dtype = layout.page.fields[prefix].dtype
            big = torch.finfo(dtype).max
            rows = pages[page_ids.long()]  # gather, fill this field, scatter back: the other field survives
            layout.page.view(rows, prefix).copy_(x.float().clamp(-big, big).to(dtype).reshape(
                -1, layout.page_size, *x.shape[1:]))
            pages[page_ids.long()] = rows
            continue
        if not scheme.stages:
            encode_into_pages(x.contiguous(), scheme, pages, page_ids)
            continue
        residual = x.float().transpose(0, 1).contiguous()  # [H, N, D]
        warm = state.centroids.get(prefix)
        generator = torch.Generator().manual_seed(spec.seed)
        stored, assigns = [], []
        for stage in range(scheme.stages):
            if warm is not None:
                init = warm[stage].to(residual.device)
            else:
                init = _INITS[spec.init](residual.cpu(), scheme.centroids, generator).to(residual.device)
            result = kmeans(residual, init, spec.iters)
            state.iterations.append(result.iterations)
            cents = result.centroids.to(torch.bfloat16)
            residual -= torch.gather(cents.float(), 1, result.assign.unsqueeze(-1).expand(-1, -1, residual.shape[2]))
            stored.append(cents)
            assigns.append(result.assign)
        centroids = torch.stack(stored)  # [S, H, C, D]
        state.centroids[prefix] = centroids.float()
        layout.codebook.view(codebook, f"{prefix}_centroids").copy_(centroids)
        assign = torch.stack(assigns).transpose(1, 2).to(torch.int32).contiguous()  # [S, N, H]
        encode_into_pages(x.contiguous(), scheme, pages, page_ids, assign, centroids)
