"""The decode step alone (no chunk encode) of the recommended spec and of each SPEC given, over 32 layers of
Llama-8B geometry at B=8, L=32K on the GPU, through `perf/experiments/default_step.py`'s `decode_step`:

    python3 perf/results/s38/step_only.py OUT.json [--k4] SPEC...

--k4: then each SPEC again with the tensor-core kernel's 4-bit key path turned on (`mma_decode.K4`; its layers with
4-bit keys timed again, the rest reused), key "k4".
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from default_step import BATCH, DIM, HEADS, HQ, LAYERS, LENGTH, decode_step  # noqa: E402
from bench_kernels import sdpa_time  # noqa: E402
from kvbackend.depth import layer_specs  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_SPEC  # noqa: E402


def main(out: str, extra: list[str]) -> None:
    k4 = "--k4" in extra
    extra = [x for x in extra if x != "--k4"]
    rotary = Rotary.default(DIM, 500000.0)
    sdpa = sdpa_time(BATCH, HQ, HEADS, LENGTH, DIM, 2, graphs=True) * 1e3
    print(f"SDPA BF16 (graphs) per layer {sdpa:.1f} us", flush=True)
    timed, result = {}, {"sdpa_graph_us_per_layer": sdpa, "specs": [], "k4": []}

    def step(name: str, spec: str, into: list) -> None:
        us, layers = decode_step(name, layer_specs(spec, LAYERS), timed, rotary)
        base = result["specs"][0]["decode_step_us"] if result["specs"] else us
        print(f"{name}: decode step {us:.0f} us, {us / base:.3f}x the recommended, {LAYERS * sdpa / us:.2f}x SDPA",
              flush=True)
        into.append({"spec": spec, "decode_step_us": us, "layers": layers, "speedup_vs_sdpa": LAYERS * sdpa / us})

    step("recommended", RECOMMENDED_SPEC, result["specs"])
    for i, spec in enumerate(extra, 1):
        step(f"extra {i}", spec, result["specs"])
    if k4:  # the 4-bit path on: layers with 4-bit keys timed again, the rest reused
        from kvbackend import codecs
        from kvbackend.kernels import mma_decode

        mma_decode.K4 = True
        mma_decode.supports_levers.cache_clear()
        for spec in [s for s in timed if codecs.parse(s).kbits == 4]:
            del timed[spec]
        for i, spec in enumerate(extra, 1):
            step(f"extra {i} with K4", spec, result["k4"])
    pathlib.Path(out).write_text(json.dumps(result, indent=1))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
