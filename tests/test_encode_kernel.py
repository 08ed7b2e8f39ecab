"""Encode and k-means kernels vs the torch reference codecs."""

import pytest
import torch

from kvbackend import Geometry, codecs
from kvbackend.codecs import kmeans as reference_kmeans
from kvbackend.codecs.base import CodecState
from kvbackend.scheme import kernel_schemes
from kernel_cases import DEVICE, filled_cache

triton = pytest.importorskip("triton")

CODECS = ["rtn:bits=2,group=32", "rtn:bits=4,group=16,symmetric=true,scale=fp8", "kivi:bits=2,group=16",
          "kivi:bits=4,group=8,scale=bf16", "qvg", "qvg-pro", "qvg:symmetric=true,scale=fp32",
          "rtn:bits=8,group=64,scale=fp8", "rtn:bits=2,group=64,scale=fp16",
          "kivi:bits=2,group=16,kbits=3", "rtn:bits=3,group=32,symmetric=true", "qvg:bits=3"]  # 8 codes in 3 bytes


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bit_exact_for_same_assignments(spec, head_dim):
    from kvbackend.kernels.encode import encode_into_pages

    geometry = Geometry(1, 3, head_dim, torch.bfloat16)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 16)
    # channels spanning four orders of magnitude exercise subnormal fp8 scales and rounding up
    k = (torch.randn(48, 3, head_dim) * torch.logspace(-3, 1, head_dim)).bfloat16()
    v = torch.randn(48, 3, head_dim).bfloat16()
    chunk = codec.encode(k, v, layout, CodecState())
    k_scheme, v_scheme = kernel_schemes(codec, layout)
    pages = torch.full((5, layout.page_bytes), 0, dtype=torch.uint8, device=DEVICE)
    ids = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    for prefix, x, scheme in (("k", k, k_scheme), ("v", v, v_scheme)):
        extra = ()
        if scheme.stages:
            assign = layout.page.view(chunk.pages, f"{prefix}_assign")  # [pages, S, P, H]
            extra = (assign.permute(1, 0, 2, 3).reshape(scheme.stages, 48, 3).int().to(DEVICE),
                     layout.codebook.view(chunk.codebook, f"{prefix}_centroids").to(DEVICE))
        encode_into_pages(x.to(DEVICE).contiguous(), scheme, pages, ids, *extra)
    assert torch.equal(pages[ids.long()].cpu(), chunk.pages)


@pytest.mark.parametrize("spec", ["rtn:bits=2,group=32,scale=fp8", "kivi:bits=2,group=16"])
def test_bit_exact_where_a_group_minimum_is_a_signed_zero(spec):
    """Groups whose smallest value is -0.0 (or +0.0 beside -0.0) store the same zero as the reference (+0)."""
    from kvbackend.kernels.encode import encode_into_pages

    geometry = Geometry(1, 2, 64, torch.bfloat16)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 16)
    k = torch.rand(32, 2, 64).bfloat16()  # non-negative: the minima are the zeros below
    k[:, :, ::5] = -0.0
    k[::2, :, ::7] = 0.0
    v = k.clone()
    chunk = codec.encode(k, v, layout, CodecState())
    k_scheme, v_scheme = kernel_schemes(codec, layout)
    pages = torch.zeros((2, layout.page_bytes), dtype=torch.uint8, device=DEVICE)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for x, scheme in ((k, k_scheme), (v, v_scheme)):
        encode_into_pages(x.to(DEVICE).contiguous(), scheme, pages, ids)
    assert torch.equal(pages.cpu(), chunk.pages)
    zeros = layout.page.view(chunk.pages, "k_zeros")
    assert not torch.signbit(zeros.float()).any()  # one zero: +0


def test_assign_matches_reference():
    from kvbackend.kernels.kmeans import assign_nearest, kmeans

    x = torch.randn(3, 300, 64)
    centroids = x[:, :20].clone()
    want, _ = reference_kmeans.assign_nearest(x, centroids)
    got = assign_nearest(x.to(DEVICE), centroids.to(DEVICE)).cpu()
    dist = torch.cdist(x.double(), centroids.double()) ** 2
    chosen, best = dist.gather(-1, got.long().unsqueeze(-1)).squeeze(-1), dist.amin(-1)
    # On the GPU the distance products run on tensor cores with tf32 operands (10-bit mantissa): a
    # near-tie may go either way, a clearly farther centroid never. The interpreter computes in fp32.
    assert torch.all(chosen - best <= 2e-3 * (x.double().norm(dim=-1) ** 2 + best))
    assert float((got != want).float().mean()) < 0.02
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    points = torch.randn(2, 500, 32)
    init = reference_kmeans.kmeanspp_init(points, 16, torch.Generator().manual_seed(0))
    ref = reference_kmeans.kmeans(points, init, 5)
    got = kmeans(points.to(DEVICE), init.to(DEVICE), 5)
    assert got.objective == pytest.approx(ref.objective, rel=1e-4 if DEVICE == "cpu" else 1e-2)
    if DEVICE == "cpu":
        assert got.iterations == ref.iterations


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=16", "rtn:bits=4,group=32,scale=fp8", "fp8", "identity",
                                  ("kivi:bits=2,group=16", "rtn:bits=4,group=32,scale=fp8")])  # a per-layer plan
def test_cache_with_triton_backend_stores_the_same_bytes(spec):
    torch_cache, _ = filled_cache(spec, 64, 16, [70, 45], backend="torch")
    triton_cache, _ = filled_cache(spec, 64, 16, [70, 45], backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(torch_cache.packed.pages, triton_cache.packed.pages))


def test_qvg_through_triton_backend():
    torch_cache, ids = filled_cache("qvg", 64, 16, [70], backend="torch")
    triton_cache, _ = filled_cache("qvg", 64, 16, [70], backend="triton")
    gen = torch.Generator().manual_seed(0)  # filled_cache's draws: the keys of each layer, then its values
    for layer in range(2):
        exact = (torch.randn(70, 2, 64, generator=gen) * 2).to(torch.bfloat16).float()
        torch.randn(70, 2, 64, generator=gen)
        want = torch_cache.read(ids[0], layer)[0].float().cpu()
        got = triton_cache.read(ids[0], layer)[0].float().cpu()
        same = torch.isclose(got, want, rtol=2**-7, atol=1e-3).all(-1)  # [tokens, heads]
        if DEVICE == "cpu":  # the same k-means steps on the same data: same reconstruction up to bf16 rounding
            assert same.all()
        else:
            # CUDA's TF32 distances and its centroid sums (another order than the reference's) may resolve a
            # near-tie the other way: a few rows then take another centroid, and the error must stay the same
            assert same.float().mean() >= 0.9
            err = [float((x - exact).norm() / exact.norm()) for x in (got, want)]
            assert err[0] == pytest.approx(err[1], rel=0.02)
    assert triton_cache.page_table(ids[0]).states[0].centroids["k"].shape == (1, 2, 16, 64)


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=16,kclip=true,vclip=true", "qvg:clip=true"])
def test_options_the_kernel_lacks_encode_through_the_reference(spec):
    """A cache on the Triton backend whose codec has options the encode kernel does not implement
    stores exactly the reference encoder's bytes (the kernel would silently use min/max steps)."""
    from kernel_cases import filled_cache

    from kvbackend.codecs.base import CodecState

    cache, ids = filled_cache(spec, 64, 16, [40], backend="triton", layers=1)
    assert cache.backend.name == "triton" and not cache.codec.kernel_encodes
    table = cache.page_table(ids[0])
    dense_like = cache.read(ids[0], 0)  # reconstruction of the packed chunk + the dense tail
    gen = torch.Generator().manual_seed(0)  # the same draws filled_cache made
    k = (torch.randn(40, 2, 64, generator=gen) * 2).to(torch.bfloat16)
    v = torch.randn(40, 2, 64, generator=gen).to(torch.bfloat16)
    chunk = cache.codec.encode(k[:32], v[:32], cache.layout, CodecState())
    assert torch.equal(cache.packed.pages[0][table.packed].cpu(), chunk.pages.cpu())
    assert dense_like[0].shape[0] == 40


@pytest.mark.parametrize("b,n,c,d", [(3, 37, 5, 16), (2, 130, 32, 64), (4, 64, 20, 32), (1, 200, 64, 128)])
def test_lloyd_update_kernel_matches_the_torch_update(b, n, c, d):
    """`lloyd_update` (one launch: one-hot sums, counts, means or the old centroid, squared norms) against the
    update in torch on odd shapes, the last centroid given no point (it keeps its place)."""
    from kvbackend.kernels.kmeans import lloyd_update

    gen = torch.Generator().manual_seed(b * n + c)
    x = torch.randn(b, n, d, generator=gen) * 3
    assign = torch.randint(0, c - 1, (b, n), generator=gen, dtype=torch.int32)
    old = torch.randn(b, c, d, generator=gen)
    onehot = (assign.long().unsqueeze(-1) == torch.arange(c)).double()
    counts = onehot.sum(1).unsqueeze(-1)
    want = torch.where(counts > 0, (onehot.transpose(1, 2) @ x.double()) / counts.clamp_min(1), old.double())
    got, norms = lloyd_update(x.to(DEVICE), assign.to(DEVICE), old.to(DEVICE))
    assert torch.allclose(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, -1].cpu(), old[:, -1])
    assert torch.allclose(norms.cpu().double(), (got.cpu().double() ** 2).sum(-1), rtol=1e-5)
