"""cProfile of one host-tier restore of a 32K-token prefix (Llama-8B geometry), on the GPU:

    python3 perf/profile_restore.py [CODEC]
"""

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_tiers import prefix_on_host  # noqa: E402


def main() -> None:
    cache, tiered, prompt, _ = prefix_on_host(sys.argv[1] if len(sys.argv) > 1 else "rtn:bits=2,group=64,scale=fp8")
    for _ in range(4):  # the first runs warm the allocator; the last one is profiled
        for page, _ in cache.evictable_pages():
            cache.drop_cached(page)
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        tiered.restore(prompt)
        profile.disable()
        torch.cuda.synchronize()
        print(f"restore {(time.perf_counter() - start) * 1e3:.1f} ms (profiled)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    tiered.close()


if __name__ == "__main__":
    main()
