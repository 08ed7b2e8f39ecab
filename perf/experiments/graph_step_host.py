"""Where the host time of a decode step with CUDA graphs goes (serving bench geometry, one cache at a time).

    python perf/experiments/graph_step_host.py --batch 9 --out $OUT/graph_step_host.txt

Per cache: the median of 5 graph steps, the summed kernel time of one, then cProfile of one step (host functions by
own time) and the CUDA-launch count of one step from torch.profiler.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_serving import CACHES, Shape, fill_random, llama, make_cache, release, requests_like, step_kernel_ms  # noqa: E402

from kvbackend.tools.llama_runner import LlamaRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default="|".join(CACHES))
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--switch", default="", help="an environment switch (kvbackend.switches) whose steps are timed "
                        "off and on, interleaved, beside the default ones")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = llama(False, "cuda", torch.bfloat16, args.context + 64)
    heads = model.config.num_attention_heads
    shape = Shape(args.context, 0, 64, 32, args.batch, 5, 0, 0, 2048, 0, 0, 0)
    report = []
    for codec in args.caches.split("|"):
        cache = make_cache(model, codec, shape, args.batch, args.context + 64, "cuda")
        first, _ = cache.add_request(list(range(args.context)))
        fill_random(cache, first, args.context, 0, heads)
        ids = [first] + requests_like(cache, first, args.batch - 1, args.context, 1000, heads)
        runner = LlamaRunner(model, cache, cuda_graphs=True)
        tokens = torch.zeros(len(ids), dtype=torch.long)

        def timed(n: int) -> list[float]:
            """``n`` graph steps after one untimed, each to the device's end, in ms."""
            runner.decode(ids, tokens)
            torch.cuda.synchronize()
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                runner.decode(ids, tokens)
                torch.cuda.synchronize()
                out.append((time.perf_counter() - t0) * 1e3)
            return out

        runner.decode(ids, tokens)  # (the capture)
        times = timed(5)
        if args.switch:  # A/B in one process: rounds of 5 steps with the switch off, then as it was set
            ab, before = {"off": [], "on": []}, os.environ.get(args.switch)
            for _ in range(args.rounds):
                for side in ("off", "on"):
                    if side == "off":
                        os.environ[args.switch] = "0"
                    elif before is None:
                        os.environ.pop(args.switch, None)
                    else:
                        os.environ[args.switch] = before
                    ab[side] += timed(5)
            medians = {side: sorted(t)[len(t) // 2] for side, t in ab.items()}
            line = (f"{codec}: B={len(ids)} {args.switch}=0: median {medians['off']:.2f} ms, as set: "
                    f"{medians['on']:.2f} ms ({args.rounds} interleaved rounds of 5 graph steps; "
                    f"off {[round(t, 1) for t in ab['off']]}, on {[round(t, 1) for t in ab['on']]})")
            print(line, flush=True)
            report.append(line)
        kernel = step_kernel_ms(runner, ids, tokens)
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        runner.decode(ids, tokens)
        profiler.disable()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.decode(ids, tokens)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        line = (f"{codec}: B={len(ids)} graph step median {sorted(times)[2]:.1f} ms (all {[round(t, 1) for t in times]}), "
                f"kernels {kernel:.1f} ms, host time of a step under cProfile {host:.1f} ms")
        print(line, flush=True)
        report += [line, text.getvalue(), table]
        del cache, runner
        release("cuda")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main()
