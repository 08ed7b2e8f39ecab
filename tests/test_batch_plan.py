"""`plan_batch` (numpy, one buffer, one copy) against a plain per-page reference of the same arrays."""

import random

import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.batch import DENSE, PACKED, plan_batch

FIELDS = ("page_ids", "kinds", "slots", "valid", "rows", "positions", "req_start", "req_pages", "req_packed",
          "cu_seqlens")


def reference_plan(cache, request_ids, layer):
    """The arrays, page by page (what the plan means)."""
    p = cache.config.page_size
    out = {name: [] for name in FIELDS}
    out["cu_seqlens"].append(0)
    for rid in request_ids:
        table = cache.page_table(rid)
        start = len(out["page_ids"])
        out["req_start"].append(start)
        dense_tokens = table.dense_tokens(layer)
        for i, page in enumerate(table.packed):
            out["page_ids"].append(page)
            out["kinds"].append(PACKED)
            out["slots"].append(cache.packed.slot_of_page[page])
            out["valid"].append(p)
            out["positions"].append(i * p)
        for i, page in enumerate(table.dense[: -(-dense_tokens // p)] if dense_tokens else []):
            out["page_ids"].append(page)
            out["kinds"].append(DENSE)
            out["slots"].append(0)
            out["valid"].append(min(p, dense_tokens - i * p))
            out["positions"].append(table.num_packed_tokens + i * p)
        out["req_pages"].append(len(out["page_ids"]) - start)
        out["req_packed"].append(len(table.packed))
        for position in out["positions"][start:]:
            out["rows"].append(out["cu_seqlens"][-1] + position)
        out["cu_seqlens"].append(out["cu_seqlens"][-1] + table.lengths[layer])
    return out


def test_plans_match_the_reference_over_random_caches():
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for trial in range(6):
        page = rng.choice([4, 8, 16])
        cache = KVCache(Geometry(2, 2, 16, torch.float32),
                        CacheConfig(codec="rtn:bits=2,group=16", page_size=page, chunk_pages=rng.choice([1, 2, 3]),
                                    dense_pages=200, packed_pages=200))
        ids = []
        for _ in range(rng.randint(1, 6)):
            rid, _ = cache.add_request()
            n = rng.randint(1, 90)
            for layer in range(2):
                cache.append(rid, layer, torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen))
            ids.append(rid)
        if trial % 2:  # a partial step: layer 0 holds one more token than layer 1
            cache.append_step(ids, 0, torch.randn(len(ids), 2, 16, generator=gen),
                              torch.randn(len(ids), 2, 16, generator=gen))
        rng.shuffle(ids)
        for layer in range(2):
            for batch in (ids, ids[:1], ids[::-1]):
                plan, want = plan_batch(cache, batch, layer), reference_plan(cache, batch, layer)
                for name in FIELDS:
                    got = getattr(plan, name)
                    assert got.dtype == torch.int32 and got.data_ptr() % 16 == 0, name
                    assert got.tolist() == want[name], (trial, layer, name)
                assert plan.max_pages == max(want["req_pages"]) and plan.min_pages == min(want["req_pages"])
                assert plan.num_tokens == want["cu_seqlens"][-1]


def test_an_empty_batch_plans_empty_arrays():
    cache = KVCache(Geometry(1, 1, 16, torch.float32),
                    CacheConfig(codec="identity", page_size=4, chunk_pages=1, dense_pages=4, packed_pages=4))
    plan = plan_batch(cache, [], 0)
    assert plan.page_ids.numel() == 0 and plan.cu_seqlens.tolist() == [0] and plan.max_pages == 0
