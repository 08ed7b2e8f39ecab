"""The kernels read a layer's levers and PSAC rows: decode and gather through the Triton backend
against the torch reference on the same pages (odd lengths, GQA, splits that isolate the sink page)."""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.attention import decode_attention
from kvbackend.rope import Rotary
from kvbackend.scheme import kernel_schemes, lever_scheme
from kernel_cases import DEVICE, lever_request

triton = pytest.importorskip("triton")

ROTARY = Rotary(1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), scaling=1.25)
RECIPE = "quantwm:kchannel=16,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true"
PAGE_RECIPE = ("quantwm:kchannel=32,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,"
               "pagerope=true")
CASES = [  # (codec, page size, lengths, GQA ratio, target programs)
    (RECIPE, 16, [45, 70, 3], 4, 64),  # the recommended recipe's levers; 64 programs: one page per split
    (RECIPE, 16, [97], 1, 2),
    (RECIPE + ",cdtype=fp8", 16, [45, 70], 4, 16),  # the recipe over fp8 centroids (the recommended spec's)
    (PAGE_RECIPE + ",cdtype=fp8", 32, [75, 5], 2, 8),
    (RECIPE + ",cdtype=fp8,outliers=16", 16, [45, 70, 3], 4, 16),  # key outliers (plain kernel, RoPE halves)
    # 3- and 4-bit keys under the recipe's levers (the layers a depth: band widens); 3 bits: 8 codes in 3 bytes
    (RECIPE + ",cdtype=fp8,kbits=3", 16, [45, 70, 3], 4, 16),
    (RECIPE + ",cdtype=fp8,kbits=3,vbits=3,outliers=16", 16, [97], 1, 2),
    (RECIPE + ",cdtype=fp8,kbits=4,outliers=16", 16, [45, 70, 3], 4, 16),
    ("quantwm:kchannel=32,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,kbits=4", 32, [75, 40], 2, 8),
    (PAGE_RECIPE + ",outliers=5", 32, [75, 40], 2, 8),  # page-relative keys with outliers
    ("quantwm:rank=0,centroids=4,kchannel=16,outliers=40", 16, [50], 3, 4),  # outliers alone, NP = 64
    # 32-token pages: the folded kernel reads outliers too (joined to pre-RoPE keys, else a score term)
    ("quantwm:kchannel=32,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
     "cdtype=fp8,outliers=16", 32, [75, 40], 2, 8),
    ("quantwm:rank=0,centroids=4,kchannel=32,outliers=40", 32, [70], 2, 4),
    ("quantwm:rank=4,keep=0.5,centroids=4,outliers=8", 32, [90, 40], 2, 8),  # per-token key groups
    ("kivi:bits=2,group=16,sink=3", 16, [40, 33], 3, 16),
    ("kivi:bits=2,group=16,sink=16", 16, [50, 16], 2, 64),  # the sinks fill page 0: a split of it is all masked
    ("kivi:bits=4,group=16,prerope=true", 16, [80], 2, 4),
    ("rtn:bits=2,group=32,vrot=hadamard", 32, [150, 65], 4, 8),
    ("quantwm:rank=4,centroids=4,vbits=2", 16, [60], 2, 8),  # a PSAC row per token, no index
    ("quantwm:rank=16,keep=0.5,centroids=4,sink=2", 16, [70, 40], 1, 16),  # sparse rows, full kernel rank
    ("identity:sink=5,prerope=true,vrot=hadamard", 16, [90], 2, 8),  # frame round trip only
    # page-relative keys: the recipe on 32-token pages, so the folded kernel reads them too
    (PAGE_RECIPE, 32, [75, 130, 5], 4, 16),
    ("kivi:bits=2,group=32,pagerope=true", 32, [100], 2, 4),
    ("rtn:bits=2,group=32,pagerope=true", 16, [70], 2, 8),  # per-token key groups: the plain kernel only
    ("quantwm:rank=4,keep=0.5,centroids=4", 32, [90, 40], 2, 8),  # PSAC rows with per-token key groups, folded
    ("identity:sink=5,pagerope=true,vrot=hadamard", 16, [90], 2, 8),
    # whole key rows (the plain kernel and the Triton gather; heavy keys first): in RoPE's halves, in the stored
    # frame, with page-relative keys, and alone
    (RECIPE + ",cdtype=fp8,outliers=16,heavy=2,whole=2", 16, [45, 70, 3], 4, 16),
    ("quantwm:rank=4,keep=0.5,centroids=4,outliers=8,whole=1", 32, [90, 40], 2, 8),
    (PAGE_RECIPE + ",outliers=5,whole=3", 32, [75, 40], 2, 8),
    ("quantwm:rank=0,centroids=4,kchannel=16,whole=8", 16, [50], 3, 4),
]


def lever_cache(codec, page_size, lengths, ratio, backend, seed=0):
    """One request per length, keys post-RoPE with outlier channels, queries fed (for PSAC)."""
    gen = torch.Generator().manual_seed(seed)
    heads, d = 2, 64
    cache = KVCache(Geometry(2, heads, d, torch.bfloat16),
                    CacheConfig(codec=codec, page_size=page_size, chunk_pages=2, dense_pages=64, packed_pages=64,
                                device=DEVICE, backend=backend), rotary=ROTARY)
    ids = []
    for n in lengths:
        rid, _ = cache.add_request()
        for layer in range(2):
            k, v, q = lever_request(gen, n, heads, d, ratio, ROTARY)
            cache.append(rid, layer, k, v, queries=q)
        ids.append(rid)
    return cache, ids


def kernel_inputs(cache, ids, layer=0):
    """(positional arguments of the kernels after ``q``, the layer's lever scheme)."""
    args = (cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
            kernel_schemes(cache.codecs[layer], cache.layouts[layer], levers_read=True), cache.plan(ids, layer))
    return args, lever_scheme(cache.codecs[layer], cache.layouts[layer])


@pytest.mark.parametrize("codec,page_size,lengths,ratio,programs", CASES)
def test_decode_and_gather_read_levers_like_the_reference(codec, page_size, lengths, ratio, programs):
    from kvbackend.kernels.gather_dequant import gather_dequant
    from kvbackend.kernels.paged_decode import paged_decode

    cache, ids = lever_cache(codec, page_size, lengths, ratio, "triton")
    assert cache.backends[0].name == "triton" and cache.backends[0].levers.active
    layer = 1
    reads = [cache.read(rid, layer) for rid in ids]  # the torch reference: decode_pages + the frame
    q = torch.randn(len(ids), 2 * ratio, 64, device=DEVICE).bfloat16()
    want, want_lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])
    args, levers = kernel_inputs(cache, ids, layer)
    plan = args[-1]
    from kvbackend.kernels import folded_decode

    folds = [False] + ([True] if folded_decode.supports(*args[3], page_size, 64)
                       and folded_decode.supports_levers(args[3][0], levers) else [])
    for fold in folds:
        out, lse = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=ROTARY, fold=fold)
        assert torch.isfinite(out.float()).all(), fold
        assert float((out.float() - want).norm() / want.norm()) < 1e-2, fold
        assert torch.allclose(lse, want_lse, atol=2e-2), fold
    k, v = gather_dequant(*args, out_dtype=torch.float32, levers=levers, rotary=ROTARY)
    rk, rv = torch.cat([r[0] for r in reads]).float(), torch.cat([r[1] for r in reads]).float()
    assert float((k - rk).abs().max()) <= 2e-2 * float(rk.abs().max())
    assert float((v - rv).abs().max()) <= 1e-2 * float(rv.abs().max())  # the reference is rounded to bf16
    # the sinks are the appended tokens, bit for bit (requests whose first page is packed)
    if levers.sink:
        first = plan.cu_seqlens[:-1].long()
        for rid, row in zip(ids, first.tolist()):
            if cache.page_table(rid).packed:
                assert torch.equal(k[row: row + levers.sink].bfloat16(), reads[ids.index(rid)][0][: levers.sink])
    # the backend path (its own split count) gives the same
    out2, _ = cache.decode(plan, layer, q)
    assert float((out2.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("codec,page_size,rope,fold", [(RECIPE, 16, "prerope", False),
                                                       (PAGE_RECIPE, 32, "pagerope", False),
                                                       (PAGE_RECIPE, 32, "pagerope", True),
                                                       (RECIPE + ",whole=2", 16, "prerope", False)])
def test_a_lever_the_kernels_ignore_would_change_the_output(codec, page_size, rope, fold):
    """Without the lever scheme the same pages decode to something else: each lever path does work."""
    from kvbackend.kernels.paged_decode import paged_decode
    from kvbackend.scheme import LeverScheme
    import dataclasses

    cache, ids = lever_cache(codec, page_size, [140], 2, "triton")
    q = torch.randn(1, 4, 64, device=DEVICE).bfloat16()
    args, levers = kernel_inputs(cache, ids)
    full, _ = paged_decode(q, *args, levers=levers, rotary=ROTARY, fold=fold)
    offs = [dict(sink=0), {rope: False}, dict(vrot=False), dict(psac_rank=0)] + ([dict(whole=0)] if levers.whole else [])
    for off in offs:
        partial = dataclasses.replace(levers, **off)
        out, _ = paged_decode(q, *args, levers=partial if partial.active else LeverScheme(), rotary=ROTARY, fold=fold)
        assert float((out.float() - full.float()).norm() / full.float().norm()) > 1e-3, off  # same kernel, same splits


def test_levers_are_refused_by_the_other_decode_kernels_and_need_the_rope():
    from kvbackend.kernels.paged_decode import paged_decode

    q = torch.randn(1, 2, 64, device=DEVICE).bfloat16()
    args, levers = kernel_inputs(*lever_cache(RECIPE, 16, [40], 1, "torch"))
    with pytest.raises(ValueError, match="not the planar one"):
        paged_decode(q, *args, levers=levers, rotary=ROTARY, planar=True)
    args, levers = kernel_inputs(*lever_cache("rtn:bits=2,group=32,prerope=true", 16, [40], 1, "torch"))
    with pytest.raises(ValueError, match="folded decode kernel does not read"):  # per-token key groups
        paged_decode(q, *args, levers=levers, rotary=ROTARY, fold=True)
    with pytest.raises(ValueError, match="RoPE"):
        paged_decode(q, *args, levers=levers, rotary=None)


def test_a_field_no_kernel_reads_is_refused_not_ignored():
    """A layout with a field the kernels do not know (a future codec option) must not reach them."""
    from kvbackend import codecs
    from kvbackend.backends import kernels_can_serve
    from kvbackend.errors import UnsupportedLayout
    from kvbackend.layout import FieldSet, PageLayout

    codec = codecs.get("kivi:bits=2,group=16")
    layout = codec.layout(Geometry(1, 2, 64, torch.bfloat16), 16)
    specs = [(f.name, f.dtype, f.shape) for f in layout.page.fields.values()] + [("k_outliers", torch.float16, (2, 2))]
    extended = PageLayout(layout.codec, layout.geometry, 16, FieldSet(specs), layout.codebook)
    assert kernels_can_serve(codec, layout) and not kernels_can_serve(codec, extended)
    with pytest.raises(UnsupportedLayout, match="k_outliers"):
        kernel_schemes(codec, extended)


def test_a_sink_codec_on_a_layout_without_sink_fields_is_refused_clearly():
    """`lever_scheme` on a codec's own layout (not `frames.lever_layout`): UnsupportedLayout, and
    `kernels_can_serve` answers False instead of raising."""
    from kvbackend import codecs
    from kvbackend.backends import kernels_can_serve
    from kvbackend.errors import UnsupportedLayout

    codec = codecs.get("kivi:bits=2,group=16,sink=4")
    layout = codec.layout(Geometry(1, 2, 64, torch.bfloat16), 16)
    with pytest.raises(UnsupportedLayout, match="lever_layout"):
        lever_scheme(codec, layout)
    assert kernels_can_serve(codec, layout) is False


def test_page_tables_hold_the_angles_keys_were_de_rotated_by():
    """The kernels' R(p0) rows are computed as `Rotary` computes RoPE (float32 angles, one rounding), so
    a page-relative key is rotated back by exactly its de-rotation angle, also a million tokens in."""
    from kvbackend.kernels.levers import lever_tables
    from kvbackend.scheme import LeverScheme

    rotary = Rotary.default(128, 500000.0)
    tables = lever_tables(LeverScheme(pagerope=True), rotary, 64, 128, 1 << 14, torch.device("cpu"))
    pages = torch.tensor([0, 1, 511, 2047, 16383])
    cos, sin = rotary._cos_sin(pages * 64, torch.device("cpu"))
    assert torch.equal(tables.base_cos[pages], cos[:, :64]) and torch.equal(tables.base_sin[pages], sin[:, :64])


def test_the_plain_kernel_with_levers_defaults_to_one_stage(monkeypatch):
    """Two software-pipelining stages made the plain kernel with the recipe's levers 4x slower on an H200
    (7.4 against 1.8 ms at B=9, L=32K: perf/NOTES.md); without levers it keeps two."""
    from kvbackend.kernels import paged_decode as module

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw["num_stages"])

    monkeypatch.setattr(module, "_paged_decode_kernel", Recorder())
    q = torch.randn(1, 2, 64, device=DEVICE).bfloat16()
    args, levers = kernel_inputs(*lever_cache(RECIPE, 16, [40], 1, "torch"))
    module.paged_decode(q, *args, levers=levers, rotary=ROTARY)
    module.paged_decode(q, *args, levers=levers, rotary=ROTARY, num_stages=2)  # an explicit choice stands
    plain, plain_ids = lever_cache("kivi:bits=2,group=16", 16, [40], 1, "torch")
    plain_args, _ = kernel_inputs(plain, plain_ids)
    module.paged_decode(q, *plain_args, fold=False, planar=False, mma=False)
    assert launched == [1, 2, 2]


def test_whole_key_rows_are_declined_by_the_kernels_that_do_not_add_them():
    """Whole key rows are added by the plain Triton decode and the Triton gather, and encoded by the kernels' unit
    encoder; the folded decode kernel, the CUDA gather and (unless opted in: `tests/test_mma_whole.py`) the
    tensor-core decode kernel decline such layouts (never read them while dropping the rows), so the plain kernel and
    the Triton gather serve them."""
    import dataclasses

    from kvbackend import codecs
    from kvbackend.codecs.base import CodecState
    from kvbackend.kernels import folded_decode, gather_cuda, mma_decode, unit_encoder

    from kvbackend.frames import lever_layout

    def layout_of(spec):
        codec = codecs.get(spec)
        return codec, lever_layout(codec.layout(Geometry(1, 2, 128, torch.bfloat16), 32), codec.levers)

    recipe = ("quantwm:kchannel=32,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,"
              "prerope=true,cdtype=fp8,outliers=16")
    codec, layout = layout_of(recipe + ",whole=1")
    schemes = kernel_schemes(codec, layout, levers_read=True)
    levers = lever_scheme(codec, layout)
    assert levers.whole == 1
    plain = dataclasses.replace(levers, whole=0, whole_codes=-1, whole_scale=-1, whole_token=-1)
    assert folded_decode.supports_levers(schemes[0], plain) and not folded_decode.supports_levers(schemes[0], levers)
    assert mma_decode.supports_levers(schemes[0], plain, 32, 128) and not mma_decode.supports_levers(
        schemes[0], levers, 32, 128, whole=False)
    assert mma_decode.supports_levers(schemes[0], levers, 32, 128, whole=True)
    assert gather_cuda._levers_ok(plain, 32, 128, 2) and not gather_cuda._levers_ok(levers, 32, 128, 2, whole=False)
    assert gather_cuda._levers_ok(levers, 32, 128, 2, whole=True)
    assert unit_encoder.supports(codec, layout, [CodecState()])
    assert unit_encoder.supports(*layout_of(recipe), [CodecState()])
