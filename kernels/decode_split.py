"""Which pages one split-K decode program walks (shared by the decode kernels)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_pages(req_start, req_pages, req_packed, pages_per_split):
    """For the program at grid (request r, KV head h, split s): (r, h, s, start, first, last, packed),
    where the request's pages are ``page_ids[start : start + count]``, the first ``packed`` of them
    packed, and this split walks pages ``first .. last - 1`` of them."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(req_start + r)
    count = tl.load(req_pages + r)
    packed = tl.load(req_packed + r)
    first = s * pages_per_split
    last = tl.minimum(first + pages_per_split, count)
    return r, h, s, start, first, last, packed


# Launch arguments that change as requests grow: Triton would otherwise specialise a kernel on each
# (equal to 1, divisible by 16) and compile a new variant in the middle of a generation (seconds,
# measured on the H200 in `perf/bench_memory.py`'s decode steps).
VARYING = ("pages_per_split", "num_splits")
