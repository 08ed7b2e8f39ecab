"""PSAC's basis solvers: LAPACK's eigh on the host and block subspace iteration on the moment's device."""

import pytest
import torch

from kvbackend import psac
from kvbackend.psac import principal_directions, subspace_directions


def _moments(heads: int = 24, d: int = 64, rank: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments U diag(w) U^T with known spectra: even heads with a gap after the ``rank`` leading eigenvalues,
    odd heads decaying geometrically (ratio 0.9: no gap, as query moments often are), one zero moment (no
    queries seen) and one of rank one. Returns the moments and which heads have the gap."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))
    steps = torch.arange(d, dtype=torch.float64)
    w = torch.where(torch.arange(heads).view(-1, 1) % 2 == 0,
                    torch.where(steps < rank, 10.0 - steps, 0.5 * 0.95 ** steps), 8.0 * 0.9 ** steps)
    w[1] = 0
    w[3, 1:] = 0
    m = ((u * w.unsqueeze(1)) @ u.transpose(1, 2)).float()
    gap = torch.arange(heads) % 2 == 0
    return (m + m.transpose(1, 2)) / 2, gap


def _captured(basis: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    u = basis.double()
    return torch.einsum("hdr,hde,her->h", u, m.double(), u)


@pytest.mark.parametrize("capturing", [False, True])  # the Ritz step by eigh, or by the iteration a graph records
@pytest.mark.parametrize("d,rank", [(64, 4), (48, 3), (16, 8)])
def test_subspace_iteration_captures_what_the_leading_eigenvectors_capture(d, rank, capturing, monkeypatch):
    monkeypatch.setattr(psac, "_capturing", lambda t: capturing)
    m, gap = _moments(d=d, rank=rank)
    basis = subspace_directions(m, rank)
    assert basis.shape == (m.shape[0], d, rank) and basis.dtype == torch.float32
    assert torch.isfinite(basis).all()
    assert torch.allclose(basis.transpose(1, 2) @ basis, torch.eye(rank).expand(m.shape[0], rank, rank), atol=1e-5)
    best = torch.linalg.eigvalsh(m.double())[:, -rank:].sum(-1)
    got = _captured(basis, m)
    some = best > 0
    assert torch.all(got[some] >= 0.999 * best[some]) and torch.all(got <= best * (1 + 1e-5) + 1e-12)  # float32 basis
    exact = principal_directions(m, rank, "eigh")
    proj = lambda u: u.double() @ u.double().transpose(1, 2)  # noqa: E731
    assert torch.allclose(proj(basis)[gap], proj(exact)[gap], atol=1e-4)  # a clear gap: the same subspace


def test_auto_solves_on_the_host_on_a_cpu_and_refuses_unknown_methods():
    m, _ = _moments(heads=4)
    assert torch.equal(principal_directions(m, 4), principal_directions(m, 4, "eigh"))
    with pytest.raises(ValueError, match="method"):
        principal_directions(m, 4, "power")


def _failing_at(index: int):
    """`torch.linalg.cholesky_ex` whose factorization of matrix ``index`` "fails" at every step."""
    real = torch.linalg.cholesky_ex

    def failing(a):
        factor, info = real(a)
        info = info.clone()
        info[index] = 1
        return factor, info

    return failing


def test_a_failed_factorization_falls_back_to_lapack_for_that_matrix(monkeypatch):
    m, _ = _moments(heads=6)
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", _failing_at(3))
    basis = subspace_directions(m, 4)
    assert torch.equal(basis[3], principal_directions(m[3:4], 4, "eigh")[0])
    monkeypatch.setattr(torch.linalg, "cholesky_ex", real)
    assert torch.equal(basis[[0, 1, 2, 4, 5]], subspace_directions(m, 4)[[0, 1, 2, 4, 5]])


def test_inside_a_graph_capture_a_failed_factorization_keeps_unit_directions(monkeypatch):
    """Where nothing may wait for the device (a CUDA graph capture), a matrix whose factorization fails is not
    sent to LAPACK: it keeps the first unit directions (finite and orthonormal), and the other matrices are
    unchanged."""
    m, _ = _moments(heads=6)
    monkeypatch.setattr(psac, "_capturing", lambda t: True)
    clean = subspace_directions(m, 4)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", _failing_at(3))
    basis = subspace_directions(m, 4)
    assert torch.equal(basis[3], torch.eye(64, 4))
    assert torch.equal(basis[[0, 1, 2, 4, 5]], clean[[0, 1, 2, 4, 5]])


def test_the_codec_keeps_its_psac_gain_with_the_device_solver(monkeypatch):
    """PSAC through the codec, its basis from subspace iteration (what a GPU runs) against eigh: the
    query-weighted key error it leaves is within 1% of eigh's."""
    from kvbackend import Geometry, codecs
    from kvbackend.tools.reconstruct import reconstruct_sequence

    geometry = Geometry(1, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(0)
    directions = torch.randn(4, 64, generator=gen)
    queries = torch.randn(6, 96, 64, generator=gen) * 0.2 + (torch.randn(6, 96, 4, generator=gen) * 3) @ directions
    k, v = torch.randn(96, 2, 64, generator=gen), torch.randn(96, 2, 64, generator=gen)
    spec = "kivi:bits=2,group=16,psac=4"

    def weighted_error(rec):
        e = (rec.k - k).transpose(0, 1)  # [H, T, D]
        return float((e @ directions.T).square().mean())

    plain = reconstruct_sequence(codecs.get("kivi:bits=2,group=16"), k, v, geometry, 16, 32, queries=queries)
    exact = reconstruct_sequence(codecs.get(spec), k, v, geometry, 16, 32, queries=queries)
    real = psac.principal_directions
    solved = []

    def device_solver(m, r, method="auto"):
        solved.append(m.shape[0])
        return real(m, r, "subspace")

    monkeypatch.setattr(psac, "principal_directions", device_solver)
    device = reconstruct_sequence(codecs.get(spec), k, v, geometry, 16, 32, queries=queries)
    assert solved and all(n == 2 for n in solved)  # the device solver served every chunk's basis
    assert weighted_error(device) < 0.25 * weighted_error(plain)
    assert weighted_error(device) <= 1.01 * weighted_error(exact)
    assert device.stored_bytes == exact.stored_bytes
