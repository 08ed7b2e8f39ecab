"""Where a warm chunk encode pass spends its time, and what each lever costs the CUDA gather (H200 probe).

1. One warm 2048-token chunk encode pass (`Codec.encode_units` with the kernels' encoder, Llama-8B geometry) for
   the recommended page codec over 32 layers and for each layer group of the recommended depth spec, under
   `torch.profiler`: wall time per pass, device time per pass (the sum of its kernels), kernel count, and the
   heaviest host operations and kernels.
2. The CUDA gather of the page codec's layout at B=8, L=32K with one lever off at a time.

    python3 perf/experiments/encode_pass_profile.py $OUT/encode_pass_profile.json
"""
import collections
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench_kernels import DEV, _with, _without_levers, bench, lever_case  # noqa: E402
from default_step import warm_chunk  # noqa: E402
from kvbackend.depth import layer_specs  # noqa: E402
from kvbackend.kernels.gather_dequant import gather_dequant  # noqa: E402
from kvbackend.kernels.unit_encoder import encode_units  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC, RECOMMENDED_SPEC  # noqa: E402

LAYERS, HQ, HEADS, DIM, PAGE, CHUNK = 32, 32, 8, 128, 64, 2048


def encode_case(spec: str, n: int, gen):
    codec, layout, k, v, warm = warm_chunk(spec, n, gen)
    return lambda: codec.encode_units(k, v, layout, warm, encoder=encode_units)


def profile_pass(name: str, fn, reps: int = 5) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    host = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.key][0] += dev_us / reps
            kernels[ev.key][1] += ev.count / reps
        elif ev.device_type == torch.autograd.DeviceType.CPU:
            host[ev.key][0] += ev.self_cpu_time_total / reps
            host[ev.key][1] += ev.count / reps
    device_ms = sum(v[0] for v in kernels.values()) / 1e3
    launches = sum(v[1] for v in kernels.values())
    top_k = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    top_h = sorted(host.items(), key=lambda kv: -kv[1][0])[:20]
    print(f"{name}: wall {wall:.2f} ms, device {device_ms:.2f} ms in {launches:.0f} kernels", flush=True)
    for key, (us, count) in top_k:
        print(f"   dev  {us / 1e3:7.3f} ms {count:6.0f}x {key[:110]}")
    for key, (us, count) in top_h:
        print(f"   host {us / 1e3:7.3f} ms {count:6.0f}x {key[:110]}")
    return {"name": name, "wall_ms": wall, "device_ms": device_ms, "kernels": launches,
            "top_kernels": [{"kernel": k, "ms": v[0] / 1e3, "count": v[1]} for k, v in top_k],
            "top_host": [{"op": k, "ms": v[0] / 1e3, "count": v[1]} for k, v in top_h]}


def gather_levers() -> list[dict]:
    batch, length = 8, 32768
    rotary = Rotary.default(DIM, 500000.0)
    out = tuple(torch.empty(batch * length, HEADS, DIM, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    variants = [
        ("recipe", RECOMMENDED_PAGE_SPEC),
        ("no vrot", ",".join(p for p in RECOMMENDED_PAGE_SPEC.split(",") if not p.startswith("vrot="))),
        ("no prerope", ",".join(p for p in RECOMMENDED_PAGE_SPEC.split(",") if not p.startswith("prerope="))),
        ("no outliers", _with(RECOMMENDED_PAGE_SPEC, outliers=0)),
        ("no PSAC", _with(RECOMMENDED_PAGE_SPEC, rank=0)),
        ("no levers, no PSAC", _with(_without_levers(RECOMMENDED_PAGE_SPEC), rank=0)),
        ("rtn-2 fp8", "rtn:bits=2,group=64,scale=fp8"),
    ]
    rows = []
    for name, spec in variants:
        case = lever_case(spec, batch, length, HQ, HEADS, DIM, PAGE, rotary)
        plan = case.plans[0]
        packed = case.pages.shape[0] // case.rotations
        moved = packed * case.layout.page_bytes + 2 * batch * PAGE * HEADS * DIM * 2 + 2 * out[0].nbytes

        def call(case=case, plan=plan):
            gather_dequant(case.pages, case.books, case.dense, case.schemes, plan, out=out, levers=case.levers,
                           rotary=rotary, backend="cuda")

        call()
        ms = bench(call)
        rows.append({"variant": name, "spec": spec, "gather_us": ms * 1e3, "GBps": moved / ms / 1e6})
        print(f"gather {name}: {ms * 1e3:.1f} us, {moved / ms / 1e6:.0f} GB/s", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def main(out: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    result = {"passes": []}
    result["passes"].append(profile_pass("page codec, 32 layers", encode_case(RECOMMENDED_PAGE_SPEC, LAYERS, gen)))
    groups = collections.Counter(layer_specs(RECOMMENDED_SPEC, LAYERS))
    for spec, n in groups.items():
        result["passes"].append(profile_pass(f"depth group of {n} layers [{spec[-50:]}]", encode_case(spec, n, gen)))
        torch.cuda.empty_cache()
    result["passes"].append(profile_pass("page codec, 4 layers", encode_case(RECOMMENDED_PAGE_SPEC, 4, gen)))
    try:
        result["gather"] = gather_levers()
    except Exception as exc:  # the encode profile is still written
        print("gather levers failed:", repr(exc), flush=True)
        result["gather_error"] = repr(exc)
    pathlib.Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
