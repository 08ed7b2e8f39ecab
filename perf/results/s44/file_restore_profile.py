"""Where a file-tier prefix hit's time to first token goes (session 44): `perf/bench_serving.py`'s section 4 for
rtn-2 and the recipe's page codec, the file restore and the host restore each under cProfile (the model, cache and
tiers as the bench builds them)."""
import cProfile
import io
import os
import pstats
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import bench_serving as bs  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402
from kvbackend.tiers.file import FileTier  # noqa: E402
from kvbackend.tiers.host import HostTier  # noqa: E402
from kvbackend.tiers.prefetch import TieredCache  # noqa: E402


def main(out_dir: str) -> None:
    tiny = os.environ.get("TINY") == "1"  # a CPU smoke run
    device = "cpu" if tiny else "cuda"
    shape = (bs.Shape(512, 2**24, 64, 2, 8, 2, 150, 300, 100, 0, 4, 4) if tiny else
             bs.Shape(32768, 40 * 2**30, 64, 32, 64, 3, 8192, 16384, 2048, 0, 8, 4))
    model = bs.llama(tiny, device, torch.float32 if tiny else torch.bfloat16, shape.context + 64)
    for codec in ("rtn:bits=2,group=64", RECOMMENDED_PAGE_SPEC):
        cache = bs.make_cache(model, codec, shape, 2, shape.context + 2, device)
        runner = bs.LlamaRunner(model, cache)
        prompt = [random.Random(11).randrange(1, model.config.vocab_size) for _ in range(shape.context)]
        bs.warm_up(runner, shape, device)
        rid, _ = cache.add_request(prompt)
        bs.prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
        cache.free(rid)
        pages = len(cache.evictable_pages())
        with tempfile.TemporaryDirectory() as directory:
            host = HostTier(max(2 * pages, 1) * cache.blob_bytes, cache.blob_bytes)
            file = FileTier(os.path.join(directory, "f"), 64 * pages * cache.blob_bytes + (1 << 20), cache.fingerprint)
            for name, tiers in (("host", (host, None)), ("file", (None, file)), ("file2", (None, file))):
                tiered = TieredCache(cache, *tiers, background=False)
                t0 = time.perf_counter()
                moved = tiered.offload(max_pages=len(cache.evictable_pages()))
                tiered.flush()
                offload_s = time.perf_counter() - t0
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                rid, hit = tiered.add_request(prompt)
                restore_s = time.perf_counter() - t0
                bs.prefill_all(runner, rid, prompt, shape.prefill_chunk, device)
                prof.disable()
                total = time.perf_counter() - t0
                print(f"== {codec[:40]} {name}: moved {moved} pages, offload {offload_s:.3f} s; add_request "
                      f"{restore_s:.3f} s, to first token {total:.3f} s, hit {hit}", flush=True)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(28)
                with open(os.path.join(out_dir, f"{name}_{codec.partition(':')[0]}.prof.txt"), "w") as f:
                    f.write(text.getvalue())
                print("\n".join(line[:150] for line in text.getvalue().splitlines()[6:34]), flush=True)
                tiered.free(rid)
                tiered.close()
            host.close()
            file.close()
        del cache, runner
        bs.release(device)


if __name__ == "__main__":
    main(sys.argv[1])
