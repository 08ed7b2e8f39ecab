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
    ("kivi:bits=3,group=32", 128, 32, [90, 40], 2, 8),  # 3-bit codes, 8 in 3 bytes: byte loads
    ("rtn:bits=3,group=32,symmetric=true", 64, 16, [37], 4, 4),
    ("qvg-pro", 64, 16, [40], 4, 2),
    ("rtn:bits=2,group=64,scale=fp8", 128, 64, [90, 17], 1, 1),
    ("identity", 64, 16, [21, 50], 3, 64),
    ("qvg:cdtype=fp8", 64, 16, [45, 70], 2, 8),  # fp8 centroids: one-hot product
    ("qvg:centroids=8,stages=2,cdtype=fp8", 64, 16, [40], 3, 4),  # fp8 centroids: gathered rows (C < 16)
]


def assert_matches_reference(cache, ids, layer, q, out, lse):
    """A kernel's decode output against reference attention over the reference reconstruction (fp16
    tensor-core operands, 11-bit mantissa, and a bf16 output, 8-bit: ~2^-8 relative per element).
    Returns the reference reads."""
    reads = [cache.read(rid, layer) for rid in ids]
    want, want_lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])
    assert torch.isfinite(out.float()).all()
    assert float((out.float() - want).norm() / want.norm()) < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2)
    return reads


@pytest.mark.parametrize("pair", [0, 1])
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs", CASES)
def test_matches_reference(codec, head_dim, page_size, lengths, ratio, programs, pair):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).bfloat16()
    out, lse = paged_decode(q, cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1],
                            kernel_schemes(cache.codec, cache.layout), plan, target_programs=programs, pair=pair,
                            fold=False)  # the plain kernel here; the folded one has its own cases below
    assert_matches_reference(cache, ids, 1, q, out, lse)


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


def test_per_layer_plan_runs_each_layers_kernels():
    """Layers of one cache with different layouts (a per-layer plan): decode and gather read each
    layer's pages with that layer's schemes."""
    cache, ids = filled_cache(("kivi:bits=2,group=16", "qvg:centroids=4,kbits=4,vbits=2"), 64, 16, [50, 21],
                              backend="triton")
    assert [b.name for b in cache.backends] == ["triton", "triton"]
    assert cache.layouts[0].page_bytes != cache.layouts[1].page_bytes
    q = torch.randn(2, 6, 64, device=DEVICE).bfloat16()
    for layer in range(2):
        plan = cache.plan(ids, layer)
        out, lse = cache.decode(plan, layer, q)
        reads = assert_matches_reference(cache, ids, layer, q, out, lse)
        k, v = cache.gather(plan, layer)  # bf16 out, summed in another order: within one bf16 step (2^-8)
        assert torch.allclose(k.float(), torch.cat([r[0] for r in reads]).float(), rtol=2**-7, atol=1e-2)
        assert torch.allclose(v.float(), torch.cat([r[1] for r in reads]).float(), rtol=2**-7, atol=1e-2)


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
    q = torch.randn(1, 2, 64, device=DEVICE)
    for bad in (0, -4, 2.5, True):  # 0 once meant 1024 programs silently
        with pytest.raises(ValueError, match="target_programs must be a positive int"):
            paged_decode(q, *args, target_programs=bad)
    import numpy as np

    assert torch.equal(paged_decode(q, *args, target_programs=np.int64(3))[0],
                       paged_decode(q, *args, target_programs=3)[0])  # numpy's integers are integers
    out, _ = paged_decode(q, *args, target_programs=1)
    assert torch.allclose(out, paged_decode(q, *args)[0], atol=1e-3)  # one split against the default grid


@pytest.mark.parametrize("codec", ["kivi:bits=2,group=16", "qvg", "rtn:bits=4,group=32,scale=fp16"])
def test_unpack_variants_agree(codec):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, 64, 16, [61, 30])
    plan = cache.plan(ids, 0)
    q = torch.randn(2, 4, 64, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    a, _ = paged_decode(q, *args, unpack=0, fold=False)  # unpack variants belong to the plain kernel
    for unpack in (1, 2, 3):
        b, _ = paged_decode(q, *args, unpack=unpack, fold=False)
        assert torch.allclose(a.float(), b.float(), atol=1e-2), unpack


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


FOLDED_CASES = [  # (codec, head_dim, page_size, lengths, GQA ratio, target programs, lazy)
    ("qvg", 64, 32, [45, 70, 3], 3, 8, False),
    ("kivi:bits=2,group=32", 64, 64, [150, 20], 4, 5, True),  # per-channel keys: two softmax blocks a page
    ("rtn:bits=4,group=32,scale=fp16", 64, 32, [40, 33, 100], 1, 3, False),
    ("rtn:bits=2,group=32,scale=fp8", 128, 32, [90, 17], 3, 4, True),  # four channel groups
    ("qvg:kchannel=32", 64, 32, [77], 4, 2, False),
    ("rtn:bits=8,group=32", 64, 32, [21], 3, 1, True),
    ("qvg:kchannel=32,vcluster=false", 64, 32, [70], 3, 2, False),  # key centroids only
    ("qvg:cdtype=fp8", 64, 32, [45, 70], 3, 8, False),  # fp8 centroids, keys and values
    ("qvg:kchannel=32,centroids=8,cdtype=fp8", 64, 32, [77], 2, 2, False),
]


@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs,lazy", FOLDED_CASES)
def test_folded_kernel_matches_reference(codec, head_dim, page_size, lengths, ratio, programs, lazy):
    """Scales folded onto the small side of each product give the reference attention."""
    from kvbackend.kernels import folded_decode
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, seed=len(lengths) + ratio)
    schemes = kernel_schemes(cache.codec, cache.layout)
    assert folded_decode.supports(*schemes, page_size, head_dim)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).bfloat16()
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1], schemes, plan)
    if lazy:  # the lazily rescaled softmax and the other value path
        out, lse = paged_decode(q, *args, target_programs=programs, fold=True,
                                fold_options=dict(lazy=True, vfold=not folded_decode.VFOLD_DEFAULT))
    else:
        out, lse = paged_decode(q, *args, target_programs=programs, fold=True)
        if not cache.layout.codebook.fields:  # two pages per block, odd page counts included
            two, lse2 = paged_decode(q, *args, target_programs=programs, fold=True, pair=1)
            assert torch.allclose(two.float(), out.float(), atol=1e-2) and torch.allclose(lse2, lse, atol=1e-3)
    assert_matches_reference(cache, ids, 1, q, out, lse)


def test_folded_kernel_support_and_default():
    from kvbackend.kernels import folded_decode
    from kvbackend.kernels.paged_decode import paged_decode

    def schemes(codec, page=32, dim=64):
        from kvbackend import Geometry, codecs

        c = codecs.get(codec)
        return kernel_schemes(c, c.layout(Geometry(1, 2, dim, torch.bfloat16), page))

    many, few = folded_decode.MIN_PAGES_PER_PROGRAM, folded_decode.MIN_PAGES_PER_PROGRAM - 1
    assert folded_decode.preferred(*schemes("rtn:bits=2,group=64,scale=fp8"), 32, 64, many)
    assert folded_decode.preferred(*schemes("qvg"), 32, 64, many)
    assert folded_decode.preferred(*schemes("kivi:bits=2,group=32", 64), 64, 64, many)
    assert not folded_decode.preferred(*schemes("qvg"), 32, 64, few)  # short splits: the plain kernel
    assert not folded_decode.supports(*schemes("qvg", 16), 16, 64)  # 16-token pages (wrong on the GPU)
    assert not folded_decode.supports(*schemes("kivi:bits=2,group=16", 16), 16, 64)  # 16-token blocks refused
    assert not folded_decode.supports(*schemes("rtn:bits=4,group=16,scale=fp16"), 32, 64)  # 16-channel groups
    assert not folded_decode.supports(*schemes("identity"), 32, 64)  # float pages: the plain kernel
    cache, ids = filled_cache("qvg-pro", 64, 16, [20])
    with pytest.raises(ValueError, match="folded decode kernel does not read"):
        paged_decode(torch.randn(1, 4, 64, device=DEVICE).bfloat16(), cache.packed.pages[0], cache.packed.codebooks[0],
                     cache.dense.data[0], kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0), fold=True)


PLANAR_CASES = [  # (codec, head_dim, page_size, lengths, GQA ratio, target programs)
    ("rtn:bits=2,group=64,scale=fp8", 128, 64, [150, 20, 64], 4, 6),  # two channel groups, a full last page
    ("rtn:bits=2,group=64", 64, 64, [200], 3, 2),  # asymmetric (zeros), one group
    ("rtn:bits=4,group=64,symmetric=true,scale=fp16", 64, 64, [70, 129], 1, 3),
    ("rtn:bits=8,group=64,scale=bf16", 128, 64, [90], 3, 1),
]


@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs", PLANAR_CASES)
def test_planar_kernel_matches_reference(codec, head_dim, page_size, lengths, ratio, programs):
    """Tokens along the product's M and codes read as bit planes give the reference attention."""
    from kvbackend.kernels import planar_decode
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, seed=len(lengths) + ratio, chunk_pages=1)
    schemes = kernel_schemes(cache.codec, cache.layout)
    assert planar_decode.supports(*schemes, page_size, head_dim)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).bfloat16()
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1], schemes, plan)
    out, lse = paged_decode(q, *args, target_programs=programs, planar=True)
    assert_matches_reference(cache, ids, 1, q, out, lse)
    folded, folded_lse = paged_decode(q, *args, target_programs=programs, fold=True, planar=False)
    assert torch.allclose(out.float(), folded.float(), atol=2e-2) and torch.allclose(lse, folded_lse, atol=1e-2)


def test_planar_kernel_support():
    from kvbackend.kernels import planar_decode
    from kvbackend.kernels.paged_decode import paged_decode

    def schemes(codec, page=64, dim=128):
        from kvbackend import Geometry, codecs

        c = codecs.get(codec)
        return kernel_schemes(c, c.layout(Geometry(1, 2, dim, torch.bfloat16), page))

    assert planar_decode.supports(*schemes("rtn:bits=2,group=64,scale=fp8"), 64, 128)
    assert planar_decode.supports(*schemes("rtn:bits=2,group=128"), 64, 128)
    assert not planar_decode.supports(*schemes("rtn:bits=2,group=64,scale=fp8", 32), 32, 128)  # pages < 64 tokens
    assert not planar_decode.supports(*schemes("rtn:bits=2,group=32"), 64, 128)  # 8-code planes: too narrow
    assert not planar_decode.supports(*schemes("qvg"), 64, 128)  # centroid stages
    assert not planar_decode.supports(*schemes("kivi:bits=2,group=64"), 64, 128)  # per-channel keys
    assert not planar_decode.supports(*schemes("identity"), 64, 128)
    many = planar_decode.MIN_PAGES_PER_PROGRAM
    assert planar_decode.preferred(*schemes("rtn:bits=2,group=64,scale=fp8"), 64, 128, many)
    assert not planar_decode.preferred(*schemes("rtn:bits=2,group=64,scale=fp8"), 64, 128, many - 1)  # short splits
    assert not planar_decode.preferred(*schemes("qvg"), 64, 128, many)
    cache, ids = filled_cache("qvg", 64, 16, [20])
    with pytest.raises(ValueError, match="planar decode kernel does not read"):
        paged_decode(torch.randn(1, 4, 64, device=DEVICE).bfloat16(), cache.packed.pages[0], cache.packed.codebooks[0],
                     cache.dense.data[0], kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0), planar=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled variants exist on the GPU only (the interpreter compiles nothing)")
def test_a_growing_request_does_not_recompile_the_decode_kernels():
    """Split counts move as a request grows (32 splits of one page, then 17 and 18 of two): the kernels
    are not specialised on them, so a generation never stops for a compilation."""
    from kvbackend.kernels import paged_decode as module

    cache, ids = filled_cache("kivi:bits=2,group=16", 64, 16, [16 * 32])
    q = torch.randn(1, 4, 64, device=DEVICE).bfloat16()
    kernels = (module._paged_decode_kernel, module._merge_kernel)

    def variants():
        return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())

    splits = []
    for extra in (0, 1, 40):
        if extra:
            kv = torch.randn(extra, 2, 64, device=DEVICE).bfloat16()
            for layer in range(2):
                cache.append(ids[0], layer, kv, kv)
        plan = cache.plan(ids, 0)
        splits.append(plan.splits(2, 64))
        out, lse = module.paged_decode(q, cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
                                       kernel_schemes(cache.codec, cache.layout), plan, target_programs=64, fold=False)
        assert_matches_reference(cache, ids, 0, q, out, lse)
        if extra == 0:
            before = variants()
    assert len(set(splits)) == 3 and variants() == before, splits
