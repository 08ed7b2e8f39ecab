"""Attacks on the mixed encode pass: `kvbackend.kernels.unit_encoder.encode_mixed` (chunks of several QVG-family
codecs that share a `clustering_key`, clustered in one pass), `TritonBackend.encode_mixed` (checks, padding of
partial pages, the value budget) and `KVCache`'s batching of a per-layer plan's groups into one mixed pass.

What is attacked: specs that must not share a clustering; parts whose states differ in warmth or in query
statistics; levers (sink, vrot, prerope, pagerope) that differ between merged groups, in interleaved layer
orders, in a bf16 cache; 3-bit keys; a QVG (not QuantWM) mix; partial last pages; a value budget that forces
the per-group fallback; random seeding (cold chunks refused, warm ones mixed); keys that the stored frame
turns non-finite; an exception midway through a pass; the states' `iterations`; and whether the pass builds
index tensors from host data (which a CUDA graph capture of it, `GraphedEncoder.mixed`, cannot hold).

Byte-for-byte comparisons hold in Triton's interpreter only (CUDA's TF32 k-means distances tie differently),
so the module runs on the CPU. The references: the same cache with mixing disabled (`TritonBackend.encode_mixed`
returning None: each group through its own `encode_units`), or each part's own `encode_units`.
"""

import logging
import math

import pytest
import torch

from kvbackend import codecs
from kvbackend.backends import TritonBackend
from kvbackend.codecs.base import CodecState
from kvbackend.errors import InvalidKV
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.manager import KVCache
from kvbackend.psac import query_second_moment
from kvbackend.rope import Rotary
from kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="byte-for-byte comparisons hold in Triton's interpreter")

from kvbackend.kernels import unit_encoder  # noqa: E402  (after the skip: needs triton)
from kvbackend.kernels.unit_encoder import Part, clustering_key, encode_mixed, encode_units  # noqa: E402

HEADS, D, PAGE = 2, 64, 16
# a small recommended-style spec: per-channel clipped keys, sparse PSAC rows, fp8 centroids, key outliers
BASE = "quantwm:kchannel=16,rank=4,keep=0.25,centroids=8,clip=true,vcluster=false,cdtype=fp8,outliers=4"
NO_OUT = BASE.replace("outliers=4", "outliers=0")
K3 = BASE + ",kbits=3"  # 3-bit keys: 8 codes in 3 bytes
# QVG with clustered values and two stages (kernel_encodes is False, so a Triton cache batches it)
QVG = "qvg:centroids=8,cdtype=fp8,clip=true,stages=2,kchannel=16"


# -- helpers -------------------------------------------------------------------------------------------------------
def _fill(specs, *, chunks=2, dtype=torch.float32, queries=None, seed=5, check_finite=True, k_of=None):
    """A Triton cache with one codec spec per layer and one request of ``chunks`` 32-token chunks appended in
    16-token steps (queries for the layers in ``queries``, None: all). ``k_of(layer, step, k)``: replaces keys.
    Returns (cache, request id, the exact K and V appended per layer)."""
    layers = len(specs)
    config = CacheConfig(layer_codecs=tuple(specs), page_size=PAGE, chunk_pages=2, dense_pages=32, packed_pages=32,
                         backend="triton", device=DEVICE, check_finite=check_finite)
    cache = KVCache(Geometry(layers, HEADS, D, dtype), config, rotary=Rotary.default(D, 10000.0))
    gen = torch.Generator().manual_seed(seed)
    rid, _ = cache.add_request()
    exact = [([], []) for _ in range(layers)]
    for step in range(2 * chunks):
        for layer in range(layers):
            k = torch.randn(16, HEADS, D, generator=gen) * torch.logspace(-1, 1, D) * 2
            v = torch.randn(16, HEADS, D, generator=gen)
            q = torch.randn(16, 2 * HEADS, D, generator=gen)
            if k_of is not None:
                k = k_of(layer, step, k)
            k, v = k.to(dtype), v.to(dtype)
            cache.append(rid, layer, k, v, queries=q if queries is None or layer in queries else None)
            exact[layer][0].append(k)
            exact[layer][1].append(v)
    return cache, rid, [(torch.cat(k), torch.cat(v)) for k, v in exact]


def _assert_same_cache(a, ra, b, rb):
    """Same packed pages, codebook slots and reads in every layer."""
    pages = a.page_table(ra).packed
    assert pages and pages == b.page_table(rb).packed
    for layer in range(a.geometry.num_layers):
        assert torch.equal(a.packed.pages[layer][pages], b.packed.pages[layer][pages]), layer
        assert torch.equal(a.packed.codebooks[layer], b.packed.codebooks[layer]), layer
        for x, y in zip(a.read(ra, layer), b.read(rb, layer)):
            assert torch.equal(x, y), layer
        sa, sb = a.page_table(ra).states[layer], b.page_table(rb).states[layer]
        assert sa.centroids.keys() == sb.centroids.keys()
        assert all(torch.equal(sa.centroids[p], sb.centroids[p]) for p in sa.centroids), layer


@pytest.fixture
def spy(monkeypatch):
    """Records every `unit_encoder.encode_mixed` call: (parts' spec strings, what it returned or raised)."""
    calls = []
    original = unit_encoder.encode_mixed

    def wrapped(parts, *args):
        specs = [part.codec.spec_string for part in parts]
        try:
            out = original(parts, *args)
        except Exception as exc:
            calls.append((specs, type(exc)))
            raise
        calls.append((specs, out))
        return out

    monkeypatch.setattr(unit_encoder, "encode_mixed", wrapped)
    return calls


def _apart(monkeypatch):
    """Each group of a Triton cache through its own `encode_units` (no mixed pass)."""
    monkeypatch.setattr(TritonBackend, "encode_mixed", lambda *a: None)


def _with(spec: str, option: str) -> str:
    """``spec`` with ``option`` (NAME=VALUE) set."""
    name, options = spec.split(":")
    kept = [o for o in options.split(",") if o.split("=")[0] != option.split("=")[0]]
    return f"{name}:{','.join(kept + [option])}"


def _layout(codec):
    return codec.layout(Geometry(1, HEADS, D, torch.float32), PAGE)


def _moment_states(units, warm_from=None, queries=True, seed=3):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for u in range(units):
        st = CodecState() if warm_from is None else warm_from[u].clone()
        if queries:
            st.query_moment = query_second_moment(torch.randn(4, 40, D, generator=gen), HEADS)
        out.append(st)
    return out


# -- what must not merge, and refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["centroids=16", "iters=2", "stages=2", "cdtype=bf16", "kchannel=0", "group=32",
                                    "bits=4", "vbits=4", "clip=false", "seed=1", "init=random", "rank=2",
                                    "keep=0.5", "candidates=2", "scale=fp16", "vcluster=true"])
def test_specs_that_cluster_differently_get_other_keys(change):
    base = codecs.get(BASE)
    other = codecs.get(_with(BASE, change))
    name = change.split("=")[0]
    assert getattr(other.spec, name) != getattr(base.spec, name)
    assert clustering_key(other) != clustering_key(base)


def test_only_key_width_outliers_and_levers_share_a_key():
    key = clustering_key(codecs.get(BASE))
    for spec in (NO_OUT, K3, BASE + ",kbits=2", BASE + ",sink=4,vrot=hadamard", BASE + ",prerope=true",
                 BASE + ",pagerope=true"):
        assert clustering_key(codecs.get(spec)) == key, spec
    assert clustering_key(codecs.get(BASE.replace("quantwm:", "qvg:").split(",rank")[0])) != key  # another codec
    assert clustering_key(codecs.get(QVG)) == clustering_key(codecs.get(QVG + ",kbits=3"))
    assert clustering_key(codecs.get("kivi:bits=2,group=16")) is None


@pytest.mark.parametrize("case", ["warm and cold", "queries and none", "random seeding, cold", "QSAC"])
def test_a_refused_mixed_pass_touches_nothing(case):
    """Parts that share a key but whose states differ across the parts (each part alike within itself), cold
    parts under random seeding, or per-token keys with query statistics (QSAC chooses the assignment): False,
    and no page, codebook or state changed."""
    spec_a, spec_b = {"random seeding, cold": (BASE + ",init=random", K3 + ",init=random"),
                      "QSAC": (_with(BASE, "kchannel=0"), _with(NO_OUT, "kchannel=0"))}.get(case, (BASE, K3))
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * 2 * PAGE, HEADS, D, generator=gen)
    v = torch.randn(2 * 2 * PAGE, HEADS, D, generator=gen)
    states = _moment_states(2, queries=case != "queries and none")
    if case == "warm and cold":
        states[1].centroids["k"] = torch.randn(1, HEADS, 8, D, generator=gen)
    if case == "queries and none":
        states[1].query_moment = query_second_moment(torch.randn(4, 40, D, generator=gen), HEADS)
    before = [st.clone() for st in states]
    parts = []
    for spec, at in ((spec_a, [1]), (spec_b, [0])):
        codec = codecs.get(spec)
        layout = _layout(codec)
        # each part alone is encodable (its own states are alike), so the refusal is the mix's (random seeding
        # of cold chunks and QSAC are refused alone too)
        assert unit_encoder.supports(codec, layout, [states[u] for u in at]) == (case in ("warm and cold",
                                                                                          "queries and none"))
        parts.append(Part(codec, layout, torch.full((2, layout.page_bytes), 7, dtype=torch.uint8),
                          torch.full((1, layout.codebook_bytes), 7, dtype=torch.uint8), at))
    assert not encode_mixed(parts, k, v, states)
    assert all(bool((p.pages == 7).all()) and bool((p.codebooks == 7).all()) for p in parts)
    for a, b in zip(states, before):
        assert a.iterations == b.iterations and a.centroids.keys() == b.centroids.keys()
        assert all(torch.equal(a.centroids[p], b.centroids[p]) for p in a.centroids)
        assert (a.query_moment is None) == (b.query_moment is None)


# -- the backend's mixed pass: partial pages, 3-bit keys, codebooks, non-finite values -----------------------------
def test_the_backends_mixed_pass_pads_partial_pages_as_each_part_alone():
    """`TritonBackend.encode_mixed` of 4 layers' 37-token chunks (a partial last page, padded) as parts of three
    codecs (one with 3-bit keys), cold then warm with query statistics: each part's pages and codebooks are
    its own `TritonBackend.encode_units`' bytes, the new centroids too; then a non-finite value in one layer:
    InvalidKV, no state touched."""
    specs = {BASE: [0, 2], K3: [3], NO_OUT: [1]}
    built = {spec: codecs.get(spec) for spec in specs}
    layouts = {spec: _layout(c) for spec, c in built.items()}
    backend = TritonBackend(built[BASE], layouts[BASE])
    gen = torch.Generator().manual_seed(2)
    mixed_states = _moment_states(4)
    alone_states = [st.clone() for st in mixed_states]
    for _ in range(2):  # cold, then warm
        k = (torch.randn(4, 2 * PAGE + 5, HEADS, D, generator=gen) * torch.logspace(-1, 1, D)).bfloat16()
        v = torch.randn(4, 2 * PAGE + 5, HEADS, D, generator=gen).bfloat16()
        k[2, -3:] = k[2, -4]  # a trailing run of equal keys in a partial page: only its first may take outliers
        parts = [(built[s], layouts[s], at) for s, at in specs.items()]
        out = backend.encode_mixed(parts, k, v, mixed_states)
        assert out is not None and len(out) == 3
        for (spec, at), (pages, books) in zip(specs.items(), out):
            ref_pages, ref_books = backend.encode_units(built[spec], layouts[spec], k[at], v[at],
                                                        [alone_states[u] for u in at])
            assert pages.shape == ref_pages.shape == (len(at), 3, layouts[spec].page_bytes)
            assert torch.equal(pages, ref_pages), spec
            assert torch.equal(books, ref_books), spec
        for a, b in zip(mixed_states, alone_states):
            assert torch.equal(a.centroids["k"], b.centroids["k"])
    before = [st.clone() for st in mixed_states]
    v[3, 7, 1, 5] = float("nan")
    with pytest.raises(InvalidKV):
        backend.encode_mixed(parts, k, v, mixed_states)
    for a, b in zip(mixed_states, before):
        assert a.iterations == b.iterations and torch.equal(a.centroids["k"], b.centroids["k"])


# -- the cache: merged groups with other levers, interleaved; a QVG mix; budgets; missing queries; seeding ----------
def test_groups_with_other_levers_interleaved_in_a_bf16_cache_read_back_as_apart(monkeypatch, spy):
    """Layers of four specs of one clustering (levers sink+vrot, pagerope, none; 3-bit keys), interleaved
    (A B K A C K), in a bf16 cache (levered groups are stored in float32, plain ones in bf16, concatenated into
    one pass): one mixed pass of four parts per chunk, and the pages, codebooks, reads and centroids of the same
    cache encoding each group apart."""
    a, b = BASE + ",sink=4,vrot=hadamard", NO_OUT + ",pagerope=true"
    specs = [a, b, K3, a, NO_OUT, K3]
    mixed, r1, exact = _fill(specs, dtype=torch.bfloat16)
    assert [len(s) for s, _ in spy] == [4, 4] and all(out is True for _, out in spy)
    _apart(monkeypatch)
    apart, r2, _ = _fill(specs, dtype=torch.bfloat16)
    assert len(spy) == 2
    _assert_same_cache(mixed, r1, apart, r2)
    for layer in (0, 3):  # the sinks: exact (bf16 cache)
        k, v = mixed.read(r1, layer)
        assert torch.equal(k[:4], exact[layer][0][:4]) and torch.equal(v[:4], exact[layer][1][:4])
    for layer, (k0, v0) in enumerate(exact):  # nothing lost: a coarse bound on the error of every layer
        k, v = mixed.read(r1, layer)
        assert (k.float() - k0.float()).norm() < 0.5 * k0.float().norm()
        assert (v.float() - v0.float()).norm() < 0.6 * v0.float().norm()


def test_a_qvg_mix_and_the_budget_fallback_write_the_same_bytes(monkeypatch, spy):
    """A QVG mix (clustered values, two stages, 2/3/8/4-bit keys) in one pass per chunk; then the same cache with a
    value budget of one layer's chunk: the backend refuses the mixed pass (None), each group is encoded apart
    in slices of one layer, and every byte is the same."""
    import kvbackend.codecs.base as base

    specs = [QVG, QVG + ",kbits=3", QVG + ",kbits=8", QVG + ",kbits=4"]
    mixed, r1, _ = _fill(specs)
    assert [len(s) for s, _ in spy] == [4, 4] and all(out is True for _, out in spy)
    returned = []
    original = TritonBackend.encode_mixed
    monkeypatch.setattr(TritonBackend, "encode_mixed", lambda *a: returned.append(original(*a)) or returned[-1])
    monkeypatch.setattr(base, "CPU_UNIT_VALUES", 2 * PAGE * HEADS * D)  # one layer's chunk
    budget, r2, _ = _fill(specs)
    assert len(returned) == 2 and all(out is None for out in returned)
    assert len(spy) == 2  # the kernels' mixed pass never ran
    _assert_same_cache(mixed, r1, budget, r2)


def test_layers_without_query_statistics_are_encoded_apart_not_mixed(monkeypatch, spy):
    """Queries for layers 0 and 2 only: the states differ across the parts, so the mixed pass refuses (False),
    each group is encoded apart, and the bytes are those of the cache that never mixes."""
    specs = [BASE, K3, NO_OUT]
    mixed, r1, _ = _fill(specs, queries={0, 2})
    assert len(spy) == 2 and all(out is False for _, out in spy)
    _apart(monkeypatch)
    apart, r2, _ = _fill(specs, queries={0, 2})
    _assert_same_cache(mixed, r1, apart, r2)
    assert mixed.page_table(r1).states[1].query_moment is None


def test_random_seeding_is_refused_cold_and_mixed_warm(monkeypatch, spy):
    """init=random, and no query statistics anywhere (outliers weighed alike, no PSAC rows): the cold chunk is
    refused (no shared seed stream) and encoded chunk by chunk; the warm one is mixed; the bytes are those of
    the cache that never mixes."""
    specs = [BASE + ",init=random", K3 + ",init=random"]
    mixed, r1, _ = _fill(specs, queries=set())
    assert [out for _, out in spy] == [False, True]
    assert mixed.page_table(r1).states[0].query_moment is None
    _apart(monkeypatch)
    apart, r2, _ = _fill(specs, queries=set())
    _assert_same_cache(mixed, r1, apart, r2)


def test_a_reused_prefix_warm_starts_every_part_as_apart(monkeypatch, spy):
    """A second request that reuses the first's 32-token chunk (sinks, 3-bit keys, pre-RoPE keys among the
    parts) warm-starts every layer from that chunk's codebook slot and encodes its next chunk in one mixed pass:
    the same pages, codebooks and reads as the cache that never mixes."""
    specs = [BASE + ",sink=4", K3, NO_OUT + ",prerope=true"]
    tokens = list(range(1000, 1032))

    def run():
        config = CacheConfig(layer_codecs=tuple(specs), page_size=PAGE, chunk_pages=2, dense_pages=32,
                             packed_pages=32, backend="triton", device=DEVICE)
        cache = KVCache(Geometry(3, HEADS, D, torch.float32), config, rotary=Rotary.default(D, 10000.0))
        gen = torch.Generator().manual_seed(11)
        first, _ = cache.add_request(tokens)
        for layer in range(3):
            cache.append(first, layer, torch.randn(32, HEADS, D, generator=gen) * 2,
                         torch.randn(32, HEADS, D, generator=gen), queries=torch.randn(32, 2 * HEADS, D, generator=gen))
        second, cached = cache.add_request(tokens + [7])
        assert cached == 32 and cache.page_table(second).states[1].centroids  # warm from the shared slot
        for layer in range(3):
            cache.append(second, layer, torch.randn(32, HEADS, D, generator=gen) * 2,
                         torch.randn(32, HEADS, D, generator=gen), queries=torch.randn(32, 2 * HEADS, D, generator=gen))
        return cache, second

    mixed, r1 = run()
    assert [len(s) for s, _ in spy] == [3, 3] and all(out is True for _, out in spy)
    _apart(monkeypatch)
    apart, r2 = run()
    _assert_same_cache(mixed, r1, apart, r2)


# -- failures: non-finite stored keys, an exception midway ---------------------------------------------------------
def test_keys_the_stored_frame_turns_non_finite_leave_the_chunk_dense(monkeypatch, caplog):
    """Finite float32 keys near float32's largest value in a prerope layer of a mixed pass: de-rotated they
    overflow, so the pass raises InvalidKV before writing anything; the chunk stays dense, every layer reads
    back exactly what was appended, no state gains centroids, and the pools stay consistent."""
    specs = [BASE, K3 + ",prerope=true", NO_OUT]

    def huge(layer, step, k):
        return torch.full_like(k, 3e38) if layer == 1 else k

    raised = []
    original = TritonBackend.encode_mixed

    def backend_pass(*args):
        try:
            return original(*args)
        except InvalidKV as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(TritonBackend, "encode_mixed", backend_pass)
    # (`append` refuses such keys before they reach an encode now, `KVCache.kv_limits`; lifted here, so that the
    # encode's own refusal stays covered)
    monkeypatch.setattr(KVCache, "_limits", lambda self, layer: (math.inf, math.inf, ""))
    with caplog.at_level(logging.ERROR, logger="kvbackend.manager"):
        cache, rid, exact = _fill(specs, chunks=1, k_of=huge)
    assert raised  # the mixed pass (all three groups) refused the chunk, not a group's own encode
    assert "encoding a chunk" in caplog.text
    table = cache.page_table(rid)
    assert not table.packed and table.num_tokens == 2 * PAGE
    for layer, (k0, v0) in enumerate(exact):
        k, v = cache.read(rid, layer)
        assert torch.equal(k, k0) and torch.equal(v, v0)
        assert not table.states[layer].centroids and not table.states[layer].iterations
    cache.check()


def test_an_exception_midway_leaves_the_chunk_dense_and_recoverable(monkeypatch, spy, caplog):
    """A failure in the second part's key fields (after the clustering and the first part's pages): the chunk
    stays dense and reads back exactly; once the failure is gone the retry a page later packs it, and the reads
    are as close to the keys as an uninterrupted cache's."""
    specs = [BASE, K3, NO_OUT]
    fail = {"calls": 0, "on": True}
    original = unit_encoder._key_fields

    def flaky(*args):
        fail["calls"] += 1
        if fail["on"] and fail["calls"] == 2:
            raise RuntimeError("injected failure in the second part's key fields")
        return original(*args)

    monkeypatch.setattr(unit_encoder, "_key_fields", flaky)
    config = CacheConfig(layer_codecs=tuple(specs), page_size=PAGE, chunk_pages=2, dense_pages=32, packed_pages=32,
                         backend="triton", device=DEVICE)
    cache = KVCache(Geometry(3, HEADS, D, torch.float32), config)
    gen = torch.Generator().manual_seed(9)
    rid, _ = cache.add_request()
    exact = [([], []) for _ in range(3)]
    free_before = cache.packed.allocator.num_free
    with caplog.at_level(logging.ERROR, logger="kvbackend.manager"):
        for step in range(4):  # two 32-token chunks: the first fails once, then both pack
            if step == 2:
                table = cache.page_table(rid)
                assert not table.packed and "injected failure" in caplog.text
                assert cache.packed.allocator.num_free == free_before  # its pages (and slot) went back
                for layer in range(3):
                    k, v = cache.read(rid, layer)
                    assert torch.equal(k, torch.cat(exact[layer][0])) and torch.equal(v, torch.cat(exact[layer][1]))
                fail["on"] = False
            for layer in range(3):
                k = torch.randn(16, HEADS, D, generator=gen) * 2
                v = torch.randn(16, HEADS, D, generator=gen)
                cache.append(rid, layer, k, v, queries=torch.randn(16, 2 * HEADS, D, generator=gen))
                exact[layer][0].append(k)
                exact[layer][1].append(v)
    table = cache.page_table(rid)
    assert len(table.packed) == 4 and table.num_tokens == 64
    cache.check()
    for layer in range(3):
        k0, v0 = torch.cat(exact[layer][0]), torch.cat(exact[layer][1])
        k, v = cache.read(rid, layer)
        assert k.shape == k0.shape and (k - k0).norm() < 0.3 * k0.norm() and (v - v0).norm() < 0.6 * v0.norm()


def test_layers_left_cold_by_a_failed_group_are_not_mixed_with_warm_ones(monkeypatch, spy, caplog):
    """A first chunk encoded group by group whose 3-bit group fails once (the other group's states are warm by
    then): the retry a page later meets warm and cold states, so the mixed pass refuses (False) and the groups
    are encoded apart; the next chunk, all warm, is mixed; every read stays close to what was appended and
    the pools stay consistent."""
    specs = [BASE, K3, BASE]
    mixing = TritonBackend.encode_mixed
    units = TritonBackend.encode_units
    failed = []

    def flaky_units(self, codec, *args):
        if codec.spec.kbits == 3 and not failed:
            failed.append(codec)
            raise RuntimeError("injected failure of the 3-bit group")
        return units(self, codec, *args)

    monkeypatch.setattr(TritonBackend, "encode_mixed", lambda *a: None)  # the first attempt goes group by group
    monkeypatch.setattr(TritonBackend, "encode_units", flaky_units)
    config = CacheConfig(layer_codecs=tuple(specs), page_size=PAGE, chunk_pages=2, dense_pages=32, packed_pages=32,
                         backend="triton", device=DEVICE)
    cache = KVCache(Geometry(3, HEADS, D, torch.float32), config)
    gen = torch.Generator().manual_seed(13)
    rid, _ = cache.add_request()
    exact = [([], []) for _ in range(3)]
    with caplog.at_level(logging.ERROR, logger="kvbackend.manager"):
        for step in range(5):  # 80 tokens: the first chunk fails, packs with the third page, then the second chunk
            if step == 2:
                states = cache.page_table(rid).states
                assert failed and not cache.page_table(rid).packed
                assert states[0].centroids and not states[1].centroids  # warm and cold layers in one request
                monkeypatch.setattr(TritonBackend, "encode_mixed", mixing)
            for layer in range(3):
                k = torch.randn(16, HEADS, D, generator=gen) * 2
                v = torch.randn(16, HEADS, D, generator=gen)
                cache.append(rid, layer, k, v, queries=torch.randn(16, 2 * HEADS, D, generator=gen))
                exact[layer][0].append(k)
                exact[layer][1].append(v)
    assert "injected failure" in caplog.text
    assert [out for _, out in spy] == [False, True]  # the retry refused (warm and cold), the next chunk mixed
    assert len(cache.page_table(rid).packed) == 4
    cache.check()
    for layer in range(3):
        k0, v0 = torch.cat(exact[layer][0]), torch.cat(exact[layer][1])
        k, v = cache.read(rid, layer)
        assert torch.equal(k[64:], k0[64:]) and torch.equal(v[64:], v0[64:])  # the dense tail, exact
        assert (k - k0).norm() < 0.3 * k0.norm() and (v - v0).norm() < 0.6 * v0.norm()


# -- defects found in review, and their fixes -----------------------------------------------------------------------
def test_each_state_records_the_passs_lloyd_steps():
    """Two parts, one chunk each: part 0's keys are 8 distinct rows per head (k-means settles at once), part 1's
    random. Each state records the mixed pass's Lloyd steps (diagnostics): with early stopping (the CPU)
    the pass runs until every part has settled, so both record the slower part's count (the bytes are each part's
    own, `test_a_mixed_pass_writes_what_each_part_writes_alone`)."""
    n = 2 * PAGE
    hard = torch.randn(n, HEADS, D, generator=torch.Generator().manual_seed(0)) * torch.logspace(-1, 1, D)
    gen = torch.Generator().manual_seed(4)
    easy = torch.randn(8, HEADS, D, generator=gen).repeat(n // 8, 1, 1)
    k = torch.cat([easy, hard])
    v = torch.randn(2 * n, HEADS, D, generator=gen)
    a, b = codecs.get(BASE), codecs.get(K3)
    la, lb = _layout(a), _layout(b)
    alone = [CodecState(), CodecState()]
    for codec, layout, u in ((a, la, 0), (b, lb, 1)):
        assert encode_units(codec, k[u * n : (u + 1) * n], v[u * n : (u + 1) * n], layout,
                            torch.zeros(2, layout.page_bytes, dtype=torch.uint8),
                            torch.zeros(1, layout.codebook_bytes, dtype=torch.uint8), [alone[u]])
    assert alone[0].iterations == [1] and alone[1].iterations[0] > 1  # the premise: the parts settle apart
    states = [CodecState(), CodecState()]
    parts = [Part(a, la, torch.zeros(2, la.page_bytes, dtype=torch.uint8),
                  torch.zeros(1, la.codebook_bytes, dtype=torch.uint8), [0]),
             Part(b, lb, torch.zeros(2, lb.page_bytes, dtype=torch.uint8),
                  torch.zeros(1, lb.codebook_bytes, dtype=torch.uint8), [1])]
    assert encode_mixed(parts, k, v, states)
    assert [st.iterations for st in states] == [alone[1].iterations] * 2


class _HostTensors:
    """`torch` as `unit_encoder` sees it, recording tensors built from host data for a device."""

    def __init__(self):
        self.built = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def tensor(self, data, *args, **kwargs):
        if "device" in kwargs:
            self.built.append(data)
        return torch.tensor(data, *args, **kwargs)


def test_the_mixed_pass_builds_no_tensor_from_host_data(monkeypatch):
    """What `GraphedEncoder.mixed` captures (`encode_mixed` of a warm chunk) must not copy host data to the device:
    inside a capture that copy is refused (`torch.tensor(..., device="cuda")` synchronizes the stream)."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2 * 2 * PAGE, HEADS, D, generator=gen)
    v = torch.randn(2 * 2 * PAGE, HEADS, D, generator=gen)
    states = _moment_states(2)
    for st in states:
        st.centroids["k"] = torch.randn(1, HEADS, 8, D, generator=gen)
    parts = []
    for spec, at in ((BASE, [0]), (K3, [1])):
        codec = codecs.get(spec)
        layout = _layout(codec)
        parts.append(Part(codec, layout, torch.zeros(2, layout.page_bytes, dtype=torch.uint8),
                          torch.zeros(1, layout.codebook_bytes, dtype=torch.uint8), at))
    host = _HostTensors()
    monkeypatch.setattr(unit_encoder, "torch", host)
    assert encode_mixed(parts, k, v, states)
    assert host.built == []
