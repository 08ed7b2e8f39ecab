"""Batched Lloyd's k-means, the torch reference for the Triton kernel.

Each batch entry (one head of one chunk) is an independent problem of N points in D dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbackend import fastkmeans

_ROWS = 4096  # distance rows computed at once, so memory stays O(rows * C), never O(N * C)
_SEED_BLOCK_BYTES = 4 << 20  # points of the rows seeded together on the CPU (k-means++)


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # float32 [B, C, D]
    assign: torch.Tensor  # int64 [B, N]
    iterations: int  # Lloyd steps run (each = assign + update)
    distance: torch.Tensor  # float32 [B, N]: squared distance to the assigned centroid, after the last assignment

    @property
    def objective(self) -> float:
        """Mean squared distance to the assigned centroid (read from the device only when asked)."""
        return float(self.distance.mean())


def assign_nearest(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid per point: (index [B, N], squared distance [B, N])."""
    c_norm = (centroids * centroids).sum(-1)  # [B, C]
    idx, dist = [], []
    for start in range(0, x.shape[1], _ROWS):
        xs = x[:, start : start + _ROWS]
        d = (xs * xs).sum(-1, keepdim=True) - 2 * xs @ centroids.transpose(1, 2) + c_norm.unsqueeze(1)
        best, where = d.min(dim=-1)
        idx.append(where)
        dist.append(best.clamp_min(0))
    return torch.cat(idx, 1), torch.cat(dist, 1)


def random_init(x: torch.Tensor, num_centroids: int, generator: torch.Generator) -> torch.Tensor:
    """C distinct random points per batch entry (with repeats only when N < C)."""
    b, n, _ = x.shape
    if n >= num_centroids:
        order = torch.stack([torch.randperm(n, generator=generator) for _ in range(b)])[:, :num_centroids]
    else:
        order = torch.randint(0, n, (b, num_centroids), generator=generator)
    return torch.gather(x, 1, order.to(x.device).unsqueeze(-1).expand(-1, -1, x.shape[2])).clone()


def kmeanspp_init(x: torch.Tensor, num_centroids: int, generator: torch.Generator, repeat: int = 1,
                  trials: int = 1) -> torch.Tensor:
    """k-means++ seeding: each next centroid is a point drawn with probability ~ squared distance
    to the nearest centroid so far. Far fewer merged clusters than uniform random points.

    Draws are inverse-CDF picks from one uniform per row, so each row's picks depend on its own weights
    and its own uniforms alone. With ``repeat=U``, ``x`` holds U problems of ``B / U`` rows each
    (problem-major) and every problem gets the draws a fresh run on its rows alone would make from the
    same generator state: U chunks seeded alike encode in one batch to the bytes of U separate encodes.

    ``trials`` > 1 is greedy k-means++ (as scikit-learn seeds): each step draws that many candidates the same way and
    keeps the one that leaves the smallest sum of squared distances to the nearest centroid (ties: the first drawn).
    """
    if trials < 1:
        raise ValueError(f"kmeanspp_init: trials={trials} must be at least 1")
    b, n, d = x.shape
    if repeat < 1 or b % repeat:
        raise ValueError(f"kmeanspp_init: {b} rows are not {repeat} problems of equal size")
    first = torch.randint(0, n, (b // repeat,), generator=generator).repeat(repeat).to(x.device)
    # every draw up front, moved to the device once: the steps below run there without a host round trip
    uniforms = torch.rand(max(num_centroids - 1, 0), b // repeat, trials, generator=generator,
                          dtype=torch.float64).repeat(1, repeat, 1).to(x.device)
    if trials == 1 and fastkmeans.enabled(x) and fastkmeans.finite(x):  # fused loops, the same draws
        seeds = fastkmeans.seed(x, first, uniforms[..., 0], num_centroids)
        if seeds is not None:
            return seeds
    # On the CPU, blocks of rows whose points stay in cache run all their steps before the next block (each row's
    # arithmetic is the same, so are its picks: 6x faster for 1024 rows of 64 x 128, one core); a GPU takes all rows
    block = b if x.device.type != "cpu" else max(1, _SEED_BLOCK_BYTES // max(n * d * x.element_size(), 1))
    return torch.cat([_seed_rows(x[at : at + block], first[at : at + block], uniforms[:, at : at + block], num_centroids)
                      for at in range(0, b, block)]) if b else x.new_empty(0, num_centroids, d)


def _seed_rows(x: torch.Tensor, first: torch.Tensor, uniforms: torch.Tensor, num_centroids: int) -> torch.Tensor:
    """`kmeanspp_init`'s steps for some rows, from their first picks and their uniforms ([C-1, B, trials])."""
    b, n, _ = x.shape
    rows = torch.arange(b, device=x.device)
    diff = torch.empty_like(x)  # one buffer for every step: a fresh one per step cost its page faults on the CPU

    def squared_distance(c: torch.Tensor) -> torch.Tensor:  # ((x - c) ** 2).sum(-1), the same operations
        torch.sub(x, c.unsqueeze(1), out=diff)
        return diff.mul_(diff).sum(-1)

    centroids = [x[rows, first]]
    nearest = squared_distance(centroids[0])  # [B, N]
    for step in range(1, num_centroids):
        weights = nearest.double()
        # Distances past float32's range (finite keys beyond about 1e19): draw among the points that far away.
        far = torch.isinf(weights)
        weights = torch.where(far.any(-1, keepdim=True), far.double(), weights)
        # All points already covered (duplicates): fall back to uniform draws.
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, torch.ones_like(weights))
        cdf = weights.cumsum(-1)
        # the first point whose cumulative weight exceeds u * total: never one of weight 0
        picks = torch.searchsorted(cdf, uniforms[step - 1] * cdf[:, -1:], right=True).clamp_max(n - 1)  # [B, trials]
        if picks.shape[1] == 1:
            c = x[rows, picks[:, 0]]
            nearest = torch.minimum(nearest, squared_distance(c))
        else:  # greedy: the candidate that leaves the least potential (float64 sums: ties resolve alike everywhere)
            best_nearest, best_potential, c = None, None, None
            for t in range(picks.shape[1]):
                cand = x[rows, picks[:, t]]
                near = torch.minimum(nearest, squared_distance(cand))
                potential = near.double().sum(-1)  # [B]
                if best_nearest is None:
                    best_nearest, best_potential, c = near, potential, cand
                    continue
                better = potential < best_potential
                best_nearest = torch.where(better.unsqueeze(-1), near, best_nearest)
                best_potential = torch.where(better, potential, best_potential)
                c = torch.where(better.unsqueeze(-1), cand, c)
            nearest = best_nearest
        centroids.append(c)
    return torch.stack(centroids, 1)


def greedy_kmeanspp_init(x: torch.Tensor, num_centroids: int, generator: torch.Generator,
                         repeat: int = 1) -> torch.Tensor:
    """Greedy k-means++ with 2 + floor(ln C) candidates a step (scikit-learn's default count)."""
    return kmeanspp_init(x, num_centroids, generator, repeat, trials=greedy_trials(num_centroids))


def greedy_trials(num_centroids: int) -> int:
    """Candidates a greedy k-means++ step draws: 2 + floor(ln C)."""
    return 2 + int(math.log(max(num_centroids, 1)))


def kmeans(x: torch.Tensor, init: torch.Tensor, max_iters: int, early_stop: bool | None = None) -> KMeansResult:
    """Lloyd's algorithm from ``init`` for at most ``max_iters`` steps; stops early once no
    assignment changes. Empty clusters keep their previous centroid.

    Args:
        x: float32 [B, N, D] points.
        init: float32 [B, C, D] starting centroids (random points, or last chunk's centroids).
        early_stop: test for a step that changed nothing, and stop there. The test reads the device, which a
            CUDA graph capture forbids: there (None: False while capturing, else True) every step runs instead;
            once assignments stop changing a step changes nothing.
    """
    if early_stop is None:
        early_stop = not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if fastkmeans.enabled(x) and fastkmeans.finite(x) and fastkmeans.finite(init):  # fused loops (CPU)
        fused = fastkmeans.lloyd(x, init, max_iters, early_stop, _ROWS)
        if fused is not None:
            return KMeansResult(*fused)
    centroids = init.float().clone()
    b, _, d = x.shape
    c = centroids.shape[1]
    assign, dist = assign_nearest(x, centroids)
    iterations = 0
    for _ in range(max_iters):
        sums = torch.zeros(b, c, d, device=x.device).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, d), x)
        counts = torch.zeros(b, c, device=x.device).scatter_add_(1, assign, torch.ones_like(assign, dtype=torch.float32))
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), centroids)
        iterations += 1
        new_assign, dist = assign_nearest(x, centroids)
        changed = not early_stop or bool((new_assign != assign).any())
        assign = new_assign
        if not changed:
            break
    return KMeansResult(centroids, assign, iterations, dist)
