"""Stored units decoded on the GPU by the gather kernel.

A storage backend keeps each page of each layer as a unit that carries its own codebook (a one-page chunk:
`Codec.encode_units`). Read back, a batch of them is a pool of pages whose codebook slots are the units' own rows,
so `gather_dequant` reconstructs the whole batch in one launch: each unit a work page of one request, reading slot
= its own index. Against the torch reference (`Codec.decode_units` and the frame's value rotation, dozens of eager
operations per batch) this is one kernel and no host work per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.batch import PACKED, BatchPlan
from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.scheme import LeverScheme, TensorScheme, kernel_schemes, lever_scheme

OUTPUT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class UnitGather:
    """The gather kernel's view of one codec's units: their schemes and levers, planned once."""

    schemes: tuple[TensorScheme, TensorScheme]
    levers: LeverScheme | None
    layout: PageLayout
    dtype: torch.dtype  # of the decoded K and V

    @classmethod
    def of(cls, codec, layout: PageLayout, dtype: torch.dtype) -> "UnitGather | None":
        """The plan for ``codec``'s units on ``layout``, decoded into ``dtype``; None where the kernels cannot
        decode a unit on its own: levers that need the tokens' positions (pre-RoPE or page-relative keys, sinks,
        sequence-level PSAC), a layout no kernel reads, a page size or head_dim that is not a power of two, or an
        output dtype other than fp16/bf16."""
        lv = codec.levers
        if lv.rope or lv.sink or lv.psac or dtype not in OUTPUT_DTYPES:
            return None
        p, d = layout.page_size, layout.geometry.head_dim
        if p & (p - 1) or d & (d - 1):
            return None
        try:
            levers = lever_scheme(codec, layout)
            schemes = kernel_schemes(codec, layout, levers_read=True)
        except UnsupportedLayout:
            return None
        return cls(schemes, levers if levers.active else None, layout, dtype)

    def __call__(self, pages: torch.Tensor, books: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[units, P, H, D]`` of ``pages [units, page_bytes]`` and their codebooks ``[units,
        codebook_bytes]`` (uint8, one device), in the model's frame (rotated values turned back). ``backend`` as
        in `gather_dequant` ("auto": the CUDA kernel where it reads the layout, else Triton's)."""
        from kvbackend.kernels.gather_dequant import gather_dequant

        lay = self.layout
        units = pages.shape[0]
        if pages.shape != (units, lay.page_bytes) or books.shape != (units, lay.codebook_bytes):
            raise ValueError(f"expected pages [{units}, {lay.page_bytes}] and codebooks [{units}, "
                             f"{lay.codebook_bytes}], got {tuple(pages.shape)} and {tuple(books.shape)}")
        g, p, dev = lay.geometry, lay.page_size, pages.device
        # the plan's tensors made on the device (no host copies on the decode's stream)
        ids = torch.arange(units, dtype=torch.int32, device=dev)
        whole = torch.full((1,), units, dtype=torch.int32, device=dev)
        plan = BatchPlan(request_ids=[0], page_ids=ids, kinds=torch.full_like(ids, PACKED), slots=ids,
                         valid=torch.full_like(ids, p), rows=ids * p, positions=ids * p,
                         req_start=torch.zeros(1, dtype=torch.int32, device=dev), req_pages=whole, req_packed=whole,
                         cu_seqlens=torch.arange(2, dtype=torch.int32, device=dev) * (units * p), max_pages=units,
                         page_size=p, min_pages=units, total_tokens=units * p)
        dense = torch.zeros(1, 2, p, g.num_kv_heads, g.head_dim, dtype=self.dtype, device=dev)  # never read
        k, v = gather_dequant(pages.contiguous(), books.contiguous(), dense, self.schemes, plan, out_dtype=self.dtype,
                              levers=self.levers, backend=backend)
        shape = (units, p, g.num_kv_heads, g.head_dim)
        return k.view(shape), v.view(shape)
