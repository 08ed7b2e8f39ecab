"""Round trips of every reference codec, with error bounds derived from the stored scales."""

import pytest
import torch

from kvbackend import Geometry, InvalidKV, codecs
from kvbackend.errors import SpecError
from kvbackend.codecs.base import CodecState
from kvbackend.codecs.kmeans import kmeans, kmeanspp_init

ALL = ["identity", "fp16", "bf16", "fp8", "rtn:bits=2,group=64", "rtn:bits=3,group=32", "rtn:bits=4,group=16,symmetric=true",
       "rtn:bits=8,group=64,scale=fp32", "kivi:bits=2,group=16", "kivi:bits=4,group=32", "qvg", "qvg:symmetric=true",
       "qvg-pro", "qvg:bits=4,centroids=8"]


def structured_kv(n, h, d, kind, gen):
    """Random, outlier-channel or repeated-token KV."""
    x = torch.randn(n, h, d, generator=gen)
    if kind == "outliers":
        x[:, :, :3] *= 40  # a few channels two orders larger, as in real keys
    elif kind == "repeated":
        x = x[torch.randint(0, 5, (n,), generator=gen)]  # five distinct tokens, repeated
    return x


def nrmse(x, y):
    return float((x.float() - y.float()).norm() / x.float().norm())


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("kind", ["random", "outliers", "repeated"])
def test_round_trip_and_bytes(spec, kind):
    gen = torch.Generator().manual_seed(1)
    geometry = Geometry(1, 3, 64, torch.float32)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 32)
    k = structured_kv(83, 3, 64, kind, gen)  # ends mid-page
    v = structured_kv(83, 3, 64, kind, gen)
    chunk = codec.encode(k, v, layout)
    kh, vh = codec.decode(chunk)
    assert kh.shape == k.shape and vh.dtype == torch.float32
    assert torch.isfinite(kh).all() and torch.isfinite(vh).all()
    # bpv from stored bytes equals the layout's accounting
    assert chunk.nbytes == layout.stored_bytes(num_pages=3, num_chunks=1)
    assert chunk.bits_per_value == pytest.approx(8 * chunk.nbytes / (83 * 2 * 3 * 64))
    name = codec.spec.name
    if name == "identity":
        assert torch.equal(kh, k) and torch.equal(vh, v)
    elif name in ("fp16", "bf16", "fp8"):
        rel = {"fp16": 2**-11, "bf16": 2**-8, "fp8": 2**-4}[name]
        for x, xh in ((k, kh), (v, vh)):  # round-to-nearest: half an ulp, relative (above the subnormals)
            assert torch.all((x - xh).abs() <= x.abs() * rel + 2**-9)
    else:
        bits = codec.spec.bits
        # Uniform quantization in b bits: relative error shrinks ~2x per bit. These ceilings hold
        # with margin on Gaussian data; the exact per-value bound is checked in test_error_bound.
        ceiling = {2: 0.8, 3: 0.25, 4: 0.12, 8: 0.01}[bits]
        if kind == "outliers" and bits == 2 and name != "kivi":
            ceiling = 1.0  # per-token groups at 2 bits: three 40x channels set every token's step
        if kind == "repeated" and name.startswith("qvg"):
            ceiling = 0.05  # five distinct tokens: the centroids capture them almost exactly
        assert nrmse(k, kh) < ceiling and nrmse(v, vh) < ceiling


@pytest.mark.parametrize("spec", ["rtn:bits=2,group=64", "rtn:bits=3,group=8,symmetric=true", "rtn:bits=4,group=32,scale=fp8",
                                  "qvg", "qvg:symmetric=true,bits=4", "qvg-pro"])
def test_error_bound_per_value(spec):
    """|x - x_hat| <= scale / 2 for every value: scales are rounded so every value is in range."""
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get(spec)
    layout = codec.layout(geometry, 16)
    k = torch.randn(48, 2, 64) * torch.logspace(-2, 2, 64)
    v = torch.randn(48, 2, 64)
    chunk = codec.encode(k, v, layout)
    kh, vh = codec.decode(chunk)
    group = codec.spec.group
    for prefix, x, xh in (("k", k, kh), ("v", v, vh)):
        scale = layout.page.view(chunk.pages, f"{prefix}_scales").float().reshape(48, 2, 64 // group)
        bound = scale.repeat_interleave(group, dim=-1) / 2
        assert torch.all((x - xh).abs() <= bound * (1 + 1e-5) + 1e-5)


def test_kivi_keys_per_channel():
    """KIVI keys: a channel with a huge constant offset costs nothing (per-channel min)."""
    geometry = Geometry(1, 1, 64, torch.float32)
    codec = codecs.get("kivi:bits=2,group=16")
    layout = codec.layout(geometry, 16)
    k = torch.randn(32, 1, 64) * 0.1
    k[:, :, 5] += 100.0  # fp16 minima have a 1/16 step at 100, still far below the group range
    kh, _ = codec.decode(codec.encode(k, k.clone(), layout))
    assert (kh - k).abs().max() < 0.15  # half a 2-bit step of a ~0.7-wide channel group, plus rounding
    assert layout.page.fields["k_scales"].shape == (1, 1, 64)


def test_qvg_bpv_at_paper_scale():
    """S=1, B=64, C=256, N=32768, D=128, symmetric FP8 scales: 2 + 8/64 + 8/128 + 16*256/32768 = 2.31."""
    geometry = Geometry(1, 2, 128, torch.bfloat16)
    codec = codecs.get("qvg:bits=2,group=64,centroids=256,stages=1,iters=1,symmetric=true,init=random")
    layout = codec.layout(geometry, 64)
    k = torch.randn(32768, 2, 128).bfloat16()
    chunk = codec.encode(k, k.clone(), layout)
    assert chunk.bits_per_value <= 2.35
    assert chunk.bits_per_value == pytest.approx(2 + 8 / 64 + 8 / 128 + 16 * 256 / 32768, abs=1e-3)


def test_warm_start_converges_faster():
    """Correlated chunks (the next chunk is the last one plus a small drift): starting from the
    previous chunk's centroids converges in fewer Lloyd steps than fresh seeding, to a no worse
    objective than the previous chunk reached."""
    gen = torch.Generator().manual_seed(4)
    centers = torch.randn(2, 16, 32, generator=gen) * 3
    idx = torch.randint(0, 16, (2, 2048), generator=gen)
    first_chunk = torch.gather(centers, 1, idx.unsqueeze(-1).expand(-1, -1, 32)) + 0.5 * torch.randn(2, 2048, 32, generator=gen)
    # the first chunk's best of a few seedings (a k-means optimum, not a merged-cluster local one)
    first = min((kmeans(first_chunk, kmeanspp_init(first_chunk, 16, torch.Generator().manual_seed(s)), max_iters=100)
                 for s in range(4)), key=lambda r: r.objective)
    second = first_chunk + 0.1 * torch.randn(first_chunk.shape, generator=gen)
    warm = kmeans(second, first.centroids, max_iters=100)
    cold = [kmeans(second, kmeanspp_init(second, 16, torch.Generator().manual_seed(s)), max_iters=100) for s in range(6)]
    cold_iters = sum(c.iterations for c in cold) / len(cold)
    assert warm.iterations < cold_iters
    assert warm.iterations <= 3
    assert warm.objective <= first.objective * 1.1  # drift of 0.1 per dim adds ~0.32 per point


def test_qvg_state_carries_centroids():
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("qvg:centroids=8,iters=3")
    layout = codec.layout(geometry, 16)
    state = CodecState()
    x = torch.randn(64, 2, 64)
    codec.encode(x, x.clone(), layout, state)
    assert state.centroids["k"].shape == (1, 2, 8, 64)
    before = state.centroids["k"].clone()
    codec.encode(x, x.clone(), layout, state)  # same data again: warm start is already converged
    assert state.iterations[-1] == 1
    assert torch.allclose(state.centroids["k"], before, atol=1e-2)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_rejected(bad):
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("qvg")
    layout = codec.layout(geometry, 16)
    k = torch.randn(16, 2, 64)
    k[3, 1, 7] = float(bad)
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        codec.encode(k, torch.randn(16, 2, 64), layout)


def test_bad_shapes_rejected():
    geometry = Geometry(1, 2, 64, torch.float32)
    codec = codecs.get("rtn")
    layout = codec.layout(geometry, 16)
    with pytest.raises(InvalidKV, match="shape"):
        codec.encode(torch.randn(16, 3, 64), torch.randn(16, 3, 64), layout)
    with pytest.raises(InvalidKV, match="differ"):
        codec.encode(torch.randn(16, 2, 64), torch.randn(15, 2, 64), layout)
    with pytest.raises(InvalidKV, match="bf16, fp16 or fp32"):
        codec.encode(torch.ones(16, 2, 64, dtype=torch.int32), torch.ones(16, 2, 64, dtype=torch.int32), layout)
    with pytest.raises(InvalidKV, match="empty"):
        codec.encode(torch.randn(0, 2, 64), torch.randn(0, 2, 64), layout)


def test_spec_checked_against_geometry():
    from kvbackend import SpecError

    with pytest.raises(SpecError, match="divide head_dim"):
        codecs.get("rtn:group=48").layout(Geometry(1, 2, 64), 16)
    with pytest.raises(SpecError, match="page_size"):
        codecs.get("kivi:group=32").layout(Geometry(1, 2, 64), 16)
    with pytest.raises(SpecError, match="1..256"):
        codecs.get("qvg:centroids=300").layout(Geometry(1, 2, 64), 16)


def test_gaussian_clip_same_bytes_lower_error_on_gaussian_groups():
    """clip=True: same fields and bytes; on Gaussian groups a lower error than min/max at 2 and 3
    bits; the step never exceeds the min/max step; a group whose min/max step is already smaller
    (uniform-like data) is quantized exactly as without clip."""
    import torch

    from kvbackend.quant import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    for bits in (2, 3):
        plain, clipped = quantize(x, bits, False, torch.float16), quantize(x, bits, False, torch.float16, clip=True)
        err = lambda q: float((dequantize(q.codes, q.scale, q.zero, bits) - x).square().mean())  # noqa: E731
        assert err(clipped) < (0.8 if bits == 2 else 0.97) * err(plain)  # measured: 0.69x and 0.94x
        assert bool((clipped.scale.float() <= plain.scale.float() * (1 + 1e-3)).all())
        assert clipped.codes.dtype == plain.codes.dtype and clipped.scale.shape == plain.scale.shape
    flat = torch.linspace(-1, 1, 4)[None].repeat(8, 1)  # 4 levels at 2 bits: min/max is exact
    a, b = quantize(flat, 2, False, torch.float16), quantize(flat, 2, False, torch.float16, clip=True)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    spec = codecs.get("kivi:bits=2,group=32,kclip=true,vclip=true")
    geometry = Geometry(1, 2, 64, torch.float32)
    assert spec.layout(geometry, 64).page_bytes == codecs.get("kivi:bits=2,group=32").layout(geometry, 64).page_bytes


def test_qvg_clip_same_bytes_lower_error():
    import torch

    geometry = Geometry(1, 2, 64, torch.float32)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(256, 2, 64, generator=g), torch.randn(256, 2, 64, generator=g)
    errors = {}
    for spec in ("qvg:kchannel=32", "qvg:kchannel=32,clip=true"):
        codec = codecs.get(spec)
        chunk = codec.encode(k, v, codec.layout(geometry, 64))
        kh, vh = codec.decode(chunk)
        errors[spec] = (chunk.nbytes, float((kh - k).norm() + (vh - v).norm()))
    (plain_bytes, plain_err), (clip_bytes, clip_err) = errors.values()
    assert plain_bytes == clip_bytes and clip_err < 0.95 * plain_err


def test_widened_clipped_steps_clip_fewer_values():
    """``widen`` multiplies the clipped (Gaussian) step and nothing else: 1 gives the default bytes; a wider
    step is never past the min/max step, equals widen times the Gaussian step where that is smaller, and clips
    fewer values (codes at the two end levels)."""
    from kvbackend.quant import GAUSSIAN_STEP, quantize

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 64, generator=g)
    base = quantize(x, 2, False, torch.float32, clip=True)
    same = quantize(x, 2, False, torch.float32, clip=True, widen=1.0)
    assert torch.equal(base.codes, same.codes) and torch.equal(base.scale, same.scale)
    wide = quantize(x, 2, False, torch.float32, clip=True, widen=1.3)
    minmax = quantize(x, 2, False, torch.float32)
    std = x.sub(x.mean(-1, keepdim=True)).square().mean(-1).sqrt()
    expect = torch.minimum(GAUSSIAN_STEP[4] * 1.3 * std, minmax.scale)
    assert torch.allclose(wide.scale, expect, rtol=1e-6)
    assert bool((wide.scale > base.scale).any()) and bool((wide.scale <= minmax.scale * (1 + 1e-6)).all())
    ends = lambda q: int(((q.codes == 0) | (q.codes == 3)).sum())  # noqa: E731
    assert ends(wide) < ends(base)
    huge = quantize(x, 2, False, torch.float32, clip=True, widen=8.0)  # every group back at its min/max step
    assert torch.equal(huge.scale, minmax.scale) and torch.equal(huge.codes, minmax.codes)


def test_vstep_widens_the_values_steps_only():
    """``vstep`` changes the value fields' bytes and leaves the keys' (and the layout) as they were; without
    clipped steps it is refused, not ignored."""
    geometry = Geometry(1, 2, 64, torch.float32)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(128, 2, 64, generator=g), torch.randn(128, 2, 64, generator=g)
    base, wide = (codecs.get(f"quantwm:kchannel=32,centroids=8,clip=true,vcluster=false{o}") for o in ("", ",vstep=1.3"))
    la, lb = base.layout(geometry, 64), wide.layout(geometry, 64)
    assert la.page_bytes == lb.page_bytes
    a, b = base.encode(k, v, la), wide.encode(k, v, lb)
    for name in la.page.fields:
        fa, fb = la.page.view(a.pages, name), lb.page.view(b.pages, name)
        if name.startswith("k_"):
            assert torch.equal(fa, fb), name
    assert not torch.equal(la.page.view(a.pages, "v_scales"), lb.page.view(b.pages, "v_scales"))
    for spec in ("quantwm:vstep=1.3", "qvg:clip=true,symmetric=true,vstep=2"):
        with pytest.raises(SpecError, match="vstep"):
            codecs.get(spec).layout(geometry, 64)


def test_qvg_values_without_centroids_are_plain_token_groups():
    """qvg:vcluster=false stores values as RTN does (same groups, scales and zeros), keys as qvg."""
    geometry = Geometry(1, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(128, 2, 64, generator=gen), torch.randn(128, 2, 64, generator=gen) * 3
    ours, qvg, rtn = (codecs.get(s) for s in ("qvg:vcluster=false", "qvg", "rtn:bits=2,group=64,scale=fp8"))
    layout = ours.layout(geometry, 64)
    assert "v_assign" not in layout.page.fields and "v_centroids" not in layout.codebook.fields
    kh, vh = ours.decode(ours.encode(k, v, layout))
    qk, _ = qvg.decode(qvg.encode(k, v, qvg.layout(geometry, 64)))
    _, rv = rtn.decode(rtn.encode(k, v, rtn.layout(geometry, 64)))
    assert torch.equal(kh, qk) and torch.equal(vh, rv)
    full = qvg.layout(geometry, 64)
    saved = full.page.fields["v_assign"].nbytes * 2 + full.codebook.fields["v_centroids"].nbytes  # two pages
    assert ours.encode(k, v, layout).nbytes == qvg.encode(k, v, full).nbytes - saved  # both pages and the codebook
    assert not ours.kernel_encodes


def test_kmeans_without_the_early_stop_runs_every_step_to_the_same_clustering():
    """What a CUDA graph capture runs (no test of the device between steps): every step, and once assignments
    stop changing a step changes nothing, so the clustering is the early-stopped one."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 300, 16, generator=gen)
    init = kmeanspp_init(x, 8, torch.Generator().manual_seed(1))
    stopped = kmeans(x, init, max_iters=50)
    assert stopped.iterations < 50  # converged: the early stop fired
    full = kmeans(x, init, max_iters=50, early_stop=False)
    assert full.iterations == 50
    assert torch.equal(full.assign, stopped.assign) and torch.equal(full.centroids, stopped.centroids)
    assert full.objective == stopped.objective
