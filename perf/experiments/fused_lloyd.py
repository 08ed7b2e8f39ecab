"""A prototype: the Lloyd update of `kvbackend.kernels.kmeans.kmeans` (one-hot sums, counts, the mean or the old
centroid, and the squared norms the next assignment reads) in one Triton launch per step, with no [B, N, C] one-hot
tensor; the assignment kernel is the project's. Checked against the torch update here, then timed in the recipe's
32-layer chunk encode against the eager loop and the per-shape CUDA graph in one process.

    python3 perf/experiments/fused_lloyd.py --check            (any machine; the interpreter without a GPU)
    python3 perf/experiments/fused_lloyd.py --out OUT.json     (CUDA)"""

import argparse
import json
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvbackend.codecs.kmeans import KMeansResult  # noqa: E402
from kvbackend.kernels.kmeans import _assign_kernel  # noqa: E402


@triton.jit
def _update_kernel(x, assign, old, out, norms, N, C, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   PRECISION: tl.constexpr):
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
        acc += tl.dot(onehot, points, input_precision=PRECISION)
        count += tl.sum(onehot, 1)
    at = (b * C + cs[:, None]) * D + d[None, :]
    previous = tl.load(old + at, mask=valid[:, None], other=0.0)
    new = tl.where(count[:, None] > 0, acc / tl.maximum(count, 1.0)[:, None], previous)
    tl.store(out + at, new, mask=valid[:, None])
    tl.store(norms + b * C + cs, tl.sum(new * new, 1), mask=valid)


def lloyd_update(x, assign, centroids):
    """(new centroids [B, C, D], their squared norms [B, C]) from float32 points [B, N, D], int32 ids [B, N] and
    the old centroids (kept where a centroid has no point)."""
    b, n, d = x.shape
    c = centroids.shape[1]
    out = torch.empty_like(centroids)
    norms = torch.empty(b, c, device=x.device)
    block_c = max(16, min(64, triton.next_power_of_2(c)))
    _update_kernel[(b, triton.cdiv(c, block_c))](x, assign, centroids, out, norms, n, c, D=d, BLOCK_N=64,
                                                 BLOCK_C=block_c, PRECISION="ieee")
    return out, norms


def _assign(x, centroids, norms, out):
    b, n, d = x.shape
    c = centroids.shape[1]
    block_c = max(16, min(64, triton.next_power_of_2(c)))
    _assign_kernel[(b, triton.cdiv(n, 64))](x, centroids, norms, out, n, c, D=d, BLOCK_N=64, BLOCK_C=block_c,
                                            PRECISION="tf32" if x.is_cuda else "ieee")
    return out


def kmeans_fused(x, init, max_iters, early_stop=True):
    """`kvbackend.kernels.kmeans.kmeans(..., early_stop=False)` with the fused update: two launches per step."""
    x = x.float().contiguous()
    centroids = init.float().contiguous().clone()
    b, n, _ = x.shape
    assign = _assign(x, centroids, (centroids * centroids).sum(-1), torch.empty(b, n, dtype=torch.int32, device=x.device))
    for _ in range(max_iters):
        centroids, norms = lloyd_update(x, assign, centroids)
        assign = _assign(x, centroids, norms, torch.empty_like(assign))
    return KMeansResult(centroids, assign.long(), max_iters, x.new_full(assign.shape, float("nan")))


def _torch_update(x, assign, centroids):
    c = centroids.shape[1]
    onehot = (assign.long().unsqueeze(-1) == torch.arange(c, device=x.device)).float()
    sums, counts = onehot.transpose(1, 2) @ x, onehot.sum(1).unsqueeze(-1)
    return torch.where(counts > 0, sums / counts.clamp_min(1), centroids)


def check():
    for b, n, c, d in ((3, 37, 5, 16), (2, 130, 32, 64), (4, 64, 20, 32)):
        gen = torch.Generator().manual_seed(b * n + c)
        x = torch.randn(b, n, d, generator=gen) * 3
        assign = torch.randint(0, c - 1, (b, n), generator=gen, dtype=torch.int32)  # the last centroid stays empty
        old = torch.randn(b, c, d, generator=gen)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        got, norms = lloyd_update(x.to(dev), assign.to(dev), old.to(dev))
        want = _torch_update(x, assign, old)
        assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-5), (b, n, c, d)
        assert torch.equal(got[:, -1].cpu(), old[:, -1])  # an empty centroid keeps its place
        assert torch.allclose(norms.cpu(), (want * want).sum(-1), rtol=1e-5, atol=1e-4)
    print("fused Lloyd update equals the torch update on 3 shapes")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    check()
    if args.check:
        return
    sys.path.insert(0, "perf/experiments")
    sys.path.insert(0, "perf")
    import bench_kernels as bk
    from kmeans_graph_ab import graphed, recipe_case

    from kvbackend.kernels import unit_encoder
    from kvbackend.kernels.kmeans import kmeans

    codec, layout, k, run = recipe_case()
    layers = k.shape[0]
    sides = {"eager": kmeans, "fused": kmeans_fused, "graphed": graphed}
    times, kept, nrmse = {name: [] for name in sides}, {}, {}
    for rounds in range(args.rounds):
        for name, fn in sides.items():
            unit_encoder.kmeans = fn
            if rounds == 0:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved()
                pages, books = run()
                decoded = torch.stack([codec.decode_pages(layout, pages[u], books[u])[0] for u in range(layers)])
                nrmse[name] = float((decoded.float() - k.float()).norm() / k.float().norm())
                del pages, books, decoded
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                kept[name] = (torch.cuda.memory_reserved() - before) / 2**20
            times[name].append(bk.bench(run, 400))
    unit_encoder.kmeans = kmeans
    out = {name: {"ms_each_round": t, "median_ms": statistics.median(t), "kept_MiB_after_first_call": kept[name],
                  "key_nrmse": nrmse[name]} for name, t in times.items()}
    for name, row in out.items():
        print(f"{name}: median {row['median_ms']:.3f} ms over {args.rounds} alternating rounds "
              f"({', '.join(f'{t:.2f}' for t in row['ms_each_round'])}); first call kept "
              f"{row['kept_MiB_after_first_call']:.0f} MiB; key NRMSE {row['key_nrmse']:.4f}")
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
