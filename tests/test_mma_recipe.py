"""The tensor-core decode kernel on the recommended recipe's layout: keys with per-channel scales over a
page and centroids per chunk, key outliers, sinks, Hadamard-rotated values and page-relative keys.

CPU runs check which layouts and levers the kernel claims and compile every switch for sm_90 (where nvcc is
installed: the shared-memory size the launcher passes is checked against the kernel's at compile time). On
a GPU each layout is compared with the torch reference and with the plain Triton kernel, and each lever is
shown to be read (turning its path off changes the output).
"""

import dataclasses
import functools
import os

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.attention import decode_attention
from kvbackend.rope import Rotary
from kvbackend.scheme import LeverScheme, kernel_schemes, lever_scheme
from kernel_cases import DEVICE, lever_request

from kvbackend.kernels import mma_decode

gpu = pytest.mark.skipif(not mma_decode.available()[0] if torch.cuda.is_available() else True,
                         reason="needs a CUDA GPU (compute capability 8.0+) and nvcc")

BASE = "quantwm:rank=0,clip=true,vcluster=false"
CASES = [  # (codec, head_dim, page size, chunk pages, lengths, KV heads, GQA ratio, target programs)
    # the recommended layout with page-relative keys: fp8 centroids, outliers, sinks, rotated values
    (f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,pagerope=true,outliers=16", 128, 64, 2,
     [700, 150, 64], 2, 4, 24),
    (f"{BASE},kchannel=64,centroids=32,cdtype=fp8", 128, 64, 2, [333, 90], 3, 8, 8),  # the same without levers
    (f"{BASE},kchannel=16,centroids=4,sink=2,vrot=hadamard", 64, 16, 3, [97, 45, 3], 2, 3, 16),  # bf16 centroids
    (f"{BASE},kchannel=32,centroids=5,cdtype=fp8,pagerope=true,outliers=5", 64, 32, 2, [150, 40], 2, 2, 8),
    (f"{BASE},kchannel=32,centroids=4,outliers=40,sink=32", 64, 32, 1, [200, 32], 1, 5, 64),  # sinks fill page 0
    ("kivi:bits=2,group=64", 128, 64, 2, [300, 65], 2, 4, 8),  # per-channel keys without centroids
    ("kivi:bits=2,group=64,sink=4,vrot=hadamard,pagerope=true", 64, 64, 1, [260, 70], 2, 1, 4),
]


def _rotary(head_dim: int) -> Rotary:
    theta = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return Rotary(theta, scaling=1.25)


def recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=0):
    """One request per length: post-RoPE keys with outlier channels, values with a loud channel."""
    gen = torch.Generator().manual_seed(seed)
    rotary = _rotary(head_dim)
    pages = 4 * sum(-(-n // page_size) + chunk_pages for n in lengths)
    cache = KVCache(Geometry(1, heads, head_dim, torch.bfloat16),
                    CacheConfig(codec=codec, page_size=page_size, chunk_pages=chunk_pages, dense_pages=pages,
                                packed_pages=pages, device=DEVICE, backend="torch"), rotary=rotary)
    ids = []
    for n in lengths:
        rid, _ = cache.add_request()
        k, v, q = lever_request(gen, n, heads, head_dim, ratio, rotary)
        cache.append(rid, 0, k, v, queries=q)
        ids.append(rid)
    return cache, ids, rotary


def _inputs(cache, ids):
    schemes = kernel_schemes(cache.codecs[0], cache.layouts[0], levers_read=True)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], schemes, cache.plan(ids, 0))
    return args, lever_scheme(cache.codecs[0], cache.layouts[0])


@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", CASES)
def test_claims_the_recipe_layouts(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs):
    cache, ids, _ = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths[:1], heads, ratio)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    assert mma_decode.supports_levers(schemes[0], levers, page_size, head_dim)


def test_refuses_what_it_does_not_read():
    def claims(codec, page_size=64):
        cache, ids, _ = recipe_cache(codec, 64, page_size, 1, [page_size], 1, 2)
        (_, _, _, schemes, _), levers = _inputs(cache, ids)
        return mma_decode.supports(*schemes, page_size, 64, 2) and mma_decode.supports_levers(schemes[0], levers,
                                                                                               page_size, 64)

    assert claims(f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,pagerope=true,outliers=16")
    assert not claims(f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,prerope=true")  # per token
    assert not claims("quantwm:rank=4,keep=0.25,clip=true,vcluster=false,kchannel=64,centroids=32")  # PSAC rows
    assert not claims(f"{BASE},kchannel=32,centroids=32")  # key scale groups of half a page
    assert not claims(f"{BASE},kchannel=64,centroids=64")  # more centroids than the table holds
    assert not claims("quantwm:rank=0,kchannel=64,centroids=32")  # clustered values
    assert not claims("rtn:bits=2,group=64,pagerope=true")  # page-relative keys need per-channel key scales
    assert not claims("kivi:bits=2,group=64,kbits=3")  # 3-bit keys: on the pre-RoPE path alone
    assert not claims("kivi:bits=2,group=64,kbits=3,pagerope=true,sink=4")
    assert not claims("kivi:bits=2,group=64,kbits=3,prerope=true")  # ... at head_dim 128
    assert not claims("kivi:bits=3,group=64,prerope=true")  # 3-bit values
    assert claims("rtn:bits=2,group=64,sink=4,vrot=hadamard")


@pytest.mark.skipif(mma_decode.nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("config", [
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, outliers=16,
                      vrot=True, page_rope=True),
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32),
    mma_decode.Config(64, 16, 1, 1, 1, 2, True, False, 3, 1, stages=3, warps=8, k_chan=True, centroids=4, c_kind=2,
                      outliers=5, vrot=True),
    mma_decode.Config(64, 32, 1, 1, 2, 2, False, True, 1, 2, k_chan=True, sink=32, page_rope=True),
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, outliers=16,
                      vrot=True, rope_token=True),
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, k_chan=True, rope_token=True),
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, outliers=16,
                      vrot=True, rope_token=True, psac_rank=4, psac_rows=4, psac_sparse=True),
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, k_chan=True, rope_token=True, psac_rank=8,
                      psac_rows=32),
    # sparse PSAC rows folded into the centroid-value table (fp8 centroids; bf16 centroids, 8 rows of 32-token pages)
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, outliers=16,
                      vrot=True, rope_token=True, psac_rank=4, psac_rows=4, psac_sparse=True, psac_fold=True),
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, k_chan=True, centroids=4, c_kind=2, rope_token=True,
                      psac_rank=8, psac_rows=8, psac_sparse=True, psac_fold=True),
    # 3-bit pre-RoPE keys: the quality spec's layers (no outliers), with PSAC rows folded; fp16 fields, one stage
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, vrot=True,
                      rope_token=True, psac_rank=4, psac_rows=4, psac_sparse=True, psac_fold=True, k_bits=3),
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, stages=1, k_chan=True, rope_token=True, outliers=5,
                      k_bits=3),
    # 4-bit pre-RoPE keys (tests/test_mma_k4.py): p27l18k4b's 4-bit layer (folded PSAC rows), and outliers, one stage
    mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, vrot=True,
                      rope_token=True, psac_rank=4, psac_rows=4, psac_sparse=True, psac_fold=True, k_bits=4),
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, stages=1, k_chan=True, rope_token=True, outliers=5,
                      k_bits=4),
    # rotated values whose packed part cannot wait in the warp's stage buffers (one 16-token stage): an area of its own
    mma_decode.Config(128, 16, 1, 2, 0, 0, False, False, 2, 2, stages=1, k_chan=True, sink=4, vrot=True),
])
def test_recipe_switches_compile_for_hopper(config, tmp_path, monkeypatch):
    """Every switch compiles, and the launcher's shared-memory count equals the kernel's (a static_assert)."""
    monkeypatch.setenv("KVBACKEND_CACHE_DIR", str(tmp_path))
    assert mma_decode.compile_cubin(config, "sm_90")[:4] == b"\x7fELF"


def test_rotated_values_wait_in_the_stage_buffers_where_they_fit():
    """With rotated values each warp's packed output ([8][D] float32) waits in its own stage buffers when they hold
    it, so the lever costs no shared memory there (and no CTA per SM); else it has an area of its own."""
    def smem(**kw):
        return mma_decode.Config(128, kw.pop("page"), 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32,
                                 **kw).smem_bytes

    for page, stages in ((64, 1), (64, 2), (32, 2)):
        assert smem(page=page, stages=stages, vrot=True) == smem(page=page, stages=stages)
    merge = 4 * 8 * 128 * 4 + 2 * 4 * 8 * 4
    assert smem(page=16, stages=1, vrot=True) == smem(page=16, stages=1) + merge
    recipe = dict(page=64, stages=1, sink=4, outliers=16, vrot=True, rope_token=True, psac_rank=4, psac_rows=4,
                  psac_sparse=True)
    assert 2 * (smem(**recipe) + 1024) <= 228 * 1024  # two CTAs per SM on a Hopper or Ampere SM (228 KiB)


def _clear_variant_caches():
    mma_decode.config_for.cache_clear()
    mma_decode._default_stages.cache_clear()
    mma_decode._wave_programs.cache_clear()


def test_sparse_psac_rows_with_centroids_are_folded_at_no_shared_memory_cost(monkeypatch):
    """The recommended spec's sparse PSAC rows join the centroid-value table (`PSAC_FOLD`): its variant folds them,
    and moving the page's corrections from their own area into the table costs no shared memory. Dense rows and
    layouts without centroids keep the per-key path; `KVBACKEND_MMA_PSAC_FOLD=0` (the module switch) turns it off."""
    def config(codec, page_size, chunk_pages, heads):
        cache, ids, _ = recipe_cache(codec, 128, page_size, chunk_pages, [page_size * chunk_pages], heads, 2)
        (_, _, _, schemes, _), levers = _inputs(cache, ids)
        return mma_decode.config_for(*schemes, page_size, 128, torch.bfloat16, torch.bfloat16, 1, 4, 0, levers)

    recipe = PREROPE_CASES[3][0]
    assert "keep=0.0625" in recipe and config(recipe, 64, 2, 2).psac_fold
    assert config(PREROPE_CASES[4][0], 32, 2, 2).psac_fold  # 8 sparse rows of 32-token pages
    assert not config(PREROPE_CASES[5][0], 32, 2, 2).psac_fold  # dense rows: one per token
    many = config(PREROPE_CASES[9][0], 64, 2, 4)  # 16 rows: folded, past the registers' 8
    assert many.psac_fold and many.psac_rows == 16
    folded = config(recipe, 64, 2, 2)
    assert folded.smem_bytes == dataclasses.replace(folded, psac_fold=False).smem_bytes
    monkeypatch.setattr(mma_decode, "PSAC_FOLD", False)
    _clear_variant_caches()
    try:
        assert not config(recipe, 64, 2, 2).psac_fold
    finally:
        monkeypatch.undo()
        _clear_variant_caches()


PREROPE_CASES = [  # pre-RoPE keys (head_dim 128): on by default since their GPU run; an env var turns them off
    (f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,prerope=true,outliers=16", 128, 64, 2,
     [700, 150, 64], 2, 4, 24),  # L0's base: the recommended layout without PSAC rows
    ("kivi:bits=2,group=64,prerope=true", 128, 64, 2, [333, 90], 3, 8, 8),  # no centroids, fp16 scales
    (f"{BASE},kchannel=32,centroids=5,prerope=true,outliers=5,sink=3", 128, 32, 3, [150, 40], 2, 2, 64),  # bf16
    # the recommended spec itself: PSAC rows (rank 4, a sixteenth of the tokens) with pre-RoPE keys
    ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,outliers=16", 128, 64, 2, [700, 150, 64], 2, 4, 24),
    ("quantwm:kchannel=32,rank=8,keep=0.25,centroids=4,vcluster=false,prerope=true", 128, 32, 2, [200, 45], 2, 3, 8),
    ("quantwm:kchannel=32,rank=4,keep=1,centroids=4,vcluster=false,prerope=true", 128, 32, 2, [130], 2, 2, 8),  # dense
    # 3-bit keys (8 codes in 3 bytes): the quality spec's 3-bit layers (no outliers), bf16 centroids with outliers, kivi
    ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,kbits=3", 128, 64, 2, [700, 150, 64], 2, 4, 24),
    (f"{BASE},kchannel=32,centroids=5,prerope=true,outliers=5,sink=3,kbits=3", 128, 32, 3, [150, 40], 2, 2, 64),
    ("kivi:bits=2,group=64,kbits=3,prerope=true", 128, 64, 2, [333, 90], 3, 8, 8),  # no centroids, fp16 scales
    # 16 folded PSAC rows per page: past the rows kept in registers (a token -> row map in shared memory instead)
    ("quantwm:kchannel=64,rank=4,keep=0.25,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,outliers=16", 128, 64, 2, [700, 150, 64], 2, 4, 24),
]
OPT_IN = {"prerope": True, "psac": True}  # explicit, so the tests run them whatever the env var says


@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", PREROPE_CASES)
def test_pre_rope_keys_are_read_by_default_and_refused_when_turned_off(codec, head_dim, page_size, chunk_pages, lengths,
                                                                        heads, ratio, programs):
    cache, ids, _ = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths[:1], heads, ratio)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    assert not mma_decode.supports_levers(schemes[0], levers, page_size, head_dim, prerope=False, psac=False)
    if os.environ.get("KVBACKEND_MMA_PREROPE", "1") != "0":
        assert mma_decode.PREROPE is True and mma_decode.PSAC is True
        assert mma_decode.supports_levers(schemes[0], levers, page_size, head_dim)  # the default reads them
    assert mma_decode.supports_levers(schemes[0], levers, page_size, head_dim, **OPT_IN)
    assert not mma_decode.supports_levers(schemes[0], levers, page_size, 64, **OPT_IN)  # head_dim 128 only
    if levers.psac_rank:  # PSAC rows need their own opt-in, and sparse rows fit the kernel's signed-byte row map
        assert not mma_decode.supports_levers(schemes[0], levers, page_size, head_dim, prerope=True, psac=False)
        if levers.psac_token != -1:
            many = dataclasses.replace(levers, psac_rows=128)
            assert not mma_decode.supports_levers(schemes[0], many, 256, head_dim, **OPT_IN)


def _reference(cache, ids, q):
    reads = [cache.read(rid, 0) for rid in ids]
    return decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])


def check_mma_case(case, seed, mma_options=None, lse_rtol=0.0):
    """The tensor-core decode of one case (a `CASES` row) against the torch reference at the case's split, one
    program per request and more splits than pages, then against the plain Triton kernel at the case's split.
    Returns ``(q, args, levers, rotary, cache, out)`` (``out`` at the case's split) for the test's own checks."""
    from kvbackend.kernels.paged_decode import paged_decode

    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs = case
    cache, ids, rotary = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=seed)
    args, levers = _inputs(cache, ids)
    q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).bfloat16()
    want, want_lse = _reference(cache, ids, q)
    for n in (1, 4096, programs):  # one program per request, more splits than pages, the test's split (kept)
        out, lse = paged_decode(q, *args, target_programs=n, levers=levers, rotary=rotary, mma=True,
                                mma_options=mma_options)
        assert torch.isfinite(out.float()).all(), n
        assert float((out.float() - want).norm() / want.norm()) < 1e-2, n
        assert torch.allclose(lse, want_lse, atol=2e-2, rtol=lse_rtol), n
    plain, _ = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=False, fold=False,
                            planar=False)
    assert float((out.float() - plain.float()).norm() / plain.float().norm()) < 1e-2
    return q, args, levers, rotary, cache, out


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", CASES)
def test_recipe_layouts_match_the_reference(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs):
    from kvbackend.kernels.paged_decode import paged_decode

    case = (codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs)
    q, args, levers, rotary, _, _ = check_mma_case(case, seed=len(lengths))
    default, _ = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary)  # picks the kernel
    assert torch.equal(default, paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary,
                                             mma=True)[0])


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", PREROPE_CASES)
def test_pre_rope_keys_match_the_reference(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs):
    from kvbackend.kernels.paged_decode import paged_decode

    case = (codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs)
    q, args, levers, rotary, _, out = check_mma_case(case, seed=7, mma_options=OPT_IN)
    assert levers.prerope
    # the rotation (and the PSAC rows) are read: without either the output moves (3-bit keys without the rotation
    # are refused: the kernel reads them on the pre-RoPE path alone)
    for off in (dict(prerope=False, psac_rank=0), dict(psac_rank=0)) if levers.psac_rank else (dict(prerope=False),):
        partial = dataclasses.replace(levers, **off)
        call = functools.partial(paged_decode, q, *args, target_programs=programs, rotary=rotary, mma=True,
                                 levers=partial if partial.active else LeverScheme(), mma_options=OPT_IN)
        if args[3][0].bits == 3 and not partial.prerope:
            with pytest.raises(ValueError, match="3-bit keys: on the pre-RoPE path alone"):
                call()
            continue
        wrong, _ = call()
        assert float((wrong.float() - out.float()).norm() / out.float().norm()) > 1e-3, off


@gpu
def test_each_lever_path_is_read():
    """With a lever's path switched off the same pages decode to something else, so none is ignored."""
    from kvbackend.kernels.paged_decode import paged_decode

    codec = f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,pagerope=true,outliers=16"
    cache, ids, rotary = recipe_cache(codec, 128, 64, 2, [400], 2, 4, seed=3)
    args, levers = _inputs(cache, ids)
    q = torch.randn(1, 8, 128, device=DEVICE).bfloat16()
    full, _ = paged_decode(q, *args, target_programs=4, levers=levers, rotary=rotary, mma=True)
    for off in (dict(sink=0), dict(pagerope=False), dict(vrot=False), dict(outliers=0)):
        partial = dataclasses.replace(levers, **off)
        out, _ = paged_decode(q, *args, target_programs=4, levers=partial if partial.active else LeverScheme(),
                              rotary=rotary, mma=True)
        assert float((out.float() - full.float()).norm() / full.float().norm()) > 1e-3, off


@gpu
def test_large_bf16_centroids_and_a_reused_centroid_table():
    """bf16 centroids of 1500 in channel 0 (the table's operand once overflowed fp16 there: an inf score, a NaN
    head), and 8-page chunks of 16-token pages read by one program, so a warp's next page is in the same chunk
    and reuses the centroid table it built (no page-relative keys)."""
    from kvbackend.kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(21)
    heads, d, ratio = 2, 128, 4
    rotary = _rotary(d)
    for codec, page, chunk in ((f"{BASE},kchannel=64,centroids=4", 64, 2), (f"{BASE},kchannel=16,centroids=4", 16, 8)):
        data = []
        for n in (460, 300):
            k = torch.randn(n, heads, d, generator=gen)
            k[..., 0] += 1500
            k[..., 1] -= 900
            data.append((k.bfloat16(), torch.randn(n, heads, d, generator=gen).bfloat16()))
        caches = []  # the kernel's bf16 cache and a float32 twin for the reference (bf16 reads round 1500 by 4)
        for dtype in (torch.bfloat16, torch.float32):
            cache = KVCache(Geometry(1, heads, d, dtype),
                            CacheConfig(codec=codec, page_size=page, chunk_pages=chunk, dense_pages=128,
                                        packed_pages=128, device=DEVICE, backend="torch"), rotary=rotary)
            ids = []
            for k, v in data:
                rid, _ = cache.add_request()
                cache.append(rid, 0, k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE))
                ids.append(rid)
            caches.append((cache, ids))
        (cache, ids), (twin, twin_ids) = caches
        args, _ = _inputs(cache, ids)
        q = (torch.randn(2, heads * ratio, d, generator=gen) * 0.05).bfloat16().to(DEVICE)
        want, want_lse = _reference(twin, twin_ids, q)
        for programs in (1, 16):
            out, lse = paged_decode(q, *args, target_programs=programs, mma=True)
            assert torch.isfinite(out.float()).all(), (codec, programs)
            assert float((out.float() - want).norm() / want.norm()) < 1e-2, (codec, programs)
            assert torch.allclose(lse, want_lse, atol=2e-2), (codec, programs)


@gpu
def test_outlier_sums_are_the_same_on_every_run():
    """Several outliers in one token: the kernel adds them in a fixed order (no atomics), bit for bit."""
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids, rotary = recipe_cache(f"{BASE},kchannel=32,centroids=4,outliers=40", 64, 32, 1, [200, 96], 2, 4, seed=9)
    args, levers = _inputs(cache, ids)
    q = torch.randn(2, 8, 64, device=DEVICE).bfloat16()
    first = paged_decode(q, *args, target_programs=8, levers=levers, rotary=rotary, mma=True)
    for _ in range(5):
        again = paged_decode(q, *args, target_programs=8, levers=levers, rotary=rotary, mma=True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@gpu
def test_large_key_scales_and_small_queries():
    """Per-channel scales fold into fp16 query fragments normalized by the page's largest scale: channels
    whose scales differ by 2^12 (keys up to about 127), and a query 1e-3 small, still match the reference.
    The reference reads a float32 twin of the cache: `KVCache.read` of the bf16 cache rounds the
    reconstructed keys to bf16, which moves this test's log-sum-exp by up to 0.045 (a first GPU run failed
    on that; perf/NOTES.md), while the kernel dequantizes in float32."""
    from kvbackend.kernels.paged_decode import paged_decode

    codec = f"{BASE},kchannel=64,centroids=32,cdtype=fp8"
    gen = torch.Generator().manual_seed(11)
    heads, d, n = 2, 128, 900
    k = torch.randn(n, heads, d, generator=gen) * torch.logspace(-2, 1.6, d)
    v = torch.randn(n, heads, d, generator=gen)
    caches = []
    for dtype in (torch.bfloat16, torch.float32):  # the kernel's cache, the reference's twin (same bf16 inputs)
        cache = KVCache(Geometry(1, heads, d, dtype),
                        CacheConfig(codec=codec, page_size=64, chunk_pages=4, dense_pages=64, packed_pages=64,
                                    device=DEVICE, backend="torch"))
        rid, _ = cache.add_request()
        cache.append(rid, 0, k.bfloat16().to(dtype).to(DEVICE), v.bfloat16().to(dtype).to(DEVICE))
        caches.append((cache, rid))
    (cache, rid), (twin, twin_rid) = caches
    assert torch.equal(twin.read(twin_rid, 0)[0].bfloat16(), cache.read(rid, 0)[0])  # one reconstruction
    args, _ = _inputs(cache, [rid])
    for scale in (1.0, 1e-3):
        q = (torch.randn(1, 8, d, generator=gen) * scale).bfloat16().to(DEVICE)
        want, want_lse = _reference(twin, [twin_rid], q)
        out, lse = paged_decode(q, *args, target_programs=8, mma=True)
        assert float((out.float() - want).norm() / want.norm()) < 1e-2, scale
        assert torch.allclose(lse, want_lse, atol=2e-2), scale


@pytest.mark.parametrize("codec,stages", [
    # pre-RoPE keys with PSAC rows: 2 stages still leave room for two blocks per SM at 2 bits (each lane's key scales
    # live in registers; 768 bytes to spare of the H200's 228 KiB per SM, so 1 KiB more per block flips this case:
    # the outliers folded into the centroid-value table, `OUT_FOLD`, take 16 KiB), not with 3-bit keys' longer rows,
    # where 1 stage does
    ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,outliers=16", 2),
    ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,outliers=0,kbits=3", 1),
    (f"{BASE},kchannel=64,centroids=32,cdtype=fp8,sink=4,vrot=hadamard,pagerope=true,outliers=16", 2),
    ("kivi:bits=2,group=64", 2),
])
def test_the_default_stage_count_keeps_two_blocks_per_sm(codec, stages):
    cache, ids, _ = recipe_cache(codec, 128, 64, 2, [200], 2, 4)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    h200 = 228 * 1024  # shared memory per SM
    assert mma_decode._default_stages(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, 4, levers, h200) == stages
    config = mma_decode.config_for(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, stages, 4, 0, levers)
    assert h200 // (config.smem_bytes + 1024) >= 2


def test_one_stage_where_only_one_fits_a_block():
    """Where two stages do not fit a block's shared memory and one does, the default is one stage (else the kernel
    would be refused and the Triton kernels would serve)."""
    codec = ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,"
             "prerope=true,cdtype=fp8,outliers=16")
    cache, ids, _ = recipe_cache(codec, 128, 64, 2, [200], 2, 4)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    per_block = 227 * 1024
    two, one = (mma_decode.config_for(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, s, 10, 0, levers).smem_bytes
                for s in (2, 1))
    assert two > per_block >= one  # ten warps
    assert mma_decode._default_stages(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, 10, levers, 228 * 1024,
                                      per_block) == 1


def test_a_failed_default_variant_sends_later_calls_to_triton(monkeypatch):
    """`preferred` asks about the variant the default path launches (its stage count from `default_stages`): once
    that variant has failed to build, the Triton kernels serve, instead of rebuilding it on every call."""
    codec = ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,"
             "prerope=true,cdtype=fp8,outliers=16")
    cache, ids, _ = recipe_cache(codec, 128, 64, 2, [200], 2, 4)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    monkeypatch.setattr(mma_decode, "available", lambda device=None: (True, ""))
    monkeypatch.setattr(mma_decode, "_shared_memory", lambda index: (228 * 1024, 227 * 1024))
    monkeypatch.setattr(mma_decode, "max_shared_memory", lambda index: 227 * 1024)
    monkeypatch.setattr(mma_decode, "PREFERRED", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(mma_decode, "_functions", {})
    monkeypatch.setattr(mma_decode, "_failed", set())
    cuda = torch.device("cuda", 0)
    args = (*schemes, 64, 128, 4, cuda, torch.bfloat16, torch.bfloat16, levers)
    assert mma_decode.preferred(*args)
    stages = mma_decode.default_stages(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, 4, levers, cuda)
    assert stages == 2
    mma_decode._failed.add((0, mma_decode.config_for(*schemes, 64, 128, torch.bfloat16, torch.bfloat16, stages, 4,
                                                     mma_decode.default_min_blocks(4), levers)))
    assert not mma_decode.preferred(*args)
    assert mma_decode.preferred(*args, stages=1)  # another variant is still asked about as itself


def _fold_against_unfolded(case, switch, field, seed, monkeypatch, check_lse=False):
    """The tensor-core decode of ``PREROPE_CASES[case]`` with the module switch ``switch`` on and off (the config's
    ``field`` follows it), each against the reference; returns the relative difference of the two outputs."""
    from kvbackend.kernels.paged_decode import paged_decode

    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs = PREROPE_CASES[case]
    cache, ids, rotary = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=seed)
    args, levers = _inputs(cache, ids)
    q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).bfloat16()
    want, want_lse = _reference(cache, ids, q)
    outs = {}
    for fold in (True, False):
        monkeypatch.setattr(mma_decode, switch, fold)
        _clear_variant_caches()
        assert getattr(mma_decode.config_for(*args[3], page_size, head_dim, q.dtype, args[2].dtype, 2, 4, None,
                                             levers), field) is fold
        outs[fold], lse = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                                       mma_options=OPT_IN)
        assert float((outs[fold].float() - want).norm() / want.norm()) < 1e-2, fold
        if check_lse:
            assert torch.allclose(lse, want_lse, atol=2e-2), fold
    monkeypatch.undo()
    _clear_variant_caches()
    return float((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm())


@gpu
@pytest.mark.parametrize("case", [3, 4, 9])
def test_folded_psac_rows_decode_as_the_per_key_path(case, monkeypatch):
    """Sparse PSAC rows folded into the centroid table give the per-key path's output (fp16 sums in another order:
    within 2e-3), and both match the reference; the fold is the variant the default launch compiles."""
    assert _fold_against_unfolded(case, "PSAC_FOLD", "psac_fold", 11, monkeypatch) < 2e-3


def _config(case, stages=1):
    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, _ = case
    cache, ids, _ = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths[:1], heads, ratio)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    return mma_decode.config_for(*schemes, page_size, head_dim, torch.bfloat16, torch.bfloat16, stages, 4, 0, levers)


def test_outliers_fold_into_the_centroid_table_with_pre_rope_keys(monkeypatch):
    """Up to 32 outliers per page and head, with pre-RoPE keys and key centroids, become rows of the centroid-value
    table (`OUT_FOLD`): one row per outlier lane, so each warp's table grows by outliers x head_dim x 2 bytes. More
    outliers, page-relative keys or keys without centroids keep the score term. Off by default (an H100 timed it
    slower); the module switch turns it on."""
    assert not _config(PREROPE_CASES[3]).out_fold or os.environ.get("KVBACKEND_MMA_OUT_FOLD") == "1"
    monkeypatch.setattr(mma_decode, "OUT_FOLD", True)
    _clear_variant_caches()
    recipe = _config(PREROPE_CASES[3])
    assert recipe.out_fold and recipe.outliers == 16 and recipe.psac_fold
    assert recipe.smem_bytes == dataclasses.replace(recipe, out_fold=False).smem_bytes + 4 * 16 * 128 * 2
    assert _config(PREROPE_CASES[2]).out_fold  # 5 outliers, bf16 centroids
    assert _config(PREROPE_CASES[7]).out_fold  # 3-bit keys
    assert not _config(PREROPE_CASES[1]).out_fold  # no centroids, no outliers
    assert not _config(PREROPE_CASES[6]).out_fold  # no outliers
    assert not _config(CASES[0]).out_fold  # page-relative keys: the score term
    many = (f"{BASE},kchannel=32,centroids=4,prerope=true,outliers=40", 128, 32, 1, [100], 2, 2, 8)
    assert _config(many).outliers == 40 and not _config(many).out_fold
    monkeypatch.undo()
    _clear_variant_caches()


@gpu
@pytest.mark.parametrize("case", [0, 2, 3, 7])
def test_folded_outliers_decode_as_the_score_term(case, monkeypatch):
    """Outliers folded into the centroid-value table give the score term's output (the outlier rounded into the fp16
    key operand instead of a split fp32 product: within 2e-3), and both match the reference."""
    assert _fold_against_unfolded(case, "OUT_FOLD", "out_fold", 13, monkeypatch, check_lse=True) < 2e-3


@gpu
def test_folded_outliers_sum_duplicates_and_skip_positions_past_the_page(monkeypatch):
    """Crafted outlier fields (a damaged page): several outliers of one token (two in one channel pair), one position
    named three times, positions past the page. The folded rows add every outlier of a token, sum a repeated position
    once per naming (in a fixed order: the same bits on every run) and skip positions past the page, as the Triton
    kernel's one-hot product does; the crafted outliers are read (the output moves)."""
    from kvbackend.batch import PACKED
    from kvbackend.kernels.paged_decode import paged_decode

    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs = PREROPE_CASES[3]
    cache, ids, rotary = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=17)
    args, levers = _inputs(cache, ids)
    monkeypatch.setattr(mma_decode, "OUT_FOLD", True)
    _clear_variant_caches()
    assert mma_decode.config_for(*args[3], page_size, head_dim, torch.bfloat16, args[2].dtype, 2, 4, None,
                                 levers).out_fold
    q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).bfloat16()
    intact, _ = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                             mma_options=OPT_IN)
    pages, plan = args[0], args[4]
    index, value = (cache.layouts[0].page.fields[name] for name in ("k_out_index", "k_out_value"))
    n, H = index.shape
    used = sorted({int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED})
    assert used and n == 16
    D, P = head_dim, page_size
    positions = [9 * D + 0, 9 * D + 8, 9 * D + 64, 9 * D + 127,  # one token, channels 0 and 8 share a pair
                 21 * D + 3, 21 * D + 3, 21 * D + 3,  # one position three times
                 P * D + 5, (P + 3) * D]  # past the page
    crafted = pages.clone()
    for p in used:  # head 0 of every packed page
        idx = crafted[p, index.offset:index.offset + n * H * 2].view(torch.int16).view(n, H)
        val = crafted[p, value.offset:value.offset + n * H * 2].view(torch.float16).view(n, H)
        for i, pos in enumerate(positions):
            idx[i, 0] = pos
            val[i, 0] = 0.75 if i % 2 else -1.25
    bad = (crafted, *args[1:])
    out, lse = paged_decode(q, *bad, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                            mma_options=OPT_IN)
    for _ in range(3):
        again = paged_decode(q, *bad, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                             mma_options=OPT_IN)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    want, want_lse = paged_decode(q, *bad, target_programs=programs, levers=levers, rotary=rotary, mma=False,
                                  fold=False, planar=False)
    assert torch.isfinite(out.float()).all()
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2)
    assert float((out.float() - intact.float()).norm() / intact.float().norm()) > 1e-3
    monkeypatch.undo()
    _clear_variant_caches()


@gpu
@pytest.mark.parametrize("case", [("recipe", 0), ("prerope", 0), ("prerope", 2), ("prerope", 3), ("prerope", 4),
                                  ("prerope", 9)])
def test_corrupted_centroid_ids_add_nothing(case):
    """A centroid id past the chunk's centroids (a corrupted page: 255, or C itself) reads inside the kernel's
    tables and adds no centroid, as the Triton kernels do: the tensor-core decode of the corrupted pages agrees with
    the Triton decode of the same pages, and differs from the decode of the intact ones (the ids are read)."""
    from kvbackend.batch import PACKED
    from kvbackend.kernels.paged_decode import paged_decode

    table, index = case
    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs = (CASES if table == "recipe"
                                                                                 else PREROPE_CASES)[index]
    cache, ids, rotary = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=5)
    args, levers = _inputs(cache, ids)
    options = {} if table == "recipe" else {"mma_options": OPT_IN}
    q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).bfloat16()
    intact, _ = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=True, **options)
    pages, plan = args[0], args[4]
    field = cache.layouts[0].page.fields["k_assign"]
    stages, P, H = field.shape
    C = cache.layouts[0].codebook.fields["k_centroids"].shape[2]
    used = sorted({int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED})
    assert used
    corrupted = pages.clone()
    for p in used:  # head 0's ids in every packed page: C (just past the table's centroids) and 255
        view = corrupted[p, field.offset:field.offset + P * H].view(P, H)
        view[::2, 0] = C
        view[1::2, 0] = 255
    bad_args = (corrupted, *args[1:])
    out, lse = paged_decode(q, *bad_args, target_programs=programs, levers=levers, rotary=rotary, mma=True, **options)
    want, want_lse = paged_decode(q, *bad_args, target_programs=programs, levers=levers, rotary=rotary, mma=False,
                                  fold=False, planar=False)
    assert torch.isfinite(out.float()).all()
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2)
    assert float((out.float() - intact.float()).norm() / intact.float().norm()) > 1e-3
