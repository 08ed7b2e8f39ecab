"""Fused paged decode vs reference attention over the reference reconstruction."""

import pytest
import torch

from kvbackend.attention import decode_attention
from kvbackend.backends import TorchBackend
from kvbackend.scheme import kernel_schemes
from kernel_cases import DEVICE, filled_cache

triton = pytest.importorskip("triton")

CASES = [  # (codec, head_dim, page_size, lengths, GQA ratio, target programs)
    ("qvg", 64, 16, [45, 70, 3], 3, 8),
    ("kivi:bits=2,group=16", 128, 16, [33, 64], 4, 16),
    ("kivi:bits=4,group=32", 64, 64, [150], 1, 4),
    ("qvg-pro", 64, 16, [40], 4, 2),
    ("rtn:bits=2,group=64,scale=fp8", 128, 64, [90, 17], 1, 1),
    ("identity", 64, 16, [21, 50], 3, 64),
]


@pytest.mark.parametrize("pair", [0, 1])
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs", CASES)
def test_matches_reference(codec, head_dim, page_size, lengths, ratio, programs, pair):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).bfloat16()
    out, lse = paged_decode(q, cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1],
                            kernel_schemes(cache.codec, cache.layout), plan, target_programs=programs, pair=pair)
    reads = [cache.read(rid, 1) for rid in ids]
    want, want_lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])
    # fp16 tensor-core operands (11-bit mantissa) and a bf16 output (8-bit): ~2^-8 relative per element.
    assert torch.isfinite(out.float()).all()
    assert float((out.float() - want).norm() / want.norm()) < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2)


def test_split_count_does_not_change_the_result():
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("kivi:bits=2,group=16", 64, 16, [97])
    plan = cache.plan(ids, 0)
    q = torch.randn(1, 4, 64, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    one, _ = paged_decode(q, *args, target_programs=2)
    many, _ = paged_decode(q, *args, target_programs=64)
    assert torch.allclose(one.float(), many.float(), atol=2e-2)


def test_backend_decode_through_cache():
    cache, ids = filled_cache("qvg", 64, 16, [50, 21], backend="triton")
    plan = cache.plan(ids, 0)
    q = torch.randn(2, 6, 64, device=DEVICE).bfloat16()
    assert cache.backend.name == "triton"
    out, _ = cache.decode(plan, 0, q)
    want, _ = TorchBackend().decode(cache, plan, 0, q)
    assert out.dtype == q.dtype
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_rejects_bad_query():
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("qvg", 64, 16, [20])
    plan = cache.plan(ids, 0)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(torch.randn(1, 3, 32, device=DEVICE), *args)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(torch.randn(2, 2, 64, device=DEVICE), *args)


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "qvg", "rtn:bits=4,group=32,scale=fp16"])
def test_unpack_variants_agree(codec):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, 64, 16, [61, 30])
    plan = cache.plan(ids, 0)
    q = torch.randn(2, 4, 64, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    a, _ = paged_decode(q, *args, unpack=0)
    b, _ = paged_decode(q, *args, unpack=1)
    assert torch.allclose(a.float(), b.float(), atol=1e-2)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_pair_of_pages_per_iteration_agrees(programs):
    """Two packed pages per loop iteration gives the one-page result, also when a split holds an odd
    number of packed pages (the second page is then fully masked)."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("kivi:bits=2,group=16", 64, 16, [100, 52], chunk_pages=2)
    assert [len(cache.page_table(r).packed) for r in ids] == [6, 2]
    plan = cache.plan(ids, 0)
    q = torch.randn(2, 4, 64, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    a, lse_a = paged_decode(q, *args, target_programs=programs, pair=0)
    b, lse_b = paged_decode(q, *args, target_programs=programs, pair=1)
    assert torch.isfinite(b.float()).all()
    assert torch.allclose(a.float(), b.float(), atol=1e-2) and torch.allclose(lse_a, lse_b, atol=1e-3)
