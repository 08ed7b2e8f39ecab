"""The tensor-core decode's path for keys at a width per channel (`kernels/mma_decode.cu`, ``K_CHW``; layers
``chw:...,order=lane`` with keys after RoPE).

On the CPU: the kernel's constants (`mma_decode.chw_tables`) and its way of reading codes (two byte-swapped words,
one funnel shift, two shifts down per thread and tile; the pairs also as `CHW_SUBN` forms them) replayed in Python
over encoded pages give every key the codec's decode gives. On a CUDA GPU: `chw_decode` through the kernel against
float32 attention over the torch reference's keys and values and against the Triton kernel, on odd shapes (head_dim
64 and 128, pages of 16-64 tokens, GQA groups 1-8, several chunks, dense tails, sinks, rotated values)."""

import random

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.klt import word_widths
from kvbackend.attention import decode_attention
from kvbackend.kernels import mma_decode
from kernel_cases import DEVICE


def _widths(heads: int, dim: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(str(rng.choice([0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8])) for _ in range(heads * dim))


def _word_widths(heads: int, dim: int, seed: int) -> str:
    """`_widths` with each head's row moved to whole 32-bit words (`kvbackend.klt.word_widths`, equal variances)."""
    w = torch.tensor([int(c) for c in _widths(heads, dim, seed)]).reshape(heads, dim)
    return "".join(str(int(x)) for x in word_widths(torch.ones(heads, dim), w).flatten())


def _replayed_keys(codec, layout, pages: torch.Tensor, codebook: torch.Tensor, heads: int, dim: int, page: int):
    """Keys [n * page, heads, dim] float32 read as the kernel reads them (one codebook slot for every page)."""
    widths = "".join(str(int(w)) for w in codec._widths(layout.geometry).tolist())
    tables = mma_decode.chw_tables(widths, heads, page, "cpu")
    codes_at = layout.page.fields["k_lcodes"].offset
    amax = layout.page.view(pages, "k_wscales").float()  # [n, A]
    mean = layout.codebook.view(codebook[None], "k_mean").reshape(heads, dim).float()
    n = pages.shape[0]
    out = torch.empty(n, page, heads, dim)
    for j in range(n):
        raw = pages[j].tolist()
        for h in range(heads):
            first, size, bits, a0 = (int(x) for x in tables.heads[h, :4])
            block = bytes(raw[codes_at + first : codes_at + first + size]) + bytes(8)
            words = [int.from_bytes(block[4 * i : 4 * i + 4], "big") for i in range(len(block) // 4)]
            for kt in range(dim // 16):
                for tig in range(4):
                    word = int(tables.tiles[h, kt, tig, 0]) & 0xFFFFFFFF
                    index = int(tables.tiles[h, kt, tig, 1]) & 0xFFFFFFFF
                    off = word & 0xFFF
                    w = [(word >> (12 + 4 * i)) & 15 for i in range(4)]
                    chans = [16 * kt + 2 * tig, 16 * kt + 2 * tig + 1, 16 * kt + 2 * tig + 8, 16 * kt + 2 * tig + 9]
                    s01 = 32 - w[0] - w[1]
                    s23 = s01 - w[2] - w[3]
                    for t in range(page):
                        bit = t * bits + off
                        window = (((words[bit >> 5] << 32) | words[(bit >> 5) + 1]) << (bit & 31) >> 32) & 0xFFFFFFFF
                        pair01 = window >> s01 if s01 < 32 else 0
                        pair23 = window >> s23 if s23 < 32 else 0
                        codes = [(pair01 >> w[1]) & ((1 << w[0]) - 1), pair01 & ((1 << w[1]) - 1),
                                 (pair23 >> w[3]) & ((1 << w[2]) - 1), pair23 & ((1 << w[3]) - 1)]
                        up = (window << (w[0] + w[1])) & 0xFFFFFFFF  # `CHW_SUBN`: the second pair at the top
                        alone = up >> (32 - w[2] - w[3]) if w[2] + w[3] else 0
                        for x, (a, b) in ((pair01, (w[0], w[1])), (alone, (w[2], w[3]))):  # `CHW_SUBN`'s halves
                            mask = ((1 << b) - 1) | (((1 << a) - 1) << 16)
                            subn = (x | (x << (16 - b))) & 0xFFFFFFFF & mask
                            assert (subn >> 16, subn & 0xFFFF) == ((x >> b) & ((1 << a) - 1), x & ((1 << b) - 1))
                        # `CHW_TAB`: the same pairs from the tile table's shifts and masks (funnel shifts clamp at 32)
                        tab = [int(x) & 0xFFFFFFFF for x in tables.tab[h, kt, tig]]
                        off_t, s01_t, up_t, s23_t, k1, k3, m01, m23 = tab
                        assert off_t == off
                        x01 = window >> min(s01_t, 32)
                        x23 = ((window << up_t) & 0xFFFFFFFF) >> min(s23_t, 32)
                        r01 = (x01 | (x01 << k1)) & 0xFFFFFFFF & m01
                        r23 = (x23 | (x23 << k3)) & 0xFFFFFFFF & m23
                        assert (r01 >> 16, r01 & 0xFFFF, r23 >> 16, r23 & 0xFFFF) == tuple(codes)
                        for i, c in enumerate(chans):
                            key = float(mean[h, c])
                            if w[i]:
                                a = float(amax[j, a0 + ((index >> (8 * i)) & 255)])
                                key += (codes[i] + 0.5) * (2 * a / 2 ** w[i]) - a
                            out[j, t, h, c] = key
    return out.reshape(n * page, heads, dim)


@pytest.mark.parametrize("heads,dim,page", [(3, 64, 16), (2, 128, 32)])
def test_the_kernel_tables_locate_every_code_as_the_codec_decodes_it(heads, dim, page):
    widths = _widths(heads, dim, seed=dim + page)
    codec = codecs.get(f"chw:kw={widths},vbits=2,order=lane")
    layout = codec.layout(Geometry(1, heads, dim, torch.bfloat16), page)
    gen = torch.Generator().manual_seed(3)
    n = 2 * page
    k = (torch.randn(n, heads, dim, generator=gen) * torch.rand(1, heads, dim, generator=gen) * 4
         + torch.randn(1, heads, dim, generator=gen)).bfloat16()
    v = torch.randn(n, heads, dim, generator=gen).bfloat16()
    chunk = codec.encode(k, v, layout)
    want, _ = codec.decode_pages(layout, chunk.pages, chunk.codebook)
    got = _replayed_keys(codec, layout, chunk.pages, chunk.codebook, heads, dim, page)
    assert want.dtype == torch.bfloat16  # the reference rounds once to the cache's dtype: the replay, rounded, is it
    assert torch.equal(got.bfloat16(), want)
    tables = mma_decode.chw_tables(widths, heads, page, "cpu")
    assert tables.block == max(int(tables.heads[h, 1]) for h in range(heads)) and tables.block % 16 == 0
    coded = torch.tensor([int(c) for c in widths]).reshape(heads, dim) > 0
    assert tables.heads[:, 4].tolist() == coded.sum(1).tolist()  # each head's absmaxes, in heads' order


def test_the_kernel_takes_only_the_layers_it_reads():
    from kvbackend.kernels.chw_gather import layer_schemes

    geometry = Geometry(1, 2, 128, torch.bfloat16)

    def scheme(spec):
        codec = codecs.get(spec)
        from kvbackend.frames import lever_layout

        return layer_schemes(codec, lever_layout(codec.layout(geometry, 64), codec.levers))

    s, lv = scheme("chw:kbits=2,vbits=2,order=lane,sink=4,vrot=hadamard")
    assert mma_decode.supports_chw(s, lv, 128, 4)
    assert not mma_decode.supports_chw(s, lv, 128, 9)  # a GQA group past the MMA's N
    for spec in ("chw:kbits=2,vbits=2", "chw:kbits=2,vbits=2,order=lane,prerope=true",  # natural order; pre-RoPE keys
                 "chw:kbits=2,vbits=3,order=lane", "chw:kbits=0,vbits=2,order=lane"):  # 3-bit values; no key codes
        assert not mma_decode.supports_chw(*scheme(spec), 128, 4), spec


def test_timing_probes_are_refused_outside_benches(monkeypatch):
    """`CHW_PROBE` reads the wrong key rows on purpose: the launcher takes it only where a bench asks by name."""
    monkeypatch.delenv("KVBACKEND_MMA_TIMING_PROBES", raising=False)
    with pytest.raises(ValueError, match="timing probes"):
        mma_decode.launch_chw(*[None] * 11, scheme=None, probe=1)
    from kvbackend.frames import lever_layout
    from kvbackend.kernels.chw_gather import layer_schemes

    codec = codecs.get("chw:kbits=2,vbits=2,order=lane")
    s, _ = layer_schemes(codec, lever_layout(codec.layout(Geometry(1, 2, 128, torch.bfloat16), 64), codec.levers))
    config = mma_decode.chw_config(s, 128, torch.bfloat16, torch.bfloat16, probe=2)
    assert config.defines().count("-DCHW_PROBE=2") == 1 and mma_decode.chw_config(s, 128, torch.bfloat16,
                                                                                  torch.bfloat16).chw_probe == 0


def test_the_tile_table_needs_the_subnormal_pairs():
    from kvbackend.frames import lever_layout
    from kvbackend.kernels.chw_gather import layer_schemes

    codec = codecs.get("chw:kbits=2,vbits=2,order=lane")
    s, _ = layer_schemes(codec, lever_layout(codec.layout(Geometry(1, 2, 128, torch.bfloat16), 64), codec.levers))
    assert "-DCHW_TAB=1" in mma_decode.chw_config(s, 128, torch.bfloat16, torch.bfloat16, tab=True).defines()
    for bad in ({"subn": False}, {"pref": True}):
        with pytest.raises(ValueError, match="subn=True"):
            mma_decode.chw_config(s, 128, torch.bfloat16, torch.bfloat16, tab=True, **bad)


def test_whole_word_rows_are_taken_only_where_every_row_is_whole_words():
    from kvbackend.frames import lever_layout
    from kvbackend.kernels.chw_gather import layer_schemes

    def scheme(spec, heads, dim):
        codec = codecs.get(spec)
        return layer_schemes(codec, lever_layout(codec.layout(Geometry(1, heads, dim, torch.bfloat16), 64),
                                                 codec.levers))[0]

    for heads, dim in ((2, 128), (3, 64)):
        widths = _word_widths(heads, dim, seed=heads)
        assert all(sum(map(int, widths[h * dim : (h + 1) * dim])) % 32 == 0 for h in range(heads))
        s = scheme(f"chw:kw={widths},vbits=2,order=lane", heads, dim)
        assert "-DCHW_W32=1" in mma_decode.chw_config(s, dim, torch.bfloat16, torch.bfloat16, w32=True).defines()
    with pytest.raises(ValueError, match="no timing probe"):
        mma_decode.chw_config(s, dim, torch.bfloat16, torch.bfloat16, w32=True, probe=2)
    odd = "3" + "2" * 127 + "2" * 128  # the first head's row 257 bits, the second's 256
    with pytest.raises(ValueError, match="whole 32-bit words"):
        mma_decode.chw_config(scheme(f"chw:kw={odd},vbits=2,order=lane", 2, 128), 128, torch.bfloat16,
                              torch.bfloat16, w32=True)
    assert "-DCHW_W32=0" in mma_decode.chw_config(scheme(f"chw:kw={odd},vbits=2,order=lane", 2, 128), 128,
                                                  torch.bfloat16, torch.bfloat16).defines()


class _Launched(Exception):
    pass


@pytest.mark.parametrize("options", [{}, {"fold": False, "subn": False, "min_blocks": 3, "stages": 1}])
def test_the_options_reach_the_launch_and_the_grid_alike(options, monkeypatch):
    """`chw_decode`'s ``mma_options`` build one `Config` for the grid (`chw_wave_programs`) and the launch
    (`launch_chw`), `chw_config`'s defaults where unnamed (the shared fold and subnormal pairs); an unknown option
    is refused. Checked on the CPU with the driver calls replaced."""
    from kvbackend.kernels.chw_decode import chw_decode

    cache = KVCache(Geometry(1, 2, 64, torch.bfloat16),
                    CacheConfig(codec="chw:kbits=2,vbits=2,order=lane", page_size=16, chunk_pages=2, dense_pages=16,
                                packed_pages=16, device="cpu"))
    rid, _ = cache.add_request()
    cache.append(rid, 0, torch.randn(70, 2, 64).bfloat16(), torch.randn(70, 2, 64).bfloat16())
    from kvbackend.kernels.chw_gather import layer_schemes

    scheme, levers = layer_schemes(cache.codec, cache.layout)
    plan = cache.plan([rid], 0)
    seen = {}
    monkeypatch.setattr(mma_decode, "available", lambda device=None: (True, ""))
    monkeypatch.setattr(mma_decode, "_wave_programs", lambda config, index: seen.setdefault("grid", config) and 264)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def launched(config, params, device, b, h, splits, warps):
        seen["launch"], seen["warps"] = config, warps
        raise _Launched

    monkeypatch.setattr(mma_decode, "_launch", launched)
    q = torch.randn(1, 4, 64).bfloat16()
    args = (q, cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], scheme, plan)
    with pytest.raises(_Launched):
        chw_decode(*args, levers=levers, mma=True, mma_options=options)
    want = mma_decode.chw_config(scheme, 64, q.dtype, torch.bfloat16, None, **options)
    assert seen["launch"] == seen["grid"] == want and seen["warps"] == want.warps == 4
    assert (want.chw_fold, want.chw_subn) == (options.get("fold", True), options.get("subn", True))
    with pytest.raises(TypeError):
        chw_decode(*args, levers=levers, mma=True, mma_options={"folded": True})


CUDA_CASES = [  # (spec, heads, dim, page, lengths, GQA group, options)
    ("chw:kw={w},vbits=2,vstep=1.15,order=lane,sink=4,vrot=hadamard", 2, 128, 64, [700, 131, 64], 4, {}),
    ("chw:kw={w},vbits=2,order=lane", 3, 64, 16, [97, 40, 3], 5, {}),
    ("chw:kw={w},vbits=2,order=lane,sink=2", 2, 128, 32, [300], 8, {"unroll": True}),
    ("chw:kw={w},vbits=2,order=lane,sink=2", 2, 128, 32, [300, 33], 6, {"qsmem": True}),
    ("chw:kw={w},vbits=2,order=lane,vrot=hadamard", 3, 64, 16, [150], 2, {"qsmem": True, "unroll": True}),
    ("chw:kw={w},vbits=2,order=lane,sink=4", 2, 128, 64, [400, 70], 4, {"swap": True, "stages": 1}),
    ("chw:kw={w},vbits=2,order=lane,vrot=hadamard", 1, 128, 16, [90, 257], 1, {"stages": 1, "warps": 2}),
    ("chw:kbits=8,vbits=2,order=lane", 2, 64, 32, [140], 2, {}),  # the widest codes: 32-bit windows
    ("chw:kw={w},vbits=2,order=lane,sink=4", 2, 128, 64, [400, 70], 4, {"fold": False, "subn": False}),  # 1024 pairs
    ("chw:kw={w},vbits=2,order=lane,sink=4,vrot=hadamard", 2, 128, 64, [500, 64], 3, {"fold": True}),  # shared fold
    ("chw:kw={w},vbits=2,vstep=1.15,order=lane,sink=4", 2, 128, 64, [600, 65], 4, {"qsmem": True, "min_blocks": 3}),
    ("chw:kw={w},vbits=2,order=lane,vrot=hadamard", 2, 128, 64, [333], 4,  # three CTAs an SM, every switch
     {"qsmem": True, "fold": True, "swap": True, "min_blocks": 3}),
    ("chw:kw={w},vbits=2,vstep=1.15,order=lane,sink=4,vrot=hadamard", 2, 128, 64, [700, 131, 64], 4,
     {"subn": True}),  # code pairs as fp16 subnormals
    ("chw:kw={w},vbits=2,order=lane", 3, 64, 16, [97, 40, 3], 5, {"subn": True, "fold": True, "pref": True}),
    ("chw:kbits=8,vbits=2,order=lane", 2, 64, 32, [140], 2, {"subn": True, "pref": True}),  # widest codes
    ("chw:kw={w},vbits=2,order=lane,sink=2", 2, 128, 32, [300, 33], 6,
     {"subn": True, "fold": True, "pref": True, "qsmem": True, "min_blocks": 3}),
    ("chw:kw={w},vbits=2,vstep=1.15,order=lane,sink=4", 2, 128, 64, [700, 131, 64], 4,  # value codes as subnormals
     {"subn": True, "fold": True, "vsubn": True}),
    ("chw:kw={w},vbits=2,order=lane,vrot=hadamard", 3, 64, 16, [97, 40, 3], 5, {"vsubn": True}),  # rotated values
    ("chw:kw={w},vbits=2,vstep=1.15,order=lane,sink=4,vrot=hadamard", 2, 128, 64, [700, 131, 64], 4,
     {"tab": True}),  # a tile's shifts and masks from the table
    ("chw:kbits=8,vbits=2,order=lane", 2, 64, 32, [140], 2, {"tab": True, "unroll": True}),  # widest codes
    ("chw:kw={w},vbits=2,order=lane,sink=2", 3, 64, 16, [97, 40, 3], 5, {"tab": True, "qsmem": True, "stages": 1}),
    # token rows of whole 32-bit words read from their own base (`CHW_W32`): mixed widths moved to whole words,
    # every width 3, the widest codes
    ("chw:kw={w32},vbits=2,vstep=1.15,order=lane,sink=4,vrot=hadamard", 2, 128, 64, [700, 131, 64], 4,
     {"w32": True}),
    ("chw:kw={w32},vbits=2,order=lane", 3, 64, 16, [97, 40, 3], 5, {"w32": True, "tab": True}),
    ("chw:kbits=3,vbits=2,order=lane,sink=2", 2, 128, 32, [300, 33], 6, {"w32": True, "tab": True, "vsubn": True}),
    ("chw:kbits=8,vbits=2,order=lane", 2, 64, 32, [140], 2, {"w32": True, "unroll": True}),
]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("spec,heads,dim,page,lengths,group,options", CUDA_CASES)
def test_the_tensor_core_path_decodes_like_the_reference(spec, heads, dim, page, lengths, group, options):
    from kvbackend.kernels.chw_decode import chw_decode

    if not mma_decode.available(torch.device("cuda"))[0]:
        pytest.skip(mma_decode.available(torch.device("cuda"))[1])
    spec = spec.format(w=_widths(heads, dim, seed=len(lengths)), w32=_word_widths(heads, dim, seed=len(lengths)))
    cache = KVCache(Geometry(1, heads, dim, torch.bfloat16),
                    CacheConfig(codec=spec, page_size=page, chunk_pages=2, dense_pages=256, packed_pages=256,
                                device="cuda", backend="triton"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    ids = []
    for n in lengths:
        rid, _ = cache.add_request()
        k = (torch.randn(n, heads, dim, device="cuda", generator=gen) * 2
             + torch.randn(1, heads, dim, device="cuda", generator=gen) * 3).bfloat16()
        v = torch.randn(n, heads, dim, device="cuda", generator=gen).bfloat16()
        cache.append(rid, 0, k, v)
        ids.append(rid)
    backend = cache.backends[0]
    plan = cache.plan(ids, 0)
    assert bool((plan.kinds == 0).any())
    q = torch.randn(len(ids), heads * group, dim, device="cuda", generator=gen).bfloat16()
    reads = [cache.read(rid, 0) for rid in ids]
    want, want_lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads])
    args = (q, cache.packed.pages[0], cache.packed.codebooks[0], cache.dense.data[0], backend.scheme, plan)
    out, lse = chw_decode(*args, levers=backend.levers, mma=True, mma_options=options)
    err = float((out.float() - want).norm() / want.norm())
    assert err < 1e-2, err
    assert torch.allclose(lse, want_lse, atol=3e-2)
    tri, tri_lse = chw_decode(*args, levers=backend.levers, mma=False, tile=True)
    assert float((out.float() - tri.float()).norm() / tri.float().norm()) < 1e-2
    assert torch.allclose(lse, tri_lse, atol=3e-2)
    # the default picks the kernel here, and the backend's decode is that call
    default, _ = cache.decode(plan, 0, q)
    assert torch.equal(default, chw_decode(*args, levers=backend.levers)[0])
    assert mma_decode.chw_preferred(backend.scheme, backend.levers, dim, group, q.device, q.dtype, torch.bfloat16)
