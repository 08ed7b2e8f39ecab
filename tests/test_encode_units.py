"""`Codec.encode_units`: many independent chunks (one page of each of several layers, as a storage backend keeps
them) encoded in one pass where the codec can (QVG, QuantWM), to exactly the bytes `encode` gives chunk by chunk
from a fresh state; other codecs loop. Refusals come before anything is encoded."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.kmeans import greedy_kmeanspp_init, kmeanspp_init
from kvbackend.errors import InvalidKV
from kvbackend.geometry import Geometry

GEOMETRY = Geometry(1, 3, 64, torch.bfloat16)
PAGE = 16

BATCHED = [
    "qvg",
    "qvg:stages=2,centroids=8,cdtype=fp8",
    "qvg:kchannel=16,vcluster=false,centroids=32",  # more centroids than a page has tokens
    "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16",
    "quantwm:rank=0,centroids=4,outliers=5,bits=3,group=32",
    "qvg:init=greedy,centroids=8",  # greedy k-means++ seeding batches as plain k-means++ does
]
LOOPED = ["kivi:bits=2,group=16", "rtn:bits=2,group=32,scale=fp8", "qvg:init=random,centroids=4"]


def _chunks(units: int, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(units, tokens, 3, 64, generator=gen) * torch.linspace(0.5, 4, units)[:, None, None, None]
    k = k + torch.randn(units, 1, 3, 64, generator=gen) * 3
    v = torch.randn(units, tokens, 3, 64, generator=gen)
    k[1, -4:] = k[1, -5]  # a trailing run of identical keys: only its first row may take outlier slots
    k[2] = k[2, :1]  # a chunk of one repeated token: every k-means draw after the first is uniform
    return k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("spec", BATCHED + LOOPED)
@pytest.mark.parametrize("tokens", [PAGE, 11, 2 * PAGE + 5])
def test_units_encode_to_the_bytes_of_separate_encodes(spec, tokens):
    codec = codecs.get(spec)
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = _chunks(7, tokens)
    pages, books = codec.encode_units(k, v, layout)
    assert pages.shape == (7, -(-tokens // PAGE), layout.page_bytes) and books.shape == (7, layout.codebook_bytes)
    for u in range(7):
        chunk = codec.encode(k[u], v[u], layout)
        assert torch.equal(pages[u], chunk.pages), (spec, u)
        assert torch.equal(books[u], chunk.codebook), (spec, u)


@pytest.mark.parametrize("spec", BATCHED)
def test_the_batched_pass_is_taken_and_decodes_each_chunk(spec, monkeypatch):
    """The one-pass path serves these specs (a loop would hide a regression of its speed), and each unit's pages
    decode with its own slot to its own chunk."""
    codec = codecs.get(spec)
    layout = codec.layout(GEOMETRY, PAGE)
    assert codec.batch_encodes
    monkeypatch.setattr(codec, "encode", lambda *a, **kw: pytest.fail("encode_units looped"))
    k, v = _chunks(5, PAGE)
    pages, books = codec.encode_units(k, v, layout)
    dk, dv = codec.decode_units(layout, pages.reshape(5, -1), books)
    err = (dk.float().view_as(k) - k.float()).norm() / k.float().norm()
    assert float(err) < 0.35, err
    assert float((dv.float().view_as(v) - v.float()).norm() / v.float().norm()) < 0.6


def test_other_codecs_loop():
    assert not codecs.get("kivi:bits=2,group=16").batch_encodes
    codec = codecs.get("qvg:init=random")  # random seeding draws a permutation per row: the loop serves
    assert codec.batch_encodes and not codec._encode_units(None, None, None, None, torch.zeros(2, 1))


@pytest.mark.parametrize("bad,message", [
    (lambda k, v: (k[0], v[0]), "units, tokens"),
    (lambda k, v: (k, v[:, :, :2]), "shape"),
    (lambda k, v: (k[:, :0], v[:, :0]), "empty"),
    (lambda k, v: (k.int(), v), "bf16, fp16 or fp32"),
])
def test_bad_input_is_refused(bad, message):
    codec = codecs.get(BATCHED[3])
    layout = codec.layout(GEOMETRY, PAGE)
    with pytest.raises(InvalidKV, match=message):
        codec.encode_units(*bad(*_chunks(3, PAGE)), layout)


def test_a_non_finite_value_in_any_chunk_refuses_the_batch():
    codec = codecs.get(BATCHED[3])
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = _chunks(4, PAGE)
    v[3, 5, 1, 7] = float("inf")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        codec.encode_units(k, v, layout)


@pytest.mark.parametrize("trials", [1, 3])
def test_seeding_repeats_each_problems_draws(trials):
    """`kmeanspp_init(repeat=U)` on U stacked problems gives each the seeds a fresh run on it alone gives; picks
    never land on points already covered while uncovered ones remain (greedy seeding too)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 20, 8, generator=gen)  # 4 problems of 3 rows
    together = kmeanspp_init(x.reshape(12, 20, 8), 6, torch.Generator().manual_seed(9), repeat=4,
                             trials=trials).view(4, 3, 6, 8)
    for u in range(4):
        assert torch.equal(together[u], kmeanspp_init(x[u], 6, torch.Generator().manual_seed(9), trials=trials))
    seeds = kmeanspp_init(x[0], 20, torch.Generator().manual_seed(3), trials=trials)  # as many as points: each once
    for row in range(3):
        assert torch.unique(seeds[row], dim=0).shape[0] == 20
    with pytest.raises(ValueError, match="problems of equal size"):
        kmeanspp_init(x.reshape(12, 20, 8), 6, torch.Generator(), repeat=5, trials=trials)
    with pytest.raises(ValueError, match="trials=0"):
        kmeanspp_init(x[0], 6, torch.Generator(), trials=0)


def test_greedy_seeding_leaves_less_potential_and_k_means_ends_lower():
    """Greedy k-means++ (the best of 2 + ln C candidates a step) seeds with a smaller sum of squared distances to
    the nearest seed than k-means++ on every one of six seedings of clustered points with scaled channels, and
    Lloyd's steps from its seeds end lower on average; its first candidate is k-means++'s own pick."""
    from kvbackend.codecs.kmeans import greedy_trials, kmeans

    gen = torch.Generator().manual_seed(5)
    centers = torch.randn(4, 12, 16, generator=gen) * 4
    x = centers[:, torch.randint(0, 12, (400,), generator=gen)] + torch.randn(4, 400, 16, generator=gen)
    x = x * torch.linspace(0.3, 2, 16)

    def potential(seeds):
        return float(torch.cdist(x, seeds).pow(2).amin(-1).sum())

    plain, greedy, plain_end, greedy_end = [], [], [], []
    for seed in range(6):
        a = kmeanspp_init(x, 16, torch.Generator().manual_seed(seed))
        b = greedy_kmeanspp_init(x, 16, torch.Generator().manual_seed(seed))
        plain.append(potential(a))
        greedy.append(potential(b))
        plain_end.append(kmeans(x, a, 8).objective)
        greedy_end.append(kmeans(x, b, 8).objective)
    assert all(g < p for g, p in zip(greedy, plain)), (greedy, plain)
    assert sum(greedy_end) < sum(plain_end), (greedy_end, plain_end)
    assert greedy_trials(32) == 5 and greedy_trials(1) == 2
    # one candidate a step is plain k-means++ (the same draws, the same seeds)
    assert torch.equal(kmeanspp_init(x, 16, torch.Generator().manual_seed(0), trials=1),
                       kmeanspp_init(x, 16, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("trials", [1, 3])
@pytest.mark.parametrize("rows,points,dim,centroids,repeat", [(70, 24, 16, 8, 1), (64, 24, 16, 8, 2), (9, 6, 4, 8, 1)])
def test_seeding_in_blocks_of_rows_picks_what_one_block_picks(monkeypatch, rows, points, dim, centroids, repeat,
                                                              trials):
    """On the CPU, k-means++ seeds blocks of rows one after another (their points stay in cache): every row gets
    the seeds of seeding all rows at once, with far points (float32-overflowing distances) and duplicates too."""
    import kvbackend.codecs.kmeans as kmeans

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, points, dim, generator=gen)
    x[3, 5] = 3e19  # a distance past float32's range
    x[5] = 1.0  # a row of duplicates
    monkeypatch.setattr(kmeans, "_SEED_BLOCK_BYTES", 1 << 40)  # one block
    whole = kmeanspp_init(x, centroids, torch.Generator().manual_seed(7), repeat=repeat, trials=trials)
    for rows_per_block in (1, 3, 7):
        monkeypatch.setattr(kmeans, "_SEED_BLOCK_BYTES", rows_per_block * points * dim * 4)
        assert torch.equal(kmeanspp_init(x, centroids, torch.Generator().manual_seed(7), repeat=repeat, trials=trials),
                           whole)
    assert kmeanspp_init(x[:0], centroids, torch.Generator().manual_seed(7)).shape == (0, centroids, dim)


def _seeds_written_out(x, first, uniforms, num_centroids):
    """k-means++ as its docstring states it, with a fresh distance tensor per step: what `_seed_rows` must pick."""
    rows = torch.arange(x.shape[0])
    picked = [x[rows, first]]
    nearest = ((x - picked[0].unsqueeze(1)) ** 2).sum(-1)
    for step in range(1, num_centroids):
        weights = nearest.double()
        far = torch.isinf(weights)
        weights = torch.where(far.any(-1, keepdim=True), far.double(), weights)
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, torch.ones_like(weights))
        cdf = weights.cumsum(-1)
        pick = torch.searchsorted(cdf, uniforms[step - 1] * cdf[:, -1:], right=True).clamp_max(x.shape[1] - 1)
        picked.append(x[rows, pick.squeeze(-1)])
        nearest = torch.minimum(nearest, ((x - picked[-1].unsqueeze(1)) ** 2).sum(-1))
    return torch.stack(picked, 1)


@pytest.mark.parametrize("rows,points,dim", [(32, 64, 128), (5, 37, 64), (3, 300, 16)])
def test_seeding_with_one_distance_buffer_picks_the_written_out_seeds(rows, points, dim):
    """`_seed_rows` reuses one buffer for every step's distances (fresh tensors cost page faults on the CPU); its
    seeds are those of the written-out steps, bit for bit, far points and duplicates included."""
    from kvbackend.codecs.kmeans import _seed_rows

    gen = torch.Generator().manual_seed(rows + points)
    x = torch.randn(rows, points, dim, generator=gen) * 3
    x[0, 1] = 3e19  # a distance past float32's range
    x[-1] = 0.5  # a row of duplicates
    first = torch.randint(0, points, (rows,), generator=gen)
    uniforms = torch.rand(31, rows, 1, generator=gen, dtype=torch.float64)
    assert torch.equal(_seed_rows(x, first, uniforms, 32), _seeds_written_out(x, first, uniforms, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_units_on_the_gpu_decode_like_the_cpu():
    """On CUDA the batched pass runs there; sums may be ordered otherwise than on the CPU, so the bytes may
    differ in a few codes, and the reconstruction stays within the codec's own error of the CPU's."""
    spec = BATCHED[3]
    codec = codecs.get(spec)
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = _chunks(33, PAGE)
    cpu_pages, cpu_books = codec.encode_units(k, v, layout)
    gpu_pages, gpu_books = codec.encode_units(k.cuda(), v.cuda(), layout)
    assert gpu_pages.is_cuda and gpu_pages.shape == cpu_pages.shape
    a = codec.decode_units(layout, cpu_pages.reshape(33, -1), cpu_books)[0].float()
    b = codec.decode_units(layout, gpu_pages.reshape(33, -1).cpu(), gpu_books.cpu())[0].float()
    original = k.float().reshape_as(a)
    err_cpu = float((a - original).norm() / original.norm())
    assert float((b - original).norm() / original.norm()) < 1.1 * err_cpu


def test_cpu_slices_give_the_same_bytes(monkeypatch):
    """On the CPU the units go through in slices of bounded size (cache-resident k-means temporaries): a batch
    cut into slices of 2 units encodes to the bytes of one slice and of separate encodes."""
    from kvbackend.codecs import base

    codec = codecs.get(BATCHED[3])
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = _chunks(5, PAGE + 3)
    whole = codec.encode_units(k, v, layout)
    passes = []
    encode = codec._encode_units
    monkeypatch.setattr(codec, "_encode_units", lambda *a: passes.append(a[4].shape[0]) or encode(*a))
    monkeypatch.setattr(base, "CPU_UNIT_VALUES", 2 * k[0].numel())
    sliced = codec.encode_units(k, v, layout)
    assert passes == [2, 2]  # the last slice of one unit is a plain encode
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])


def test_seeding_of_keys_beyond_float32_squared_range_stays_distinct():
    """Finite keys so large that their squared distances overflow float32 still seed distinct centroids (drawn among
    the points at infinite distance), never the last point again and again."""
    x = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(0)) * 1e20
    seeds = kmeanspp_init(x, 6, torch.Generator().manual_seed(1))
    for row in range(2):
        assert torch.unique(seeds[row], dim=0).shape[0] == 6


# -- chunks with their own states: one request's layers (`KVCache` encodes a chunk of every layer in one pass) --

STATED = [
    "qvg:stages=2,centroids=8,cdtype=fp8",
    "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,cdtype=fp8,outliers=16",
    "quantwm:kchannel=0,candidates=4,rank=2,keep=0.25,centroids=8,outliers=3",  # QSAC: per-token key groups
    "qvg:init=random,centroids=4",  # cold chunks loop (random seeding), warm ones batch
]


def _moment(gen, heads=3, d=64):
    q = torch.randn(heads, 40, d, generator=gen) * torch.linspace(0.2, 3, d)
    return q.transpose(1, 2) @ q / 40


@pytest.mark.parametrize("spec", STATED)
def test_units_with_states_encode_to_the_bytes_of_encodes_with_those_states(spec):
    """Three chunks in a row of five layers, the later ones warm-started and with query statistics (QSAC, PSAC,
    weighted outliers): every chunk's bytes and every state's centroids as five separate encodes give them."""
    from kvbackend.codecs.base import CodecState

    codec = codecs.get(spec)
    layout = codec.layout(GEOMETRY, PAGE)
    gen = torch.Generator().manual_seed(3)
    batched, separate = [CodecState() for _ in range(5)], [CodecState() for _ in range(5)]
    for chunk in range(3):
        k, v = _chunks(5, 2 * PAGE + 3, seed=chunk)
        if chunk:
            for a, b in zip(batched, separate):
                a.query_moment = _moment(gen)
                b.query_moment = a.query_moment.clone()
        pages, books = codec.encode_units(k, v, layout, batched)
        for u in range(5):
            alone = codec.encode(k[u], v[u], layout, separate[u])
            assert torch.equal(pages[u], alone.pages), (spec, chunk, u)
            assert torch.equal(books[u], alone.codebook), (spec, chunk, u)
            assert batched[u].centroids.keys() == separate[u].centroids.keys()
            for name, cents in separate[u].centroids.items():
                assert torch.equal(batched[u].centroids[name], cents), (spec, chunk, u, name)


def test_states_that_differ_are_encoded_one_by_one_to_the_same_bytes(monkeypatch):
    """A warm and a cold chunk (or one with query statistics beside one without) cannot share one pass: the
    batched pass refuses them before touching any state, and the loop gives each its own bytes."""
    from kvbackend.codecs.base import CodecState

    codec = codecs.get(STATED[1])
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = (x[:2] for x in _chunks(3, PAGE))
    warm = CodecState()
    codec.encode(k[0], v[0], layout, warm)
    mixed, alone = [warm.clone(), CodecState()], [warm.clone(), CodecState()]
    mixed[1].query_moment = alone[1].query_moment = _moment(torch.Generator().manual_seed(0))
    encode_units = codec._encode_units
    refused = []
    monkeypatch.setattr(codec, "_encode_units", lambda *a: refused.append(encode_units(*a)) or False)
    pages, books = codec.encode_units(k, v, layout, mixed)
    assert refused == [False]
    for u in range(2):
        chunk = codec.encode(k[u], v[u], layout, alone[u])
        assert torch.equal(pages[u], chunk.pages) and torch.equal(books[u], chunk.codebook)


def test_states_must_be_one_per_chunk():
    from kvbackend.codecs.base import CodecState

    codec = codecs.get(STATED[0])
    layout = codec.layout(GEOMETRY, PAGE)
    k, v = _chunks(3, PAGE)
    with pytest.raises(ValueError, match="2 states for 3 chunks"):
        codec.encode_units(k, v, layout, [CodecState(), CodecState()])


@pytest.mark.parametrize("spec", [
    "quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,"
    "cdtype=fp8,outliers=16",
    "qvg:stages=2,centroids=8",
])
def test_kv_cache_encodes_every_layer_of_a_chunk_in_one_pass_to_the_layer_by_layer_bytes(spec, monkeypatch):
    """`KVCache` encodes a completed chunk of all its layers in one `encode_units` pass (the reference encoder's
    host overhead once per chunk, not once per layer): the pages, codebook slots (sinks included) and reads are
    those of layer-by-layer encodes, over warm chunks with query statistics."""
    from kvbackend.geometry import CacheConfig
    from kvbackend.manager import KVCache
    from kvbackend.rope import Rotary

    layers, heads, d = 4, 2, 64
    config = CacheConfig(codec=spec, page_size=16, chunk_pages=2, dense_pages=16, packed_pages=16)

    def run(batched: bool):
        cache = KVCache(Geometry(layers, heads, d, torch.float32), config, rotary=Rotary.default(d, 10000.0))
        passes = []
        if batched:
            encode_units = cache.codecs[0].encode_units
            monkeypatch.setattr(cache.codecs[0], "encode_units",
                                lambda k, *a: passes.append(k.shape[0]) or encode_units(k, *a))
        else:
            monkeypatch.setattr(cache, "_encode_group", lambda layer: None)
        gen = torch.Generator().manual_seed(5)
        rid, _ = cache.add_request()
        for _ in range(5):  # 5 x 20 tokens: three 32-token chunks complete (the first with its sinks)
            for layer in range(layers):
                k, v = torch.randn(20, heads, d, generator=gen) * 3, torch.randn(20, heads, d, generator=gen)
                cache.append(rid, layer, k, v, queries=torch.randn(20, 2 * heads, d, generator=gen))
        reads = [cache.read(rid, layer) for layer in range(layers)]
        return cache, rid, reads, passes

    one, rid1, reads1, passes = run(True)
    alone, rid2, reads2, _ = run(False)
    assert passes == [layers] * 3
    assert one.page_table(rid1).packed == alone.page_table(rid2).packed
    pages = one.page_table(rid1).packed
    for layer in range(layers):
        assert torch.equal(one.packed.pages[layer][pages], alone.packed.pages[layer][pages]), layer
        assert torch.equal(one.packed.codebooks[layer], alone.packed.codebooks[layer]), layer
        assert torch.equal(reads1[layer][0], reads2[layer][0]) and torch.equal(reads1[layer][1], reads2[layer][1])
