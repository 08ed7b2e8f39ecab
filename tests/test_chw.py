"""chw: page codecs (a key width per channel, klt's page form): codes pack to their bits and back, every coded
channel reads within half a step of its page's range, a width-0 channel reads as its chunk mean, the stored bytes
are the fields', bad specs and keys past fp16 are refused, the kernels refuse the layout by name, the paged cache
serves it through the torch reference, and `kvbackend.klt.page_specs` plans it from frozen bases."""

import math

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, SpecError, codecs
from kvbackend.backends import kernels_can_serve
from kvbackend.codecs.chw import bit_layout, pack_pages, unpack_pages
from kvbackend.errors import InvalidKV, UnsupportedLayout
from kvbackend.klt import KeyBases, page_specs, parse_klt
from kvbackend.rope import Rotary
from kvbackend.scheme import kernel_schemes
from kvbackend.tools.reconstruct import reconstruct_sequence

GEOM = Geometry(2, 3, 16, torch.float32)
KW = "".join(str(i % 9) for i in range(48))  # every width 0-8 on some channel of each head


def kv(tokens=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offset = torch.linspace(-6, 6, 48).view(1, 3, 16)  # channel means the codes must not spend levels on
    k = torch.randn(tokens, 3, 16, generator=gen) * torch.linspace(0.1, 4, 48).view(1, 3, 16) + offset
    return k, torch.randn(tokens, 3, 16, generator=gen)


def test_codes_of_mixed_widths_pack_to_their_bits_and_back():
    gen = torch.Generator().manual_seed(1)
    for heads, channels in ((1, 1), (1, 7), (3, 11)):
        width = torch.randint(0, 9, (heads * channels,), generator=gen, dtype=torch.uint8)
        width[0] = 5  # at least one coded channel
        bits = bit_layout(width, heads, 5)
        coded = width[width > 0]
        codes = (torch.rand(3, 5, coded.numel(), generator=gen) * (2.0 ** coded.float())).floor().to(torch.int32)
        packed = pack_pages(codes, bits)
        per_head = width.reshape(heads, channels).long().sum(1)
        assert packed.shape == (3, int((4 * ((5 * per_head + 31) // 32)).sum()))  # whole 32-bit words a head
        assert torch.equal(unpack_pages(packed, bits, 5), codes)
    one = pack_pages(torch.tensor([[[1, 2]]], dtype=torch.int32), bit_layout(torch.tensor([1, 3], dtype=torch.uint8), 1, 1))
    assert one.tolist() == [[0b1010_0000, 0, 0, 0]]  # 1 (one bit) then 010 (three bits), most significant first


def test_each_channel_reads_within_half_a_step_and_width_zero_reads_its_mean():
    codec = codecs.get(f"chw:kw={KW},vbits=4")
    layout = codec.layout(GEOM, 16)
    k, v = kv()
    chunk = codec.encode(k, v, layout)
    kd, vd = codec.decode(chunk)
    width = torch.tensor([int(c) for c in KW])
    flat, out = k.reshape(5, 16, 48), kd.reshape(5, 16, 48)
    mean = k.reshape(80, 48).mean(0).half().float()
    for b in range(9):
        cols = width == b
        if b == 0:
            assert torch.equal(out[:, :, cols], mean[cols].expand(5, 16, -1))
            continue
        peak = (flat[:, :, cols] - mean[cols]).abs().amax(1, keepdim=True)  # per page and channel
        half_step = peak * (1 + 2.0 ** -9) / 2 ** b  # the fp16 scale is the peak rounded up (a 2**-10 step)
        assert torch.all((out[:, :, cols] - flat[:, :, cols]).abs() <= half_step + 1e-6)
    assert (vd - v).pow(2).mean() < 0.02 * v.pow(2).mean()  # 4-bit values
    widths = torch.tensor([int(c) for c in KW])
    per_page = math.ceil(16 * int(widths.sum()) / 8) + 2 * int((widths > 0).sum()) + 16 * 3 * 8 // 8 * 1 + 16 * 3 * 2
    assert layout.page_bytes >= per_page and layout.codebook_bytes >= 2 * 48
    assert chunk.nbytes == 5 * layout.page_bytes + layout.codebook_bytes
    more = codecs.get(f"chw:kw={KW.replace('2', '5')},vbits=4")
    k5 = more.decode(more.encode(k, v, more.layout(GEOM, 16)))[0]
    cols = width == 2
    assert (k5 - k).reshape(80, 48)[:, cols].abs().mean() < (kd - k).reshape(80, 48)[:, cols].abs().mean() / 4


def test_a_uniform_width_and_a_layer_of_zero_widths():
    k, v = kv()
    uniform = codecs.get("chw:kbits=3")
    assert uniform.spec.key_widths(3, 16).tolist() == [3] * 48
    kd = uniform.decode(uniform.encode(k, v, uniform.layout(GEOM, 16)))[0]
    assert (kd - k).pow(2).mean() < 0.05 * k.pow(2).mean()
    zero = codecs.get("chw:kbits=0")
    layout = zero.layout(GEOM, 16)
    assert "k_hcodes" not in layout.page.fields  # nothing to store per page for the keys
    kz = zero.decode(zero.encode(k, v, layout))[0]
    assert torch.equal(kz, k.mean(0).half().float().expand_as(k))


@pytest.mark.parametrize("spec, message", [
    ("chw:kw=0129", "digits 0-8"),
    ("chw:kw=12a", "digits 0-8"),
    ("chw:kbits=9", "out of range"),
    ("chw:vbits=5", "not supported"),
    ("chw:vstep=1.2,vclip=false", "needs vclip=true"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(SpecError, match=message):
        codecs.get(spec)


def test_widths_for_another_geometry_are_refused():
    with pytest.raises(SpecError, match="47 widths.*3 KV heads x 16 channels = 48"):
        codecs.get(f"chw:kw={KW[:-1]}").layout(GEOM, 16)


def test_keys_past_fp16_are_refused_not_clipped():
    codec = codecs.get("chw:kbits=2")
    layout = codec.layout(GEOM, 16)
    k, v = kv(32)
    far = k.clone()
    far[3, 1, 2] = 1.5e5  # its distance from the channel's mean needs a scale past fp16
    with pytest.raises(InvalidKV, match="exceeds fp16"):
        codec.encode(far, v, layout)
    high = k.clone()
    high[:, 0, 0] = 7e4  # the channel's mean itself is past fp16
    with pytest.raises(InvalidKV, match="mean exceeds fp16"):
        codec.encode(high, v, layout)
    nan = k.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV, match="NaN"):
        codec.encode(nan, v, layout)


def test_keys_whose_reconstruction_leaves_fp16_are_refused():
    """Each stored key within fp16, but a channel's mean plus its spread past it: a coarse level (mean + 1.25 x the
    spread here) would read back past 65504, where the kernels' fp16 operands overflow. Refused, the cache unchanged."""
    codec = codecs.get("chw:kbits=2,vbits=2")
    layout = codec.layout(Geometry(1, 1, 16, torch.float32), 16)
    k = torch.randn(16, 1, 16)
    k[:15, 0, 0] = 60000.0
    k[15, 0, 0] = 0.0  # mean 56250, spread 56250
    with pytest.raises(InvalidKV, match="reach past fp16"):
        codec.encode(k, torch.randn(16, 1, 16), layout)
    k[:15, 0, 0] = 30000.0  # mean 28125 + spread 28125 = 56250: read back within fp16
    kd, _ = codec.decode(codec.encode(k, torch.randn(16, 1, 16), layout))
    assert torch.isfinite(kd.half()).all()


def test_the_kernels_refuse_the_layout_by_name():
    codec = codecs.get(f"chw:kw={KW},sink=4,prerope=true,vrot=hadamard")
    layout = codec.layout(GEOM, 16)
    with pytest.raises(UnsupportedLayout, match="k_hcodes"):
        kernel_schemes(codec, layout, levers_read=True)
    assert not kernels_can_serve(codec, layout)


def test_the_paged_cache_serves_a_chw_plan_as_its_sequence_reference():
    rotary = Rotary.default(16, 10000.0)
    plan = (f"chw:kw={KW},vbits=2,vstep=1.15,sink=4,prerope=true,vrot=hadamard",
            f"chw:kw={KW[::-1]},vbits=3,sink=4,prerope=true,vrot=hadamard")
    cache = KVCache(GEOM, CacheConfig(layer_codecs=plan, page_size=16, chunk_pages=2, dense_pages=16,
                                      packed_pages=16), rotary=rotary)
    rid, _ = cache.add_request(list(range(80)))
    data = [kv(80, seed=layer) for layer in range(2)]
    for layer, (k, v) in enumerate(data):
        cache.append(rid, layer, k, v)
    for layer, (k, v) in enumerate(data):
        rec = reconstruct_sequence(codecs.get(plan[layer]), k, v, GEOM, 16, 32, rotary)
        ck, cv = cache.read(rid, layer)
        # two packed chunks of 32 tokens, then 16 tokens of the dense active chunk, kept as appended
        assert torch.allclose(ck[:64], rec.k[:64], atol=1e-4, rtol=1e-4)
        assert torch.allclose(cv[:64], rec.v[:64], atol=1e-4, rtol=1e-4)
        assert torch.equal(ck[64:], k[64:]) and torch.equal(cv[64:], v[64:])
        assert torch.equal(ck[:4], k[:4].half().float())  # the exact sinks
        assert not torch.allclose(ck[4:64], k[4:64], atol=1e-3)  # the packed chunks are coded, not kept
    cache.check()


def _bases(layers=2, heads=3, dim=16, tokens=120):
    gen = torch.Generator().manual_seed(3)
    rotary = Rotary.default(dim, 10000.0)
    pos = torch.arange(tokens)
    spread = torch.logspace(1, -2, dim)
    keys = [rotary.rotate(torch.randn(heads, tokens, dim, generator=gen) * spread, pos) for _ in range(layers)]
    queries = [rotary.rotate(torch.randn(2 * heads, tokens, dim, generator=gen), pos) for _ in range(layers)]
    return KeyBases.fit(queries, keys, rotary)


def test_page_specs_spend_the_key_budget_on_the_widest_channels():
    bases = _bases()
    spec = parse_klt("klt:kbits=3,vbits=2,vstep=1.15,axes=channels,paged=true")
    plan = page_specs(spec, bases, 16)
    assert len(plan) == 2
    parsed = [codecs.parse(p) for p in plan]
    widths = torch.tensor([[int(c) for c in p.kw] for p in parsed]).float()  # [L, H * D]
    spent = (widths.sum() * 16 + (widths > 0).sum() * 16) / (widths.numel() * 16)
    assert 2.4 < spent <= 3.0  # codes and one fp16 scale per coded channel and page
    order = bases.var.flatten().argsort()
    assert torch.all(widths.flatten()[order].diff() >= 0)  # a wider channel never gets fewer bits
    for p in plan:
        codec = codecs.get(p)
        assert codec.spec.vbits == 2 and codec.spec.vstep == 1.15 and codec.spec.vclip
        assert codec.levers.prerope and codec.levers.vrot == "hadamard" and codec.levers.sink == 4
    with pytest.raises(SpecError, match="axes=channels only"):
        parse_klt("klt:kbits=3,paged=true")
    assert parse_klt("klt:kbits=3,axes=channels,paged=true").spec_string.endswith(",axes=channels,paged=true")


def test_page_specs_after_rope_plan_on_the_rotated_channels():
    """``rope=post``: keys stored as attention reads them, widths by the channels' variances after RoPE."""
    bases = _bases()
    pre = page_specs(parse_klt("klt:kbits=3,vbits=2,axes=channels,paged=true"), bases, 16)
    spec = parse_klt("klt:kbits=3,vbits=2,axes=channels,paged=true,rope=post")
    assert parse_klt(spec.spec_string) == spec and spec.spec_string.endswith(",paged=true,rope=post")
    post = page_specs(spec, bases, 16)
    widths = torch.tensor([[int(c) for c in codecs.parse(p).kw] for p in post]).float()
    order = bases.var_post.flatten().argsort()
    assert torch.all(widths.flatten()[order].diff() >= 0)  # planned on the variances after RoPE
    assert not torch.allclose(bases.var_post, bases.var)  # (which differ: RoPE turns each pair's two channels)
    assert post != pre
    for p in post:
        levers = codecs.get(p).levers
        assert not levers.prerope and levers.vrot == "hadamard" and levers.sink == 4
    with pytest.raises(SpecError, match="only the paged codec"):
        parse_klt("klt:kbits=3,axes=channels,rope=post")
    with pytest.raises(SpecError):
        parse_klt("klt:kbits=3,axes=channels,paged=true,rope=sideways")


@pytest.mark.model
def test_eval_serves_paged_klt_through_the_cache():
    pytest.importorskip("transformers")
    from pathlib import Path

    from kvbackend.tools.evaluate import EvalSettings, evaluate, key_bases_from_text
    from kvbackend.tools.models import load_model

    model, tokenizer = load_model()
    text = (Path(__file__).parent / "data" / "sample.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids
    calib = tokenizer(open("/usr/share/common-licenses/GPL-3").read(), return_tensors="pt").input_ids
    settings = EvalSettings(tokens=320, prefix=256, cont=64, queries=64, chunk_tokens=256)  # one chunk
    bases = key_bases_from_text(model, calib, tokens=512)
    spec = "klt:kbits=3,vbits=2,axes=channels,paged=true"
    with pytest.raises(ValueError, match="--calibration"):
        evaluate(model, ids, [spec], settings)
    paged, sequence = evaluate(model, ids, [spec, "klt:kbits=3,vbits=2,axes=channels"], settings, key_bases=bases)
    assert paged.path == "paged" and sequence.path == "sequence"
    assert len(paged.plan) == 30 and all(p.startswith("chw:kw=") for p in paged.plan)
    assert paged.canonical == parse_klt(spec).spec_string
    assert math.isclose(paged.bpv, 8 * paged.stored_bytes / (2 * 30 * 256 * 3 * 64))
    # the same format: the chunk's key means (16 bits a channel) and its sink slots are what the pages add
    assert 0 < paged.bpv - sequence.bpv < 0.1 and paged.kl < 1.5 * sequence.kl + 0.005


def test_a_cuda_device_gives_the_cpu_bytes_and_values():
    """The codec's torch ops on a GPU (the paged cache serves chw: layers through them there): the bytes the CPU
    writes, and the same decoded keys and values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    codec = codecs.get(f"chw:kw={KW},vbits=3,vclip=true,vstep=1.15")
    layout = codec.layout(GEOM, 16)
    k, v = kv(96, seed=5)
    host = codec.encode(k, v, layout)
    device = codec.encode(k.cuda(), v.cuda(), layout)
    assert torch.equal(device.pages.cpu(), host.pages) and torch.equal(device.codebook.cpu(), host.codebook)
    for a, b in zip(codec.decode(device), codec.decode(host)):
        assert a.is_cuda and torch.allclose(a.cpu(), b, atol=1e-5, rtol=1e-5)


def test_chunks_longer_than_a_slice_give_the_bytes_of_one_pass(monkeypatch):
    """Codes are (un)packed a slice of pages at a time (bounded temporaries): the bytes and values of a chunk do
    not depend on the slice."""
    import kvbackend.codecs.chw as chw

    codec = codecs.get(f"chw:kw={KW},vbits=2")
    layout = codec.layout(GEOM, 16)
    k, v = kv(80, seed=9)
    whole = codec.encode(k, v, layout)
    whole_kv = codec.decode(whole)
    monkeypatch.setattr(chw, "SLICE_CODES", 16 * 40)  # one page of 40 coded channels a slice
    sliced = codec.encode(k, v, layout)
    assert torch.equal(sliced.pages, whole.pages) and torch.equal(sliced.codebook, whole.codebook)
    for a, b in zip(codec.decode(whole), whole_kv):
        assert torch.equal(a, b)


def _pack_reference(codes, width, heads):
    """The bytes of `pack_pages` built bit by bit: one string a KV head, token after token, the head's coded channels
    in order, most significant bit of each code first, zero-padded to whole 32-bit words."""
    dim = width.numel() // heads
    column = torch.cumsum((width > 0).long(), 0) - 1  # each coded channel's index among the coded ones
    pages = []
    for page in codes:
        out = []
        for h in range(heads):
            bits = [(int(page[t, column[c]]) >> (int(width[c]) - 1 - k)) & 1
                    for t in range(page.shape[0]) for c in range(h * dim, (h + 1) * dim) for k in range(int(width[c]))]
            bits += [0] * (-len(bits) % 32)
            out += [int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8)]
        pages.append(out)
    return torch.tensor(pages, dtype=torch.uint8)


def test_packing_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(4)
    width = torch.tensor([0, 8, 3, 1, 7, 5, 0, 0, 0, 0, 0, 0, 0, 0, 2, 6, 4, 3, 8, 1, 1], dtype=torch.uint8)
    heads = 3  # the second head codes no channel: an empty block
    bits = bit_layout(width, heads, 5)
    coded = width[width > 0]
    codes = (torch.rand(2, 5, coded.numel(), generator=gen) * (2.0 ** coded.float())).floor().to(torch.int32)
    packed = pack_pages(codes, bits)
    assert torch.equal(packed, _pack_reference(codes, width, heads))
    assert torch.equal(unpack_pages(packed, bits, 5), codes)
    with pytest.raises(ValueError, match="code bytes per page"):
        unpack_pages(packed[:, :-1], bits, 5)

def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (-0 and +0 told apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return torch.equal(a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype]))


@pytest.mark.parametrize("order", ["natural", "lane"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw, page_size, tokens", [(KW, 16, 80), (KW, 3, 10), (KW, 1, 4), ("", 5, 23),
                                                   ("3" * 47 + "0", 7, 30), ("1" * 48, 16, 33)])
def test_the_compiled_loops_give_the_torch_bytes_and_values(monkeypatch, dtype, kw, page_size, tokens, order):
    """`kvbackend.fastchw` (numba) against the torch path: the same pages, codebook and decoded bits, for every
    width, pages of 1 token, odd pages, padded chunks, bf16 input read as is and float32, both channel orders."""
    pytest.importorskip("numba")
    from kvbackend import fastquant

    codec = codecs.get((f"chw:kw={kw},vbits=2,vstep=1.15" if kw else "chw:kbits=4,vbits=2") + f",order={order}")
    layout = codec.layout(Geometry(2, 3, 16, dtype), page_size)
    k, v = kv(tokens, seed=page_size)
    k[:, 0, 0] = -1e-9 * torch.rand(tokens)  # a channel mean that rounds to -0 in fp16 (width 0 in KW: read as is)
    k, v = k.to(dtype), v.to(dtype)
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "0")
    assert not fastquant._usable()
    slow = codec.encode(k, v, layout)
    slow_kv = codec.decode(slow)
    monkeypatch.setenv("KVBACKEND_FASTQUANT", "1")
    if not fastquant._usable():
        pytest.skip("numba's compiled loops do not serve here")
    fast = codec.encode(k, v, layout)
    assert torch.equal(fast.pages, slow.pages) and torch.equal(fast.codebook, slow.codebook)
    for a, b in zip(codec.decode(fast), slow_kv):
        assert _same_bits(a, b)
    assert not fastquant._broken


@pytest.mark.parametrize("fused", ["0", "1"])
def test_units_in_one_pass_give_the_bytes_of_one_chunk_at_a_time(monkeypatch, fused):
    """`encode_units` (one pass over many chunks, each its own mean) and `decode_units` (a codebook slot per page):
    the bytes and values of `encode` and `decode_pages` chunk by chunk, page by page."""
    monkeypatch.setenv("KVBACKEND_FASTQUANT", fused)
    codec = codecs.get(f"chw:kw={KW},vbits=3")
    assert codec.batch_encodes and codec.per_page_codebooks
    layout = codec.layout(GEOM, 8)
    units = [kv(20, seed=s) for s in range(5)]  # 20 tokens: three pages of 8, the last padded
    for u, (k, _) in enumerate(units):
        k += 3 * u  # means far apart: a shared mean would show
    k = torch.stack([u[0] for u in units])
    v = torch.stack([u[1] for u in units])
    pages, books = codec.encode_units(k, v, layout)
    for u in range(5):
        one = codec.encode(k[u], v[u], layout)
        assert torch.equal(pages[u], one.pages) and torch.equal(books[u], one.codebook)
    flat = pages.reshape(15, -1)
    slots = books.repeat_interleave(3, 0)
    kd, vd = codec.decode_units(layout, flat, slots)
    for i in range(15):
        ki, vi = codec.decode_pages(layout, flat[i : i + 1], slots[i])
        assert _same_bits(kd[8 * i : 8 * i + 8], ki) and _same_bits(vd[8 * i : 8 * i + 8], vi)


def test_lane_order_stores_the_same_codes_where_a_tensor_core_thread_reads_them():
    """``order=lane``: the keys and values decode bit for bit as in channel order (the same codes, other places);
    each thread column's four channels of a 16-channel tile are consecutive in a token's bits (one 32-bit window);
    head blocks start on 16-byte boundaries; the generic kernels refuse the field by name, the chw kernels read it."""
    from kvbackend.backends import chw_kernels_can_serve
    from kvbackend.codecs.chw import lane_order

    order = lane_order(32)
    assert sorted(order.tolist()) == list(range(32)) and order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
    natural, lane = codecs.get(f"chw:kw={KW},vbits=2"), codecs.get(f"chw:kw={KW},vbits=2,order=lane")
    assert lane.spec_string.endswith(",order=lane") and codecs.get(lane.spec_string).spec == lane.spec
    k, v = kv(48, seed=5)
    a, b = natural.layout(GEOM, 16), lane.layout(GEOM, 16)
    assert "k_lcodes" in b.page.fields and "k_hcodes" not in b.page.fields and a.fingerprint != b.fingerprint
    ea, eb = natural.encode(k, v, a), lane.encode(k, v, b)
    assert not torch.equal(a.page.view(ea.pages, "k_hcodes"), b.page.view(eb.pages, "k_lcodes"))
    for x, y in zip(natural.decode(ea), lane.decode(eb)):
        assert _same_bits(x, y)
    bits = lane.bits(GEOM, 16)
    assert all(first % 16 == 0 for first in bits.block[:-1])
    width = torch.tensor([int(c) for c in KW]).reshape(3, 16)
    start = torch.full((3, 16), -1, dtype=torch.int64)
    start.view(-1)[width.view(-1) > 0] = bits.start
    for h in range(3):
        for j in range(4):  # thread column j of the one tile: channels 2j, 2j + 1, 2j + 8, 2j + 9
            group = [2 * j, 2 * j + 1, 2 * j + 8, 2 * j + 9]
            at = [int(start[h, c]) for c in group if width[h, c] > 0]
            ends = [int(start[h, c] + width[h, c]) for c in group if width[h, c] > 0]
            assert all(e == s for e, s in zip(ends[:-1], at[1:]))  # consecutive bits
    with pytest.raises(UnsupportedLayout, match="k_lcodes"):
        kernel_schemes(lane, b, levers_read=True)
    assert not kernels_can_serve(lane, b) and chw_kernels_can_serve(lane, b)  # the chw kernels read either order
    with pytest.raises(SpecError, match="multiple of 16"):
        codecs.get("chw:kbits=2,order=lane").layout(Geometry(1, 1, 8, torch.float32), 16)
    with pytest.raises(SpecError):
        codecs.get("chw:kbits=2,order=sideways")


def test_word_plans_give_whole_word_rows_where_the_bits_matter_most():
    """``words=true``: each head's row of key bits the nearer multiple of 32, bits added where the channel variance
    left per bit is largest and taken where it is smallest, only coded channels changed; ``chw_config(w32=True)``
    takes every layer of such a plan."""
    from kvbackend.frames import lever_layout
    from kvbackend.kernels import mma_decode
    from kvbackend.kernels.chw_gather import layer_schemes
    from kvbackend.klt import word_widths

    bases = _bases()
    spec = parse_klt("klt:kbits=2.6,vbits=2,vstep=1.15,axes=channels,paged=true,rope=post,words=true")
    assert parse_klt(spec.spec_string) == spec and spec.spec_string.endswith(",rope=post,words=true")
    plain = [codecs.parse(p).kw for p in page_specs(parse_klt(spec.spec_string.replace(",words=true", "")), bases,
                                                      16)]
    plan = page_specs(spec, bases, 16)
    heads, dim = bases.var_post.shape[1:]
    for kw, before in zip((codecs.parse(p).kw for p in plan), plain):
        for h in range(heads):
            a = [int(c) for c in before[h * dim : (h + 1) * dim]]
            b = [int(c) for c in kw[h * dim : (h + 1) * dim]]
            assert sum(b) % 32 == 0 and sum(b) == 32 * ((sum(a) + 16) // 32)
            assert all(abs(x - y) <= 1 and (x > 0) == (y > 0) for x, y in zip(a, b))
    for p in plan:  # every layer's rows are taken by the whole-word kernel variant
        codec = codecs.get(p)
        s, levers = layer_schemes(codec, lever_layout(codec.layout(Geometry(1, heads, dim, torch.bfloat16), 16),
                                                      codec.levers))
        assert mma_decode.chw_config(s, dim, torch.bfloat16, torch.bfloat16, levers, w32=True).chw_w32
    # the greedy step itself, one head: up from 19 bits, a bit a channel where lam * 4^-w is largest (the 13 channels
    # at width 1, 0.25 each; not the uncoded one); down from 44, bits taken from the widest where they matter least
    lam = torch.tensor([[[8.0, 4.0, 1.0, 1.0] + [1.0] * 12]])
    got = word_widths(lam, torch.tensor([[[3, 3, 1, 0] + [1] * 12]], dtype=torch.uint8))
    assert got.dtype == torch.uint8 and got.flatten().tolist() == [3, 3, 2, 0] + [2] * 12
    down = word_widths(lam, torch.tensor([[[8, 8, 8, 8] + [1] * 12]], dtype=torch.uint8)).flatten().tolist()
    assert sum(down) == 32 and down[4:] == [1] * 12 and down[0] == max(down) and sorted(down[2:4]) == [4, 5]
    with pytest.raises(SpecError, match="paged=true"):
        parse_klt("klt:kbits=3,axes=channels,words=true")
