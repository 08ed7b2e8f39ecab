"""The ``chw:`` gather kernel (`kvbackend.kernels.chw_gather`) and the backend that serves ``chw:`` layers on a GPU,
against the torch reference (the codec's decode and the cache's frames) on the same pages: every width 0-8, the
levers a klt plan writes (sinks, pre-RoPE keys, rotated values), odd lengths with a dense active chunk, GQA."""

import dataclasses

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.attention import decode_attention
from kvbackend.backends import ChwBackend, TorchBackend, choose
from kvbackend.errors import SpecError, UnsupportedLayout
from kvbackend.frames import lever_layout
from kernel_cases import DEVICE
from test_kernel_levers import ROTARY, lever_cache  # (queries fed too: chw: layers book none)

triton = pytest.importorskip("triton")

KW = "".join(str(i % 9) for i in range(128))  # every width 0-8 on channels of both heads
CASES = [  # (codec, page size, lengths, GQA ratio)
    (f"chw:kw={KW},vbits=2,vstep=1.15,sink=4,prerope=true,vrot=hadamard", 16, [45, 70, 3], 4),  # a klt plan's layer
    (f"chw:kw={KW[::-1]},vbits=3,sink=4,prerope=true,vrot=hadamard", 16, [97], 1),  # 3-bit values, byte triples
    (f"chw:kw={KW},vbits=4", 32, [75, 40], 2),  # no lever
    ("chw:kbits=3,vbits=2,pagerope=true", 16, [70], 2),  # every channel coded, page-relative keys
    ("chw:kbits=0,vbits=2,sink=2", 16, [50, 33], 2),  # no channel coded: the keys are the chunk means
    (f"chw:kw={'8' * 128},vbits=8,vrot=hadamard", 16, [64, 64], 2),  # the widest codes, whole pages only
    (f"chw:kw={KW},vbits=2,sink=4,vrot=hadamard,order=lane", 16, [45, 70, 3], 4),  # lane order (keys after RoPE)
    (f"chw:kw={KW[::-1]},vbits=2,order=lane", 32, [97, 20], 8),  # lane order, no lever, a GQA group of 8
]


@pytest.mark.parametrize("codec,page_size,lengths,ratio", CASES)
def test_gather_and_decode_read_chw_pages_like_the_reference(codec, page_size, lengths, ratio):
    from kvbackend.kernels.chw_decode import chw_decode
    from kvbackend.kernels.chw_gather import chw_gather

    cache, ids = lever_cache(codec, page_size, lengths, ratio, "triton")
    backend = cache.backends[1]
    assert isinstance(backend, ChwBackend) and backend.name == "triton"
    layer = 1
    reads = [cache.read(rid, layer) for rid in ids]  # the torch reference: decode_pages + the frame
    plan = cache.plan(ids, layer)
    assert bool((plan.kinds == 0).any()), "no packed page: nothing of the kernel's own path would be tested"
    k, v = chw_gather(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                      backend.scheme, plan, out_dtype=torch.float32, levers=backend.levers, rotary=ROTARY)
    rk, rv = torch.cat([r[0] for r in reads]).float(), torch.cat([r[1] for r in reads]).float()
    # the reference is rounded to bf16 once; the kernel's float32 keys differ from it by that rounding (and by the
    # RoPE's float32 arithmetic) at most
    assert float((k - rk).abs().max()) <= 1e-2 * float(rk.abs().max())
    assert float((v - rv).abs().max()) <= 1e-2 * float(rv.abs().max())
    if backend.levers.sink:  # the exact sinks, bit for bit
        for rid, row in zip(ids, plan.cu_seqlens[:-1].tolist()):
            if cache.page_table(rid).packed:
                sink = backend.levers.sink
                assert torch.equal(k[row : row + sink].bfloat16(), reads[ids.index(rid)][0][:sink])
    # codes gathered from a register tile of the head's block: the same bytes, the same arithmetic
    tk, tv = chw_gather(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                        backend.scheme, plan, out_dtype=torch.float32, levers=backend.levers, rotary=ROTARY, tile=True)
    assert torch.equal(tk, k) and torch.equal(tv, v)
    bk, bv = cache.gather(plan, layer)  # the backend's own call, in the cache's dtype: one bf16 rounding away
    assert bk.dtype == torch.bfloat16 and bv.dtype == torch.bfloat16
    assert torch.allclose(bk.float(), k, rtol=2 ** -7, atol=1e-6) and torch.allclose(bv.float(), v, rtol=2 ** -7, atol=1e-6)
    q = torch.randn(len(ids), 2 * ratio, 64, device=DEVICE).bfloat16()
    want, want_lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])
    out, lse = cache.decode(plan, layer, q)
    assert float((out.float() - want).norm() / want.norm()) < 1e-2
    assert backend.tile == (backend.scheme.codes >= 0)  # blocks this small fit the tile: the backend runs it
    direct = chw_decode(q, cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                        backend.scheme, plan, levers=backend.levers, rotary=ROTARY, tile=False)
    if DEVICE == "cpu":  # the interpreter: the same operations give the same bits
        assert torch.equal(direct[0], out) and torch.equal(direct[1], lse)
    else:  # compiled, the two programs may schedule the products apart (measured on an H100: not bit for bit)
        assert float((direct[0].float() - out.float()).norm() / out.float().norm()) < 1e-3
        assert torch.allclose(direct[1], lse, atol=1e-3)
    # keys near 8 are a bf16 step (1/16) apart where the two frames' float32 arithmetic rounds them apart
    assert torch.allclose(lse, want_lse, atol=5e-2)
    cut = plan.cu_seqlens.tolist()  # the fused kernel over the gathered rows' attention: its fp16 operands apart
    own, own_lse = decode_attention(q, [bk[a:b] for a, b in zip(cut, cut[1:])], [bv[a:b] for a, b in zip(cut, cut[1:])])
    assert float((out.float() - own).norm() / own.norm()) < 5e-3 and torch.allclose(lse, own_lse, atol=2e-2)


def test_the_backend_reads_blocks_past_its_tile_directly(monkeypatch):
    from kvbackend.kernels.chw_gather import tile_bytes

    codec = f"chw:kw={KW},vbits=2,sink=4,prerope=true,vrot=hadamard"
    cache, ids = lever_cache(codec, 16, [45, 70], 2, "triton")
    small = cache.backends[1]
    assert small.tile
    need = tile_bytes(small.scheme.widths, cache.geometry.num_kv_heads, 16)
    monkeypatch.setattr(ChwBackend, "MAX_TILE", need - 1)  # one byte short: direct reads
    wide, _ = lever_cache(codec, 16, [45, 70], 2, "triton")
    backend = wide.backends[1]
    assert isinstance(backend, ChwBackend) and not backend.tile
    layer = 1
    plan_a, plan_b = cache.plan(ids, layer), wide.plan(ids, layer)
    ka, va = cache.gather(plan_a, layer)
    kb, vb = wide.gather(plan_b, layer)
    assert torch.equal(ka, kb) and torch.equal(va, vb)  # the same bytes read two ways give the same keys


def test_each_lever_path_of_the_gather_does_work():
    """Without the lever scheme the same pages gather to something else (the sink, RoPE and rotation paths)."""
    from kvbackend.kernels.chw_gather import chw_gather

    cache, ids = lever_cache(CASES[0][0], 16, [70], 2, "triton")
    backend, plan = cache.backends[0], cache.plan(ids, 0)
    args = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], backend.scheme, plan)
    full = chw_gather(*args, out_dtype=torch.float32, levers=backend.levers, rotary=ROTARY)
    for off, changed in ((dict(sink=0), (0, 1)), (dict(prerope=False), (0,)), (dict(vrot=False), (1,))):
        part = chw_gather(*args, out_dtype=torch.float32, levers=dataclasses.replace(backend.levers, **off),
                          rotary=ROTARY)
        for i in (0, 1):  # K, V: what the lever touches changes, the other stays to the bit
            assert torch.allclose(part[i], full[i], atol=1e-3) != (i in changed), (off, i)
            assert (i in changed) or torch.equal(part[i], full[i]), (off, i)


def test_the_backend_is_chosen_for_chw_layers_only():
    geometry = Geometry(2, 2, 64, torch.bfloat16)
    chw = codecs.get(f"chw:kw={KW},vbits=2,sink=4,prerope=true,vrot=hadamard")
    layout = lever_layout(chw.layout(geometry, 16), chw.levers)  # (the sink fields, as a cache lays them out)
    assert isinstance(choose("triton", torch.device(DEVICE), chw, layout), ChwBackend)
    assert isinstance(choose("torch", torch.device(DEVICE), chw, layout), TorchBackend)
    assert isinstance(choose("auto", torch.device("cpu"), chw, layout), TorchBackend)  # the CPU keeps the reference
    odd = lever_layout(chw.layout(geometry, 24), chw.levers)  # pages of 24 tokens: no kernel reads them
    assert isinstance(choose("auto", torch.device("cpu"), chw, odd), TorchBackend)
    with pytest.raises(SpecError, match="cannot read codec"):
        choose("triton", torch.device(DEVICE), chw, odd)
    from kvbackend.kernels.chw_gather import chw_scheme

    with pytest.raises(UnsupportedLayout, match="power-of-two"):
        chw_scheme(chw, odd)
    rtn = codecs.get("rtn:bits=2,group=32")
    with pytest.raises(UnsupportedLayout, match="not a chw"):
        chw_scheme(rtn, rtn.layout(geometry, 16))



def test_a_scheme_of_another_layout_is_refused():
    """Offsets of another geometry would read other fields of a page, or past it: both kernels refuse the scheme."""
    from kvbackend.kernels.chw_decode import chw_decode
    from kvbackend.kernels.chw_gather import chw_gather

    kw = "3" * 64 + "5" * 64
    donor, _ = lever_cache(f"chw:kw={kw},vbits=4", 16, [40], 1, "triton")
    cache = KVCache(Geometry(2, 1, 128, torch.bfloat16),
                    CacheConfig(codec=f"chw:kw={kw},vbits=4", page_size=16, chunk_pages=2, dense_pages=8,
                                packed_pages=8, device=DEVICE, backend="triton"))
    rid, _ = cache.add_request()
    for layer in range(2):
        cache.append(rid, layer, torch.randn(40, 1, 128, device=DEVICE).bfloat16(),
                     torch.randn(40, 1, 128, device=DEVICE).bfloat16())
    plan = cache.plan([rid], 0)
    pools = (cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0])
    with pytest.raises(ValueError, match="layout of 2 KV heads"):
        chw_gather(*pools, donor.backends[0].scheme, plan)
    with pytest.raises(ValueError, match="layout of 2 KV heads"):
        chw_decode(torch.randn(1, 2, 128, device=DEVICE).bfloat16(), *pools, donor.backends[0].scheme, plan)
    k, _ = chw_gather(*pools, cache.backends[0].scheme, plan, out_dtype=torch.float32)  # its own: served
    assert torch.allclose(k.bfloat16().float(), cache.read(rid, 0)[0].float(), rtol=2 ** -7, atol=1e-6)


def test_a_negative_zero_mean_reads_back_as_the_reference_reads_it():
    """No channel coded: the keys are the chunk means, a -0 mean included (bit for bit as the torch reference)."""
    from kvbackend.kernels.chw_gather import chw_gather

    for spec in ("chw:kbits=0,vbits=4", "chw:kw=" + "0" * 63 + "3" + "3" * 64 + ",vbits=4"):
        cache = KVCache(Geometry(1, 2, 64, torch.float32),
                        CacheConfig(codec=spec, page_size=16, chunk_pages=1, dense_pages=8, packed_pages=8,
                                    device=DEVICE, backend="triton"))
        rid, _ = cache.add_request()
        k = torch.randn(17, 2, 64, device=DEVICE)
        k[:, 0, 0] = -1e-9  # a mean that rounds to -0 in fp16
        cache.append(rid, 0, k, torch.randn(17, 2, 64, device=DEVICE))
        got, _ = chw_gather(cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0],
                            cache.backends[0].scheme, cache.plan([rid], 0), out_dtype=torch.float32)
        want = cache.read(rid, 0)[0]
        assert torch.equal(got[:16, 0, 0].view(torch.int32), want[:16, 0, 0].view(torch.int32)), spec
        assert int(want[0, 0, 0].view(torch.int32)) == int(torch.tensor(-0.0).view(torch.int32))
