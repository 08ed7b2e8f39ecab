"""The fused CPU k-means loops (`kvbackend.fastkmeans`) against the torch path they stand in for.

Lloyd's steps take the torch path's own matrix products, so their results are the same bit for bit; the seeding
sums its distances in another order, so the same picks hold where no draw lands within a rounding of a boundary
(random data here), and the edge cases (coinciding points, distances past float32's range, fewer points than
centroids) are handled alike.
"""
import pytest
import torch

pytest.importorskip("numba")

from kvbackend import fastkmeans, fastquant  # noqa: E402
from kvbackend.codecs import kmeans as km  # noqa: E402


def _both(monkeypatch, fn):
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    off = fn()
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "1")
    return off, fn()


@pytest.fixture(autouse=True)
def _fused_taken(monkeypatch):
    """Counts the calls that reach each fused loop, so every test can check the fused path ran."""
    calls = {"seed": 0, "lloyd": 0}
    seed, lloyd = fastkmeans.seed, fastkmeans.lloyd

    def counted_seed(*args):
        calls["seed"] += 1
        return seed(*args)

    def counted_lloyd(*args):
        calls["lloyd"] += 1
        return lloyd(*args)

    monkeypatch.setattr(fastkmeans, "seed", counted_seed)
    monkeypatch.setattr(fastkmeans, "lloyd", counted_lloyd)
    return calls


@pytest.mark.parametrize("b,n,d,c,repeat", [(64, 64, 128, 32, 1), (9, 37, 24, 5, 3), (16, 20, 16, 24, 1),
                                             (40, 200, 64, 16, 4)])
def test_seeds_match_the_torch_path(monkeypatch, _fused_taken, b, n, d, c, repeat):
    x = torch.randn(b, n, d) * torch.rand(b, 1, 1) * 3
    off, on = _both(monkeypatch, lambda: km.kmeanspp_init(x, c, torch.Generator().manual_seed(11), repeat=repeat))
    assert _fused_taken["seed"] == 1
    assert torch.equal(off, on)


@pytest.mark.parametrize("n,c,iters", [(64, 32, 4), (37, 7, 9), (300, 16, 0), (50, 60, 3)])
@pytest.mark.parametrize("early_stop", [True, False])
def test_lloyd_matches_the_torch_path_bit_for_bit(monkeypatch, _fused_taken, n, c, iters, early_stop):
    x = torch.randn(24, n, 40)
    init = x[:, torch.randperm(n)[: min(c, n)]].clone()
    if c > n:  # more centroids than points: some never get a point and keep their value
        init = torch.cat([init, torch.randn(24, c - n, 40) * 5], 1)
    off, on = _both(monkeypatch, lambda: km.kmeans(x, init, iters, early_stop=early_stop))
    assert _fused_taken["lloyd"] == 1
    assert torch.equal(off.centroids, on.centroids)
    assert torch.equal(off.assign, on.assign)
    assert torch.equal(off.distance, on.distance)
    assert off.iterations == on.iterations
    assert on.iterations <= iters and (early_stop or on.iterations == iters)


def test_lloyd_in_slices_of_points_as_the_torch_path(monkeypatch, _fused_taken):
    """More points than one product takes (`_ROWS`): the slices, and so the products, are the torch path's."""
    monkeypatch.setattr(km, "_ROWS", 48)
    x = torch.randn(8, 130, 32)
    init = x[:, :12].clone()
    off, on = _both(monkeypatch, lambda: km.kmeans(x, init, 6))
    assert _fused_taken["lloyd"] == 1
    assert torch.equal(off.centroids, on.centroids) and torch.equal(off.assign, on.assign)
    assert torch.equal(off.distance, on.distance)


def test_edge_cases_are_handled_alike(monkeypatch, _fused_taken):
    same = torch.ones(8, 64, 16)  # every point one point: after the first pick all weights are 0 (uniform draws)
    far = torch.randn(8, 64, 16)
    far[:, ::7] *= 3e19  # distances past float32's range: draws among the points that far away
    few = torch.randn(8, 16, 64)  # fewer points than centroids
    for x, c in ((same, 8), (far, 8), (few, 24)):
        off, on = _both(monkeypatch, lambda: km.kmeanspp_init(x, c, torch.Generator().manual_seed(3)))
        assert torch.equal(off, on)
    assert _fused_taken["seed"] == 3
    picked = km.kmeanspp_init(far, 8, torch.Generator().manual_seed(3))
    assert (picked.abs().amax(-1) > 1e18).sum(1).min() >= 8 - 1  # all but the first pick are far points


def test_non_finite_points_take_the_torch_path(monkeypatch, _fused_taken):
    x = torch.randn(8, 64, 64)
    x[3, 5, 7] = float("nan")
    init = torch.randn(8, 4, 64)
    off, on = _both(monkeypatch, lambda: km.kmeans(x, init, 3))
    assert _fused_taken["lloyd"] == 0
    assert torch.equal(off.assign, on.assign)
    assert fastkmeans.finite(torch.randn(5000)) and not fastkmeans.finite(torch.tensor([1.0] * 5000 + [float("inf")]))
    assert not fastkmeans.finite(torch.tensor([float("nan")] * 3)[::2])  # strided: the torch check
    half = torch.ones(4096, dtype=torch.bfloat16)
    half[0] = float("nan")  # a NaN in the low half of a 32-bit word: other dtypes never go through the float32 bits
    assert not fastkmeans.finite(half)
    init = torch.randn(8, 4, 64).bfloat16()
    init[2, 1, 3] = float("inf")
    x[3, 5, 7] = 0.0
    off, on = _both(monkeypatch, lambda: km.kmeans(x, init, 3))
    assert _fused_taken["lloyd"] == 0  # non-finite starting centroids: the torch path
    assert torch.equal(off.assign, on.assign)


def test_a_failed_loop_falls_back_to_torch(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiled loop here")

    monkeypatch.setattr(fastkmeans, "_pick", broken)
    monkeypatch.setattr(fastquant, "_broken", [])  # the failure disables the loops for this test only
    x = torch.randn(16, 64, 32)
    init = x[:, :8].clone()
    got = km.kmeans(x, init, 4)
    assert fastquant._broken  # the failure was recorded (and said once in the log)
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    want = km.kmeans(x, init, 4)
    assert torch.equal(got.assign, want.assign) and torch.equal(got.centroids, want.centroids)


def test_equal_distances_go_to_the_first_centroid(monkeypatch, _fused_taken):
    """Duplicate starting centroids tie for every point near them: the first of equals wins, as torch's ``min``
    (centroid 0 and 1 are one point, whose products are the same; 3 and 4 tie as well, though a matrix product
    may round a duplicate column's products apart)."""
    x = torch.randn(12, 64, 32)
    init = x[:, [0, 0, 1, 2, 2, 3]].clone()
    off, on = _both(monkeypatch, lambda: km.kmeans(x, init, 0))
    assert _fused_taken["lloyd"] == 1
    assert torch.equal(off.assign, on.assign)
    assert (on.assign == 0).any() and not (on.assign == 1).any()  # the second of an exact pair never wins
