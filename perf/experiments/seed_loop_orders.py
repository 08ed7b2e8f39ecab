"""k-means++ seeding loop orders on one core (#20's CPU set): the distance loop of `fastkmeans._seed` as today
(channel-major, vectorised over points), row-major, row-major with fastmath reassociation, eight accumulators, blocks
of 16 points; 128 rows of 64 points of 128 channels, 32 centroids.

    taskset -c 0 .venv/bin/python -P perf/experiments/seed_loop_orders.py
"""
import time, numpy as np, torch, numba, sys
sys.path.insert(0, ".")
torch.set_num_threads(1)
from kvbackend import fastkmeans
B, N, D, C = 128, 64, 128, 32
x = torch.randn(B, N, D)
first = torch.randint(0, N, (B,))
u = torch.rand(C - 1, B, dtype=torch.float64)
def t(f, *a):
    f(*a); best = 1e9
    for _ in range(7):
        s = time.perf_counter(); f(*a); best = min(best, time.perf_counter() - s)
    return best
ref = fastkmeans.seed(x, first, u, C)
print("seed now  %.2f ms" % (1e3 * t(fastkmeans.seed, x, first, u, C)))

@numba.njit(nogil=True, cache=False)
def _dist_rows(x, r, c, out):  # x [B,N,D], c [D] -> out[N]
    n, d = x.shape[1], x.shape[2]
    for i in range(n):
        acc = np.float32(0.0)
        for k in range(d):
            tt = x[r, i, k] - c[k]
            acc += tt * tt
        out[i] = acc

@numba.njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, cache=False)
def _dist_rows_fm(x, r, c, out):
    n, d = x.shape[1], x.shape[2]
    for i in range(n):
        acc = np.float32(0.0)
        for k in range(d):
            tt = x[r, i, k] - c[k]
            acc += tt * tt
        out[i] = acc

def make(dist):
    @numba.njit(nogil=True, cache=False)
    def seed2(x, first, uniforms, out):
        b, n, d = x.shape
        c = out.shape[1]
        nearest = np.empty(n, np.float32); dd = np.empty(n, np.float32); cdf = np.empty(n, np.float64)
        for r in range(b):
            pick = first[r]
            out[r, 0, :] = x[r, pick, :]
            dist(x, r, out[r, 0], nearest)
            for step in range(1, c):
                total = 0.0
                for i in range(n):
                    total += np.float64(nearest[i]); cdf[i] = total
                target = uniforms[step - 1, r] * cdf[n - 1]
                pick = n - 1
                for i in range(n):
                    if cdf[i] > target:
                        pick = i; break
                out[r, step, :] = x[r, pick, :]
                dist(x, r, out[r, step], dd)
                for i in range(n):
                    if dd[i] < nearest[i]:
                        nearest[i] = dd[i]
    return seed2
for name, dist in (("rowwise", _dist_rows), ("rowwise fastmath", _dist_rows_fm)):
    f = make(dist)
    out = np.empty((B, C, D), np.float32)
    xs = x.numpy(); fs = first.numpy(); us = u.numpy()
    ms = t(f, xs, fs, us, out)
    same = np.array_equal(out, ref.numpy())
    print(f"{name} {1e3*ms:.2f} ms same picks as now: {same}")

@numba.njit(nogil=True, cache=False)
def _dist_rows8(x, r, c, out):
    n, d = x.shape[1], x.shape[2]
    for i in range(n):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for k in range(0, d, 8):
            t0 = x[r, i, k] - c[k]; t1 = x[r, i, k + 1] - c[k + 1]; t2 = x[r, i, k + 2] - c[k + 2]; t3 = x[r, i, k + 3] - c[k + 3]
            t4 = x[r, i, k + 4] - c[k + 4]; t5 = x[r, i, k + 5] - c[k + 5]; t6 = x[r, i, k + 6] - c[k + 6]; t7 = x[r, i, k + 7] - c[k + 7]
            a0 += t0 * t0; a1 += t1 * t1; a2 += t2 * t2; a3 += t3 * t3; a4 += t4 * t4; a5 += t5 * t5; a6 += t6 * t6; a7 += t7 * t7
        out[i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))

@numba.njit(nogil=True, cache=False)
def _dist_block(x, r, c, out):  # points in blocks of 16: acc per point in a small array, k outer
    n, d = x.shape[1], x.shape[2]
    acc = np.empty(16, np.float32)
    for i0 in range(0, n, 16):
        m = min(16, n - i0)
        for j in range(16):
            acc[j] = 0.0
        for k in range(d):
            ck = c[k]
            for j in range(m):
                tt = x[r, i0 + j, k] - ck
                acc[j] += tt * tt
        for j in range(m):
            out[i0 + j] = acc[j]
for name, dist in (("rowwise 8 accumulators", _dist_rows8), ("blocks of 16", _dist_block)):
    f = make(dist)
    out = np.empty((B, C, D), np.float32)
    xs = x.numpy(); fs = first.numpy(); us = u.numpy()
    ms = t(f, xs, fs, us, out)
    print(f"{name} {1e3*ms:.2f} ms same picks as now: {np.array_equal(out, ref.numpy())}")
