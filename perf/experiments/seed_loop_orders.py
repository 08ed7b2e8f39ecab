"""k-means++ seeding loop orders on one core (#20's CPU set): the distance loop of `fastkmeans._seed` as today
(channel-major, vectorised over points) against row-major, row-major with fastmath reassociation, eight accumulators
and blocks of 16 points; 128 rows of 64 points of 128 channels, 32 centroids. Each variant's picks are compared with
today's.

    taskset -c 0 .venv/bin/python -P perf/experiments/seed_loop_orders.py
"""

from __future__ import annotations

import sys
import time

import numba
import numpy as np
import torch

sys.path.insert(0, ".")
from kvbackend import fastkmeans  # noqa: E402

ROWS, POINTS, DIM, CENTROIDS = 128, 64, 128, 32
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # no nnan/ninf: the seeding tests infinite distances


def _row_major_loop(x, r, c, out):
    for i in range(x.shape[1]):
        acc = np.float32(0.0)
        for k in range(x.shape[2]):
            t = x[r, i, k] - c[k]
            acc += t * t
        out[i] = acc


_row_major = numba.njit(nogil=True)(_row_major_loop)
_row_major_fastmath = numba.njit(nogil=True, fastmath=FASTMATH)(_row_major_loop)  # the same loop, sums reassociated


@numba.njit(nogil=True)
def _eight_accumulators(x, r, c, out):
    for i in range(x.shape[1]):
        acc = np.zeros(8, np.float32)
        for k in range(0, x.shape[2], 8):
            for j in range(8):
                t = x[r, i, k + j] - c[k + j]
                acc[j] += t * t
        out[i] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@numba.njit(nogil=True)
def _blocks_of_16(x, r, c, out):
    n, d = x.shape[1], x.shape[2]
    acc = np.empty(16, np.float32)
    for i0 in range(0, n, 16):
        m = min(16, n - i0)
        acc[:] = 0.0
        for k in range(d):
            for j in range(m):
                t = x[r, i0 + j, k] - c[k]
                acc[j] += t * t
        out[i0 : i0 + m] = acc[:m]


def seeding(distances):
    """`fastkmeans._seed`'s draws (finite points only) around another distance loop ``distances(x, r, c, out)``."""
    @numba.njit(nogil=True)
    def run(x, first, uniforms, out):
        n, c = x.shape[1], out.shape[1]
        nearest = np.empty(n, np.float32)
        dist = np.empty(n, np.float32)
        cdf = np.empty(n, np.float64)
        for r in range(x.shape[0]):
            out[r, 0, :] = x[r, first[r], :]
            distances(x, r, out[r, 0], nearest)
            for step in range(1, c):
                total = 0.0
                for i in range(n):
                    total += np.float64(nearest[i])
                    cdf[i] = total
                target = uniforms[step - 1, r] * cdf[n - 1]
                pick = n - 1
                for i in range(n):
                    if cdf[i] > target:
                        pick = i
                        break
                out[r, step, :] = x[r, pick, :]
                distances(x, r, out[r, step], dist)
                for i in range(n):
                    if dist[i] < nearest[i]:
                        nearest[i] = dist[i]
    return run


def best_of(call, repeats: int = 7) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(ROWS, POINTS, DIM)
    first = torch.randint(0, POINTS, (ROWS,))
    uniforms = torch.rand(CENTROIDS - 1, ROWS, dtype=torch.float64)
    today = fastkmeans.seed(x, first, uniforms, CENTROIDS)
    if today is None:
        raise SystemExit("the compiled loops are not usable here (numba missing or switched off)")
    print(f"today's loop (channel-major): {best_of(lambda: fastkmeans.seed(x, first, uniforms, CENTROIDS)) * 1e3:.2f} ms")
    xs, fs, us = x.numpy(), first.numpy(), uniforms.numpy()
    for name, loop in (("row-major", _row_major), ("row-major, fastmath", _row_major_fastmath),
                       ("eight accumulators", _eight_accumulators), ("blocks of 16 points", _blocks_of_16)):
        run, out = seeding(loop), np.empty((ROWS, CENTROIDS, DIM), np.float32)
        seconds = best_of(lambda: run(xs, fs, us, out))
        print(f"{name}: {seconds * 1e3:.2f} ms, the same picks as today's: {np.array_equal(out, today.numpy())}")


if __name__ == "__main__":
    main()
