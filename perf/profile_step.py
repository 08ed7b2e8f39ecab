"""Where a serving step's time goes, per cache: a profiled decode step and prefill chunk of `LlamaRunner`.

    python perf/profile_step.py --layers 4 --batch 9 --out $OUT/profile_step.txt

Llama-3-8B geometry with random weights and ``--layers`` decoder layers (the per-layer cost is what
matters; fewer layers fill faster). Per cache: the step's wall time, then `KVCache.decode` and
`KVCache.append_step` of one layer timed alone (synchronised), then torch.profiler's tables of a decode
step and of one prefill chunk (self CPU time and device time, top rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Shape, fill_random, make_cache, release, requests_like, sync  # noqa: E402

from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402
from kvbackend.tools.llama_runner import LlamaRunner  # noqa: E402


def model_with_layers(layers: int, device: str, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=512)
    else:
        sizes = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=128256)
    config = LlamaConfig(**sizes, num_hidden_layers=layers, max_position_embeddings=1 << 17, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return LlamaForCausalLM(config).to(dtype).eval()


def timed(fn, device: str, repeat: int = 5) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat * 1e3


def table(prof, device: str, rows: int) -> str:
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    return (averages.table(sort_by="self_cpu_time_total", row_limit=rows) + "\n"
            + (averages.table(sort_by=key, row_limit=rows) if device == "cuda" else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default=f"rtn:bits=2,group=64|{RECOMMENDED_PAGE_SPEC}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--variants", type=int, default=1, help="1: time the decode kernels' options on layer 0")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_with_layers(args.layers, device, args.tiny)
    heads = model.config.num_attention_heads
    chunk_pages = 2 if args.tiny else 32
    shape = Shape(args.context, 0, 64, chunk_pages, args.batch, 4, 0, 0, 2048, 0, 0, 0)
    report = []
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for codec in args.caches.split("|"):
        cache = make_cache(model, codec, shape, args.batch + 1, args.context + 64 + 3 * shape.chunk_pages * 64, device)
        first, _ = cache.add_request(list(range(args.context)))
        fill_random(cache, first, args.context, 0, heads)
        ids = [first] + requests_like(cache, first, args.batch - 1, args.context, 1000, heads)
        runner = LlamaRunner(model, cache)
        tokens = torch.zeros(len(ids), dtype=torch.long)
        step_ms = timed(lambda: runner.decode(ids, tokens), device, 3)
        plan = cache.plan(ids, 0)
        g = cache.geometry
        q = torch.randn(len(ids), heads, g.head_dim, device=device, dtype=g.dtype)
        k = torch.randn(len(ids), g.num_kv_heads, g.head_dim, device=device, dtype=g.dtype)
        decode_ms = timed(lambda: cache.decode(plan, 0, q), device)
        plan_ms = timed(lambda: cache.plan(ids, 0), device)
        variants = []
        backend = cache.backends[0]
        if args.variants and device == "cuda" and hasattr(backend, "levers"):
            from kvbackend.kernels.paged_decode import paged_decode

            pools = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], backend.schemes, plan)
            for fold in (False, True):
                for warps in (4, 8):
                    for stages in (1, 2):
                        def call(fold=fold, warps=warps, stages=stages):
                            return paged_decode(q, *pools, num_warps=warps, num_stages=stages, fold=fold,
                                                levers=backend.levers, rotary=cache.frames[0].rotary)
                        try:
                            variants.append((f"fold={fold} warps={warps} stages={stages}", timed(call, device)))
                        except Exception as error:  # noqa: BLE001 - a variant the kernel refuses is reported
                            variants.append((f"fold={fold} warps={warps} stages={stages}: {type(error).__name__}", -1.0))
        with profile(activities=activities) as prof:
            runner.decode(ids, tokens)
            sync(device)
        decode_table = table(prof, device, args.rows)
        extra, _ = cache.add_request()
        chunk = torch.zeros(cache.config.chunk_tokens, dtype=torch.long)  # one whole chunk: its encode runs
        prefill_ms = timed(lambda: runner.prefill(extra, chunk), device, 1)
        with profile(activities=activities) as prof:
            runner.prefill(extra, chunk)
            sync(device)
        prefill_table = table(prof, device, args.rows)
        line = (f"{codec}: B={len(ids)} L={args.context} {args.layers} layers: decode step {step_ms:.1f} ms "
                f"({step_ms / args.layers:.2f} ms/layer); KVCache.decode alone {decode_ms:.2f} ms/layer; plan "
                f"{plan_ms:.2f} ms; prefill of a {chunk.numel()}-token chunk {prefill_ms:.1f} ms")
        for name, ms in variants:
            line += f"\n    paged_decode {name}: {ms:.3f} ms"
        print(line, flush=True)
        report += [line, "-- decode step", decode_table, f"-- prefill chunk ({chunk.numel()} tokens)", prefill_table]
        del cache, runner
        release(device)
    text = "\n".join(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
