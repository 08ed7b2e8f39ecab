"""Property test: random operation sequences over a tiered cache with tiny pools, checked against a
pure-Python model after every step.

The model is simple because K/V are a pure function of the token chain: the key and value of token i
of layer l are drawn from a generator seeded by (tokens[: i + 1], l). Any two requests that share a
prefix therefore share its K/V, so every page the cache reuses, restores from a lower tier or keeps
cached must read back as exactly the model's values (the identity codec stores them losslessly).
A codebook codec is checked against the reconstruction first read from the same page bytes: wherever
those bytes go (another request, a lower tier and back), they must decode with their own chunk's codebook.
After every step every invariant of the pools holds; at the end no page and no slot is leaked.
"""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbackend import CacheConfig, CacheFull, Geometry, KVCache
from kvbackend.tiers.file import FileTier
from kvbackend.tiers.host import HostTier
from kvbackend.tiers.prefetch import TieredCache

GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
P = 2  # tokens per page; chunks of 2 pages
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 2, 2, 2, 2]]


@lru_cache(maxsize=None)
def token_kv(chain: tuple[int, ...], layer: int) -> torch.Tensor:
    """[2, H, D]: the key and value of the chain's last token in ``layer``."""
    gen = torch.Generator().manual_seed(hash((chain, layer)) & (2**62 - 1))
    return torch.randn(2, GEOM.num_kv_heads, GEOM.head_dim, generator=gen)


def chain_kv(tokens: list[int], start: int, stop: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = [token_kv(tuple(tokens[: i + 1]), layer) for i in range(start, stop)]
    kv = torch.stack(kv) if kv else torch.zeros(0, 2, GEOM.num_kv_heads, GEOM.head_dim)
    return kv[:, 0], kv[:, 1]


class Harness:
    """A tiered cache plus the model: per live request, its token ids and how many have K/V."""

    def __init__(self, tmp_dir: str, codec: str, packed_pages: int, slots: int, host_pages: int) -> None:
        self.cache = KVCache(GEOM, CacheConfig(codec=codec, page_size=P, chunk_pages=2, dense_pages=10,
                                               packed_pages=packed_pages, codebook_slots=slots))
        self.exact = codec == "identity"
        self.host = HostTier(host_pages * self.cache.blob_bytes, self.cache.blob_bytes, pin=False)
        self.file = FileTier(tmp_dir, 12 * self.cache.blob_bytes, self.cache.fingerprint, fsync=False)
        self.tiered = TieredCache(self.cache, self.host, self.file, background=False)
        self.requests: dict[int, list[int]] = {}  # request id -> token ids (those with K/V written)
        self.pending: dict[int, list[int]] = {}  # request id -> tokens still to append
        self.reconstruction: dict[tuple, tuple] = {}  # codebook codecs: (layer, page bytes) -> first read

    # -- operations ---------------------------------------------------------------------------
    def add(self, pick: int) -> None:
        tokens = PROMPTS[pick % len(PROMPTS)]
        if pick % 3 == 0:
            self.tiered.prefetch(tokens).wait(timeout=30)
        rid, cached = self.tiered.add_request(tokens)
        assert cached % P == 0 and cached <= len(tokens) - 1
        self.requests[rid] = list(tokens[:cached])
        self.pending[rid] = list(tokens[cached:])

    def append(self, rid: int, n: int) -> None:
        tokens, todo = self.requests[rid], self.pending[rid]
        if not todo:  # generate: new token ids are known to the cache, so their pages get hashed too
            todo.extend((len(tokens) + j) % 3 for j in range(n))
            self.cache.extend_tokens(rid, todo)
        new = todo[:n]
        full = tokens + new
        try:
            for layer in range(GEOM.num_layers):
                k, v = chain_kv(full, len(tokens), len(full), layer)
                self.tiered.append(rid, layer, k, v)
        except CacheFull:
            assert layer == 0, "CacheFull after the first layer was written"  # nothing written: model unchanged
            return
        tokens.extend(new)
        del todo[:n]

    def fork(self, rid: int) -> None:
        try:
            new = self.cache.fork(rid)
        except CacheFull:
            return
        self.requests[new] = list(self.requests[rid])
        self.pending[new] = list(self.pending[rid])

    def free(self, rid: int) -> None:
        self.tiered.free(rid)
        del self.requests[rid], self.pending[rid]

    def offload(self, n: int) -> None:
        self.tiered.offload(max_pages=n)
        self.tiered.flush()

    def evict(self, n: int) -> None:
        (self.host if n % 2 else self.file).evict(n)

    # -- checks ---------------------------------------------------------------------------------
    def verify(self) -> None:
        cache = self.cache
        cache.check()
        self.host.check()
        for rid, tokens in self.requests.items():
            table = cache.page_table(rid)
            assert table.num_tokens == len(tokens)
            for layer in range(GEOM.num_layers):
                k, v = cache.read(rid, layer)
                if self.exact:
                    ek, ev = chain_kv(tokens, 0, len(tokens), layer)
                    assert torch.equal(k, ek) and torch.equal(v, ev), f"request {rid} layer {layer}"
                    continue
                pk, pv = cache.read_packed(rid, layer)
                for i, page in enumerate(table.packed):  # each page's bytes read as they did when first packed
                    key = (layer, bytes(cache.packed.pages[layer][page].numpy()))
                    got = (pk[i * P : (i + 1) * P], pv[i * P : (i + 1) * P])
                    first = self.reconstruction.setdefault(key, got)
                    assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), f"page {i} of {rid}"

    def finish(self) -> None:
        for rid in list(self.requests):
            self.free(rid)
        self.tiered.close()
        cache = self.cache
        cache.check()
        stats = cache.stats()
        assert stats.dense_pages_used == 0 and stats.packed_pages_used == 0 and stats.requests == 0
        for page, _ in cache.evictable_pages():  # every remaining page is cached, and only it holds slots
            cache.drop_cached(page)
        cache.check()
        assert cache.stats().codebook_slots_used == 0 and cache.packed.slots.num_free == cache.packed.slots.num_pages
        assert not cache.packed.slot_of_chunk


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "append", "fork", "free", "offload", "evict"]),
                         st.integers(0, 11), st.integers(1, 5)), min_size=5, max_size=40)


def run(tmp_path, ops, codec: str, packed_pages: int, slots: int, host_pages: int) -> None:
    directory = tmp_path / f"tier{random.getrandbits(32)}"
    h = Harness(str(directory), codec, packed_pages, slots, host_pages)
    try:
        for op, pick, n in ops:
            live = sorted(h.requests)
            if op == "add" or not live:
                h.add(pick)
            elif op == "append":
                h.append(live[pick % len(live)], n)
            elif op == "fork":
                h.fork(live[pick % len(live)])
            elif op == "free":
                h.free(live[pick % len(live)])
            elif op == "offload":
                h.offload(n)
            else:
                h.evict(n)
            h.verify()
        h.finish()
    finally:
        h.tiered.close()
        h.file.close()


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(OPS, st.sampled_from([(6, 2, 3), (8, 3, 2), (12, 7, 8)]))
def test_identity_reads_back_exactly(tmp_path, ops, sizes):
    run(tmp_path, ops, "identity", *sizes)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(OPS, st.sampled_from([(6, 2, 3), (8, 3, 2)]))
def test_codebook_pages_never_change(tmp_path, ops, sizes):
    run(tmp_path, ops, "qvg:centroids=2,group=8", *sizes)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(OPS, st.sampled_from([(6, 2, 3), (8, 3, 2), (12, 7, 8)]), st.sampled_from(["identity", "qvg:centroids=2,group=8"]))
def test_many_sequences(tmp_path, ops, sizes, codec):
    run(tmp_path, ops, codec, *sizes)
