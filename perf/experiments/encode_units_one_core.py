"""One-core encode of one storage batch with the recipe's page codec (without its levers): 128 one-page chunks
(64 tokens, 8 KV heads of 128), `Codec.encode_units` eight times on the same random K/V; prints the minimum and the
median. Run from the root of the tree to time (its own `kvbackend` first on the path), e.g. against a worktree:

    taskset -c 0 .venv/bin/python -P perf/experiments/encode_units_one_core.py LABEL
"""
import sys
import time

import torch

sys.path.insert(0, ".")
torch.set_num_threads(1)
from kvbackend import codecs  # noqa: E402
from kvbackend.geometry import Geometry  # noqa: E402

SPEC = "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,cdtype=fp8,outliers=16"


def main(label: str) -> None:
    codec = codecs.get(SPEC)
    layout = codec.layout(Geometry(1, 8, 128), 64)
    torch.manual_seed(0)
    k, v = torch.randn(128, 64, 8, 128), torch.randn(128, 64, 8, 128)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        codec.encode_units(k, v, layout)
        times.append(time.perf_counter() - start)
    raw = 2 * k.numel() * 2  # K and V as bf16
    print(f"{label} min {min(times) * 1e3:.1f} ms ({raw / min(times) / 1e9:.3f} GB/s of bf16 K/V), "
          f"median {sorted(times)[4] * 1e3:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
