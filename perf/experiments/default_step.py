"""The recommended page codec (`kvbackend.spec.RECOMMENDED_PAGE_SPEC`, one spec for every layer) against the
recommended depth spec built on it (`RECOMMENDED_SPEC`, session 27's `QUALITY_SPEC`) over a 32-layer model
of Llama-8B geometry on the GPU: one decode step at B=8, L=32K (each layer's spec through `paged_decode`'s default
kernel, CUDA graphs, summed over the layers) and one warm 2048-token chunk completion (the layers grouped by spec as
`KVCache` groups them, each group one `Codec.encode_units` pass with the kernels' encode), beside SDPA BF16.

    python3 perf/experiments/default_step.py $OUT/default_step.json [SPEC ...]

Each further SPEC (a depth or page spec) has its decode step and chunk encode timed beside the recommended one's
(key "extra", a list): a lever that changes no decoded byte layout, such as `kmetric`, costs only in the encode.

The quality spec (`QUALITY_SPEC`: whole key rows in 10 of 32 layers) is timed the same way (key "quality"); run it
once as is and once with KVBACKEND_CUDA_WHOLE=1 (the tensor-core kernel's whole-row path; "mma_whole" says which).

JSON keys: "page_codec", "recommended" and "quality" (session 28's runs, `perf/results/s28/call{2,5}/`, wrote them as
"recommended" and "quality").
"""
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench_kernels import DEV, bench, graph_time, lever_case, sdpa_time  # noqa: E402
from kvbackend import Geometry, codecs  # noqa: E402
from kvbackend.codecs.base import CodecState  # noqa: E402
from kvbackend.depth import layer_specs  # noqa: E402
from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.kernels.unit_encoder import encode_units, supports as encoder_supports  # noqa: E402
from kvbackend.psac import query_second_moment  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import QUALITY_SPEC, RECOMMENDED_PAGE_SPEC, RECOMMENDED_SPEC  # noqa: E402

LAYERS, HQ, HEADS, DIM, PAGE, BATCH, LENGTH, CHUNK = 32, 32, 8, 128, 64, 8, 32768, 2048


def decode_us(spec: str, rotary) -> tuple[float, str]:
    case = lever_case(spec, BATCH, LENGTH, HQ, HEADS, DIM, PAGE, rotary)
    calls = [lambda j=j: paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                      levers=case.levers, rotary=rotary) for j in range(case.rotations)]
    from kvbackend.kernels import mma_decode
    kernel = "mma" if mma_decode.preferred(*case.schemes, PAGE, DIM, HQ // HEADS, torch.device(DEV), torch.bfloat16,
                                           torch.bfloat16, case.levers) else "triton"
    us = graph_time(calls) * 1e3
    torch.cuda.empty_cache()
    return us, kernel


def decode_step(name: str, specs: list[str], timed: dict, rotary) -> tuple[float, list]:
    """The decode step over the layers of ``specs``: each distinct layer spec timed once (``timed`` caches), summed."""
    step, layers = 0.0, []
    for layer_spec, count in collections.Counter(specs).items():
        if layer_spec not in timed:
            timed[layer_spec] = decode_us(layer_spec, rotary)
        us, kernel = timed[layer_spec]
        step += count * us
        layers.append({"spec": layer_spec, "count": count, "us": us, "kernel": kernel})
        print(f"{name}: {count:2d} layers x {us:7.1f} us ({kernel})  [{layer_spec[-60:]}]", flush=True)
    return step, layers


def warm_chunk(spec: str, n: int, gen) -> tuple:
    """(codec, layout, K, V, warm states): one 2048-token chunk of ``n`` layers of Llama-8B geometry (keys with
    channel scales and offsets, Gaussian values, query statistics), its cold encode done."""
    codec = codecs.get(spec)
    layout = codec.layout(Geometry(1, HEADS, DIM, torch.bfloat16), PAGE)
    k = torch.randn(n, CHUNK, HEADS, DIM, device=DEV, generator=gen)
    k = (k * torch.linspace(0.2, 4, DIM, device=DEV) + torch.randn(n, 1, HEADS, DIM, device=DEV, generator=gen)).bfloat16()
    v = torch.randn(n, CHUNK, HEADS, DIM, device=DEV, generator=gen).bfloat16()
    queries = torch.randn(n, 4 * HEADS, 256, DIM, device=DEV, generator=gen) * torch.linspace(3, 0.1, DIM, device=DEV)
    states = [CodecState(query_moment=query_second_moment(q, HEADS)) for q in queries]
    codec.encode_units(k, v, layout, states)  # cold
    return codec, layout, k, v, [st.clone() for st in states]


def encode_ms(specs: list[str]) -> dict:
    """One warm chunk of every layer, grouped by spec; each group's pass timed and summed, eager and replayed
    from CUDA graphs (one `GraphedEncoder` for all groups, as `KVCache` shares one)."""
    from kvbackend.kernels.encode_graph import GraphedEncoder

    gen = torch.Generator(device=DEV).manual_seed(0)
    groups = collections.defaultdict(list)
    for layer, spec in enumerate(specs):
        groups[spec].append(layer)
    graphed = GraphedEncoder()
    total, total_graphed, per_group, mixed = 0.0, 0.0, [], []
    for spec, layers in groups.items():
        n = len(layers)
        codec, layout, k, v, warm = warm_chunk(spec, n, gen)
        kernels = encoder_supports(codec, layout, warm)
        ms = bench(lambda: codec.encode_units(k, v, layout, warm, encoder=encode_units), 400)
        replays = graphed.replays
        graph_ms = bench(lambda: codec.encode_units(k, v, layout, warm, encoder=graphed), 400)
        replayed = graphed.replays > replays
        total += ms
        total_graphed += graph_ms
        per_group.append({"spec": spec, "layers": layers, "ms": ms, "graph_ms": graph_ms, "replayed": replayed,
                          "kernels": kernels})
        print(f"  encode {n} layers x {CHUNK} tokens, kernels {kernels}: {ms:.3f} ms eager, {graph_ms:.3f} ms "
              f"from a CUDA graph (replayed: {replayed})  [{spec[-60:]}]", flush=True)
        mixed.append((codec, layout, k, v, warm))
    result = {"ms": total, "graph_ms": total_graphed, "graph_pool_bytes": graphed.reserved_bytes, "groups": per_group}
    if len(mixed) > 1:  # the groups in one pass, as `KVCache` encodes them on the Triton backend (`encode_mixed`)
        from kvbackend.backends import TritonBackend
        from kvbackend.frames import lever_layout

        backend = TritonBackend(mixed[0][0], lever_layout(mixed[0][1], mixed[0][0].levers))
        parts, at = [], 0
        for codec, layout, k, _, _ in mixed:
            parts.append((codec, layout, list(range(at, at + k.shape[0]))))
            at += k.shape[0]
        ks, vs = torch.cat([m[2] for m in mixed]), torch.cat([m[3] for m in mixed])
        states = [st for m in mixed for st in m[4]]
        assert backend.encode_mixed(parts, ks, vs, states) is not None, "the mixed pass was refused"
        result["mixed_ms"] = bench(lambda: backend.encode_mixed(parts, ks, vs, states), 400)
        print(f"  encode all {ks.shape[0]} layers in one mixed pass: {result['mixed_ms']:.3f} ms", flush=True)
        mixed_graphs = GraphedEncoder()
        backend.unit_encoder = mixed_graphs
        result["mixed_graph_ms"] = bench(lambda: backend.encode_mixed(parts, ks, vs, states), 400)
        result["mixed_graph_replays"] = mixed_graphs.replays
        result["mixed_graph_pool_bytes"] = mixed_graphs.reserved_bytes
        print(f"  encode all {ks.shape[0]} layers in one mixed pass from a CUDA graph: {result['mixed_graph_ms']:.3f} ms "
              f"({mixed_graphs.replays} replays, pool {mixed_graphs.reserved_bytes / 2**20:.0f} MiB)", flush=True)
    return result


def main(out: str, extra: list[str]) -> None:
    rotary = Rotary.default(DIM, 500000.0)
    result = {"sdpa_graph_us_per_layer": sdpa_time(BATCH, HQ, HEADS, LENGTH, DIM, 2, graphs=True) * 1e3}
    print(f"SDPA BF16 (graphs) per layer {result['sdpa_graph_us_per_layer']:.1f} us", flush=True)
    timed = {}
    from kvbackend.kernels import mma_decode
    result["mma_whole"] = mma_decode.WHOLE  # KVBACKEND_CUDA_WHOLE=1: the tensor-core kernel reads whole key rows
    for name, spec in (("page_codec", RECOMMENDED_PAGE_SPEC), ("recommended", RECOMMENDED_SPEC),
                       ("quality", QUALITY_SPEC)):
        specs = layer_specs(spec, LAYERS)
        step, layers = decode_step(name, specs, timed, rotary)
        enc = encode_ms(specs)
        result[name] = {"spec": spec, "decode_step_us": step, "layers": layers, "encode_chunk": enc,
                        "speedup_vs_sdpa": LAYERS * result["sdpa_graph_us_per_layer"] / step}
        print(f"{name}: decode step {step:.0f} us over {LAYERS} layers ({result[name]['speedup_vs_sdpa']:.2f}x SDPA), "
              f"chunk encode {enc['ms']:.2f} ms eager, {enc['graph_ms']:.2f} ms from graphs (pool "
              f"{enc['graph_pool_bytes'] / 2**20:.0f} MiB)" + (f", one mixed pass {enc['mixed_ms']:.2f} ms"
                                                                if "mixed_ms" in enc else ""), flush=True)
    q, r = result["recommended"], result["page_codec"]
    print(f"recommended / page codec: decode {q['decode_step_us'] / r['decode_step_us']:.3f}x, "
          f"encode {q['encode_chunk']['ms'] / r['encode_chunk']['ms']:.3f}x eager, "
          f"{q['encode_chunk']['graph_ms'] / r['encode_chunk']['graph_ms']:.3f}x from graphs", flush=True)
    w = result["quality"]
    print(f"quality / recommended: decode {w['decode_step_us'] / q['decode_step_us']:.3f}x, "
          f"encode {w['encode_chunk']['ms'] / q['encode_chunk']['ms']:.3f}x eager", flush=True)
    result["extra"] = []
    for i, spec in enumerate(extra):
        specs = layer_specs(spec, LAYERS)
        step, layers = decode_step(f"extra {i}", specs, timed, rotary)
        print(f"extra {i}: decode step {step:.0f} us ({step / q['decode_step_us']:.3f}x the recommended, "
              f"{LAYERS * result['sdpa_graph_us_per_layer'] / step:.2f}x SDPA)", flush=True)
        enc = encode_ms(specs)
        result["extra"].append({"spec": spec, "decode_step_us": step, "layers": layers, "encode_chunk": enc,
                                "speedup_vs_sdpa": LAYERS * result["sdpa_graph_us_per_layer"] / step})
        print(f"{spec[-70:]}: chunk encode {enc['ms']:.2f} ms eager ({enc['ms'] / q['encode_chunk']['ms']:.3f}x the "
              f"recommended), {enc['graph_ms']:.2f} ms from graphs ({enc['graph_ms'] / q['encode_chunk']['graph_ms']:.3f}x)"
              + (f", one mixed pass {enc['mixed_ms']:.2f} ms ({enc['mixed_ms'] / q['encode_chunk']['mixed_ms']:.3f}x)"
                 if "mixed_ms" in enc and "mixed_ms" in q["encode_chunk"] else ""), flush=True)
    pathlib.Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
