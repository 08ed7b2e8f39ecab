"""A page or codebook slot another request left behind never reaches a request's output: the decode kernels read a
dense page's rows past its token count and a slot's sinks only where they count (values that overflow fp16, or NaN
written with ``check_finite=False``, would otherwise turn 0 x inf into NaN), gathered outputs are checked, the torch
backend answers an empty batch as the kernels do, and a float32 cache's 16-bit sinks saturate instead of overflowing.
"""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.errors import InvalidKV, UnknownRequest
from kvbackend.attention import decode_attention
from kvbackend.kernels.gather_dequant import gather_dequant
from kvbackend.kernels.paged_decode import paged_decode
from kvbackend.scheme import kernel_schemes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("stale, check_finite", [(6e4, True), (float("nan"), False)])  # (past 65504: refused)
def test_a_freed_requests_dense_rows_do_not_reach_the_next_request(stale, check_finite):
    cache = KVCache(Geometry(1, 2, 32, torch.bfloat16), CacheConfig(
        codec="identity", page_size=16, chunk_pages=2, dense_pages=1, packed_pages=8, backend="triton",
        check_finite=check_finite, device=DEVICE))
    a, _ = cache.add_request()
    cache.append(a, 0, torch.randn(16, 2, 32, device=DEVICE), torch.full((16, 2, 32), stale, device=DEVICE))
    cache.free(a)
    b, _ = cache.add_request()
    gen = torch.Generator().manual_seed(0)
    cache.append(b, 0, torch.randn(3, 2, 32, generator=gen).to(DEVICE), torch.randn(3, 2, 32, generator=gen).to(DEVICE))
    assert cache.page_table(b).dense == [0]  # B took A's page
    q = torch.randn(1, 4, 32, generator=gen).bfloat16().to(DEVICE)
    out, _ = cache.decode(cache.plan([b], 0), 0, q)
    want, _ = decode_attention(q, *([x] for x in cache.read(b, 0)))
    assert torch.isfinite(out).all() and torch.allclose(out.float(), want, atol=2e-2)


@pytest.mark.parametrize("kernel", [dict(fold=False, planar=False), dict(fold=True), dict(planar=True)])
def test_every_decode_kernel_masks_a_dense_pages_leftover_rows(kernel):
    cache = KVCache(Geometry(1, 2, 64, torch.bfloat16), CacheConfig(
        codec="rtn:bits=2,group=64,scale=fp16", page_size=64, chunk_pages=1, dense_pages=2, packed_pages=8,
        check_finite=False, device=DEVICE))
    a, _ = cache.add_request()
    cache.append(a, 0, torch.randn(8, 2, 64, device=DEVICE), torch.full((8, 2, 64), float("nan"), device=DEVICE))
    cache.free(a)
    b, _ = cache.add_request()
    gen = torch.Generator().manual_seed(0)
    cache.append(b, 0, torch.randn(70, 2, 64, generator=gen).to(DEVICE), torch.randn(70, 2, 64, generator=gen).to(DEVICE))
    q = torch.randn(1, 4, 64, generator=gen).bfloat16().to(DEVICE)
    want, _ = decode_attention(q, *([x] for x in cache.read(b, 0)))
    out, _ = paged_decode(q, cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
                          kernel_schemes(cache.codec, cache.layout), cache.plan([b], 0), **kernel)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), want, atol=5e-2)


def test_a_request_without_packed_pages_never_reads_another_chunks_sinks():
    """Request X's first chunk holds sinks near fp16's largest value (a float32 cache stores them 16-bit; past it the
    chunk stays dense) or NaN; request Y, all dense, must not see them through slot 0 in the merge kernel."""
    for dtype, value, check in ((torch.bfloat16, float("nan"), False), (torch.float32, 6e4, True)):
        cache = KVCache(Geometry(1, 2, 64, dtype), CacheConfig(
            codec="kivi:bits=2,group=16,sink=4", page_size=16, chunk_pages=2, dense_pages=8, packed_pages=8,
            backend="triton", check_finite=check, device=DEVICE))
        x, _ = cache.add_request()
        v = torch.randn(40, 2, 64, device=DEVICE)
        v[:4] = value
        cache.append(x, 0, torch.randn(40, 2, 64, device=DEVICE), v)
        assert cache.page_table(x).packed  # X's first chunk (and its sinks) is packed
        y, _ = cache.add_request()
        gen = torch.Generator().manual_seed(1)
        cache.append(y, 0, torch.randn(5, 2, 64, generator=gen).to(DEVICE), torch.randn(5, 2, 64, generator=gen).to(DEVICE))
        q = torch.randn(1, 4, 64, generator=gen).to(dtype).to(DEVICE)
        out, _ = cache.decode(cache.plan([y], 0), 0, q)
        want, _ = decode_attention(q, *([t] for t in cache.read(y, 0)))
        assert torch.isfinite(out).all() and torch.allclose(out.float(), want, atol=2e-2), dtype


def test_a_float32_caches_sinks_past_their_16_bit_field_stay_dense():
    """They were clamped to 65504 (served as such); now the chunk is not packed and reads stay exact."""
    cache = KVCache(Geometry(1, 2, 64, torch.float32), CacheConfig(
        codec="kivi:bits=2,group=16,sink=4", page_size=16, chunk_pages=2, dense_pages=8, packed_pages=8))
    r, _ = cache.add_request()
    v = torch.randn(32, 2, 64)
    v[0] = 1e5
    cache.append(r, 0, torch.randn(32, 2, 64), v)
    _, got = cache.read(r, 0)
    assert cache.page_table(r).packed == [] and torch.equal(got, v)


def test_gather_checks_both_output_buffers():
    cache = KVCache(Geometry(1, 2, 16, torch.bfloat16), CacheConfig(
        codec="identity", page_size=16, chunk_pages=2, dense_pages=4, packed_pages=4, device=DEVICE))
    r, _ = cache.add_request()
    cache.append(r, 0, torch.randn(20, 2, 16, device=DEVICE), torch.randn(20, 2, 16, device=DEVICE))
    plan = cache.plan([r], 0)
    good = torch.empty(20, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    strided = torch.empty(20, 16, 2, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    for out in ((good, strided), (strided, good), (good, good[:10])):
        with pytest.raises(ValueError, match="output buffers must be contiguous"):
            gather_dequant(*args, out=out)


def test_the_torch_backend_answers_an_empty_batch():
    cache = KVCache(Geometry(1, 2, 32, torch.bfloat16), CacheConfig(codec="identity", page_size=16, backend="torch"))
    plan = cache.plan([], 0)
    out, lse = cache.decode(plan, 0, torch.empty(0, 4, 32, dtype=torch.bfloat16))
    k, v = cache.gather(plan, 0)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4) and k.shape == v.shape == (0, 2, 32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_plan_made_before_its_request_was_freed_or_packed_is_refused(backend):
    """A plan names page ids: once its request is freed (or packs a chunk, freeing its dense pages), another request
    may hold those pages, and the kernels would read that request's tokens. Both backends refuse the plan alike."""
    from kvbackend.errors import InvalidKV, UnknownRequest

    cache = KVCache(Geometry(1, 2, 16, torch.float32), CacheConfig(
        codec="identity", page_size=16, chunk_pages=2, dense_pages=2, packed_pages=4, backend=backend, device=DEVICE))
    a, _ = cache.add_request()
    cache.append(a, 0, torch.zeros(5, 2, 16, device=DEVICE), torch.zeros(5, 2, 16, device=DEVICE))
    stale = cache.plan([a], 0)
    cache.free(a)
    b, _ = cache.add_request()
    cache.append(b, 0, torch.full((5, 2, 16), 7.0, device=DEVICE), torch.full((5, 2, 16), 7.0, device=DEVICE))
    with pytest.raises(UnknownRequest, match="stale"):
        cache.gather(stale, 0)
    with pytest.raises(UnknownRequest, match="stale"):
        cache.decode(stale, 0, torch.randn(1, 4, 16, device=DEVICE))
    before = cache.plan([b], 0)
    cache.append(b, 0, torch.ones(27, 2, 16, device=DEVICE), torch.ones(27, 2, 16, device=DEVICE))  # packs a chunk
    assert cache.page_table(b).packed
    with pytest.raises(InvalidKV, match="packed a chunk"):
        cache.gather(before, 0)
    k, v = cache.gather(cache.plan([b], 0), 0)  # planned again: served
    assert k.shape == (32, 2, 16) and torch.equal(k[:5], torch.full((5, 2, 16), 7.0, device=DEVICE))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_plan_is_refused_on_a_layer_that_holds_another_number_of_tokens(backend):
    """A plan's row counts come from its layer. Used on a layer the request had not appended yet, the Triton
    gather read 10 rows of a freed request's dense page (its values, as a hit); after an append to every layer the
    torch gather served one request's newest token as the next request's first row. Both are refused now, and the
    plan of the layer itself, made after its appends, serves."""
    geometry = Geometry(2, 2, 32, torch.bfloat16)
    cache = KVCache(geometry, CacheConfig(codec="kivi:bits=4,group=16", page_size=16, chunk_pages=2, dense_pages=2,
                                          packed_pages=8, backend=backend, device=DEVICE))
    full = lambda n, x: torch.full((n, 2, 32), x, device=DEVICE)  # noqa: E731
    a, _ = cache.add_request([])
    for layer in range(2):
        cache.append(a, layer, full(10, 7.0), full(10, 7.0))
    cache.free(a)
    b, _ = cache.add_request([])
    cache.append(b, 0, full(10, 1.0), full(10, 1.0))
    plan = cache.plan([b], 0)
    with pytest.raises(InvalidKV, match="does not fit layer 1"):
        cache.gather(plan, 1)
    with pytest.raises(InvalidKV, match="does not fit layer 1"):
        cache.decode(plan, 1, torch.randn(1, 4, 32, device=DEVICE).bfloat16())
    k, _ = cache.gather(plan, 0)
    assert k.shape[0] == 10 and bool((k == 1).all())
    c, _ = cache.add_request([])
    for layer in range(2):
        cache.append(c, layer, full(5, 2.0), full(5, 2.0))
    cache.append(b, 1, full(10, 1.0), full(10, 1.0))
    plan = cache.plan([b, c], 0)
    for layer in range(2):
        cache.append(b, layer, full(1, 1.5), full(1, 1.5))
    with pytest.raises(InvalidKV, match="holds 11 tokens there, the plan 10"):
        cache.gather(plan, 0)
    k, _ = cache.gather(cache.plan([b, c], 0), 0)
    assert k.shape[0] == 16 and k[10].float().mean() == 1.5 and bool((k[11:] == 2).all())


def test_request_ids_are_ints_never_floats_or_bools():
    """`append_step([1.7], ...)` appended to request 1, `free(True)` freed request 1 and `read(1.0, ...)` read it."""
    cache = KVCache(Geometry(2, 2, 32, torch.bfloat16), CacheConfig(codec="identity", page_size=16, chunk_pages=2,
                                                                     dense_pages=8, packed_pages=8, backend="torch"))
    ids = [cache.add_request([])[0] for _ in range(2)]
    assert ids[1] == 1
    one = torch.ones(1, 2, 32)
    for bad in (1.7, True, 1.0, "1", None):
        with pytest.raises(UnknownRequest):
            cache.append_step([bad], 0, one, one)
        with pytest.raises(UnknownRequest):
            cache.free(bad)
        with pytest.raises(UnknownRequest):
            cache.read(bad, 0)
    assert cache.page_table(1).lengths == [0, 0] and cache.request_ids == ids
    import numpy as np

    cache.append_step([np.int64(1)], 0, one, one)  # integer ids of numpy and 0-d tensors name their request
    k, _ = cache.read(torch.tensor(1), 0)
    assert k.shape[0] == 1 and cache.page_table(0).lengths == [0, 0]
    cache.free(np.int64(1))
    assert cache.request_ids == [0]
