"""The CUDA gather kernel (`kernels/gather_dequant.cu`) against the torch reference.

On a CUDA GPU it must write every planned token of the plain layouts exactly as the reference reconstructs them
(the same float32 operations, one rounding to the output dtype), and the recipe's lever layouts within the
tolerance of the Triton kernel's test. CPU runs check which layouts it claims, the argument checks, and compile the
source for sm_90 where nvcc is installed.
"""

import pytest
import torch

from kvbackend import Geometry, codecs
from kvbackend.scheme import kernel_schemes, lever_scheme
from kernel_cases import DEVICE, filled_cache
from test_kernel_levers import CASES as LEVER_CASES, RECIPE, ROTARY, kernel_inputs, lever_cache

from kvbackend.kernels import gather_cuda, mma_decode

gpu = pytest.mark.skipif(not mma_decode.available()[0] if torch.cuda.is_available() else True,
                         reason="needs a CUDA GPU and nvcc")

CASES = [  # (codec, head_dim, page_size, lengths, heads): lengths end mid-page and mid-chunk (dense tails)
    ("rtn:bits=2,group=64,scale=fp8", 128, 64, [150, 20, 64, 301], 3),
    ("rtn:bits=2,group=64", 64, 16, [45, 70, 3], 2),
    ("rtn:bits=4,group=32,symmetric=true,scale=fp8", 64, 64, [130, 20], 2),
    ("rtn:bits=8,group=64,scale=bf16", 64, 16, [37], 5),
    ("rtn:bits=2,group=8,symmetric=true,scale=fp16", 32, 16, [33, 17], 1),
    ("kivi:bits=2,group=16", 64, 16, [70, 5, 40], 2),
    ("kivi:bits=4,group=32", 128, 64, [150], 3),
    ("kivi:bits=2,group=64", 128, 64, [257, 64], 8),
    ("kivi:bits=3,group=32", 64, 32, [90, 7], 2),  # 3-bit codes, 8 in 3 bytes: byte loads
    ("rtn:bits=3,group=32,symmetric=true,scale=fp16", 128, 16, [37, 20], 3),
    ("fp8", 64, 16, [50], 2),
    ("identity", 128, 16, [40, 3], 2),
    ("qvg", 64, 16, [45, 70], 2),  # centroid stages: bf16 centroids for K and V
    ("qvg:centroids=8,stages=2,kchannel=8,group=32,cdtype=fp8", 64, 16, [37], 3),  # two fp8 stages
    ("qvg:kchannel=64,centroids=32,vcluster=false,cdtype=fp8,clip=true", 128, 64, [200, 64], 4),  # the recipe's keys
]


def _schemes(spec, head_dim=64, page_size=16, heads=2):
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, heads, head_dim, torch.bfloat16), page_size)
    return codec, layout


def test_claims_plain_layouts_only():
    def claims(spec, head_dim=64, page_size=16, out=torch.bfloat16):
        codec, layout = _schemes(spec, head_dim, page_size)
        return gather_cuda.supports(*kernel_schemes(codec, layout), page_size, head_dim, out, torch.bfloat16)

    for spec, head_dim, page_size, _, _ in CASES:
        assert claims(spec, head_dim, page_size), spec
    assert not claims("rtn:bits=2,group=64", head_dim=256)  # 32 runs a row: no bit left for the PSAC flag
    assert not claims("rtn:bits=2,group=4")  # a run of 8 channels would span two scale groups
    assert not claims("rtn:bits=2,group=64,scale=fp8", out=torch.float32)  # 16-bit outputs only
    assert not claims("identity", head_dim=512)  # a row of 64 runs would span two warps

    def lever_claims(spec, heads=2, head_dim=64, page=16):
        from kvbackend.frames import lever_layout
        codec, layout = _schemes(spec, head_dim, page, heads)
        layout = lever_layout(layout, codec.levers)
        return gather_cuda.supports(*kernel_schemes(codec, layout, levers_read=True), page, head_dim, torch.bfloat16,
                                    torch.bfloat16, lever_scheme(codec, layout), heads)

    assert lever_claims(RECIPE + ",cdtype=fp8,outliers=16")
    assert lever_claims("kivi:bits=2,group=16,sink=4,vrot=hadamard")
    assert not lever_claims(RECIPE + ",outliers=16", heads=40)  # more heads than a CTA stages rows for
    assert lever_claims("quantwm:rank=16,centroids=4")  # a dense row per 16-token page's token at rank 16
    assert not lever_claims("quantwm:rank=16,centroids=4", page=64)  # 64 of them: too many to stage


def test_rejects_bad_options():
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache("rtn:bits=2,group=64", 64, 16, [20])
    plan = cache.plan(ids, 0)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    with pytest.raises(ValueError, match="backend must be"):
        gather_dequant(*args, backend="cutlass")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="runs on CUDA pages"):
            gather_dequant(*args, backend="cuda")
    with pytest.raises(ValueError, match="threads must be"):
        gather_cuda.config_for(*args[3], 16, 64, torch.bfloat16, torch.bfloat16, threads=96)


def test_auto_falls_back_to_triton_when_the_cuda_kernel_cannot_load(monkeypatch):
    """A variant that fails to compile or load costs the call nothing under backend="auto" (the Triton kernel
    serves it); backend="cuda" reports the failure."""
    from kvbackend.kernels import gather_dequant as module

    cache, ids = filled_cache("rtn:bits=2,group=64", 64, 16, [45, 19])
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), cache.plan(ids, 0))
    want = module.gather_dequant(*args, backend="triton")

    def broken(*a, **k):
        raise RuntimeError("nvcc failed")
    monkeypatch.setattr(gather_cuda, "preferred", lambda *a, **k: True)
    monkeypatch.setattr(gather_cuda, "launch", broken)
    got = module.gather_dequant(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="nvcc failed"):
        module.gather_dequant(*args, backend="cuda")


@pytest.mark.skipif(mma_decode.nvcc() is None, reason="nvcc not installed")
def test_source_compiles_for_each_storage_mode(tmp_path, monkeypatch):
    """Per-token and per-channel groups, symmetric and not, 2/3/4/8 bits, fp8/fp16/bf16 scales, float pages, both
    output dtypes: each variant compiles (and a second ask comes from the disk cache)."""
    monkeypatch.setenv("KVBACKEND_CACHE_DIR", str(tmp_path))
    seen = set()
    for spec, head_dim, page_size, _, _ in CASES:
        codec, layout = _schemes(spec, head_dim, page_size)
        for out in (torch.bfloat16, torch.float16):
            config = gather_cuda.config_for(*kernel_schemes(codec, layout), page_size, head_dim, out, torch.bfloat16)
            if config in seen:
                continue
            seen.add(config)
            cubin = gather_cuda.compile_cubin(config, "sm_90")
            assert cubin[:4] == b"\x7fELF"
    from kvbackend.frames import lever_layout
    for spec, page in ((RECIPE + ",cdtype=fp8,outliers=16", 16), ("quantwm:kchannel=32,rank=4,keep=0.25,centroids=4,"
                                                                  "vcluster=false,sink=4,vrot=hadamard,pagerope=true", 32)):
        codec, layout = _schemes(spec, 64, page)
        layout = lever_layout(layout, codec.levers)
        config = gather_cuda.config_for(*kernel_schemes(codec, layout, levers_read=True), page, 64, torch.bfloat16,
                                        torch.bfloat16, levers=lever_scheme(codec, layout))
        assert config.sink and config.vrot and config.psac_rank and (config.rope or config.page_rope)
        seen.add(config)
        assert gather_cuda.compile_cubin(config, "sm_90")[:4] == b"\x7fELF"
    for spec, page in ((RECIPE + ",cdtype=fp8,outliers=16,heavy=2,whole=2", 16),  # whole key rows beside each lever
                       ("quantwm:rank=0,centroids=4,kchannel=16,outliers=31,whole=8", 16)):  # the outlier set's bound
        codec, layout = _schemes(spec, 64, page)
        layout = lever_layout(layout, codec.levers)
        config = gather_cuda.config_for(*kernel_schemes(codec, layout, levers_read=True), page, 64, torch.bfloat16,
                                        torch.bfloat16, levers=lever_scheme(codec, layout))
        assert config.whole == lever_scheme(codec, layout).whole >= 2
        seen.add(config)
        assert gather_cuda.compile_cubin(config, "sm_90")[:4] == b"\x7fELF"
    assert len(seen) >= len(CASES)
    assert len(list(tmp_path.rglob("gather_dequant-*.cubin"))) == len(seen)


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,lengths,heads", CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_exactly(codec, head_dim, page_size, lengths, heads, out_dtype):
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache(codec, head_dim, page_size, lengths, heads=heads, seed=5)
    layer = 1
    plan = cache.plan(ids, layer)
    total = sum(lengths)
    poison = tuple(torch.full((total, heads, head_dim), float("nan"), dtype=out_dtype, device=DEVICE)
                   for _ in range(2))
    k, v = gather_dequant(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                          kernel_schemes(cache.codec, cache.layout), plan, out=poison, backend="cuda")
    reads = [cache.read(rid, layer) for rid in ids]
    for got, want in ((k, torch.cat([r[0] for r in reads])), (v, torch.cat([r[1] for r in reads]))):
        assert not torch.isnan(got).any()  # every element written
        if out_dtype == want.dtype:  # the reference's float32 values rounded once to the cache's dtype: bit for bit
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        else:  # the reference rounded to bf16, the kernel to fp16: within half a bf16 ulp plus one fp16 ulp
            err = (got.float() - want.float()).abs()
            assert torch.all(err <= want.float().abs() * (2**-8 + 2**-10) + 2**-24), err.max()


@gpu
def test_auto_takes_the_cuda_kernel_for_plain_layouts(monkeypatch):
    from kvbackend.kernels import gather_dequant as module

    calls = []
    real = gather_cuda.launch
    monkeypatch.setattr(gather_cuda, "launch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cache, ids = filled_cache("rtn:bits=2,group=64,scale=fp8", 64, 16, [45, 70])
    plan = cache.plan(ids, 0)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    k, v = module.gather_dequant(*args)
    assert calls == [1]
    tk, tv = module.gather_dequant(*args, backend="triton")
    assert calls == [1]
    # the Triton kernel may fuse code * scale + zero into one rounding: within one output ulp
    for got, want in ((k, tk), (v, tv)):
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6)
    module.gather_dequant(*args, out_dtype=torch.float32, out=None)
    assert calls == [1]  # float32 outputs stay with the Triton kernel
    module.gather_dequant(*args, num_warps=4)
    assert calls == [1]  # so does a Triton launch option


@pytest.fixture
def cuda_whole(monkeypatch):
    """The CUDA kernels' whole-row paths on (`mma_decode.WHOLE`, on by default; KVBACKEND_CUDA_WHOLE=0 turns it off),
    the layout claims asked again with it and after it."""
    monkeypatch.setattr(mma_decode, "WHOLE", True)
    gather_cuda.supports.cache_clear()
    yield
    gather_cuda.supports.cache_clear()


@gpu
@pytest.mark.parametrize("codec,page_size,lengths,ratio,programs", LEVER_CASES)
def test_lever_layouts_match_the_reference(codec, page_size, lengths, ratio, programs, cuda_whole):
    """The recipe's levers (sinks, pre-RoPE and page-relative keys, rotated values, PSAC rows, key outliers) as
    the Triton kernel's test holds them, and within rounding of the Triton kernel itself."""
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = lever_cache(codec, page_size, lengths, ratio, "triton")
    layer = 1
    args, levers = kernel_inputs(cache, ids, layer)
    if not gather_cuda.supports(*args[3], page_size, 64, torch.bfloat16, torch.bfloat16, levers, 2):
        pytest.skip("a layout the CUDA gather kernel leaves to the Triton kernel")
    reads = [cache.read(rid, layer) for rid in ids]
    k, v = gather_dequant(*args, levers=levers, rotary=ROTARY, backend="cuda")
    assert k.dtype == torch.bfloat16 and not torch.isnan(k).any() and not torch.isnan(v).any()
    rk, rv = torch.cat([r[0] for r in reads]).float(), torch.cat([r[1] for r in reads]).float()
    assert float((k.float() - rk).abs().max()) <= 2e-2 * float(rk.abs().max())
    assert float((v.float() - rv).abs().max()) <= 1e-2 * float(rv.abs().max())
    tk, tv = gather_dequant(*args, out_dtype=torch.float32, levers=levers, rotary=ROTARY, backend="triton")
    for got, want in ((k, tk), (v, tv)):  # both within a bf16 rounding of float32 values that agree closely
        assert torch.all((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3 * float(want.abs().max()))
    if levers.sink:  # the sinks are the appended tokens, bit for bit (requests whose first page is packed)
        plan = args[-1]
        for rid, row in zip(ids, plan.cu_seqlens[:-1].tolist()):
            if cache.page_table(rid).packed:
                assert torch.equal(k[row: row + levers.sink], reads[ids.index(rid)][0][: levers.sink])


@gpu
def test_each_lever_the_kernel_reads_changes_its_output():
    """Turning off any one lever in the scheme changes what the kernel writes: every lever path does work."""
    import dataclasses

    from kvbackend.kernels.gather_dequant import gather_dequant
    from kvbackend.scheme import LeverScheme

    cache, ids = lever_cache(RECIPE + ",cdtype=fp8,outliers=16", 16, [140], 2, "triton")
    args, levers = kernel_inputs(cache, ids)
    full = gather_dequant(*args, levers=levers, rotary=ROTARY, backend="cuda")
    for off in (dict(sink=0), dict(prerope=False), dict(vrot=False), dict(psac_rank=0), dict(outliers=0)):
        partial = dataclasses.replace(levers, **off)
        k, v = gather_dequant(*args, levers=partial if partial.active else LeverScheme(), rotary=ROTARY,
                              backend="cuda")
        assert not (torch.equal(k, full[0]) and torch.equal(v, full[1])), off


@gpu
@pytest.mark.parametrize("codec,heads,head_dim,page_size", [
    (RECIPE + ",cdtype=fp8,outliers=16", 3, 128, 16),  # 16 runs a row: RoPE partners 8 lanes apart
    (RECIPE + ",cdtype=fp8,outliers=7,group=32", 5, 32, 16),  # 4 runs a row, odd head count
    (RECIPE + ",cdtype=fp8,outliers=40", 3, 128, 16),  # past 31 outliers: the per-run masks, not a row's outlier set
    ("kivi:bits=2,group=16,sink=3,vrot=hadamard,pagerope=true", 3, 16, 16),  # 2 runs a row
    # 16 PSAC rows a page: no shared memory left for the per-page R(p0 + t) table, so keys turn twice
    (RECIPE + ",cdtype=fp8,outliers=16", 3, 128, 64),
])
def test_lever_layouts_at_other_head_sizes_and_counts(codec, heads, head_dim, page_size):
    from kvbackend import CacheConfig, KVCache
    from kvbackend.kernels.gather_dequant import gather_dequant
    from kvbackend.rope import Rotary
    from kernel_cases import lever_request

    rotary = Rotary(1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), scaling=1.25)
    gen = torch.Generator().manual_seed(7)
    cache = KVCache(Geometry(1, heads, head_dim, torch.bfloat16),
                    CacheConfig(codec=codec, page_size=page_size, chunk_pages=2, dense_pages=64, packed_pages=64,
                                device=DEVICE, backend="triton"), rotary=rotary)
    ids = []
    for n in (75, 40) if page_size < 64 else (300, 140):  # past a chunk of two pages
        rid, _ = cache.add_request()
        k, v, q = lever_request(gen, n, heads, head_dim, 2, rotary)
        cache.append(rid, 0, k, v, queries=q)
        ids.append(rid)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codecs[0], cache.layouts[0], levers_read=True), cache.plan(ids, 0))
    levers = lever_scheme(cache.codecs[0], cache.layouts[0])
    assert gather_cuda.supports(*args[3], page_size, head_dim, torch.bfloat16, torch.bfloat16, levers, heads)
    k, v = gather_dequant(*args, levers=levers, rotary=rotary, backend="cuda")
    reads = [cache.read(rid, 0) for rid in ids]
    rk, rv = torch.cat([r[0] for r in reads]).float(), torch.cat([r[1] for r in reads]).float()
    assert float((k.float() - rk).abs().max()) <= 2e-2 * float(rk.abs().max())
    assert float((v.float() - rv).abs().max()) <= 1e-2 * float(rv.abs().max())


@gpu
@pytest.mark.parametrize("codec", ["qvg:centroids=8,kchannel=8,group=32", "qvg:kchannel=8,group=32,cdtype=fp8"])
def test_corrupted_centroid_ids_add_nothing_as_in_triton(codec):
    """Centroid ids past C (a corrupted page) read nothing past the codebook and add no centroid, as the Triton
    kernel does (`test_gather_dequant.test_corrupted_centroid_ids_add_nothing`)."""
    from kvbackend.batch import PACKED
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache(codec, 64, 16, [45, 30], seed=7)
    layer = 1
    plan = cache.plan(ids, layer)
    pages = cache.packed.pages[layer].clone()
    field = cache.layout.page.fields["k_assign"]
    C = cache.layout.codebook.fields["k_centroids"].shape[2]
    _, P, H = field.shape
    for p in {int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED}:
        ids_view = pages[p, field.offset:field.offset + P * H].view(P, H)
        ids_view[::2, 0], ids_view[1::2, 0] = C, 255
    args = (pages, cache.packed.codebooks[layer], cache.dense.data[layer], kernel_schemes(cache.codec, cache.layout),
            plan)
    clean = gather_dequant(cache.packed.pages[layer], *args[1:], backend="cuda")[0]
    got = gather_dequant(*args, backend="cuda")[0]
    want = gather_dequant(*args, backend="triton")[0]
    assert not torch.equal(got, clean) and torch.isfinite(got.float()).all()
    assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6)


@gpu
@pytest.mark.parametrize("craft", ["loud", "tokens"])
def test_crafted_whole_rows_gather_as_the_triton_kernel(craft, cuda_whole):
    """Whole rows 64x louder (their scales: a row added at the wrong token or channels would show), or token indices
    past the page (ignored) and two rows naming one token (both add), in every packed page: the CUDA gather writes
    what the Triton gather writes, within a bf16 rounding, and each craft moves the output (the rows are read)."""
    from kvbackend.batch import PACKED
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = lever_cache(RECIPE + ",cdtype=fp8,outliers=16,heavy=2,whole=2", 16, [140, 45], 2, "triton")
    args, levers = kernel_inputs(cache, ids)
    assert levers.whole == 2
    intact = gather_dequant(*args, levers=levers, rotary=ROTARY, backend="cuda")[0]
    pages, plan = args[0], args[-1]
    tokens, scales = (cache.layouts[0].page.fields[name] for name in ("k_whole_token", "k_whole_scale"))
    W, H = tokens.shape
    used = sorted({int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED})
    assert used
    crafted = pages.clone()
    for p in used:
        if craft == "loud":
            crafted[p, scales.offset:scales.offset + 2 * W * H].view(torch.float16).mul_(64)
        else:
            view = crafted[p, tokens.offset:tokens.offset + W * H].view(W, H)
            view[0, 0] = 255
            view[1, 1 % H] = view[0, 1 % H]
    bad = (crafted, *args[1:])
    k, _ = gather_dequant(*bad, levers=levers, rotary=ROTARY, backend="cuda")
    want, _ = gather_dequant(*bad, out_dtype=torch.float32, levers=levers, rotary=ROTARY, backend="triton")
    assert torch.all((k.float() - want).abs() <= want.abs() * 2**-7 + 1e-3 * float(want.abs().max()))
    assert not torch.equal(k, intact)
