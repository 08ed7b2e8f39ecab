"""Small odd-shaped caches shared by the kernel tests (kept small: the CPU interpreter is slow)."""

import torch

from kvbackend import CacheConfig, Geometry, KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filled_cache(codec: str, head_dim: int, page_size: int, lengths, heads: int = 2, layers: int = 2,
                 backend: str = "torch", chunk_pages: int = 2, dtype=torch.bfloat16, seed: int = 0,
                 v_scale: float = 1.0):
    """A cache holding one request per length; lengths end mid-page and mid-chunk. ``codec`` is one
    spec, or a tuple of one spec per layer; values are Gaussian times ``v_scale``."""
    gen = torch.Generator().manual_seed(seed)
    pages = max(64, sum(-(-n // page_size) + chunk_pages for n in lengths))  # room for every request at once
    geometry = Geometry(layers, heads, head_dim, dtype)
    which = {"layer_codecs": codec} if isinstance(codec, tuple) else {"codec": codec}
    cache = KVCache(geometry, CacheConfig(**which, page_size=page_size, chunk_pages=chunk_pages, dense_pages=pages,
                                          packed_pages=pages, device=DEVICE, backend=backend))
    ids = []
    for n in lengths:
        rid, _ = cache.add_request()
        for layer in range(layers):
            k = (torch.randn(n, heads, head_dim, generator=gen) * 2).to(dtype).to(DEVICE)
            v = (torch.randn(n, heads, head_dim, generator=gen) * v_scale).to(dtype).to(DEVICE)
            cache.append(rid, layer, k, v)
        ids.append(rid)
    return cache, ids


def lever_request(gen: torch.Generator, n: int, heads: int, head_dim: int, ratio: int, rotary):
    """K (post-RoPE, four channels offset), V (one channel scaled) and queries of one request's ``n`` tokens, bf16 on
    DEVICE: the data the lever and tensor-core tests append."""
    k = torch.randn(heads, n, head_dim, generator=gen)
    k[..., :4] += 6
    k = rotary.rotate(k, torch.arange(n)).transpose(0, 1)
    v = torch.randn(n, heads, head_dim, generator=gen)
    v[..., 3] *= 8
    q = torch.randn(n, heads * ratio, head_dim, generator=gen)
    return k.bfloat16().to(DEVICE), v.bfloat16().to(DEVICE), q.bfloat16().to(DEVICE)

