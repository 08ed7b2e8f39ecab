"""Memory of a long generation through transformers: `KVBackendCache` against `DynamicCache` (and
`QuantizedCache` where its backend is installed), on a Llama-shaped model with random weights.

    python perf/bench_memory.py --out $OUT/bench_memory.json            # the H200: Llama-8B shape, 16K tokens
    python perf/bench_memory.py --tiny --out /tmp/bench_memory.json     # any machine: a small shape

Each cache gets the same prompt, fed chunk by chunk (2048 tokens a call; `KVBackendCache.prefill`
for ours, the same pieces for the others), then ``--steps`` greedy decode steps. Measured on the
device's allocator (``torch.cuda.memory_allocated``; on CPU the caches' own tensors are counted
instead): the bytes held after the generation beyond the model's weights (``kv_held``: the cache at
rest), the peak during the decode steps (a layer's temporary reconstruction and the activations
included) and the peak over the whole run. The KV part of ours must shrink by the codec's ratio
(16 / bpv of its stored bytes, measured by ``kv_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvbackend.spec import RECOMMENDED_PAGE_SPEC
from kvbackend.tools.models import cache_argument

CHUNK = 2048
RECIPE = RECOMMENDED_PAGE_SPEC


def llama_config(tiny: bool, tokens: int):
    from transformers import LlamaConfig

    if tiny:
        shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, num_hidden_layers=2, vocab_size=512)
    else:  # Llama-3-8B's attention and MLP shape; a small vocabulary (the logits are not what is measured)
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, num_hidden_layers=32, vocab_size=32000)
    return LlamaConfig(**shape, max_position_embeddings=2 * tokens, rope_theta=500000.0, tie_word_embeddings=False)


def compiled_kernels() -> int:
    """How many compiled variants kvbackend's Triton kernels hold (0 without Triton)."""
    try:
        import importlib
        import pkgutil

        import triton
        import kvbackend.kernels as package
    except ImportError:
        return 0
    count = 0
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"kvbackend.kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.JITFunction):
                count += sum(len(caches[0]) for caches in value.device_caches.values())
    return count


def held_bytes(cache) -> int:
    """Bytes of every tensor the cache keeps (CPU fallback for the allocator's figure)."""
    if hasattr(cache, "engine"):
        engine = cache.engine
        return (engine.dense.data.nbytes + sum(t.nbytes for t in engine.packed.pages)
                + sum(t.nbytes for t in engine.packed.codebooks))
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def run_one(model, name: str, make_cache, ids: torch.Tensor, steps: int, device: str) -> dict:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    cache = make_cache()
    if hasattr(cache, "attach"):  # queries for quantwm; decode steps attend on the pages (paged decode on CUDA)
        cache.attach(model)
    try:
        return _run(model, name, cache, ids, steps, cuda, base if cuda else 0, t0)
    finally:
        if hasattr(cache, "detach"):
            cache.detach(model)


def _run(model, name, cache, ids, steps, cuda, base, t0) -> dict:
    with torch.no_grad():
        if hasattr(cache, "prefill"):
            out = cache.prefill(model, ids, logits_to_keep=1)
        else:
            for start in range(0, ids.shape[1], CHUNK):
                out = model(ids[:, start:start + CHUNK], use_cache=True, logits_to_keep=1,
                            **cache_argument(model, cache))
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        if cuda:
            after_prefill = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, use_cache=True, **cache_argument(model, cache))  # one step untimed: kernels compile
        token = out.logits[:, -1:].argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        compiled = compiled_kernels()
        t1 = time.perf_counter()
        step_ms = []
        for _ in range(steps):
            t_step = time.perf_counter()
            out = model(token, use_cache=True, **cache_argument(model, cache))
            token = out.logits[:, -1:].argmax(-1)  # a device-to-host read per step in effect: each step ends here
            if cuda:
                torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t_step) * 1e3)
        decode_s = time.perf_counter() - t1
    row = {"cache": name, "tokens": ids.shape[1] + steps + 1, "prefill_s": prefill_s,
           "decode_ms_per_step": decode_s / max(steps, 1) * 1e3,
           "decode_ms_median": statistics.median(step_ms) if step_ms else None,
           "decode_ms_max": max(step_ms, default=None),
           # Triton compilations during the timed steps: a step that compiles is seconds, not milliseconds
           "kernel_compiles_during_steps": compiled_kernels() - compiled}
    del out, token
    if cuda:
        torch.cuda.synchronize()
        row["kv_held"] = torch.cuda.memory_allocated() - base
        row["after_prefill"] = after_prefill
        row["decode_peak"] = torch.cuda.max_memory_allocated() - base
    else:
        row["kv_held"] = held_bytes(cache)
    if hasattr(cache, "kv_bytes"):
        report = cache.kv_bytes()
        row.update({f"report_{k}": v for k, v in report.items()})
        # the packed part against the same tokens at the model's dtype: the codec's own ratio, measured
        row["codec_ratio"] = (report["exact"] - report["dense"]) / report["packed"] if report["packed"] else None
        row["decode_path"] = ("paged decode kernel" if cache.engine.backends[0].name == "triton" and cache.attached
                              else "pages read for SDPA")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps after the prompt")
    parser.add_argument("--codecs", default="kivi:bits=2,group=32|kivi:bits=2,group=32@8|rtn:bits=2,group=64@8|" + RECIPE,
                        help="KVBackendCache codec specs separated by |, each optionally @CHUNK_PAGES (64-token "
                             "pages; default 32, 2048-token chunks)")
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="caches not started within this many seconds are skipped (and listed as skipped)")
    parser.add_argument("--out", default="perf/results/bench_memory.json")
    args = parser.parse_args()
    from transformers import DynamicCache, LlamaForCausalLM

    from kvbackend.integration.transformers import KVBackendCache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = llama_config(args.tiny, args.tokens + args.steps)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)
    total = args.tokens + args.steps
    caches = [("DynamicCache", lambda: DynamicCache(config=config))]
    try:  # transformers' own quantized cache needs optimum-quanto or hqq
        from transformers import QuantizedCache

        QuantizedCache(backend="quanto", config=config, nbits=2)
        caches.append(("QuantizedCache(quanto, 2 bits)", lambda: QuantizedCache(backend="quanto", config=config,
                                                                                nbits=2)))
        quantized = "measured"
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        quantized = f"not measured: {type(error).__name__}: {str(error)[:200]}"
    for entry in args.codecs.split("|"):
        spec, sep, pages = entry.rpartition("@")  # a depth: spec's bands hold "@" too: only a trailing integer counts
        if not sep or not pages.isdigit():
            spec, pages = entry, ""
        pages = int(pages or 32)
        # the dense pool holds one chunk per row: `prefill` packs each chunk before the next is read
        caches.append((f"KVBackendCache({spec}, chunk {pages * 64})",
                       lambda spec=spec, pages=pages: KVBackendCache(config, codec=spec, chunk_pages=pages,
                                                                     max_tokens=total, dense_tokens=pages * 64)))
    rows, skipped, began = [], [], time.perf_counter()
    for name, make in caches:
        if time.perf_counter() - began > args.budget_s:
            skipped.append(name)
            print(f"skipped (time budget): {name}", flush=True)
            continue
        row = run_one(model, name, make, ids, args.steps, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    exact = rows[0]["kv_held"]
    for row in rows:
        row["kv_held_vs_dynamic"] = exact / row["kv_held"] if row["kv_held"] else None
        print(f"{row['cache']:45s} held {row['kv_held'] / 2**20:9.1f} MiB ({row['kv_held_vs_dynamic']:.2f}x smaller)"
              + (f", decode peak {row['decode_peak'] / 2**20:9.1f} MiB" if "decode_peak" in row else "")
              + f", {row['decode_ms_per_step']:.1f} ms/step (median {row['decode_ms_median']:.1f}, max "
              f"{row['decode_ms_max']:.1f}, {row['kernel_compiles_during_steps']} kernel compilations)", flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
              "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim")},
              "tokens": args.tokens, "steps": args.steps, "chunk": CHUNK, "quantized_cache": quantized, "skipped": skipped,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
