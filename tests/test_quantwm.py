"""QuantWM: QSAC's choice under its own score, PSAC's correction, causal query statistics."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.base import CodecState
from kvbackend.codecs.quantwm import channel_weights, qsac_assign, qsac_score
from kvbackend.geometry import Geometry
from kvbackend.errors import SpecError
from kvbackend.psac import query_mean, query_second_moment
from kvbackend.tools.reconstruct import reconstruct_layer


def _keys(t=128, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(1, h, d, generator=g))  # outlier channels
    return torch.randn(t, h, d, generator=g) * scale


def _queries(t=128, hq=4, d=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, t, d, generator=g) * torch.linspace(0.1, 3.0, d)  # some channels matter more


@pytest.mark.parametrize("group", [16, 64])
def test_qsac_never_worse_than_nearest_under_its_score(group):
    x = _keys().transpose(0, 1)  # [H, T, D]
    cents = x[:, torch.randperm(x.shape[1])[:16]] + 0.1
    weights = channel_weights(query_second_moment(_queries(), 2))
    nearest = ((x.unsqueeze(2) - cents.unsqueeze(1)) ** 2).sum(-1).argmin(-1)
    chosen = qsac_assign(x, cents, weights, 4, group)
    ours, plain = qsac_score(x, cents, chosen, weights, group), qsac_score(x, cents, nearest, weights, group)
    weighted_nearest = ((x.unsqueeze(2) - cents.unsqueeze(1)) ** 2 * weights[:, None, None]).sum(-1).argmin(-1)
    # the weighted-nearest centroid is always among the candidates, so QSAC's pick scores no worse
    assert bool((ours <= qsac_score(x, cents, weighted_nearest, weights, group) + 1e-4).all())
    assert float(ours.mean()) < float(plain.mean())  # and it pays on average against plain nearest


def test_psac_full_rank_reproduces_keys_to_int8_rounding():
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("quantwm:rank=64,candidates=1")
    layout = codec.layout(geometry, 64)
    k, v = _keys(), _keys(seed=3)
    plain = codecs.get("quantwm:rank=0,candidates=1")
    state = CodecState(query_moment=query_second_moment(_queries(), 2))
    kh, _ = codec.decode(codec.encode(k, v, layout, state))
    base, _ = plain.decode(plain.encode(k, v, plain.layout(geometry, 64), CodecState(query_moment=state.query_moment)))
    err, base_err = (k - kh).norm(dim=-1), (k - base).norm(dim=-1)
    # INT8 with one scale per (token, head): at most half a step of 127 per coefficient
    assert bool((err <= base_err / 127 * 64**0.5 + 1e-3).all())
    assert float(err.mean()) < 0.02 * float(base_err.mean())


def test_psac_rows_only_kept_when_they_help_and_bytes_counted():
    geometry = Geometry(1, 2, 64, torch.float32)
    codec, qvg = codecs.get("quantwm"), codecs.get("qvg")
    k, v = _keys(), _keys(seed=3)
    moment = query_second_moment(_queries(), 2)
    chunk = codec.encode(k, v, codec.layout(geometry, 64), CodecState(query_moment=moment))
    kh, _ = codec.decode(chunk)
    plain = codecs.get("quantwm:rank=0").decode(
        codecs.get("quantwm:rank=0").encode(k, v, codecs.get("quantwm:rank=0").layout(geometry, 64),
                                            CodecState(query_moment=moment)))[0]
    qerr = lambda e: torch.einsum("thd,hde,the->th", e, moment, e)  # noqa: E731
    assert bool((qerr(k - kh) <= qerr(k - plain) * (1 + 1e-3) + 1e-4).all())  # never worse, row by row
    assert float(qerr(k - kh).mean()) < 0.7 * float(qerr(k - plain).mean())
    extra = chunk.nbytes - qvg.encode(k, v, qvg.layout(geometry, 64)).nbytes
    assert extra == 128 * 2 * (8 + 2) + 2 * 64 * 8 * 2  # INT8 rows + fp16 scales + bf16 bases


def test_query_statistics_are_causal():
    """A chunk's encoding never depends on queries after its last token."""
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("quantwm")
    k, v = _keys(t=192), _keys(t=192, seed=3)
    q = _queries(t=192)
    later = q.clone()
    later[:, 128:] = torch.randn_like(later[:, 128:]) * 5  # different future queries
    a = reconstruct_layer(codec, k, v, geometry, 64, 128, queries=q)
    b = reconstruct_layer(codec, k, v, geometry, 64, 128, queries=later)
    assert torch.equal(a.k[:128], b.k[:128])  # the first chunk ended at token 128
    assert not torch.equal(a.k[128:], b.k[128:])


def test_cold_start_is_qvg():
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(), _keys(seed=3)
    ours = codecs.get("quantwm")
    qvg = codecs.get("qvg")
    kh, vh = ours.decode(ours.encode(k, v, ours.layout(geometry, 64)))
    qk, qv = qvg.decode(qvg.encode(k, v, qvg.layout(geometry, 64)))
    assert torch.equal(kh, qk) and torch.equal(vh, qv)


def test_paged_cache_moments_are_causal_per_chunk():
    """KVCache.append(queries=...): a chunk is encoded with the queries of its own and earlier tokens
    only, even when one append runs past the chunk's end."""
    from kvbackend import CacheConfig, KVCache

    geometry = Geometry(2, 2, 64, torch.float32)
    cache = KVCache(geometry, CacheConfig(codec="quantwm", page_size=16, chunk_pages=2, dense_pages=16,
                                          packed_pages=16))
    rid, _ = cache.add_request()
    k, v, q = _keys(t=80), _keys(t=80, seed=3), _queries(t=80).transpose(0, 1)  # q: [T, Hq, D]
    for layer in range(2):
        cache.append(rid, layer, k, v, queries=q)  # 80 tokens: chunks of 32 complete twice
    state = cache.page_table(rid).states[0]
    expected = query_second_moment(q[:64].transpose(0, 1), 2)  # the second chunk ends at token 64
    assert torch.allclose(state.query_moment, expected, rtol=1e-5, atol=1e-5)
    assert set(state.query_parts) == {1, 2}  # tokens 64..79 wait for their own chunk
    assert torch.allclose(state.query_mean, query_mean(q[:64].transpose(0, 1), 2), rtol=1e-5, atol=1e-5)
    reference = codecs.get("quantwm")
    st = CodecState(query_moment=query_second_moment(q[:32].transpose(0, 1), 2))
    first = reference.encode(k[:32], v[:32], reference.layout(geometry, 16), st)
    stored = cache.packed.pages[0][cache.page_table(rid).packed[:2]]
    assert torch.equal(stored, first.pages)  # chunk 0 saw exactly the queries of tokens 0..31
    from kvbackend.errors import InvalidKV

    with pytest.raises(InvalidKV, match="queries"):
        cache.append(rid, 0, k[:2], v[:2], queries=q[:3])


@pytest.mark.model
def test_transformers_attach_feeds_queries():
    pytest.importorskip("transformers")
    from kvbackend.integration.transformers import KVBackendCache
    from kvbackend.tools.models import load_model

    model, tok = load_model()
    ids = tok(open("/usr/share/common-licenses/GPL-3").read(), return_tensors="pt").input_ids[:, :200]
    cache = KVBackendCache(model.config, codec="quantwm", page_size=16, chunk_pages=4, max_tokens=256)
    name = cache.attach(model)
    assert model.config._attn_implementation == name and cache.wants_queries
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)  # one decode step: the prompt's last tokens land
    engine = cache.engine
    rid = cache.request_ids[0]
    states = engine.page_table(rid).states
    assert all(s.query_moment is not None for s in states)  # every layer's chunks saw queries
    layout = engine.layout
    packed = engine.page_table(rid).packed
    scales = layout.page.view(engine.packed.pages[5][packed], "k_psac_scale")
    assert float(scales.float().abs().sum()) > 0  # PSAC rows were kept
    cache.detach(model)
    assert model.config._attn_implementation != name
    plain = KVBackendCache(model.config, codec="quantwm", page_size=16, chunk_pages=4, max_tokens=256)
    with torch.no_grad(), pytest.warns(UserWarning, match="attach"):  # no queries: the user is told
        model(ids, cache=plain)
    assert all(s.query_moment is None for s in plain.engine.page_table(plain.request_ids[0]).states)


def test_kernel_schemes_read_group_sizes_from_the_layout():
    """Key residuals per channel (kchannel) are described to the kernels with their real token groups;
    PSAC fields, which no kernel reads yet, send the cache to the torch reference."""
    from kvbackend.errors import UnsupportedLayout
    from kvbackend.scheme import CHANNEL_GROUPS, TOKEN_GROUPS, kernel_schemes

    geometry = Geometry(2, 3, 64, torch.bfloat16)
    codec = codecs.get("qvg:kchannel=16,group=32")
    k, v = kernel_schemes(codec, codec.layout(geometry, 64))
    assert (k.mode, k.group, v.mode, v.group) == (CHANNEL_GROUPS, 16, TOKEN_GROUPS, 32)
    kivi = codecs.get("kivi:bits=2,group=32")
    k, v = kernel_schemes(kivi, kivi.layout(geometry, 64))
    assert (k.mode, k.group, v.mode, v.group) == (CHANNEL_GROUPS, 32, TOKEN_GROUPS, 32)
    with pytest.raises(UnsupportedLayout, match="PSAC"):
        quantwm = codecs.get("quantwm")
        kernel_schemes(quantwm, quantwm.layout(geometry, 64))
    ok = codecs.get("quantwm:rank=0,kchannel=32")
    assert kernel_schemes(ok, ok.layout(geometry, 64))[0].group == 32


def test_sparse_psac_keeps_the_best_rows_per_page_and_counts_the_index():
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(), _keys(seed=3)
    moment = query_second_moment(_queries(), 2)
    state = lambda: CodecState(query_moment=moment)  # noqa: E731
    dense, every, sparse = (codecs.get(s) for s in ("quantwm", "quantwm:keep=0.999", "quantwm:keep=0.25"))
    plain = codecs.get("quantwm:rank=0")
    kd = dense.decode(dense.encode(k, v, dense.layout(geometry, 64), state()))[0]
    chunk_all = every.encode(k, v, every.layout(geometry, 64), state())
    chunk_dense = dense.encode(k, v, dense.layout(geometry, 64), state())
    # a sparse budget of every row reproduces the dense correction, and pays one index byte a row
    assert torch.equal(every.decode(chunk_all)[0], kd)
    assert chunk_all.nbytes - chunk_dense.nbytes == 2 * 64 * 2 * 1  # 2 pages x 64 rows x 2 heads, uint8
    chunk = sparse.encode(k, v, sparse.layout(geometry, 64), state())
    ks = sparse.decode(chunk)[0]
    kp = plain.decode(plain.encode(k, v, plain.layout(geometry, 64), state()))[0]
    qerr = lambda e: torch.einsum("thd,hde,the->th", e, moment, e)  # noqa: E731
    corrected = (ks != kp).any(-1).reshape(2, 64, 2)  # [page, token, head]
    assert bool((corrected.sum(1) <= 16).all()) and int(corrected.sum()) > 0  # at most ceil(0.25 * 64) a page
    assert bool((qerr(k - ks) <= qerr(k - kp) * (1 + 1e-3) + 1e-4).all())  # never worse, row by row
    # the rows kept are the ones that lower the error most: no dropped row beats a kept one
    gain = (qerr(k - kp) - qerr(k - kd)).reshape(2, 64, 2)
    for page in range(2):
        for head in range(2):
            kept, dropped = gain[page, corrected[page, :, head], head], gain[page, ~corrected[page, :, head], head]
            assert float(kept.min()) >= float(dropped.max()) - 1e-5
    # bytes: 16 rows x 2 heads per page of INT8 coefficients, fp16 scale and uint8 index (16-byte aligned fields)
    assert chunk.nbytes < chunk_dense.nbytes
    layout = sparse.layout(geometry, 64)
    assert layout.page.fields["k_psac"].shape == (16, 2, 8) and layout.page.fields["k_psac_token"].shape == (16, 2)


@pytest.mark.parametrize("bad", ["quantwm:keep=0", "quantwm:keep=1.5"])
def test_sparse_psac_rejects_bad_budgets(bad):
    from kvbackend.errors import SpecError

    with pytest.raises(SpecError, match="keep"):
        codecs.get(bad).layout(Geometry(1, 2, 64, torch.float32), 64)


@pytest.mark.parametrize("name", ["qvg", "quantwm"])
def test_fp8_centroids_halve_the_codebook_and_decode_what_encoding_subtracted(name):
    """cdtype=fp8: e4m3 centroids with an fp16 scale per stage and head. Residuals are taken against the
    stored (rounded) centroids, so the reconstruction error stays that of the residual codes; warm
    starts read the scaled values."""
    from kvbackend import CacheConfig, KVCache
    from kvbackend.backends import kernels_can_serve

    geometry = Geometry(1, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(128, 2, 64, generator=gen) * 30, torch.randn(128, 2, 64, generator=gen)
    errors, books = {}, {}
    for cdtype in ("bf16", "fp8"):
        codec = codecs.get(f"{name}:centroids=8,stages=2,kchannel=32,cdtype={cdtype}")
        layout = codec.layout(geometry, 32)
        chunk = codec.encode(k, v, layout, CodecState())
        dk, dv = codec.decode(chunk)
        errors[cdtype] = float((dk - k).norm() / k.norm())
        books[cdtype] = {f.name: f.nbytes for f in layout.codebook.fields.values()}
        assert kernels_can_serve(codec, layout)  # the kernels read fp8 centroids and their scales
    # half the centroid bytes, plus an fp16 scale per stage and head; every other field as it was
    assert books["fp8"]["k_centroids"] * 2 == books["bf16"]["k_centroids"] and books["fp8"]["k_centroid_scales"] == 2 * 2 * 2
    assert {n: b for n, b in books["fp8"].items() if "centroid" not in n} == {
        n: b for n, b in books["bf16"].items() if "centroid" not in n}
    assert errors["fp8"] < 1.15 * errors["bf16"]
    cache = KVCache(geometry, CacheConfig(codec=f"{name}:centroids=8,kchannel=32,cdtype=fp8", page_size=32,
                                          chunk_pages=2, dense_pages=8, packed_pages=8))
    rid, _ = cache.add_request(list(range(100)))
    cache.append(rid, 0, k[:100], v[:100])
    other, hit = cache.add_request(list(range(64)) + [7])
    assert hit == 64
    warm = cache.page_table(other).states[0].centroids["k"]
    slot = cache.packed.slot_of_page[cache.page_table(rid).packed[0]]
    book = cache.layouts[0].codebook
    raw = book.view(cache.packed.codebooks[0][slot], "k_centroids").float()
    scales = book.view(cache.packed.codebooks[0][slot], "k_centroid_scales").float()
    assert torch.equal(warm, raw * scales[..., None, None]) and float(warm.abs().max()) > 20  # scaled, not raw codes


def test_key_outliers_store_the_largest_weighted_errors_and_count_their_bytes():
    """outliers=n: per page and head, the n key entries of largest query-weighted error store that error
    (fp16), so they come back to fp16 rounding; every other entry decodes as without outliers; the bytes
    grow by exactly n * 4 per page and head; PSAC rows correct what is left."""
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(), _keys(seed=3)
    k[5, 0, 3], k[70, 1, 10] = 9.0, -7.0  # two spikes inside their channels' ranges: large errors
    moment = query_second_moment(_queries(), 2)
    state = lambda: CodecState(query_moment=moment)  # noqa: E731
    base, sparse = codecs.get("quantwm:rank=0,kchannel=64,clip=true"), codecs.get("quantwm:rank=0,kchannel=64,clip=true,outliers=12")
    chunk_base = base.encode(k, v, base.layout(geometry, 64), state())
    chunk = sparse.encode(k, v, sparse.layout(geometry, 64), state())
    kb, vb = base.decode(chunk_base)
    ks, vs = sparse.decode(chunk)
    assert torch.equal(vs, vb)  # values untouched
    changed = (ks != kb).reshape(2, 64, 2, 64)  # [page, token, head, channel]
    assert bool((changed.sum(dim=(1, 3)) <= 12).all()) and int(changed.sum()) > 0
    moved = changed.reshape(k.shape)  # the entries kept come back to the fp16 rounding of their error
    assert bool(((ks - k).abs()[moved] <= (k - kb).abs()[moved] * 2**-10 + 1e-6).all())
    weights = channel_weights(moment)
    score = ((k - kb) ** 2 * weights[None]).reshape(2, 64, 2, 64).permute(0, 2, 1, 3).reshape(2, 2, -1)
    picked = changed.permute(0, 2, 1, 3).reshape(2, 2, -1)
    for page in range(2):
        for head in range(2):  # no entry left out has a larger weighted error than one kept
            kept, left = score[page, head][picked[page, head]], score[page, head][~picked[page, head]]
            assert float(kept.min()) >= float(left.max()) * (1 - 1e-6)
    assert chunk.nbytes - chunk_base.nbytes == 2 * 2 * 12 * 4  # 2 pages x 2 heads x 12 x (int16 + fp16)
    assert float((k - ks).norm()) < float((k - kb).norm())
    # with PSAC rows on top: never worse than either alone, row for row under the query-weighted error
    both = codecs.get("quantwm:rank=4,kchannel=64,clip=true,outliers=12")
    kk = both.decode(both.encode(k, v, both.layout(geometry, 64), state()))[0]
    qerr = lambda e: torch.einsum("thd,hde,the->th", e, moment, e)  # noqa: E731
    assert bool((qerr(k - kk) <= qerr(k - ks) * (1 + 1e-3) + 1e-4).all())


def test_key_outliers_are_read_with_the_levers_only_and_checked():
    from kvbackend.errors import SpecError, UnsupportedLayout
    from kvbackend.scheme import kernel_schemes, lever_scheme

    codec = codecs.get("quantwm:rank=0,kchannel=64,outliers=4")
    layout = codec.layout(Geometry(1, 2, 64, torch.float16), 64)
    with pytest.raises(UnsupportedLayout, match="levers_read"):  # never read while ignoring the outliers
        kernel_schemes(codec, layout)
    kernel_schemes(codec, layout, levers_read=True)
    levers = lever_scheme(codec, layout)
    assert levers.active and levers.outliers == 4
    assert levers.out_index == layout.page.fields["k_out_index"].offset
    many = codecs.get("quantwm:rank=0,kchannel=64,outliers=65")  # the torch reference serves these
    with pytest.raises(UnsupportedLayout, match="at most 64 key outliers"):
        lever_scheme(many, many.layout(Geometry(1, 2, 64, torch.float16), 64))
    with pytest.raises(SpecError, match="outliers"):
        codecs.get("quantwm:outliers=5000").layout(Geometry(1, 2, 64, torch.float32), 64)
    with pytest.raises(SpecError, match="int16"):
        codecs.get("quantwm:outliers=4").layout(Geometry(1, 2, 256, torch.float32), 256)


def test_key_outliers_skip_the_padding_of_a_partial_last_page():
    """A partial last page is padded with copies of the last token; outlier slots go to real tokens only."""
    codec = codecs.get("quantwm:group=16,rank=0,kchannel=16,outliers=3")
    layout = codec.layout(Geometry(1, 1, 32, torch.float32), 32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(33, 1, 32, generator=g), torch.randn(33, 1, 32, generator=g)
    k[32, 0, 5] = 30.0  # the last (and only real) token of page 1 has the page's largest errors
    chunk = codec.encode(k, v, layout)
    tokens = layout.page.view(chunk.pages, "k_out_index")[1, :, 0].long() // 32
    assert tokens.tolist() == [0, 0, 0]
    assert abs(float(codec.decode(chunk)[0][32, 0, 5]) - 30.0) < 0.02


def test_dequantize_leaves_float_codes_alone():
    from kvbackend.quant import dequantize

    codes = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    before = codes.clone()
    out = dequantize(codes, torch.tensor([2.0]), torch.tensor([1.0]), 2)
    assert torch.equal(codes, before) and torch.equal(out, torch.tensor([[1.0, 3.0, 5.0, 7.0]]))
    codes, scale = torch.tensor([0, 3], dtype=torch.uint8), torch.tensor([[1.0], [2.0]])
    wide = dequantize(codes, scale, None, 2)  # scales with more leading dimensions broadcast, as out of place
    assert torch.equal(wide, (codes.float() - 1) * scale.unsqueeze(-1)) and wide.shape == (2, 1, 2)


def test_principal_directions_are_the_leading_eigenvectors():
    from kvbackend.psac import principal_directions

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 16, 40, generator=gen)
    moment = a @ a.transpose(1, 2) / 40  # [H, D, D] symmetric, positive semi-definite
    u = principal_directions(moment, 4)
    values = torch.linalg.eigvalsh(moment.double())[:, -4:].float()  # ascending, as the basis is ordered
    assert u.shape == (3, 16, 4) and u.device == moment.device
    assert torch.allclose(moment @ u, u * values[:, None, :], atol=1e-4)  # M u = lambda u, column by column
    assert torch.allclose(u.transpose(1, 2) @ u, torch.eye(4).expand(3, 4, 4), atol=1e-5)


@pytest.mark.parametrize("shape,n,segment", [((3, 5, 8192), 16, 128), ((7, 2, 300), 5, 10), ((4, 96), 4, 32),
                                             ((2, 64), 8, 8), ((5, 70), 3, 7)])
def test_top_positions_through_segments_equal_the_full_top_k(shape, n, segment):
    from kvbackend.codecs.quantwm import top_positions

    g = torch.Generator().manual_seed(sum(shape))
    score = torch.randn(*shape, generator=g)
    # crowd the largest entries into one segment: the segment pre-filter must still find them all
    score[..., :segment] += 10.0
    expected = score.topk(n, dim=-1).indices
    assert torch.equal(top_positions(score, n, segment), expected)
    assert torch.equal(top_positions(-score, n, segment), (-score).topk(n, dim=-1).indices)


def _skewed_moment(h=2, d=64, heavy=(3, 17, 40, 50), weight=400.0):
    """A query second moment whose diagonal puts most of the weight on a few channels: [H, D, D]."""
    diag = torch.ones(d)
    diag[list(heavy)] = weight
    return torch.diag(diag).expand(h, d, d).clone()


def test_query_weighted_kmeans_lowers_the_query_weighted_key_error():
    """`kmetric=1` clusters keys under the chunk's query channel weights: the decoded keys' error weighted by them
    (the logits' error for these queries) is lower than plain k-means gives, at the same bytes; the plain
    Euclidean error may rise."""
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(t=256), _keys(t=256, seed=5)
    moment = _skewed_moment()
    w = channel_weights(moment)  # [H, D], mean 1
    spec = "quantwm:centroids=8,rank=0,vcluster=false,iters=8,kchannel=16"
    errors = {}
    for metric in (0, 1):
        codec = codecs.get(f"{spec},kmetric={metric}")
        layout = codec.layout(geometry, 64)
        chunk = codec.encode(k, v, layout, CodecState(query_moment=moment))
        kh, _ = codec.decode(chunk)
        e = (kh - k) ** 2  # [T, H, D]
        errors[metric] = (float((e * w).sum()), float(e.sum()), chunk.nbytes)
    assert errors[1][2] == errors[0][2]  # the same bytes stored
    assert errors[1][0] < 0.8 * errors[0][0], errors


def test_query_weighted_kmeans_needs_query_statistics_and_the_kernels_encode_it():
    """Without query statistics `kmetric` changes nothing (the same bytes); with them the kernels' encoder takes
    the keys too (it clusters in the same weighted space: `tests/test_unit_encoder.py` compares the bytes)."""
    from kvbackend.kernels import unit_encoder

    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(t=128), _keys(t=128, seed=5)
    plain, weighted = (codecs.get(f"quantwm:centroids=8,rank=0,vcluster=false,kchannel=16,kmetric={m}") for m in (0, 1))
    layout = plain.layout(geometry, 64)
    assert torch.equal(plain.encode(k, v, layout, CodecState()).pages, weighted.encode(k, v, layout, CodecState()).pages)
    with_stats = [CodecState(query_moment=_skewed_moment())]
    assert unit_encoder.supports(plain, layout, with_stats)
    assert unit_encoder.supports(weighted, layout, with_stats)
    assert unit_encoder.supports(weighted, layout, [CodecState()])
    moment = _skewed_moment()
    a = plain.encode(k, v, layout, CodecState(query_moment=moment)).pages
    b = weighted.encode(k, v, layout, CodecState(query_moment=moment)).pages
    assert not torch.equal(a, b)


def test_the_mean_query_is_kept_beside_the_moment_and_unknown_when_a_part_lacks_it():
    """`CodecState` keeps the sum of q beside q q^T: `close_chunk` sets the mean query of every query up to the
    chunk; queries booked without their sum (`add_moment` with no ``total_q``) leave it unknown (None) from then
    on, never a mean of some of them; `clone` copies it."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(40, 6, 64, generator=gen) + 1.5  # [T, Hq, D]
    state = CodecState()
    state.add_queries(0, q[:16], 2)
    state.add_queries(1, q[16:40], 2)
    state.close_chunk(0)
    assert torch.allclose(state.query_mean, query_mean(q[:16].transpose(0, 1), 2), rtol=1e-5, atol=1e-5)
    copy = state.clone()
    state.close_chunk(1)
    assert torch.allclose(state.query_mean, query_mean(q.transpose(0, 1), 2), rtol=1e-5, atol=1e-5)
    assert torch.allclose(copy.query_mean, query_mean(q[:16].transpose(0, 1), 2), rtol=1e-5, atol=1e-5)
    partial = CodecState()
    partial.add_queries(0, q[:8], 2)
    one = q[8:9].float().transpose(0, 1).reshape(2, 3, 64)
    partial.add_moment(0, one.transpose(1, 2) @ one, 3)  # no sum of q: the chunk's mean is not known
    partial.close_chunk(0)
    assert partial.query_moment is not None and partial.query_mean is None
    partial.add_queries(1, q[9:20], 2)
    partial.close_chunk(1)
    assert partial.query_mean is None  # a later chunk's mean would leave out the queries above


def _heavy_case(seed: int = 0):
    """Keys with per-channel scales, queries with a strong mean, and in each head one key far along the mean
    query (the key attention would gather on), plus sink-like copies of it ahead of it in head 0."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(256, 2, 64, generator=gen) * torch.linspace(0.2, 3, 64)
    v = torch.randn(256, 2, 64, generator=gen)
    q = torch.randn(6, 256, 64, generator=gen) + 2.0  # [Hq, T, D]
    mu = query_mean(q, 2)
    k[37] += 12 * mu / mu.norm(dim=-1, keepdim=True)
    k[100:105, 0] = k[104, 0] + 20 * mu[0] / mu[0].norm()  # a run of five equal rows (as sink copies are)
    return k, v, q, mu


def test_heavy_keys_take_the_outlier_slots_and_psac_rows_first():
    """`heavy=N`: per chunk and head the N keys of largest logit under the mean query (never a row equal to the
    next one) take their page's outlier slots and PSAC rows before the others: their logit error under the mean
    query falls by orders of magnitude; without the mean query, or with heavy=0, the bytes are the old ones."""
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v, q, mu = _heavy_case()
    base = "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=8,clip=true,vcluster=false,cdtype=fp8,outliers=16"
    plain, heavy = codecs.get(base), codecs.get(base + ",heavy=2")
    layout = plain.layout(geometry, 64)

    def state(mean=True):
        return CodecState(query_moment=query_second_moment(q, 2), query_mean=query_mean(q, 2) if mean else None)

    a, b = plain.encode(k, v, layout, state()), heavy.encode(k, v, layout, state())
    assert torch.equal(plain.encode(k, v, layout, state(False)).pages, heavy.encode(k, v, layout, state(False)).pages)
    assert torch.equal(a.pages, plain.encode(k, v, layout, state(False)).pages)  # heavy=0 ignores the mean
    assert not torch.equal(a.pages, b.pages)
    rows = heavy.heavy_rows(k, query_mean(q, 2)[None], 1)
    assert rows.sum(0).tolist() == [2, 2]
    assert rows[37].all() and rows[104, 0] and not rows[100:104, 0].any()  # copies give way to the run's last row
    # heavyz: only logits far above the chunk's own; head 1 has one planted key, so only one of its two is kept
    far = codecs.get(base + ",heavy=2,heavyz=4").heavy_rows(k, query_mean(q, 2)[None], 1)
    assert far.sum(0).tolist() == [2, 1] and far[37].all() and far[104, 0]
    ka, kb = plain.decode(a)[0], heavy.decode(b)[0]
    err_a = ((ka - k) * mu).sum(-1)[rows] ** 2  # logit errors of the heavy rows under the mean query
    err_b = ((kb - k) * mu).sum(-1)[rows] ** 2
    assert float(err_b.sum()) < 1e-3 * float(err_a.sum()), (err_a, err_b)
    with pytest.raises(SpecError, match="heavy"):
        codecs.get("quantwm:rank=4,keep=1,heavy=2").layout(geometry, 64)  # no outliers, every row already kept


def test_heavy_keys_units_encode_to_the_bytes_of_separate_encodes():
    """Chunks with mean queries encode in one pass to the bytes of separate encodes with `heavy` (each chunk its
    own heavy keys), and states without means are not batched with states that have them."""
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=8,clip=true,vcluster=false,cdtype=fp8,"
                       "outliers=16,heavy=3")
    layout = codec.layout(geometry, 64)
    cases = [_heavy_case(seed) for seed in range(3)]
    k = torch.stack([c[0] for c in cases])
    v = torch.stack([c[1] for c in cases])
    states = [CodecState(query_moment=query_second_moment(c[2], 2), query_mean=query_mean(c[2], 2)) for c in cases]
    pages, books = codec.encode_units(k, v, layout, [st.clone() for st in states])
    for u in range(3):
        one = codec.encode(k[u], v[u], layout, states[u].clone())
        assert torch.equal(pages[u], one.pages) and torch.equal(books[u], one.codebook), u
    mixed = [states[0].clone(), CodecState(query_moment=states[1].query_moment.clone())]
    assert not codec._states_alike(mixed)


def _whole_pair(extra: str, base: str = "quantwm:rank=0,kchannel=64,clip=true"):
    return codecs.get(base), codecs.get(base + extra)


def test_whole_keys_come_back_to_int8_rounding_and_count_their_bytes():
    """whole=W: per page and head, the W keys of largest query-weighted error store that error as INT8 with one
    fp16 scale, so each comes back within half a step (max error / 254); every other key decodes as without them;
    the bytes grow by the three fields' (W * (D + 3) per page and head, each field 16-byte aligned); the kernels
    read the rows only with the levers (`lever_scheme`), and at most `MAX_KERNEL_WHOLE` of them."""
    from kvbackend.errors import UnsupportedLayout
    from kvbackend.page_check import index_fields
    from kvbackend.scheme import kernel_schemes, lever_scheme

    geometry = Geometry(1, 2, 64, torch.float32)
    k, v = _keys(), _keys(seed=3)
    moment = query_second_moment(_queries(), 2)
    base, whole = _whole_pair(",whole=2")
    a = base.encode(k, v, base.layout(geometry, 64), CodecState(query_moment=moment))
    layout = whole.layout(geometry, 64)
    b = whole.encode(k, v, layout, CodecState(query_moment=moment))
    ka, va = base.decode(a)
    kb, vb = whole.decode(b)
    assert torch.equal(va, vb)
    fields = [layout.page.fields[name].nbytes for name in ("k_whole", "k_whole_scale", "k_whole_token")]
    assert fields == [2 * 2 * 64, 2 * 2 * 2, 2 * 2]  # [W, H, D] int8, [W, H] fp16, [W, H] uint8
    assert b.nbytes - a.nbytes == 2 * sum(-(-n // 16) * 16 for n in fields)  # 2 pages
    token = layout.page.view(b.pages, "k_whole_token").long()  # [page, W, head]
    chosen = torch.zeros(2, 64, 2, dtype=torch.bool).scatter_(1, token, True).view(128, 2)
    assert int(chosen.sum()) == 8
    assert torch.equal(kb[~chosen], ka[~chosen])  # every other key as without whole rows
    err_a, err_b = (k - ka).abs(), (k - kb).abs()
    assert bool((err_b[chosen].amax(-1) <= err_a[chosen].amax(-1) / 254 * (1 + 1e-3) + 1e-6).all())
    score = ((k - ka) ** 2 * channel_weights(moment)).sum(-1).view(2, 64, 2)
    picked = chosen.view(2, 64, 2)
    for page in range(2):
        for head in range(2):  # no key left out has a larger weighted error than one kept
            s, m = score[page, :, head], picked[page, :, head]
            assert float(s[m].min()) >= float(s[~m].max())
    with pytest.raises(UnsupportedLayout, match="whole key rows"):  # never read while ignoring the rows
        kernel_schemes(whole, layout)
    kernel_schemes(whole, layout, levers_read=True)
    levers = lever_scheme(whole, layout)
    assert levers.active and levers.whole == 2 and levers.whole_token == layout.page.fields["k_whole_token"].offset
    many = codecs.get("quantwm:rank=0,kchannel=64,whole=9")  # the torch reference serves these
    with pytest.raises(UnsupportedLayout, match="at most 8 whole key rows"):
        lever_scheme(many, many.layout(geometry, 64))
    assert "k_whole_token" in [f.name for f in index_fields(whole, layout)]
    with pytest.raises(SpecError, match="whole"):
        codecs.get("quantwm:whole=65").layout(geometry, 64)
    with pytest.raises(SpecError, match="whole"):
        codecs.get("quantwm:whole=1").layout(geometry, 512)


def test_whole_keys_take_heavy_rows_first_and_keep_every_other_field():
    """With `heavy`, the heavy keys are stored whole before any other. The whole rows are written after the outlier
    slots (which the heavy keys still take first, and which keep their bytes) and before the PSAC rows, which fit
    what the rows leave: a heavy key's logit error under the mean query falls by orders of magnitude."""
    geometry = Geometry(1, 2, 64, torch.float32)
    k, v, q, mu = _heavy_case()
    base = "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=8,clip=true,vcluster=false,cdtype=fp8,outliers=16,heavy=2"
    slots, whole = codecs.get(base), codecs.get(base + ",whole=1")
    layout, slot_layout = whole.layout(geometry, 64), slots.layout(geometry, 64)

    def state():
        return CodecState(query_moment=query_second_moment(q, 2), query_mean=query_mean(q, 2))

    a, b = slots.encode(k, v, slot_layout, state()), whole.encode(k, v, layout, state())
    token = layout.page.view(b.pages, "k_whole_token").long()  # [page, 1, head]
    assert token[0, 0].tolist() == [37, 37] and token[1, 0, 0] == 104 - 64  # the heavy keys (the run's last row)
    for name in ("k_codes", "k_scales", "k_assign", "v_codes", "k_out_index", "k_out_value"):
        assert torch.equal(slot_layout.page.view(a.pages, name), layout.page.view(b.pages, name)), name
    assert torch.equal(a.codebook, b.codebook)  # the centroids and the PSAC basis
    rows = whole.heavy_rows(k, query_mean(q, 2)[None], 1)
    ka, kb = slots.decode(a)[0], whole.decode(b)[0]
    err_a = ((ka - k) * mu).sum(-1)[rows] ** 2
    err_b = ((kb - k) * mu).sum(-1)[rows] ** 2
    assert float(err_b.sum()) < 1e-2 * float(err_a.sum()), (err_a, err_b)
    assert float((kb - k).norm()) < float((ka - k).norm())


def test_whole_keys_skip_stand_ins_and_units_encode_to_separate_encodes():
    """Rows that stand in for others are never stored whole: copies equal to the next row (as sink copies are)
    and a partial last page's padding (its first copy, the real last token, may be). Chunks encode in one pass
    to the bytes of separate encodes."""
    geometry = Geometry(1, 1, 32, torch.float32)
    codec = codecs.get("quantwm:group=16,rank=0,whole=2,centroids=1")  # no centroid on the copies
    layout = codec.layout(geometry, 32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(33, 1, 32, generator=g), torch.randn(33, 1, 32, generator=g)
    k[4] *= 9  # a key with the page's largest errors, and four copies of it ahead of it
    k[0:4] = k[4]
    chunk = codec.encode(k, v, layout)
    token = layout.page.view(chunk.pages, "k_whole_token")[:, :, 0].long()
    assert 4 in token[0].tolist() and not set(token[0].tolist()) & {0, 1, 2, 3}
    assert 0 in token[1].tolist()  # page 1: the real token, then one padding row (the only other choice is padding)
    k2 = torch.stack([torch.randn(64, 1, 32, generator=g) for _ in range(3)])
    v2 = torch.stack([torch.randn(64, 1, 32, generator=g) for _ in range(3)])
    pages, books = codec.encode_units(k2, v2, layout)
    for u in range(3):
        one = codec.encode(k2[u], v2[u], layout)
        assert torch.equal(pages[u], one.pages) and torch.equal(books[u], one.codebook), u


def test_trailing_copies_count_the_run_of_equal_rows_at_a_page_end():
    from kvbackend.codecs.quantwm import trailing_copies
    g = torch.Generator().manual_seed(3)
    last = torch.randn(7, 16, 2, 8, generator=g)
    runs = [0, 1, 3, 15, 0, 2, 15]  # rows after the run's first: unit 3 and 6 wholly one row
    for u, n in enumerate(runs):
        last[u, 16 - n - 1 :] = last[u, -1]
    last[4, -2] = last[4, -1]
    last[4, -2, 1, 3] += 1.0  # one value apart: no copy
    last[5, 3] = last[5, -1]  # an equal row before the run does not extend it
    want = torch.tensor([0, 1, 3, 15, 0, 2, 15])
    got = trailing_copies(last)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    same = (last == last[:, -1:]).flatten(2).all(2).flip(1).cumprod(1)  # the device path's formula
    assert torch.equal(got, same.sum(1) - 1)


def test_chosen_rows_are_the_gathered_centroids():
    from kvbackend.codecs.qvg import chosen_rows
    g = torch.Generator().manual_seed(4)
    cents = torch.randn(5, 7, 3, generator=g)
    assign = torch.randint(0, 7, (5, 11), generator=g)
    want = torch.gather(cents, 1, assign.unsqueeze(-1).expand(-1, -1, 3))
    assert torch.equal(chosen_rows(cents, assign), want)
