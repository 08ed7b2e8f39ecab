"""Where the time of a prefix restore goes: `TieredCache.restore` (tier reads, copies, install) apart from the
prefill of the prompt's remaining tokens, from the host tier and from the file tier, for each cache, with a
cProfile of each restore. The setting is `perf/bench_serving.py`'s time-to-first-token section (Llama-3-8B
geometry with random weights on CUDA; ``--tiny`` on the CPU).

    python3 perf/experiments/restore_profile.py --out $OUT/restore_profile.json [--context 32768] [--caches "a|b"]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serving import Shape, llama, make_cache, prefill_all, release, sync, warm_up  # noqa: E402

from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402
from kvbackend.tools.llama_runner import LlamaRunner  # noqa: E402


def profile_text(profile: cProfile.Profile, lines: int) -> str:
    buffer = io.StringIO()
    pstats.Stats(profile, stream=buffer).sort_stats("cumulative").print_stats(lines)
    return buffer.getvalue()


def restores(model, codec: str, shape: Shape, device: str, directory: str, lines: int) -> dict:
    from kvbackend.tiers.file import FileTier
    from kvbackend.tiers.host import HostTier
    from kvbackend.tiers.prefetch import TieredCache

    cache = make_cache(model, codec, shape, 2, shape.context + 2, device)
    runner = LlamaRunner(model, cache)
    prompt = [random.Random(11).randrange(1, model.config.vocab_size) for _ in range(shape.context)]
    warm_up(runner, shape, device)
    rid, _ = cache.add_request(prompt)
    prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
    cache.free(rid)
    pages = len(cache.evictable_pages())
    host = HostTier(max(2 * pages, 1) * cache.blob_bytes, cache.blob_bytes)
    file = FileTier(os.path.join(directory, codec.partition(":")[0]), 64 * pages * cache.blob_bytes + (1 << 20),
                    cache.fingerprint)
    out = {"codec": codec, "blob_bytes": cache.blob_bytes, "pages": pages}
    for name, tiers in (("host", (host, None)), ("file", (None, file))):
        tiered = TieredCache(cache, *tiers, background=False)
        out[f"{name}_pages_moved"] = tiered.offload(max_pages=len(cache.evictable_pages()))
        tiered.flush()
        profile = cProfile.Profile()
        sync(device)
        t0 = time.perf_counter()
        profile.enable()
        report = tiered.restore(prompt)
        sync(device)
        profile.disable()
        out[f"{name}_restore_s"] = time.perf_counter() - t0
        out[f"{name}_report"] = str(report)
        t1 = time.perf_counter()
        rid, hit = tiered.add_request(prompt)
        prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
        out[f"{name}_admit_and_prefill_s"] = time.perf_counter() - t1
        out[f"{name}_hit"] = hit
        out[f"{name}_profile"] = profile_text(profile, lines)
        tiered.free(rid)
        tiered.close()
    host.close()
    file.close()
    del cache, runner
    release(device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--caches", default="identity|" + RECOMMENDED_PAGE_SPEC)
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.context = 512
    page_size, chunk_pages = (64, 2) if args.tiny else (64, 32)
    shape = Shape(args.context, 1 << 30, page_size, chunk_pages, 8, 2, 8, 8, 100 if args.tiny else 2048, 0, 1, 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = llama(args.tiny, device, dtype, args.context + 16)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for codec in args.caches.split("|"):
            r = restores(model, codec, shape, device, directory, args.lines)
            print({k: v for k, v in r.items() if not k.endswith("_profile")}, flush=True)
            results.append(r)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "context": args.context,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
