"""Warm chunk encodes replayed from CUDA graphs (`kvbackend.kernels.encode_graph.GraphedEncoder`): a replay gives
the bytes a fresh capture gives for the same inputs, carries nothing of one chunk into the next, encodes within the
eager pass's error, and a `KVCache` serves the same values with and without graphs. Off CUDA the encoder is the
eager one, byte for byte."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.base import CodecState
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.psac import query_second_moment
from kernel_cases import DEVICE

pytest.importorskip("triton")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
SPEC = ("quantwm:kchannel=16,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,vrot=hadamard,"
        "cdtype=fp8,outliers=16")
HEADS, DIM, PAGE = 3, 64, 16


def _case(units: int = 2, tokens: int = 3 * PAGE, seed: int = 0):
    codec = codecs.get(SPEC)
    layout = codec.layout(Geometry(1, HEADS, DIM, torch.bfloat16), PAGE)
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(3):
        k = torch.randn(units, tokens, HEADS, DIM, generator=gen) * torch.logspace(-1, 1, DIM)
        k = k + torch.randn(units, 1, HEADS, DIM, generator=gen) * 3
        v = torch.randn(units, tokens, HEADS, DIM, generator=gen)
        chunks.append((k.bfloat16().to(DEVICE), v.bfloat16().to(DEVICE)))
    states = [CodecState(query_moment=query_second_moment(torch.randn(2 * HEADS, 40, DIM, generator=gen), HEADS)
                         .to(DEVICE)) for _ in range(units)]
    return codec, layout, chunks, states


def _snapshot(states):
    return [st.clone() for st in states]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path (Triton's interpreter)")
def test_off_cuda_the_eager_encoder_encodes():
    from kvbackend.kernels.encode_graph import GraphedEncoder
    from kvbackend.kernels.unit_encoder import encode_units

    codec, layout, chunks, states = _case()
    codec.encode_units(*chunks[0], layout, states, encoder=encode_units)  # warm
    graphed = GraphedEncoder()
    a, b = _snapshot(states), _snapshot(states)
    want = codec.encode_units(*chunks[1], layout, a, encoder=encode_units)
    for _ in range(3):  # a CUDA device would capture from the second pass on
        b2 = _snapshot(b)
        got = codec.encode_units(*chunks[1], layout, b2, encoder=graphed)
    assert graphed.replays == 0 and not graphed._graphs
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(x.centroids["k"], y.centroids["k"]) for x, y in zip(a, b2))


def test_encode_graphs_is_a_checked_switch():
    assert CacheConfig().encode_graphs is False
    assert CacheConfig(encode_graphs=True).encode_graphs is True
    with pytest.raises(ValueError, match="encode_graphs must be True or False"):
        CacheConfig(encode_graphs="yes")


@CUDA
def test_a_replay_is_what_a_capture_gives_and_keeps_nothing_of_the_last_chunk():
    from kvbackend.kernels.encode_graph import GraphedEncoder

    codec, layout, chunks, states = _case()
    graphed = GraphedEncoder()
    codec.encode_units(*chunks[0], layout, states, encoder=graphed)  # cold: eager
    assert not graphed._graphs
    codec.encode_units(*chunks[0], layout, _snapshot(states), encoder=graphed)  # first warm pass: eager
    assert not graphed._graphs and graphed.replays == 0
    before = _snapshot(states)
    first = codec.encode_units(*chunks[1], layout, states, encoder=graphed)  # captured, then replayed
    assert len(graphed._graphs) == 1 and graphed.replays == 1
    after_first = _snapshot(states)
    other = codec.encode_units(*chunks[2], layout, _snapshot(before), encoder=graphed)
    assert not torch.equal(other[0], first[0])  # another chunk, other bytes
    again_states = _snapshot(before)
    again = codec.encode_units(*chunks[1], layout, again_states, encoder=graphed)
    assert graphed.replays == 3 and len(graphed._graphs) == 1
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    for x, y in zip(again_states, after_first):
        assert torch.equal(x.centroids["k"], y.centroids["k"])
        assert x.iterations == y.iterations and len(x.iterations) == len(before[0].iterations) + 1
    # the outputs are the caller's own tensors: a later replay does not change them
    kept = first[0].clone()
    codec.encode_units(*chunks[2], layout, _snapshot(before), encoder=graphed)
    assert torch.equal(first[0], kept)
    assert graphed.reserved_bytes > 0  # the pass's intermediates live in the graph's pool


@CUDA
def test_a_replay_encodes_within_the_eager_error():
    from kvbackend.kernels.encode_graph import GraphedEncoder
    from kvbackend.kernels.unit_encoder import encode_units

    codec, layout, chunks, states = _case(units=3, tokens=4 * PAGE + 5)
    codec.encode_units(*chunks[0], layout, states, encoder=encode_units)
    graphed = GraphedEncoder()
    for _ in range(2):
        codec.encode_units(*chunks[0], layout, _snapshot(states), encoder=graphed)
    assert len(graphed._graphs) == 1
    eager_states, graph_states = _snapshot(states), _snapshot(states)
    k, v = chunks[1]
    sides = [codec.encode_units(k, v, layout, eager_states, encoder=encode_units),
             codec.encode_units(k, v, layout, graph_states, encoder=graphed)]
    assert graphed.replays == 2
    errors = []
    for pages, books in sides:
        n = k.shape[1]
        decoded = [codec.decode_pages(layout, pages[u], books[u]) for u in range(k.shape[0])]
        kd = torch.stack([d[0][:n] for d in decoded]).float()
        vd = torch.stack([d[1][:n] for d in decoded]).float()
        errors.append((float((kd - k.float()).norm() / k.float().norm()), float((vd - v.float()).norm() / v.float().norm())))
    (ek, ev), (gk, gv) = errors
    assert 0 < gk <= 1.02 * ek and gv == pytest.approx(ev, rel=1e-6)
    for x, y in zip(eager_states, graph_states):
        assert torch.allclose(x.centroids["k"], y.centroids["k"], rtol=1e-3, atol=1e-3)


@CUDA
def test_a_replay_reads_each_chunks_own_mean_query():
    """`heavy` picks keys by the chunk's mean query: a replay copies the new chunk's means into the graph, so it
    gives the bytes a capture made with them gives, not those of the means it was captured with."""
    from kvbackend.kernels.encode_graph import GraphedEncoder
    from kvbackend.psac import query_mean

    codec, layout, chunks, states = _case()
    codec = codecs.get(SPEC + ",heavy=3")
    gen = torch.Generator().manual_seed(11)

    def with_means(sts, shift):
        out = _snapshot(sts)
        for st in out:
            q = torch.randn(2 * HEADS, 40, DIM, generator=gen) + shift * torch.linspace(-3, 3, DIM)
            st.query_mean = query_mean(q, HEADS).to(DEVICE)
        return out

    codec.encode_units(*chunks[0], layout, states, encoder=GraphedEncoder())  # cold and warm-up: eager
    a, b = with_means(states, 1.0), with_means(states, -1.0)
    graphed = GraphedEncoder()
    for _ in range(2):
        codec.encode_units(*chunks[1], layout, _snapshot(a), encoder=graphed)  # captured with a's means
    replayed = codec.encode_units(*chunks[1], layout, _snapshot(b), encoder=graphed)
    assert len(graphed._graphs) == 1 and graphed.replays >= 2
    fresh = GraphedEncoder()
    for _ in range(2):
        want = codec.encode_units(*chunks[1], layout, _snapshot(b), encoder=fresh)  # captured with b's means
    stale = codec.encode_units(*chunks[1], layout, _snapshot(a), encoder=fresh)
    assert torch.equal(replayed[0], want[0]) and torch.equal(replayed[1], want[1])
    assert not torch.equal(stale[0], want[0])  # the means choose other heavy keys: other bytes
    # states without a mean are another graph, never a replay of one made with means
    codec.encode_units(*chunks[1], layout, _snapshot(states), encoder=graphed)
    codec.encode_units(*chunks[1], layout, _snapshot(states), encoder=graphed)
    assert len(graphed._graphs) == 2


LEVERS = SPEC.replace("vrot=hadamard", "vrot=hadamard,sink=4,prerope=true")
# a depth spec's three layer codecs (other outlier counts and key widths): one mixed pass per chunk
MIXED = (LEVERS, LEVERS.replace("outliers=16", "outliers=0"), LEVERS.replace("outliers=16", "outliers=0,kbits=3"))


# whole key rows (heavy keys first) in one codec, and in some layers of a mixed pass
WHOLE = (LEVERS + ",heavy=2,whole=1", LEVERS.replace("outliers=16", "outliers=0,whole=2,heavy=2"),
         LEVERS.replace("outliers=16", "outliers=0,kbits=3,heavy=2"))


@CUDA
@pytest.mark.parametrize("specs", [(LEVERS,) * 3, MIXED, (WHOLE[0],) * 3, WHOLE],
                         ids=["one codec", "mixed pass", "whole rows", "mixed pass, whole rows"])
def test_a_cache_serves_the_same_values_with_and_without_encode_graphs(specs):
    from kvbackend.manager import KVCache
    from kvbackend.rope import Rotary

    layers, heads, d = 3, 2, 64

    def run(graphs: bool):
        config = CacheConfig(layer_codecs=specs, page_size=16, chunk_pages=2, dense_pages=32, packed_pages=32,
                             backend="triton", device=DEVICE, encode_graphs=graphs)
        cache = KVCache(Geometry(layers, heads, d, torch.float32), config, rotary=Rotary.default(d, 10000.0))
        gen = torch.Generator().manual_seed(5)
        rid, _ = cache.add_request()
        exact = [([], []) for _ in range(layers)]
        for _ in range(10):  # 10 x 16 tokens: five 32-token chunks (cold, warm eager, captured, two replays)
            for layer in range(layers):
                k, v = torch.randn(16, heads, d, generator=gen) * 3, torch.randn(16, heads, d, generator=gen)
                cache.append(rid, layer, k.to(DEVICE), v.to(DEVICE),
                             queries=torch.randn(16, 2 * heads, d, generator=gen).to(DEVICE))
                exact[layer][0].append(k)
                exact[layer][1].append(v)
        return cache, rid, [(torch.cat(k), torch.cat(v)) for k, v in exact]

    graphed, rid1, exact = run(True)
    eager, rid2, _ = run(False)
    encoder = graphed.backends[0].unit_encoder
    assert encoder is not None and encoder.replays == 3  # chunks 3, 4 and 5
    assert eager.backends[0].unit_encoder is None
    for layer in range(layers):
        for x, y, original in zip(graphed.read(rid1, layer), eager.read(rid2, layer), exact[layer]):
            x, y = x.float().cpu(), y.float().cpu()
            assert x.shape == y.shape == original.shape
            assert torch.equal(x[:4], y[:4])  # the sinks
            assert (x - original).norm() <= 1.02 * (y - original).norm()
            assert (x - y).norm() <= 0.05 * original.norm()
