"""The kernel benchmark's page layout (`perf/bench_kernels.py`): every 32-page chunk of a request reads a codebook
slot of its own, as a cache's chunks do. Until session 46 every page read slot 0, one codebook that stayed in L2,
and the tensor-core decode of codebook layouts timed 25-40% faster than a cache serves it."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

import bench_kernels as bk  # noqa: E402


def test_each_chunk_of_each_request_reads_its_own_slot(monkeypatch):
    monkeypatch.setattr(bk, "DEV", "cpu")
    batch, packed, first_slot = 3, 70, 5
    plan = bk.make_plan(batch, packed, 64, 64, 0, 0, bk.CHUNK_PAGES, first_slot)
    chunks = bk.chunks_per_req(packed, bk.CHUNK_PAGES)
    assert chunks == 3
    slots, kinds = plan.slots.tolist(), plan.kinds.tolist()
    seen = set()
    for r in range(batch):
        start, count = int(plan.req_start[r]), int(plan.req_pages[r])
        mine = [s for s, k in zip(slots[start:start + count], kinds[start:start + count]) if k == 0]
        assert len(mine) == packed
        assert mine == [first_slot + r * chunks + j // bk.CHUNK_PAGES for j in range(packed)]
        assert not seen & set(mine)  # no slot shared between requests
        seen |= set(mine)
        assert [s for s, k in zip(slots[start:start + count], kinds[start:start + count]) if k == 1] == [0]
    # without chunk_pages, as before: every page on slot 0
    assert set(bk.make_plan(batch, packed, 64, 64, 0, 0).slots.tolist()) == {0}


def test_spread_codebooks_are_distinct_copies():
    book = torch.arange(40, dtype=torch.uint8)
    books = bk.spread_codebooks(book, 6)
    assert books.shape == (6, 40) and books.is_contiguous()
    assert all(torch.equal(row, book) for row in books)
    assert books.data_ptr() != book.data_ptr()


def test_rotations_share_no_slot_and_every_slot_has_a_codebook(monkeypatch):
    """What the decode, levers and gather sections time: no two rotations (nor two requests) read one slot, and
    every slot a plan names is a row of the codebooks, a copy of the chunk's."""
    monkeypatch.setattr(bk, "DEV", "cpu")
    book = torch.arange(48, dtype=torch.uint8)
    batch, packed, rotations = 3, 70, 4
    books, plans = bk.rotation_plans(batch, packed, 64, rotations, book)
    assert len(plans) == rotations
    used = []
    for plan in plans:
        packed_slots = plan.slots[plan.kinds == 0]
        assert packed_slots.numel() == batch * packed
        used.append(set(packed_slots.tolist()))
        assert int(packed_slots.max()) < books.shape[0]
    assert sum(len(u) for u in used) == len(set().union(*used)) == books.shape[0]  # disjoint, and every row used
    assert all(torch.equal(row, book) for row in books)
    # each rotation's pages and dense pages are its own too
    pages = [set(plan.page_ids[plan.kinds == 0].tolist()) for plan in plans]
    assert sum(len(x) for x in pages) == len(set().union(*pages)) == rotations * batch * packed


def test_gather_plans_have_no_dense_page_and_a_slot_per_chunk(monkeypatch):
    """The gather section's layout (`rotation_plans(..., dense_tokens=0)`): packed pages only, a slot per chunk."""
    monkeypatch.setattr(bk, "DEV", "cpu")
    books, (plan,) = bk.rotation_plans(2, 70, 64, 1, torch.arange(16, dtype=torch.uint8), dense_tokens=0)
    assert int((plan.kinds == 1).sum()) == 0 and plan.page_ids.numel() == 2 * 70
    assert sorted(set(plan.slots.tolist())) == list(range(books.shape[0])) == list(range(2 * 3))
