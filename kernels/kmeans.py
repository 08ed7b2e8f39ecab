"""Batched Lloyd's k-means on the GPU: a fused nearest-centroid kernel plus a scatter update.

The assignment kernel computes ||c||^2 - 2 x.c block by block with `tl.dot` and keeps a running
arg-min, so the N x C distance matrix never exists in memory. The update is two `index_add_`s (on CUDA, a
one-hot product for few centroids, `lloyd_update`: one launch per step). The encoders run fixed steps on CUDA (no
host synchronisation); a CUDA graph of them saved about 2 ms per 32-layer chunk encode but held its memory pool
(712-864 MiB for that shape) for the process's life (perf/NOTES.md, session 26).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbackend.codecs.kmeans import KMeansResult


@triton.jit
def _assign_kernel(x, centroids, c_norm, out, N, C, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   PRECISION: tl.constexpr):
    b = tl.program_id(0)  # problem (head)
    block = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    live = rows < N
    points = tl.load(x + (b * N + rows[:, None]).to(tl.int64) * D + d[None, :], mask=live[:, None], other=0.0)
    best = tl.full((BLOCK_N,), float("inf"), tl.float32)
    best_id = tl.zeros((BLOCK_N,), tl.int32)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        valid = cols < C
        cents = tl.load(centroids + (b * C + cols[:, None]) * D + d[None, :], mask=valid[:, None], other=0.0)
        norms = tl.load(c_norm + b * C + cols, mask=valid, other=float("inf"))
        dist = norms[None, :] - 2.0 * tl.dot(points, tl.trans(cents), input_precision=PRECISION)
        block_best = tl.min(dist, 1)
        block_id = tl.argmin(dist, 1).to(tl.int32) + start
        better = block_best < best
        best = tl.where(better, block_best, best)
        best_id = tl.where(better, block_id, best_id)
    tl.store(out + b * N + rows, best_id, mask=live)


@triton.jit
def _update_kernel(x, assign, old, out, norms, N, C, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """One Lloyd update of a block of centroids of one problem: the mean of the points assigned to each (a one-hot
    product, full float32), or the old centroid where none is, and the new centroids' squared norms."""
    b = tl.program_id(0)  # problem (head)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    valid = cs < C
    acc = tl.zeros((BLOCK_C, D), tl.float32)
    count = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        live = rows < N
        ids = tl.load(assign + b * N + rows, mask=live, other=-1)
        onehot = (ids[None, :] == cs[:, None]).to(tl.float32)  # [BLOCK_C, BLOCK_N]
        points = tl.load(x + (b * N + rows[:, None]).to(tl.int64) * D + d[None, :], mask=live[:, None], other=0.0)
        acc += tl.dot(onehot, points, input_precision="ieee")
        count += tl.sum(onehot, 1)
    at = (b * C + cs[:, None]) * D + d[None, :]
    previous = tl.load(old + at, mask=valid[:, None], other=0.0)
    new = tl.where(count[:, None] > 0, acc / tl.maximum(count, 1.0)[:, None], previous)
    tl.store(out + at, new, mask=valid[:, None])
    tl.store(norms + b * C + cs, tl.sum(new * new, 1), mask=valid)


def _block_c(c: int) -> int:
    return max(16, min(64, triton.next_power_of_2(c)))


def _assign(x: torch.Tensor, centroids: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """`assign_nearest` of contiguous float32 inputs with the centroids' squared norms given: int32 ids [B, N]."""
    b, n, d = x.shape
    c = centroids.shape[1]
    out = torch.empty(b, n, dtype=torch.int32, device=x.device)
    _assign_kernel[(b, triton.cdiv(n, 64))](x, centroids, norms, out, n, c, D=d, BLOCK_N=64, BLOCK_C=_block_c(c),
                                            PRECISION="tf32" if x.is_cuda else "ieee")
    return out


def lloyd_update(x: torch.Tensor, assign: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lloyd update in one launch, no [B, N, C] one-hot tensor: (the new centroids [B, C, D], their squared
    norms [B, C]) from contiguous float32 points [B, N, D], int32 ids [B, N] and the old centroids [B, C, D], kept
    where a centroid has no point. The sums are full float32 (in another order than a matrix product's)."""
    b, n, d = x.shape
    c = centroids.shape[1]
    out = torch.empty_like(centroids)
    norms = torch.empty(b, c, device=x.device)
    _update_kernel[(b, triton.cdiv(c, _block_c(c)))](x, assign, centroids, out, norms, n, c, D=d, BLOCK_N=64,
                                                     BLOCK_C=_block_c(c))
    return out, norms


def assign_nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid ids, int64 [B, N], for float32 points [B, N, D] and centroids [B, C, D]."""
    b, n, d = x.shape
    c = centroids.shape[1]
    if centroids.shape != (b, c, d) or x.device != centroids.device:
        raise ValueError(f"centroids {tuple(centroids.shape)} do not match points {tuple(x.shape)}")
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    x = x.float().contiguous()
    centroids = centroids.float().contiguous()
    return _assign(x, centroids, (centroids * centroids).sum(-1).contiguous()).long()


# On CUDA, up to this many centroids sum their points by a one-hot product (call 2 of session 25: the recipe's 32 per
# head 4x faster than `index_add_`), inside `lloyd_update`'s one launch per step (session 26: two launches per Lloyd
# step instead of about twelve); with more, fewer points share each row, and the product (N x C x D) outgrows the
# atomic adds (qvg with 256 centroids: its whole chunk encode took 1.6x as long)
ONE_HOT_CENTROIDS = 64


def kmeans(x: torch.Tensor, init: torch.Tensor, max_iters: int, early_stop: bool = True) -> KMeansResult:
    """Same contract as `kvbackend.codecs.kmeans.kmeans`, with the assignment step in Triton.

    ``early_stop=False`` runs exactly ``max_iters`` steps with no host synchronisation (the GPU
    encode path; its ``distance`` is NaN, which no encoder reads); once assignments stop changing, further steps
    change nothing. On CUDA the centroid sums of up to `ONE_HOT_CENTROIDS` centroids are a one-hot product in full
    float32 (`lloyd_update`), summed in another order than the reference's.
    On CUDA the distances use TF32 tensor cores, so near-ties may resolve differently from the
    float32 reference.
    """
    x = x.float().contiguous()
    centroids = init.float().clone()
    b, _, d = x.shape
    c = centroids.shape[1]
    assign = assign_nearest(x, centroids)
    iterations = 0
    if x.is_cuda and c <= ONE_HOT_CENTROIDS:  # two launches per step: the fused update, then the assignment
        assign = assign.to(torch.int32)
        centroids = centroids.contiguous()
        for _ in range(max_iters):
            centroids, norms = lloyd_update(x, assign, centroids)
            iterations += 1
            new_assign = _assign(x, centroids, norms)
            changed = not early_stop or bool((new_assign != assign).any())
            assign = new_assign
            if not changed:
                break
        assign = assign.long()
    else:
        offsets = (torch.arange(b, device=x.device) * c)[:, None]
        for _ in range(max_iters):
            flat = (assign + offsets).reshape(-1)
            sums = torch.zeros(b * c, d, device=x.device).index_add_(0, flat, x.reshape(-1, d))
            counts = torch.zeros(b * c, device=x.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
            centroids = torch.where(counts.view(b, c, 1) > 0, sums.view(b, c, d) / counts.view(b, c, 1).clamp_min(1),
                                    centroids)
            iterations += 1
            new_assign = assign_nearest(x, centroids)
            if early_stop and not bool((new_assign != assign).any()):
                assign = new_assign
                break
            assign = new_assign
    if not early_stop:  # the encoders' fixed-step path reads no distance: NaN, not a pass over every point
        return KMeansResult(centroids, assign, iterations, x.new_full(assign.shape, float("nan")))
    nearest = torch.gather(centroids, 1, assign.unsqueeze(-1).expand(-1, -1, d))
    return KMeansResult(centroids, assign, iterations, ((x - nearest) ** 2).sum(-1))
