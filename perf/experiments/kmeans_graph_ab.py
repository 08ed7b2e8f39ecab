"""The recipe's warm 32-layer chunk encode (`Codec.encode_units` with the kernels' encoder, as `bench_kernels`'s
encode rows) with the k-means run eagerly (as served since session 26) and replayed from a per-shape CUDA graph
(session 25's path, copied here), alternating in one process so that both see the same host and clocks.

    python3 perf/experiments/kmeans_graph_ab.py --out OUT.json"""

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, "perf")
import bench_kernels as bk  # noqa: E402

from kvbackend import Geometry, codecs  # noqa: E402
from kvbackend.codecs.base import CodecState  # noqa: E402
from kvbackend.codecs.kmeans import KMeansResult  # noqa: E402
from kvbackend.kernels import unit_encoder  # noqa: E402
from kvbackend.kernels.kmeans import kmeans  # noqa: E402
from kvbackend.psac import query_second_moment  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor
    init: torch.Tensor
    result: KMeansResult


_CAPTURED: dict = {}


def kmeans_graphed(x, init, steps):
    key = (tuple(x.shape), tuple(init.shape), x.device, steps)
    captured = _CAPTURED.get(key)
    if captured is None:
        static_x, static_init = x.float().contiguous().clone(), init.float().contiguous().clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            kmeans(static_x, static_init, steps, early_stop=False)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = kmeans(static_x, static_init, steps, early_stop=False)
        captured = _CAPTURED[key] = _Captured(graph, static_x, static_init, result)
    captured.x.copy_(x)
    captured.init.copy_(init)
    captured.graph.replay()
    out = captured.result
    return KMeansResult(out.centroids.clone(), out.assign.clone(), out.iterations, out.distance.clone())


def graphed(x, init, iters, early_stop=True):
    return kmeans_graphed(x, init, iters) if x.is_cuda and not early_stop else kmeans(x, init, iters, early_stop)


def recipe_case(heads: int = 8, dim: int = 128, p: int = 64, layers: int = 32, n: int = 2048):
    """The recommended spec's warm chunk of ``layers`` layers on CUDA, as `bench_kernels`'s encode rows make it:
    (codec, layout, keys, a call of `Codec.encode_units` through the kernels' encoder)."""
    codec = codecs.get(RECOMMENDED_PAGE_SPEC)
    layout = codec.layout(Geometry(1, heads, dim, torch.bfloat16), p)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(layers, n, heads, dim, device="cuda", generator=gen)
    k = (k * torch.linspace(0.2, 4, dim, device="cuda") + torch.randn(layers, 1, heads, dim, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(layers, n, heads, dim, device="cuda", generator=gen).bfloat16()
    queries = torch.randn(layers, 4 * heads, 256, dim, device="cuda", generator=gen) * torch.linspace(3, 0.1, dim, device="cuda")
    states = [CodecState(query_moment=query_second_moment(q, heads)) for q in queries]
    codec.encode_units(k, v, layout, states)
    warm = [st.clone() for st in states]
    return codec, layout, k, lambda: codec.encode_units(k, v, layout, warm, encoder=unit_encoder.encode_units)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    run = recipe_case()[3]
    times = {"eager": [], "graphed": []}
    kept = {}
    for rounds in range(args.rounds):
        for name, fn in (("eager", kmeans), ("graphed", graphed)):
            unit_encoder.kmeans = fn
            if rounds == 0:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved()
                run()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                kept[name] = (torch.cuda.memory_reserved() - before) / 2**20
            times[name].append(bk.bench(run, 400))
    unit_encoder.kmeans = kmeans
    out = {name: {"ms_each_round": t, "median_ms": statistics.median(t), "kept_MiB_after_first_call": kept[name]}
           for name, t in times.items()}
    for name, row in out.items():
        print(f"{name}: median {row['median_ms']:.3f} ms over {args.rounds} alternating rounds "
              f"({', '.join(f'{t:.2f}' for t in row['ms_each_round'])}); first call kept {row['kept_MiB_after_first_call']:.0f} MiB")
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
