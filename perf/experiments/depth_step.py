"""A transformers decode step through `KVBackendCache` on a Llama-8B-shaped model with random weights (the memory
bench's setup): the recommended spec against the quality-first depth spec (P7, `perf/results/s27/p7.spec`: 4 of 32
layers with 3-bit keys, decoded by the Triton kernel), DynamicCache as the control. B=1.

    python3 perf/experiments/depth_step.py --out $OUT/depth_step.json [--tokens 16384 --steps 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_memory as bm  # noqa: E402

from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402

P7 = (Path(__file__).resolve().parents[1] / "results" / "s27" / "p7.spec").read_text().strip()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from transformers import DynamicCache, LlamaForCausalLM

    from kvbackend.integration.transformers import KVBackendCache

    config = bm.llama_config(False, args.tokens + args.steps)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device="cuda")
    total = args.tokens + args.steps + 2
    rows = [bm.run_one(model, "DynamicCache", lambda: DynamicCache(config=config), ids, args.steps, "cuda")]
    for name, spec in (("recommended", RECOMMENDED_PAGE_SPEC), ("depth P7", P7), ("recommended again", RECOMMENDED_PAGE_SPEC)):
        rows.append(bm.run_one(model, name, lambda spec=spec: KVBackendCache(config, codec=spec, chunk_pages=32,
                                                                               max_tokens=total, dense_tokens=2048),
                               ids, args.steps, "cuda"))
        print(f"{name:20s} {rows[-1]['decode_ms_per_step']:7.2f} ms/step (median {rows[-1]['decode_ms_median']:.2f})",
              flush=True)
    print(f"DynamicCache {rows[0]['decode_ms_per_step']:7.2f} ms/step")
    with open(args.out, "w") as f:
        json.dump({"p7": P7, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
