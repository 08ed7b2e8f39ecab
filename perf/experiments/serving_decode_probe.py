"""Why the serving cache's decode layer is slower than the kernel benchmark's at the same (B, L) (CUDA): the serving
bench's cache (`perf/bench_serving.py`: 32K-token requests, 2048-token chunks, copies of one request's pages under
other keys) at batch B, one layer's decode through the backend timed with CUDA graphs, beside timing-only variants
of the same plan (their outputs are wrong on purpose, only their times are kept):

- ``as served``: the plan as the step makes it (default grid);
- ``one codebook``: every packed page reads codebook slot 0 (the benchmark's pages share one codebook);
- ``no dense``: the dense pages dropped from the plan (each request's active chunk);
- ``one request's pages``: every request reads the first request's page ids (the benchmark's pages repeat);
and `perf/bench_kernels.py`'s layout (one 4096-token chunk repeated, `lever_case`) at the same (B, L).

    python3 perf/experiments/serving_decode_probe.py --out OUT.json [--batch 46]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/ for the benches
from bench_kernels import graph_time, lever_case  # noqa: E402
from bench_serving import Shape, fill_random, make_cache, requests_like  # noqa: E402

from kvbackend.kernels.paged_decode import paged_decode  # noqa: E402
from kvbackend.rope import Rotary  # noqa: E402
from kvbackend.spec import RECOMMENDED_PAGE_SPEC  # noqa: E402


class _Model:  # what `make_cache` reads of a model: its config and dtype (no weights)
    def __init__(self, context: int):
        from transformers import LlamaConfig

        self.config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                  num_key_value_heads=8, head_dim=128, num_hidden_layers=32, vocab_size=128256,
                                  max_position_embeddings=2 * context, rope_theta=500000.0)
        self.dtype = torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=46)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--codec", default=RECOMMENDED_PAGE_SPEC)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    shape = Shape(args.context, 40 << 30, 64, 32, 64, 3, 8192, 16384, 2048, 0, 32, 4)
    model = _Model(args.context)
    cache = make_cache(model, args.codec, shape, args.batch, shape.context + 64, args.device)
    first, _ = cache.add_request(list(range(shape.context)))
    fill_random(cache, first, shape.context, 0, 32)
    ids = [first] + requests_like(cache, first, args.batch - 1, shape.context, 1000, 32)
    layer = 3
    plan = cache.plan(ids, layer)
    backend = cache.backends[layer]
    q = torch.randn(args.batch, 32, 128, device=args.device).bfloat16()
    pages, books, dense = cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer]
    rotary = cache.frames[layer].rotary
    kinds = plan.kinds.cpu()
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "batch": args.batch, "codec": args.codec,
           "max_pages": plan.max_pages, "min_pages": plan.min_pages, "work_pages": int(kinds.numel()),
           "dense_pages": int((kinds == 1).sum()), "codebook_slots": int(plan.slots.unique().numel()),
           "page_bytes": int(pages.shape[1]), "codebook_bytes": int(books.shape[1]),
           "dense_tokens_per_request": [int(cache.page_table(r).dense_tokens(layer)) for r in ids[:3]], "us": {}}
    print({k: v for k, v in out.items() if k != "us"}, flush=True)

    def timed(name, p):
        def call():
            return paged_decode(q, pages, books, dense, backend.schemes, p, levers=backend.levers, rotary=rotary)
        try:
            us = 1e3 * graph_time([call])
        except Exception as exc:  # said, the other rows stand
            print(f"{name}: {type(exc).__name__}: {exc}"[:300], flush=True)
            return
        out["us"][name] = round(us, 1)
        print(f"{name:24s} {us:8.1f} us", flush=True)

    timed("as served", plan)
    timed("one codebook", dataclasses.replace(plan, slots=torch.where(plan.kinds == 0, plan.slots[0], plan.slots)))
    # the same requests without their dense pages (packed pages come first in each request's run)
    counts = plan.req_packed.clone()
    timed("no dense", dataclasses.replace(plan, req_pages=counts, max_pages=int(counts.max()),
                                          min_pages=int(counts.min())))
    first_run = plan.page_ids[: int(plan.req_pages[0])]
    same = plan.page_ids.clone()
    for b in range(args.batch):
        s, n = int(plan.req_start[b]), int(plan.req_pages[b])
        same[s: s + n] = first_run[:n]
    timed("one request's pages", dataclasses.replace(plan, page_ids=same))
    del cache
    if args.device != "cuda":
        return
    torch.cuda.empty_cache()
    case = lever_case(args.codec, args.batch, args.context, 32, 8, 128, 64, Rotary.default(128, 500000.0))
    lv = case.levers
    out["bench_layout_us"] = round(1e3 * graph_time([
        lambda j=j: paged_decode(case.qs[j], case.pages, case.books, case.dense, case.schemes, case.plans[j],
                                 levers=lv, rotary=Rotary.default(128, 500000.0)) for j in range(case.rotations)]), 1)
    print(f"{'benchmark layout':24s} {out['bench_layout_us']:8.1f} us", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
