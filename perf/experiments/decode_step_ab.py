"""A decode step of transformers through `KVBackendCache` on a Llama-8B-shaped model with random weights (the memory
bench's setup, `perf/bench_memory.py`): the recommended spec with the tensor-core kernel's default grid (one full
wave) against 1024 programs, DynamicCache as the host-noise control, and a profile of one step's CUDA kernels.

    python3 perf/experiments/decode_step_ab.py --out $OUT/decode_step_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_memory as bm  # noqa: E402

from kvbackend.kernels import mma_decode  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402
from kvbackend.tools.models import cache_argument  # noqa: E402


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

    def recipe():
        return KVBackendCache(config, codec=RECOMMENDED_PAGE_SPEC, chunk_pages=32, max_tokens=total, dense_tokens=2048)

    rows = [bm.run_one(model, "DynamicCache", lambda: DynamicCache(config=config), ids, args.steps, "cuda")]
    rows.append(bm.run_one(model, "recipe, default grid", recipe, ids, args.steps, "cuda"))
    original = mma_decode.wave_programs
    mma_decode.wave_programs = lambda *a, **k: 1024
    try:
        rows.append(bm.run_one(model, "recipe, 1024 programs", recipe, ids, args.steps, "cuda"))
    finally:
        mma_decode.wave_programs = original
    for row in rows:
        print(f"{row['cache']:28s} {row['decode_ms_per_step']:7.1f} ms/step (median {row['decode_ms_median']:.1f})",
              flush=True)
    # one profiled step of the recipe after a short prefill (4096 tokens): where a step's time goes
    cache = KVBackendCache(config, codec=RECOMMENDED_PAGE_SPEC, chunk_pages=32, max_tokens=total, dense_tokens=2048)
    cache.attach(model)
    with torch.no_grad():
        out = cache.prefill(model, ids[:, :4096], logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            out = model(token, use_cache=True, **cache_argument(model, cache))
            token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = model(token, use_cache=True, **cache_argument(model, cache))
            out.logits[:, -1:].argmax(-1).item()
    cache.detach(model)
    table_cuda = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    table_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    print(table_cuda)
    print(table_cpu)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "profile_cuda": table_cuda, "profile_cpu": table_cpu}, f, indent=1)


if __name__ == "__main__":
    main()
