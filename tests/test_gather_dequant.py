"""gather_dequant kernel vs the torch reference decode (Triton interpreter on CPU)."""

import pytest
import torch

from kvbackend.scheme import kernel_schemes
from kernel_cases import filled_cache

triton = pytest.importorskip("triton")

CASES = [  # (codec, head_dim, page_size, lengths)
    ("qvg", 64, 16, [45, 70]),
    ("qvg-pro", 128, 16, [33]),
    ("qvg:kchannel=8,group=32", 64, 16, [45, 30]),
    ("kivi:bits=2,group=16", 64, 16, [70, 5, 40]),
    ("kivi:bits=4,group=32", 128, 64, [150]),
    ("kivi:bits=3,group=32", 64, 32, [90, 7]),  # 3-bit codes, 8 in 3 bytes
    ("qvg:bits=3,kchannel=16,group=32", 128, 16, [45]),
    ("rtn:bits=4,group=32,symmetric=true,scale=fp8", 64, 64, [130, 20]),
    ("rtn:bits=8,group=64,scale=bf16", 64, 16, [37]),
    ("fp8", 64, 16, [50]),
    ("identity", 128, 16, [40, 3]),
    ("qvg:cdtype=fp8", 64, 16, [45, 30]),
    ("qvg:centroids=8,stages=2,kchannel=8,group=32,cdtype=fp8", 64, 16, [37]),
]


def reference(cache, ids, layer):
    reads = [cache.read(rid, layer) for rid in ids]
    return torch.cat([r[0] for r in reads]), torch.cat([r[1] for r in reads])


@pytest.mark.parametrize("codec,head_dim,page_size,lengths", CASES)
def test_matches_reference(codec, head_dim, page_size, lengths):
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache(codec, head_dim, page_size, lengths)
    layer = 1
    plan = cache.plan(ids, layer)
    assert plan.num_tokens == sum(lengths)
    total = sum(lengths)
    poison = (torch.full((total, 2, head_dim), float("nan"), dtype=torch.bfloat16, device=cache.dense.data.device),
              torch.full((total, 2, head_dim), float("nan"), dtype=torch.bfloat16, device=cache.dense.data.device))
    k, v = gather_dequant(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                          kernel_schemes(cache.codec, cache.layout), plan, out=poison)
    rk, rv = reference(cache, ids, layer)
    assert not torch.isnan(k).any() and not torch.isnan(v).any()  # every element written
    # Both sides round one float32 reconstruction to bf16; summation order may differ by 1 bf16 ulp (2^-8 relative).
    for got, want in ((k, rk), (v, rv)):
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6)


@pytest.mark.parametrize("codec", ["rtn:bits=2,group=64,scale=fp8", "qvg", "kivi:bits=2,group=16",
                                   "rtn:bits=4,group=32,symmetric=true,scale=fp16"])
def test_unpack_variants_are_bit_identical(codec):
    """Every unpack variant (broadcast words or per-element words; int-to-float conversion or the
    2^23 mantissa trick) and warp count writes the same bits: the codes are exact either way."""
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache(codec, 64, 16, [45, 19], seed=3)
    plan = cache.plan(ids, 0)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
            kernel_schemes(cache.codec, cache.layout), plan)
    base_k, base_v = gather_dequant(*args, backend="triton")
    rk, _ = reference(cache, ids, 0)
    assert torch.all((base_k.float() - rk.float()).abs() <= rk.float().abs() * 2**-7 + 1e-6)
    for unpack, warps in ((1, 4), (2, 2), (3, 8)):
        k, v = gather_dequant(*args, unpack=unpack, num_warps=warps)
        assert torch.equal(k.view(torch.int16), base_k.view(torch.int16)), (unpack, warps)
        assert torch.equal(v.view(torch.int16), base_v.view(torch.int16)), (unpack, warps)


def test_backend_gather_through_cache():
    cache, ids = filled_cache("qvg", 64, 16, [50, 21], backend="triton")
    plan = cache.plan(ids, 0)
    k, v = cache.gather(plan, 0)
    rk, rv = reference(cache, ids, 0)
    assert torch.allclose(k.float(), rk.float(), rtol=2**-7, atol=1e-6)


def test_rejects_bad_input():
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache("qvg", 64, 16, [20])
    plan = cache.plan(ids, 0)
    schemes = kernel_schemes(cache.codec, cache.layout)
    with pytest.raises(ValueError, match="uint8"):
        gather_dequant(cache.packed.pages[0].float(), cache.packed.codebooks[0], cache.dense.data[0], schemes, plan)
    with pytest.raises(ValueError, match="dense pages"):
        gather_dequant(cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0, :, 0], schemes, plan)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], schemes, plan)
    with pytest.raises(ValueError, match="unpack must be one of"):
        gather_dequant(*args, unpack=4)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        gather_dequant(*args, num_warps=6)


def test_default_warps_by_layout():
    """Eight warps a program for plain group layouts, four where centroid stages add a product per page."""
    from kvbackend import Geometry, codecs
    from kvbackend.kernels.gather_dequant import default_warps

    def schemes(spec):
        codec = codecs.get(spec)
        return kernel_schemes(codec, codec.layout(Geometry(1, 2, 64, torch.bfloat16), 16))

    assert default_warps(*schemes("rtn:bits=2,group=64,scale=fp8")) == 8
    assert default_warps(*schemes("kivi:bits=2,group=16")) == 8
    assert default_warps(*schemes("qvg")) == 4


@pytest.mark.parametrize("codec", ["qvg:centroids=8,kchannel=8,group=32", "qvg:kchannel=8,group=32"])
def test_corrupted_centroid_ids_add_nothing(codec):
    """A centroid id past the stage's C (a corrupted page) must not read past the codebook: its token's row gets no
    centroid, whether the kernel gathers rows (C < 16) or takes a one-hot product. Every other row is unchanged, and
    each changed row differs by exactly one centroid row of its head."""
    from kvbackend.kernels.gather_dequant import gather_dequant

    cache, ids = filled_cache(codec, 64, 16, [45, 30], seed=7)
    layer = 1
    plan = cache.plan(ids, layer)
    pages, books = cache.packed.pages[layer], cache.packed.codebooks[layer]
    schemes = kernel_schemes(cache.codec, cache.layout)
    before, _ = gather_dequant(pages, books, cache.dense.data[layer], schemes, plan, backend="triton")
    field = cache.layout.page.fields["k_assign"]
    stages, P, H = field.shape
    C = cache.layout.codebook.fields["k_centroids"].shape[2]
    from kvbackend.batch import PACKED
    used = sorted({int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED})
    assert used
    corrupted = pages.clone()
    for p in used:  # stage 0's ids of head 0 in every packed page: C (just past) and 255
        ids_view = corrupted[p, field.offset:field.offset + P * H].view(P, H)
        ids_view[::2, 0] = C
        ids_view[1::2, 0] = 255
    after, _ = gather_dequant(corrupted, books, cache.dense.data[layer], schemes, plan, backend="triton")
    assert torch.isfinite(after.float()).all()
    changed = (after != before).any(dim=-1)
    assert changed[:, 0].sum() > 0 and not changed[:, 1:].any()  # only head 0's rows, and some of them
    cf = cache.layout.codebook.fields["k_centroids"]
    cents = books[:, cf.offset:cf.offset + cf.nbytes].view(torch.bfloat16).view(-1, stages, H, C, 64)[:, 0, 0].float()
    diff = (before.float() - after.float())[changed[:, 0], 0]  # [rows, D]
    err = (diff[:, None, None, :] - cents[None]).abs().amax(-1).flatten(1).amin(-1)  # the nearest centroid row
    assert float(err.max()) <= 2**-6 * float(before.float().abs().max()), err.max()
