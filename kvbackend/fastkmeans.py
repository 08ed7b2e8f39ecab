"""Fused CPU loops for k-means++ seeding and Lloyd's k-means, compiled with numba where it is installed.

The torch k-means (`kvbackend.codecs.kmeans`) runs each step as a dozen whole-batch tensor passes: on a CPU with
small problems (a 64-token storage page of one head: 64 points, 32 centroids) memory traffic and per-call
overhead, not arithmetic, bound it. Here each row (one head of one chunk) runs every step in one compiled loop
while its points stay in cache.

Same algorithm, same draws, another summation order: the torch path sums each squared distance with its own
vectorized reduction and the centroid products in a BLAS matrix product; these loops sum channel by channel. So a
distance may differ in its last bits, and where two candidates are that close (a draw landing within a rounding
of a cumulative-weight boundary, two centroids at the same distance but for rounding) a pick or an assignment may
go the other way. Either result is a valid seeding or clustering; `tests/test_fastkmeans.py` holds the two paths
to the same picks, assignments and centroids on data without such ties, and to the same edge-case handling
(coinciding points, distances past float32's range, fewer points than centroids).

Used for finite float32 CPU inputs when `kvbackend.fastquant`'s loops are usable (numba imports, its JIT is on,
``KVBACKEND_FASTQUANT`` is not off); the greedy seeding (several candidates a step) stays on torch. The loops
release the GIL, so the adapters' worker threads run them in parallel.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbackend import fastquant

MIN_VALUES = 1 << 12  # below this, the torch path's few calls cost less than a compiled call's setup


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused loops take points ``x`` [B, N, D] (the caller checks they are finite, `finite`)."""
    return (fastquant._usable() and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3
            and x.numel() >= MIN_VALUES and not x.requires_grad)


def finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite (non-finite points take the torch path: its NaN handling
    is its own), in one compiled pass over the bits where it can (``torch.isfinite`` writes a mask first: 3 ms of
    a storage page's 16)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and fastquant._usable():
        done = fastquant._run(_finite_f32, x.reshape(-1).view(torch.int32).numpy())
        if done is not fastquant._FAILED:
            return bool(done)
    return bool(torch.isfinite(x).all())


if fastquant.numba is not None:
    _jit = fastquant._jit

    @_jit
    def _finite_f32(x):  # x float32 bits (int32), flat: no NaN or Inf
        special = np.int32(0)
        for j in range(x.shape[0]):
            special |= np.int32((x[j] & np.int32(0x7F800000)) == np.int32(0x7F800000))
        return special == 0

    @_jit
    def _distances_to(xt, ck, out):  # xt float32 [D, N] (a row's points, channel-major), ck [D] -> out [N]
        d, n = xt.shape
        for i in range(n):
            out[i] = 0.0
        for k in range(d):
            c = ck[k]
            for i in range(n):
                t = xt[k, i] - c
                out[i] += t * t

    @_jit
    def _seed(x, first, uniforms, out):
        # x float32 [B, N, D]; first int64 [B]; uniforms float64 [C-1, B]; out float32 [B, C, D]
        b, n, d = x.shape
        c = out.shape[1]
        xt = np.empty((d, n), np.float32)
        nearest = np.empty(n, np.float32)
        dist = np.empty(n, np.float32)
        cdf = np.empty(n, np.float64)
        for r in range(b):
            for i in range(n):
                for k in range(d):
                    xt[k, i] = x[r, i, k]
            pick = first[r]
            out[r, 0, :] = x[r, pick, :]
            _distances_to(xt, out[r, 0], nearest)
            for step in range(1, c):
                far = False  # distances past float32's range: draw among the points that far away
                for i in range(n):
                    if np.isinf(nearest[i]):
                        far = True
                total = 0.0
                for i in range(n):
                    if far:
                        w = 1.0 if np.isinf(nearest[i]) else 0.0
                    else:
                        w = np.float64(nearest[i])
                    total += w
                    cdf[i] = total
                if not total > 0:  # every point already a centroid (duplicates): uniform draws
                    for i in range(n):
                        cdf[i] = i + 1.0
                target = uniforms[step - 1, r] * cdf[n - 1]
                pick = n - 1  # the first point whose cumulative weight exceeds the target (never one of weight 0)
                for i in range(n):
                    if cdf[i] > target:
                        pick = i
                        break
                out[r, step, :] = x[r, pick, :]
                _distances_to(xt, out[r, step], dist)
                for i in range(n):
                    if dist[i] < nearest[i]:
                        nearest[i] = dist[i]

    @_jit
    def _pick(xnorm, dots, cnorm, assign, dist):
        # xnorm [B, N], dots [B, N, C] (x.c, a matrix product), cnorm [B, C], all float32 -> the nearest centroid
        # per point (the first of equals) by |x|^2 - 2 x.c + |c|^2 (float32, in the torch path's order), into
        # assign [B, N] (int64) and dist [B, N]; returns whether any assignment changed
        b, n, c = dots.shape
        changed = False
        for r in range(b):
            for i in range(n):
                best = np.float32(np.inf)
                where = 0
                for j in range(c):
                    e = np.float32(xnorm[r, i] - np.float32(2.0) * dots[r, i, j]) + cnorm[r, j]
                    if e < best:
                        best = e
                        where = j
                if where != assign[r, i]:
                    changed = True
                assign[r, i] = where
                dist[r, i] = best if best > 0 else np.float32(0.0)
        return changed

    @_jit
    def _update(x, assign, cents):
        # the means of each row's clusters (float32 sums in point order, as a scatter-add makes them) into cents
        # [B, C, D]; a centroid without points keeps its value
        b, n, d = x.shape
        c = cents.shape[1]
        sums = np.empty((c, d), np.float32)
        counts = np.empty(c, np.float32)
        for r in range(b):
            sums[:, :] = 0.0
            counts[:] = 0.0
            for i in range(n):
                j = assign[r, i]
                counts[j] += np.float32(1.0)
                for k in range(d):
                    sums[j, k] += x[r, i, k]
            for j in range(c):
                if counts[j] > 0:
                    for k in range(d):
                        cents[r, j, k] = sums[j, k] / counts[j]


def seed(x: torch.Tensor, first: torch.Tensor, uniforms: torch.Tensor, num_centroids: int) -> torch.Tensor | None:
    """k-means++ seeds [B, C, D] of points ``x`` [B, N, D] from each row's first pick ``first`` [B] and its uniforms
    ``uniforms`` [C-1, B] (float64), as `kvbackend.codecs.kmeans.kmeanspp_init` draws them; None where the loops
    cannot serve (then the torch path does)."""
    b, n, d = x.shape
    out = torch.empty(b, num_centroids, d, dtype=torch.float32)
    done = fastquant._run(_seed, x.contiguous().numpy(), first.to(torch.int64).contiguous().numpy(),
                          uniforms.to(torch.float64).contiguous().numpy(), out.numpy())
    return None if done is fastquant._FAILED else out


def lloyd(x: torch.Tensor, init: torch.Tensor, max_iters: int, early_stop: bool, rows: int
          ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
    """Lloyd's k-means of points ``x`` [B, N, D] from ``init`` [B, C, D]: (centroids [B, C, D], assignments int64
    [B, N], steps run, squared distances [B, N]) as `kvbackend.codecs.kmeans.kmeans` returns them, the distances'
    products taken ``rows`` points at a time as it takes them (so the same products, bit for bit); None where the
    loops cannot serve."""
    b, n, _ = x.shape
    x = x.contiguous()
    cents = init.to(torch.float32).clone().contiguous()
    xnorm = (x * x).sum(-1)
    assign = torch.full((b, n), -1, dtype=torch.int64)
    dist = torch.empty(b, n, dtype=torch.float32)

    def step() -> bool | None:  # the nearest centroids, whether any changed (None: the loops failed)
        cnorm = (cents * cents).sum(-1)
        changed = False
        for start in range(0, n, rows):
            xs = x[:, start : start + rows]
            got = fastquant._run(_pick, xnorm[:, start : start + rows].contiguous().numpy(),
                                 (xs @ cents.transpose(1, 2)).contiguous().numpy(), cnorm.numpy(),
                                 assign[:, start : start + rows].numpy(), dist[:, start : start + rows].numpy())
            if got is fastquant._FAILED:
                return None
            changed |= bool(got)
        return changed

    if step() is None:
        return None
    steps = 0
    for _ in range(max_iters):
        if fastquant._run(_update, x.numpy(), assign.numpy(), cents.numpy()) is fastquant._FAILED:
            return None
        steps += 1
        changed = step()
        if changed is None:
            return None
        if early_stop and not changed:
            break
    return cents, assign, steps, dist

