"""Host-side planning of a batch of requests for the kernels (the `plan` half of plan/run).

A `BatchPlan` flattens the page tables of a batch into int32 arrays, once per batch; every layer's
kernel launch reuses it. Packed pages come first in each request, then its dense active pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.errors import InvalidKV

PACKED, DENSE = 0, 1  # page kinds


@dataclass
class BatchPlan:
    request_ids: list[int]
    page_ids: torch.Tensor  # int32 [W]: physical page of each work page
    kinds: torch.Tensor  # int32 [W]: PACKED or DENSE
    slots: torch.Tensor  # int32 [W]: codebook slot of packed pages (0 for dense)
    valid: torch.Tensor  # int32 [W]: tokens present in the page (1..P)
    rows: torch.Tensor  # int32 [W]: output row of the page's first token (cu_seqlens-style)
    positions: torch.Tensor  # int32 [W]: sequence position of the page's first token
    req_start: torch.Tensor  # int32 [B]: index of each request's first work page
    req_pages: torch.Tensor  # int32 [B]: work pages per request
    req_packed: torch.Tensor  # int32 [B]: how many of those are packed (they come first)
    cu_seqlens: torch.Tensor  # int32 [B + 1]: token offsets of requests in gathered output
    max_pages: int  # most work pages of any request
    page_size: int
    min_pages: int = 1  # fewest work pages of any request (host-side, so launchers need no device sync)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def check_queries(self, q: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        """Raise InvalidKV unless ``q`` is one query per planned request, ``[B, Hq, D]`` with GQA heads."""
        batch = len(self.request_ids)
        if (not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != batch or q.shape[2] != head_dim
                or q.shape[1] % num_kv_heads or not q.dtype.is_floating_point):
            raise InvalidKV(f"decode queries must be float [{batch}, Hq, {head_dim}] with Hq a multiple of "
                            f"{num_kv_heads}, got {getattr(q, 'shape', q)!r}")

    def splits(self, num_kv_heads: int, target_programs: int = 1024) -> tuple[int, int]:
        """(pages per split, number of splits) so the decode grid has about ``target_programs`` programs."""
        batch = len(self.request_ids)
        wanted = max(1, target_programs // max(batch * num_kv_heads, 1))
        per_split = max(1, -(-self.max_pages // wanted))
        return per_split, max(1, -(-self.max_pages // per_split))


def plan_batch(cache, request_ids: list[int], layer: int = 0) -> BatchPlan:
    """Flatten the page tables of ``request_ids`` (lengths taken from ``layer``; all layers of a
    request must hold the same number of tokens when the plan is reused across layers)."""
    p = cache.config.page_size
    page_ids, kinds, slots, valid, rows, positions, starts, counts, packed, cu = [], [], [], [], [], [], [], [], [], [0]
    for rid in request_ids:
        table = cache.page_table(rid)
        starts.append(len(page_ids))
        dense_tokens = table.dense_tokens(layer)
        for i, page in enumerate(table.packed):
            page_ids.append(page)
            kinds.append(PACKED)
            slots.append(cache.packed.slot_of_page[page])
            valid.append(p)
            positions.append(i * p)
        for i, page in enumerate(table.dense[: -(-dense_tokens // p)] if dense_tokens else []):
            page_ids.append(page)
            kinds.append(DENSE)
            slots.append(0)
            valid.append(min(p, dense_tokens - i * p))
            positions.append(table.num_packed_tokens + i * p)
        counts.append(len(page_ids) - starts[-1])
        packed.append(len(table.packed))
        for position in positions[starts[-1] :]:
            rows.append(cu[-1] + position)
        cu.append(cu[-1] + table.lengths[layer])
    device = cache.dense.data.device

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return BatchPlan(list(request_ids), as_tensor(page_ids), as_tensor(kinds), as_tensor(slots), as_tensor(valid),
                     as_tensor(rows), as_tensor(positions), as_tensor(starts), as_tensor(counts), as_tensor(packed),
                     as_tensor(cu),
                     max(counts, default=0), p, min(counts, default=0))
