"""`plan_batch` (numpy, one buffer, one copy) against a plain per-page reference of the same arrays."""

import random

import pytest

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
    for trial in range(16):
        page = rng.choice([4, 8, 16])
        cache = KVCache(Geometry(2, 2, 16, torch.float32),
                        CacheConfig(codec="rtn:bits=2,group=16", page_size=page, chunk_pages=rng.choice([1, 2, 3]),
                                    dense_pages=200, packed_pages=200))
        ids = []
        for _ in range(rng.randint(1, 6)):
            rid, _ = cache.add_request()
            n = 0 if trial > 5 and not ids else rng.randint(1, 90)  # (later trials: a request holding no token)
            for layer in range(2):
                cache.append(rid, layer, torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen))
            ids.append(rid)
        if trial % 2 and all(cache.page_table(rid).lengths[0] for rid in ids):  # a partial step: layer 0 ahead
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


def _plan(batch: int, max_pages: int):
    from kvbackend.batch import BatchPlan

    empty = torch.zeros(0, dtype=torch.int32)
    return BatchPlan(list(range(batch)), empty, empty, empty, empty, empty, empty, empty, empty, empty, empty,
                     max_pages, 64)


def _waves(batch: int, heads: int, wave: int, splits: int) -> int:
    return -(-batch * heads * splits // wave)


def _exhaustive_wave_splits(pairs: int, max_pages: int, wave: int, fixed: int) -> tuple[int, int]:
    """The grid of least modelled cost (whole waves x (pages per split + fixed)) over every split count, the fewest
    splits among equals, at most a CUDA grid's 65535."""
    best = None
    for wanted in range(1, max_pages + 1):
        per_split = -(-max_pages // wanted)
        splits = -(-max_pages // per_split)
        if splits > 65535:
            continue
        cost = -(-pairs * splits // wave) * (per_split + fixed)
        if best is None or cost < best[0]:
            best = (cost, per_split, splits)
    return best[1], best[2]


def test_wave_splits_cover_every_page_and_fill_the_last_wave():
    """Every page lies in exactly one split, and the grid is the one of least modelled cost; the serving shape that
    motivated it (46 requests of 512 pages, 8 KV heads, 264 programs a wave) gets five splits: 1840 programs, seven
    waves at 99.6%, against one wave divided by the pairs' one split (368 programs, two waves)."""
    assert _plan(46, 512).wave_splits(8, 264) == (103, 5)
    assert _plan(46, 512).splits(8, 264) == (512, 1)
    for batch, pages, wave in [(8, 512, 264), (1, 512, 264), (32, 128, 264), (24, 512, 264), (45, 512, 396),
                               (9, 512, 264), (3, 63, 132), (200, 7, 264), (1, 1, 264), (5, 3, 1), (17, 1000, 528)]:
        per_split, splits = _plan(batch, pages).wave_splits(8, wave)
        assert per_split * splits >= pages > per_split * (splits - 1), (batch, pages, wave, per_split, splits)
        assert (per_split, splits) == _exhaustive_wave_splits(batch * 8, pages, wave, 4), (batch, pages, wave)


def test_wave_splits_keep_the_one_wave_grids_of_the_benchmark_shapes():
    """Where one wave divided by the pairs already fills a wave (the kernel benchmark's shapes), the grid stays."""
    for batch, pages in [(8, 512), (1, 512), (32, 128), (8, 2048)]:
        plan = _plan(batch, pages)
        assert plan.wave_splits(8, 264) == plan.splits(8, 264), (batch, pages)


def test_wave_splits_search_finds_the_least_cost_grid():
    """The search visits only distinct grids and stops at a lower bound; over batches 1-64, 1-2100 pages, waves of
    1 to 4 blocks on 132 SMs and fixed costs 0-16 it returns what trying every split count returns."""
    from kvbackend.batch import _wave_splits

    rng = random.Random(0)
    shapes = [(b, n, w, f) for b in (1, 2, 3, 8, 9, 24, 45, 46, 64) for n in (1, 2, 7, 31, 63, 64, 129, 512, 2048)
              for w in (132, 264, 396, 528) for f in (0, 4)]
    shapes += [(rng.randrange(1, 65), rng.randrange(1, 2100), rng.choice((1, 7, 132, 264, 396)), rng.randrange(17))
               for _ in range(400)]
    for b, n, w, f in shapes:
        assert _wave_splits(b * 8, n, w, f) == _exhaustive_wave_splits(b * 8, n, w, f), (b, n, w, f)
        assert _plan(b, n).wave_splits(8, w, f) == _exhaustive_wave_splits(b * 8, n, w, f)
    assert _plan(1, 0).wave_splits(8, 264) == (1, 1)  # no pages: one split, as `splits` gives


def test_wave_splits_edge_inputs():
    """At most 65535 splits (a CUDA grid's z dimension), plain ints back whatever int type came in, and a negative
    fixed cost is refused."""
    import numpy as np

    per_split, splits = _plan(1, 200_000).wave_splits(1, 70_000, 0)
    assert splits <= 65535 and per_split * splits >= 200_000
    plan = _plan(3, 300)
    plan.max_pages = np.int64(300)
    got = plan.wave_splits(np.int64(8), np.int64(264))
    assert got == _plan(3, 300).wave_splits(8, 264) and all(type(x) is int for x in got)
    with pytest.raises(ValueError, match="fixed_pages"):
        _plan(3, 300).wave_splits(8, 264, -1)


def test_plans_follow_their_tables_across_packed_chunks_and_forks():
    """Each table's packed arrays are made once per chunk (`packed_arrays`): plans made between decode steps, while
    chunks complete and are packed and requests are forked and freed, still match the reference page by page."""
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(Geometry(1, 2, 16, torch.float32),
                    CacheConfig(codec="rtn:bits=2,group=16", page_size=4, chunk_pages=2, dense_pages=64,
                                packed_pages=128))
    ids = []
    for n in (3, 9, 17):
        rid, _ = cache.add_request()
        cache.append(rid, 0, torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen))
        ids.append(rid)
    made = 0
    for step in range(30):
        if step == 10:
            ids.append(cache.fork(ids[1]))  # a table whose packed list is a copy of another's
        if step == 20:
            cache.free(ids.pop(0))
        plan, want = plan_batch(cache, ids, 0), reference_plan(cache, ids, 0)
        assert all(getattr(plan, name).tolist() == want[name] for name in FIELDS), step
        made += sum(cache.page_table(rid).plan_arrays is not None for rid in ids)
        cache.append_step(ids, 0, torch.randn(len(ids), 2, 16, generator=gen),
                          torch.randn(len(ids), 2, 16, generator=gen))
    assert made and all(len(cache.page_table(rid).packed) >= 4 for rid in ids)  # several chunks packed meanwhile


def _exhaustive_aligned(pairs: int, max_pages: int, wave: int, fixed: int, align: int) -> tuple[int, int]:
    """Every pages-per-split from 1 to max_pages that divides ``align`` or is a multiple of it (plus the multiple
    of ``align`` just past max_pages), the least modelled cost, the fewest splits among equals."""
    best = None
    for per_split in range(-(-max_pages // align) * align, 0, -1):
        if align % per_split and per_split % align:
            continue
        splits = -(-max_pages // per_split)
        cost = -(-pairs * splits // wave) * (per_split + fixed)
        if best is None or cost < best[0] or (cost == best[0] and splits < best[2]):
            best = (cost, per_split, splits)
    return best[1], best[2]


def test_aligned_wave_splits_start_every_split_at_a_chunk_boundary():
    """With ``align`` (a codebook layout's pages per slot) every split starts at a multiple of ``align`` pages or
    lies inside one chunk, every page lies in one split, and the grid is the least-cost aligned one. The serving
    shape B=46 (512 pages of 32-page chunks, 264 programs a wave) gets 2 splits, the sweep's fastest, not 5 (103
    pages: splits start mid-chunk); the kernel benchmark's shapes keep their grids."""
    assert _plan(46, 512).wave_splits(8, 264, align=32) == (256, 2)
    for batch, pages in [(8, 512), (1, 512), (32, 128), (8, 2048), (24, 512)]:
        plan = _plan(batch, pages)
        assert plan.wave_splits(8, 264, align=32) == plan.wave_splits(8, 264), (batch, pages)
    rng = random.Random(1)
    shapes = [(rng.randrange(1, 65), rng.randrange(1, 2100), rng.choice((7, 132, 264, 396)), rng.randrange(17),
               rng.choice((2, 3, 8, 32, 48))) for _ in range(300)]
    for b, n, w, f, align in shapes:
        per_split, splits = _plan(b, n).wave_splits(8, w, f, align=align)
        assert per_split * splits >= n > per_split * (splits - 1), (b, n, w, f, align, per_split, splits)
        assert align % per_split == 0 or per_split % align == 0, (b, n, w, f, align, per_split)
        assert (per_split, splits) == _exhaustive_aligned(b * 8, n, w, f, align), (b, n, w, f, align)
    assert _plan(3, 0).wave_splits(8, 264, align=32) == (1, 1)
    assert _plan(3, 5).wave_splits(8, 264, align=1) == _plan(3, 5).wave_splits(8, 264)
    with pytest.raises(ValueError, match="align"):
        _plan(3, 5).wave_splits(8, 264, align=0)


def test_a_caches_plan_knows_its_chunk():
    """`KVCache.plan` records the cache's pages per codebook slot, which the tensor-core decode aligns its splits to."""
    from kvbackend import CacheConfig, Geometry, KVCache

    cache = KVCache(Geometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32),
                    CacheConfig(codec="rtn:bits=2,group=16", page_size=16, chunk_pages=3, dense_pages=8,
                                packed_pages=8))
    rid, _ = cache.add_request()
    cache.append(rid, 0, torch.randn(50, 2, 16), torch.randn(50, 2, 16))
    assert cache.plan([rid], 0).chunk_pages == 3
