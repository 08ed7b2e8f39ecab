"""cProfile of one host-tier restore of a 32K-token prefix (Llama-8B geometry), on the GPU:
    python3 perf/profile_restore.py
"""
import cProfile
import pstats
import struct
import time

import torch
from kvbackend import CacheConfig, Geometry, KVCache
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.prefetch import TieredCache
geometry = Geometry(32, 8, 128, torch.bfloat16)
tokens=32768; pages=tokens//64
cache = KVCache(geometry, CacheConfig(codec="rtn:bits=2,group=64,scale=fp8", page_size=64, chunk_pages=16, dense_pages=4, packed_pages=pages + 8, device="cuda"))
prompt = list(range(tokens + 1))
keys = cache.prefix_keys(prompt)[:pages]
host = HostTier(cache.blob_bytes * pages, cache.blob_bytes)
part = geometry.num_layers * cache.layout.page_bytes
payload = torch.randint(0, 255, (cache.blob_bytes,), dtype=torch.uint8)
blobs=[]
for j in range(pages):
    blob = payload[: part + 16].clone()
    blob[part:part+16] = torch.frombuffer(bytearray(struct.pack("<QQ", j // 16, 0)), dtype=torch.uint8)
    blobs.append(blob)
host.put(keys, blobs).wait()
tiered = TieredCache(cache, host, None, background=False)
for rep in range(4):
    for page, _ in cache.evictable_pages(): cache.drop_cached(page)
    torch.cuda.synchronize()
    pr=cProfile.Profile(); t=time.perf_counter(); pr.enable(); tiered.restore(prompt); pr.disable(); torch.cuda.synchronize(); ms=(time.perf_counter()-t)*1e3
    print("restore ms", ms)
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
