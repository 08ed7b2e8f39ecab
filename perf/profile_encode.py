"""Where the GPU time of one chunk encode goes: the CUDA kernels of `encode_chunk`, by total time.

    python3 perf/profile_encode.py [SPEC ...] > $OUT/profile_encode.txt

4096 tokens, 8 KV heads, head_dim 128, page 64 (the bench's encode shape), warm-started like a
request's second chunk; 10 encodes profiled after 3 of warm-up.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvbackend import Geometry, codecs
from kvbackend.codecs.base import CodecState
from kvbackend.kernels.chunk_encoder import encode_chunk


def main(specs: list[str]) -> None:
    heads, dim, page, tokens = 8, 128, 64, 4096
    for spec in specs:
        codec = codecs.get(spec)
        layout = codec.layout(Geometry(1, heads, dim, torch.bfloat16), page)
        k = torch.randn(tokens, heads, dim, device="cuda").bfloat16()
        v = torch.randn(tokens, heads, dim, device="cuda").bfloat16()
        pages = torch.zeros(tokens // page, layout.page_bytes, dtype=torch.uint8, device="cuda")
        book = torch.zeros(layout.codebook_bytes, dtype=torch.uint8, device="cuda")
        ids = torch.arange(tokens // page, dtype=torch.int32, device="cuda")
        state = CodecState()
        for _ in range(3):
            encode_chunk(codec, layout, k, v, state, pages, ids, book)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                encode_chunk(codec, layout, k, v, state, pages, ids, book)
            torch.cuda.synchronize()
        print(f"== {spec}: 10 encodes")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:] or ["qvg:centroids=256,iters=3", "kivi:bits=2,group=64"])
