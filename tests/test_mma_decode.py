"""The CUDA tensor-core decode kernel (`kernels/mma_decode.cu`) against the reference attention.

The kernel runs on a CUDA GPU only; CPU runs check which layouts it claims, and compile the source for
sm_90 where nvcc is installed (a syntax or PTX error fails here before any GPU run).
"""

import pytest
import torch

from kvbackend.scheme import kernel_schemes
from kernel_cases import DEVICE, filled_cache
from test_paged_decode import assert_matches_reference

from kvbackend.kernels import mma_decode

gpu = pytest.mark.skipif(not mma_decode.available()[0] if torch.cuda.is_available() else True,
                         reason="needs a CUDA GPU (compute capability 8.0+) and nvcc")

CASES = [  # (codec, head_dim, page_size, lengths, GQA ratio, target programs)
    ("rtn:bits=2,group=64,scale=fp8", 128, 64, [150, 20, 64, 700], 4, 6),  # two scale groups, dense tails, splits
    ("rtn:bits=2,group=64", 64, 64, [200, 333], 3, 2),  # asymmetric (zeros), one group
    ("rtn:bits=2,group=128", 128, 64, [90, 260], 8, 64),  # one scale group over 128 channels, many splits
    ("rtn:bits=2,group=64,symmetric=true,scale=fp16", 64, 16, [45, 70, 3], 1, 8),  # 16-token pages
    ("rtn:bits=2,group=64,scale=bf16", 128, 32, [97], 5, 1),  # one program walks everything
]


def _schemes(spec, head_dim=128, page_size=64):
    cache, _ = filled_cache(spec, head_dim, page_size, [page_size], heads=1, layers=1)
    return kernel_schemes(cache.codec, cache.layout)


def test_supported_layouts():
    assert mma_decode.supports(*_schemes("rtn:bits=2,group=64,scale=fp8"), 64, 128, 4)
    assert mma_decode.supports(*_schemes("rtn:bits=2,group=128"), 64, 128, 8)
    assert mma_decode.supports(*_schemes("rtn:bits=2,group=64", 64, 16), 16, 64, 3)
    assert not mma_decode.supports(*_schemes("rtn:bits=2,group=64,scale=fp8"), 64, 128, 9)  # GQA group > 8
    assert not mma_decode.supports(*_schemes("rtn:bits=4,group=64"), 64, 128, 4)  # 4-bit codes
    assert not mma_decode.supports(*_schemes("rtn:bits=2,group=32"), 64, 128, 4)  # 32-channel groups
    assert mma_decode.supports(*_schemes("kivi:bits=2,group=64"), 64, 128, 4)  # per-channel keys over one page
    assert not mma_decode.supports(*_schemes("kivi:bits=2,group=32"), 64, 128, 4)  # ... over half a page
    assert not mma_decode.supports(*_schemes("qvg"), 64, 128, 4)  # centroid stages
    assert not mma_decode.supports(*_schemes("rtn:bits=2,group=64,scale=fp32"), 64, 128, 4)
    assert not mma_decode.supports(*_schemes("identity"), 64, 128, 4)


@pytest.mark.skipif(mma_decode.nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("config", [
    mma_decode.Config(128, 64, 2, 2, 0, 0, True, True, 2, 2),
    mma_decode.Config(64, 16, 1, 1, 1, 2, False, True, 3, 1, stages=3, warps=8),
])
def test_source_compiles_for_hopper(config, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBACKEND_CACHE_DIR", str(tmp_path))
    cubin = mma_decode.compile_cubin(config, "sm_90")
    assert cubin[:4] == b"\x7fELF" and len(list(tmp_path.rglob("*.cubin"))) == 1
    assert mma_decode.compile_cubin(config, "sm_90") == cubin  # from the disk cache


def test_refuses_where_it_cannot_run():
    cache, ids = filled_cache("rtn:bits=2,group=64", 64, 16, [40], heads=2, layers=1)
    from kvbackend.kernels.paged_decode import paged_decode
    q = torch.randn(1, 4, 64, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0))
    if not mma_decode.available()[0]:
        with pytest.raises(ValueError, match="cannot run here"):
            paged_decode(q, *args, mma=True)
    else:
        bad, bad_ids = filled_cache("rtn:bits=4,group=64", 64, 16, [40], heads=2, layers=1)
        with pytest.raises(ValueError, match="does not read this layout"):
            paged_decode(q, bad.packed.pages[0], bad.packed.codebooks[0], bad.dense.data[0],
                         kernel_schemes(bad.codec, bad.layout), bad.plan(bad_ids, 0), mma=True)


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs", CASES)
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
def test_matches_reference(codec, head_dim, page_size, lengths, ratio, programs, qdtype):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, seed=len(lengths) + ratio, chunk_pages=1)
    schemes = kernel_schemes(cache.codec, cache.layout)
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).to(qdtype)
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1], schemes, plan)
    out, lse = paged_decode(q, *args, target_programs=programs, mma=True)
    assert_matches_reference(cache, ids, 1, q, out, lse)
    plain, plain_lse = paged_decode(q, *args, target_programs=programs, mma=False, fold=False, planar=False)
    assert torch.allclose(out.float(), plain.float(), atol=2e-2) and torch.allclose(lse, plain_lse, atol=1e-2)


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,ratio,programs",
                         CASES + [("kivi:bits=2,group=64", 128, 64, [600, 70], 4, 16)])
def test_value_codes_read_as_subnormals(codec, head_dim, page_size, lengths, ratio, programs, monkeypatch):
    """`V_SUBN`: the packed pages' value codes as fp16 subnormals (the 2^24 put back once after the pages) give
    the reference's attention and, within the products' rounding, the default variant's output."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, seed=len(lengths) + ratio, chunk_pages=1)
    schemes = kernel_schemes(cache.codec, cache.layout)
    plan = cache.plan(ids, 1)
    q = torch.randn(len(ids), 2 * ratio, head_dim, device=DEVICE).bfloat16()
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1], schemes, plan)
    plain, plain_lse = paged_decode(q, *args, target_programs=programs, mma=True)
    monkeypatch.setattr(mma_decode, "V_SUBN", True)
    mma_decode.config_for.cache_clear()
    try:
        assert mma_decode.config_for(*schemes[:2], page_size, head_dim, q.dtype, torch.bfloat16).v_subn
        out, lse = paged_decode(q, *args, target_programs=programs, mma=True)
    finally:
        monkeypatch.setattr(mma_decode, "V_SUBN", False)
        mma_decode.config_for.cache_clear()
    assert_matches_reference(cache, ids, 1, q, out, lse)
    assert torch.allclose(out.float(), plain.float(), atol=2e-2) and torch.allclose(lse, plain_lse, atol=1e-3)


@gpu
def test_many_dense_pages_and_the_default_path():
    """Long active chunks (several dense pages per request, spread over the warps), and `paged_decode`
    without kernel arguments takes the tensor-core kernel on a supported layout."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp8", 128, 64, [1000, 300, 40], seed=9, chunk_pages=8)
    schemes = kernel_schemes(cache.codec, cache.layout)
    plan = cache.plan(ids, 0)
    assert int((plan.kinds == 1).sum()) >= 6  # dense pages: the active chunks
    q = torch.randn(3, 16, 128, device=DEVICE).bfloat16()
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], schemes, plan)
    out, lse = paged_decode(q, *args, target_programs=6, mma=True)
    assert_matches_reference(cache, ids, 0, q, out, lse)
    default, default_lse = paged_decode(q, *args, target_programs=6)
    chosen = mma_decode.preferred(*schemes, 64, 128, 8, q.device, q.dtype, cache.dense.data[0].dtype)
    assert chosen == mma_decode.PREFERRED
    assert (torch.equal(default, out) and torch.equal(default_lse, lse)) == chosen


@gpu
def test_default_grid_fills_whole_waves():
    """Without ``target_programs`` the tensor-core kernel's split-K grid fills whole waves (SMs x the blocks an SM
    holds of that variant: `BatchPlan.wave_splits`), and the output is the reference's whatever the split count."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp8", 128, 64, [4000, 2600, 700], heads=8, layers=1, seed=5,
                              chunk_pages=8)
    schemes = kernel_schemes(cache.codec, cache.layout)
    plan = cache.plan(ids, 0)
    q = torch.randn(3, 32, 128, device=DEVICE).bfloat16()
    dense = cache.dense.data[0]
    wave = mma_decode.wave_programs(*schemes, 64, 128, q.dtype, dense.dtype, 2, 4, None, q.device)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert wave % sms == 0 and 1 <= wave // sms <= 16
    args = (cache.packed.pages[0], cache.packed.codebooks[0], dense, schemes, plan)
    out, lse = paged_decode(q, *args, mma=True, num_stages=2)
    assert_matches_reference(cache, ids, 0, q, out, lse)
    # 24 (request, head) pairs, 63 pages: a grid other than the default's, to compare with
    other = next(t for t in (1024, 96, 24) if plan.splits(8, t) != plan.wave_splits(8, wave))
    many, many_lse = paged_decode(q, *args, mma=True, num_stages=2, target_programs=other)
    assert torch.allclose(out.float(), many.float(), atol=2e-2) and torch.allclose(lse, many_lse, atol=1e-2)


@gpu
@pytest.mark.parametrize("scale", ["fp16", "fp8"])
def test_small_probabilities_times_small_value_scales(scale):
    """Probability times value scale stays out of fp16's subnormal range (the kernel's per-page exponent).
    One token per head takes the attention (its score is 11 nats above the rest, its value is zero); the
    other 6000 tokens share one value row of scale ~1e-3 and probability e^-11 = 1.7e-5 each, so without the
    exponent p * scale (~2e-8) rounds to zero in fp16 and the output loses its code part (~50% error)."""
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.kernels.paged_decode import paged_decode

    heads, head_dim, n, ratio = 2, 128, 6000, 4
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(Geometry(1, heads, head_dim, torch.bfloat16),
                    CacheConfig(codec=f"rtn:bits=2,group=64,scale={scale}", page_size=64, chunk_pages=4,
                                dense_pages=128, packed_pages=128, device=DEVICE))
    rid, _ = cache.add_request()
    u = torch.randn(heads, head_dim, generator=gen) * 2
    k = torch.zeros(n, heads, head_dim)
    k[0] = u
    channels = torch.arange(head_dim, dtype=torch.float32)
    v = (0.003 * (1 + 0.5 * torch.sin(channels + torch.arange(heads)[:, None]))).expand(n, heads, head_dim).clone()
    v[0] = 0
    cache.append(rid, 0, k.bfloat16().to(DEVICE), v.bfloat16().to(DEVICE))
    key0 = cache.read(rid, 0)[0][0].float()  # the reconstructed key the scores use
    q = key0 * (11 * head_dim ** 0.5 / (key0 * key0).sum(-1, keepdim=True))
    q = q.repeat_interleave(ratio, 0)[None].bfloat16()
    out, lse = paged_decode(q, cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
                            kernel_schemes(cache.codec, cache.layout), cache.plan([rid], 0), target_programs=4,
                            mma=True)
    reads = assert_matches_reference(cache, [rid], 0, q, out, lse)
    assert float(reads[0][1][1:].float().abs().mean()) > 1e-3  # the premise: the small-p tokens carry the output


def test_refuses_bad_launch_options():
    cache, _ = filled_cache("rtn:bits=2,group=64", 64, 16, [40], heads=2, layers=1)
    k, v = kernel_schemes(cache.codec, cache.layout)
    for good in ({"stages": 1}, {"stages": 2}, {"warps": 4}):  # cached: a bad value equal to one of these still fails
        mma_decode.config_for(k, v, 16, 64, torch.bfloat16, torch.bfloat16, **good)
    for bad in ({"stages": 0}, {"warps": None}, {"warps": 64}, {"min_blocks": -1}, {"stages": True}, {"stages": 2.0},
                {"warps": 4.0}):
        with pytest.raises(ValueError, match="tensor-core decode kernel takes"):
            mma_decode.config_for(k, v, 16, 64, torch.bfloat16, torch.bfloat16, **bad)
    with pytest.raises(ValueError, match="dense pages of dtype"):
        mma_decode.config_for(k, v, 16, 64, torch.bfloat16, torch.float32)


def test_default_min_blocks_never_squeezes_wide_blocks():
    """Unless the caller names it, two blocks per SM are asked of the compiler only where that caps registers at
    255 (up to 4 warps); 8 or 16 warps get the compiler's own choice (two blocks would cap them at 128 or 64)."""
    cache, _ = filled_cache("rtn:bits=2,group=64", 64, 16, [40], heads=2, layers=1)
    k, v = kernel_schemes(cache.codec, cache.layout)
    got = {w: mma_decode.config_for(k, v, 16, 64, torch.bfloat16, torch.bfloat16, 1, w).min_blocks for w in (2, 4, 8, 16)}
    assert got == {2: mma_decode.DEFAULT_MIN_BLOCKS, 4: mma_decode.DEFAULT_MIN_BLOCKS, 8: 0, 16: 0}
    assert mma_decode.config_for(k, v, 16, 64, torch.bfloat16, torch.bfloat16, 1, 8, 3).min_blocks == 3  # as named


def test_not_preferred_for_dtypes_it_cannot_read(monkeypatch):
    """fp32 KV pools are a valid geometry: the default path must not pick a kernel that refuses them."""
    cache, _ = filled_cache("rtn:bits=2,group=64", 64, 16, [40], heads=2, layers=1)
    schemes = kernel_schemes(cache.codec, cache.layout)
    monkeypatch.setattr(mma_decode, "PREFERRED", True)
    monkeypatch.setattr(mma_decode, "available", lambda device=None: (True, ""))
    cuda = torch.device("cuda", 0)
    assert not mma_decode.preferred(*schemes, 16, 64, 2, cuda, torch.bfloat16, torch.float32)
    assert not mma_decode.preferred(*schemes, 16, 64, 2, cuda, torch.int8, torch.bfloat16)
    assert not mma_decode.preferred(*schemes, 16, 64, 2, torch.device("cpu"), torch.bfloat16, torch.bfloat16)


GEOMETRY_CASES = [  # (codec, head_dim, page_size, lengths, KV heads, GQA ratio): shapes the cases above do not use
    ("rtn:bits=2,group=64,scale=fp8", 128, 128, [700, 129], 3, 4),  # 128-token pages, odd KV heads
    ("rtn:bits=2,group=128,scale=bf16", 128, 256, [600], 1, 8),  # 256-token pages, one KV head, one bf16 group
    ("rtn:bits=2,group=64,scale=fp8,symmetric=true", 128, 32, [300, 31], 5, 2),  # symmetric fp8 at D=128
    ("rtn:bits=2,group=64,scale=fp8", 64, 64, [64, 128], 3, 7),  # requests ending on a page boundary
]


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,heads,ratio", GEOMETRY_CASES)
def test_other_geometries(codec, head_dim, page_size, lengths, heads, ratio):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, heads=heads, seed=heads + ratio, chunk_pages=1)
    schemes = kernel_schemes(cache.codec, cache.layout)
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1], schemes, cache.plan(ids, 1))
    for qdtype in (torch.bfloat16, torch.float32):
        q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).to(qdtype)
        for programs in (1, 7, 4096):  # one program walks everything; a few; more splits than pages
            out, lse = paged_decode(q, *args, target_programs=programs, mma=True)
            assert_matches_reference(cache, ids, 1, q, out, lse)


@gpu
def test_fp16_pools():
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp16", 128, 64, [333, 90], seed=4, chunk_pages=2,
                              dtype=torch.float16)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0))
    q = torch.randn(2, 8, 128, device=DEVICE).half()
    out, lse = paged_decode(q, *args, target_programs=4, mma=True)
    assert_matches_reference(cache, ids, 0, q, out, lse)


@gpu
@pytest.mark.parametrize("stages,warps", [(1, 4), (3, 2), (2, 8)])
def test_pipeline_options_agree(stages, warps):
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp8", 128, 64, [900, 130], seed=3, chunk_pages=1)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0))
    q = torch.randn(2, 8, 128, device=DEVICE).bfloat16()
    want, want_lse = paged_decode(q, *args, target_programs=4, mma=True)
    out, lse = paged_decode(q, *args, target_programs=4, mma=True, num_stages=stages, num_warps=warps)
    assert torch.allclose(out.float(), want.float(), atol=1e-2) and torch.allclose(lse, want_lse, atol=1e-3)


@gpu
def test_replays_from_a_cuda_graph():
    """The launch goes to torch's current stream, so a captured graph replays it with new queries."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp8", 128, 64, [500, 77], seed=5, chunk_pages=1)
    args = (cache.packed.pages[1], cache.packed.codebooks[1], cache.dense.data[1],
            kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 1))
    q = torch.randn(2, 8, 128, device=DEVICE).bfloat16()
    paged_decode(q, *args, mma=True)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out, lse = paged_decode(q, *args, mma=True)
    torch.cuda.current_stream().wait_stream(side)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(cache, ids, 1, q, out, lse)
