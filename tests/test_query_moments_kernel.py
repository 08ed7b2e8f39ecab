"""The step query statistics kernel (`kvbackend.kernels.query_moments`) against the torch path it replaces on CUDA:
`LeverFrame.step_queries_to_stored`, then `query_moments`."""

import pytest
import torch

from kvbackend import codecs
from kvbackend.codecs.base import query_moments
from kvbackend.frames import LeverFrame
from kvbackend.kernels import query_moments as kernel
from kvbackend.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter without a GPU)


def _reference(q, kv_heads, tables, scaling):
    """The torch path: de-rotate (rounded to q's dtype), then the moments and sums in float32."""
    stored = q if tables is None else Rotary(torch.ones(q.shape[-1] // 2), scaling).derotate(
        q.transpose(0, 1), None, cos_sin=tables).transpose(0, 1)
    return (*query_moments(stored, kv_heads), stored)


def _bound(stored, kv_heads):
    """An elementwise bound of the kernel's distance from the torch path: a de-rotated value may round the other
    way (fused multiply-adds on the GPU: one unit in the last place of its dtype), and float32 sums in another
    order."""
    b, hq, d = stored.shape
    eps = torch.finfo(stored.dtype).eps if stored.dtype != torch.float32 else 1e-6
    a = stored.float().abs().reshape(b, kv_heads, hq // kv_heads, d)
    return 2.5 * eps * (a.transpose(-1, -2) @ a + 1e-30), 1.5 * eps * a.sum(2) + 1e-30


def _out(b, h, d, fill=float("nan")):
    return (torch.full((b, h, d, d), fill, device=DEVICE), torch.full((b, h, d), fill, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,hq,h,d", [(1, 3, 1, 8), (5, 4, 2, 12), (3, 9, 3, 64), (2, 8, 8, 6)])
@pytest.mark.parametrize("rotate,scaling", [(False, 1.0), (True, 1.0), (True, 1.7)])
def test_the_kernel_matches_the_torch_path(dtype, b, hq, h, d, rotate, scaling):
    """Odd shapes (head sizes that are not powers of two, one request, GQA groups of 1 to 4), every float dtype, no
    turn, a turn, and a turn with a RoPE scaling; queries strided as a model's projection leaves them, the outputs
    filled with NaN first (every element must be written)."""
    gen = torch.Generator().manual_seed(b * 100 + d)
    wide = torch.randn(b, hq, d + 3, generator=gen) * 3
    q = wide[..., 1:d + 1].to(DEVICE, dtype)  # (rows strided, last dim contiguous)
    if dtype != torch.float32:
        q = wide.to(DEVICE, dtype)[..., 1:d + 1]
    positions = torch.randint(0, 5000, (b,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    tables = Rotary(inv, scaling).cos_sin(positions, torch.device(DEVICE)) if rotate else None
    want_m, want_s, stored = _reference(q, h, tables, scaling)
    got_m, got_s = kernel.step_query_moments(q, h, tables, scaling, _out(b, h, d))
    bound_m, bound_s = _bound(stored, h)
    assert not got_m.isnan().any() and not got_s.isnan().any()
    assert ((got_m - want_m).abs() <= bound_m).all(), (got_m - want_m).abs().max()
    assert ((got_s - want_s).abs() <= bound_s).all(), (got_s - want_s).abs().max()
    if DEVICE == "cpu" and dtype != torch.bfloat16:  # the interpreter has no fused multiply-adds: the same values
        # (its bf16 conversion truncates, where the GPU's rounds to nearest: within the bound only)
        torch.testing.assert_close(got_m, want_m, rtol=1e-5, atol=1e-5 * float(want_m.abs().max()))


def test_a_wrong_turn_is_seen():
    """The bound is tight enough to see the turn of the wrong way, or at the wrong position."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE, torch.bfloat16)
    rotary = Rotary.default(16, 10000.0)
    tables = rotary.cos_sin(torch.tensor([11, 900]), torch.device(DEVICE))
    other = rotary.cos_sin(torch.tensor([12, 900]), torch.device(DEVICE))
    got_m, _ = kernel.step_query_moments(q, 2, other, 1.0, _out(2, 2, 16))
    want_m, _, stored = _reference(q, 2, tables, 1.0)
    assert not ((got_m - want_m).abs() <= _bound(stored, 2)[0]).all()


def test_bad_outputs_and_groups_are_refused():
    q = torch.randn(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not split"):
        kernel.step_query_moments(q, 3, None, 1.0, _out(2, 3, 8))
    with pytest.raises(ValueError, match="out must be"):
        kernel.step_query_moments(q, 2, None, 1.0, _out(2, 1, 8))
    with pytest.raises(ValueError, match="RoPE tables"):
        kernel.step_query_moments(q, 2, (torch.ones(3, 8), torch.ones(3, 8)), 1.0, _out(2, 2, 8))
    assert not kernel.supports(torch.zeros(1, 2, 256)) and not kernel.supports(torch.zeros(1, 2, 7))
    assert not kernel.supports(torch.zeros(1, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("levers", ["", "prerope=true", "pagerope=true"])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_the_frame_takes_the_kernel_where_asked(levers, use_kernel, monkeypatch):
    """`LeverFrame.step_query_moments` gives the torch path's statistics (within the kernel's bound with the
    kernel, the same bits without), for queries in the stored frame, pre-RoPE and page-relative keys;
    ``KVBACKEND_STEP_KERNEL=0`` takes the torch path where the kernel was asked for."""
    spec = "rtn:bits=2,group=32" + (f",{levers}" if levers else "")
    frame = LeverFrame(codecs.get(spec).levers, Rotary.default(64, 10000.0), 16)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(4, 6, 64, generator=gen).to(DEVICE, torch.bfloat16)
    positions = torch.tensor([0, 17, 300, 4095], device=DEVICE)
    memo = {}
    got = frame.step_query_moments(q, positions, memo, 2, _out(4, 2, 64), kernel=use_kernel)
    stored = frame.step_queries_to_stored(q, positions, memo)
    want = query_moments(stored, 2)
    if use_kernel:
        assert all(((a - b).abs() <= bound).all() for a, b, bound in zip(got, want, _bound(stored, 2)))
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert bool(levers) == bool(memo)  # the tables made once, for the step's other layers
    monkeypatch.setenv("KVBACKEND_STEP_KERNEL", "0")
    got = frame.step_query_moments(q, positions, memo, 2, _out(4, 2, 64), kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("codec", ["quantwm:group=16,rank=2,centroids=2,vbits=2,pagerope=true",
                                   "quantwm:group=16,rank=2,centroids=2,vbits=2"])
def test_a_triton_cache_books_the_kernels_statistics(codec, monkeypatch):
    """A cache whose layers the Triton backend serves books a decode step's query statistics through the kernel
    (and a torch-backend cache through torch): the same statistics per chunk within float32 rounding, the same
    counts."""
    from kvbackend.geometry import CacheConfig, Geometry
    from kvbackend.manager import KVCache

    calls = []
    launch = kernel.step_query_moments
    monkeypatch.setattr(kernel, "step_query_moments", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    geometry = Geometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    caches = {name: KVCache(geometry, CacheConfig(codec=codec, page_size=16, chunk_pages=1, dense_pages=12,
                                                  packed_pages=24, backend=name, device=DEVICE),
                            rotary=Rotary.default(16, 10000.0)) for name in ("torch", "triton")}
    gen = torch.Generator().manual_seed(4)
    ids = {name: [cache.add_request()[0] for _ in range(3)] for name, cache in caches.items()}
    for _ in range(19):  # a chunk completed and the next one opened
        k, v = (torch.randn(3, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
        q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
        for name, cache in caches.items():
            cache.append_step(ids[name], 0, k, v, queries=q)
    assert len(calls) == 19
    for a, b in zip(ids["torch"], ids["triton"]):
        sa, sb = caches["torch"].page_table(a).states[0], caches["triton"].page_table(b).states[0]
        assert sa.query_parts.keys() == sb.query_parts.keys() and sa.query_parts
        for chunk, (total, count) in sa.query_parts.items():
            assert count == sb.query_parts[chunk][1]
            torch.testing.assert_close(sb.query_parts[chunk][0], total, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sb.query_sums[chunk], sa.query_sums[chunk], rtol=1e-5, atol=1e-5)


def test_the_kernel_adds_into_parts_as_out_then_add_does():
    """``parts``: each request's moments and sums added in place at its parts' addresses (a request whose sum is
    not kept: row 1 is 0, nothing written there), bitwise what writing ``out`` and adding it gives; the rest of the
    memory around the parts untouched."""
    gen = torch.Generator().manual_seed(3)
    b, hq, h, d = 3, 6, 2, 12
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE, torch.bfloat16)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    tables = Rotary(inv, 1.3).cos_sin(torch.tensor([5, 70, 900]), torch.device(DEVICE))
    moments, sums = kernel.step_query_moments(q, h, tables, 1.3, _out(b, h, d))
    arena = torch.randn(b + 1, h + 1, d, d, generator=gen).to(DEVICE)  # parts with neighbours on both sides
    sum_arena = torch.randn(b + 1, h + 1, d, generator=gen).to(DEVICE)
    totals = [arena[i, 1:] for i in range(b)]
    kept = [sum_arena[0, 1:], None, sum_arena[2, 1:]]
    before, sums_before = arena.clone(), sum_arena.clone()
    parts = torch.tensor([[t.data_ptr() for t in totals], [0 if s is None else s.data_ptr() for s in kept]],
                         device=DEVICE)
    assert kernel.step_query_moments(q, h, tables, 1.3, parts=parts) is None
    want, want_sums = before.clone(), sums_before.clone()
    want[:b, 1:] += moments
    want_sums[0, 1:] += sums[0]
    want_sums[2, 1:] += sums[2]
    assert torch.equal(arena, want) and torch.equal(sum_arena, want_sums)
    with pytest.raises(ValueError, match="one of out"):
        kernel.step_query_moments(q, h, tables, 1.3)
    with pytest.raises(ValueError, match="parts must be"):
        kernel.step_query_moments(q, h, tables, 1.3, parts=parts[:, :2])


def _query_caches(codec, fused_off: list):
    from kvbackend import CacheConfig, Geometry, KVCache

    geometry = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    config = CacheConfig(codec=codec, page_size=16, chunk_pages=2, dense_pages=16, packed_pages=16, device=DEVICE,
                         backend="triton")
    return [KVCache(geometry, config, rotary=Rotary.default(16, 10000.0)) for _ in fused_off]


@pytest.mark.parametrize("codec", ["quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true",
                                   "quantwm:group=16,rank=2,centroids=2,vbits=2,pagerope=true"])
def test_decode_steps_add_their_statistics_in_place(codec, monkeypatch):
    """A cache whose steps add their query statistics straight into the chunks' parts (`step_parts`, once the last
    step took every part in place) holds bitwise the parts, counts, sums and packed pages of one whose steps write
    them to buffers and add those; both step through chunk completions (the table is remade) and requests joining."""
    import kvbackend.manager as manager

    real, calls = manager.step_parts, {"fused": 0}

    def step_parts(*args, off=False):
        parts = None if off else real(*args)
        calls["fused"] += parts is not None
        return parts

    fused, buffered = _query_caches(codec, [False, True])
    gen = torch.Generator().manual_seed(1)
    ids = []
    for n in (27, 30):  # chunks of 32 tokens: both complete one during the steps
        k, v = torch.randn(2, n, 2, 16, generator=gen), torch.randn(2, n, 2, 16, generator=gen)
        q = torch.randn(2, n, 4, 16, generator=gen)
        for cache in (fused, buffered):
            rid, _ = cache.add_request()
            for layer in range(2):
                cache.append(rid, layer, k[layer].to(DEVICE, torch.bfloat16), v[layer].to(DEVICE, torch.bfloat16),
                             queries=q[layer].to(DEVICE, torch.bfloat16))
        ids.append(rid)
    for step in range(12):
        if step == 5:  # a request joins mid-way: a new partition
            for cache in (fused, buffered):
                rid, _ = cache.add_request()
                for layer in range(2):
                    cache.append(rid, layer, *(torch.ones(2, 2, 16, device=DEVICE, dtype=torch.bfloat16),) * 2)
            ids.append(rid)
        k, v = torch.randn(2, len(ids), 2, 16, generator=gen), torch.randn(2, len(ids), 2, 16, generator=gen)
        q = torch.randn(2, len(ids), 4, 16, generator=gen)
        for cache, off in ((fused, False), (buffered, True)):
            monkeypatch.setattr(manager, "step_parts", lambda *a, off=off: step_parts(*a, off=off))
            for layer in range(2):
                cache.append_step(ids, layer, *(t[layer].to(DEVICE, torch.bfloat16) for t in (k, v, q)))
    assert calls["fused"] >= 8  # most steps of the first cache added in place
    for rid in ids:
        a, b = fused.page_table(rid), buffered.page_table(rid)
        assert a.lengths == b.lengths and len(a.packed) == len(b.packed) >= (rid in ids[:2])
        for layer in range(2):
            sa, sb = a.states[layer], b.states[layer]
            assert sa.query_parts.keys() == sb.query_parts.keys()
            for chunk, (total, count) in sa.query_parts.items():
                assert count == sb.query_parts[chunk][1] and torch.equal(total, sb.query_parts[chunk][0])
            assert sa.query_sums.keys() == sb.query_sums.keys()
            for chunk, total in sa.query_sums.items():
                assert torch.equal(total, sb.query_sums[chunk])
            for pa, pb in zip(a.packed, b.packed):
                assert torch.equal(fused.packed.pages[layer][pa], buffered.packed.pages[layer][pb])
    fused.check()


@pytest.mark.parametrize("why", ["switched off", "head too wide"])
def test_the_parts_are_not_checked_where_the_kernel_will_not_take_the_step(why, monkeypatch):
    """`step_parts` (its layout checks cost about 150 us a layer at B=46) is asked only where the step statistics
    kernel takes the queries: not with ``KVBACKEND_STEP_KERNEL=0``, nor for heads wider than the kernel reads; those
    steps book their statistics through the buffers, the same as a cache that never adds in place."""
    import kvbackend.manager as manager

    asked = []
    real = manager.step_parts
    monkeypatch.setattr(manager, "step_parts", lambda *a: asked.append(1) or real(*a))
    if why == "switched off":
        monkeypatch.setenv("KVBACKEND_STEP_KERNEL", "0")
    else:
        monkeypatch.setattr(kernel, "MAX_HEAD_DIM", 8)  # the caches' 16-channel heads are then too wide
    fused, buffered = _query_caches("quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true", [False, True])
    gen = torch.Generator().manual_seed(3)
    ids = [[cache.add_request()[0] for _ in range(2)] for cache in (fused, buffered)]
    for _ in range(6):
        k, v, q = (torch.randn(2, 2, h, 16, generator=gen).to(DEVICE, torch.bfloat16) for h in (2, 2, 4))
        for cache, rids in zip((fused, buffered), ids):
            if cache is buffered:
                monkeypatch.setenv("KVBACKEND_STEP_PARTS", "0")
            for layer in range(2):
                cache.append_step(rids, layer, k[layer], v[layer], queries=q[layer])
            monkeypatch.delenv("KVBACKEND_STEP_PARTS", raising=False)
    assert not asked
    for a, b in zip(*ids):
        sa, sb = fused.page_table(a).states[1], buffered.page_table(b).states[1]
        assert sa.query_parts.keys() == sb.query_parts.keys() and sa.query_parts
        for chunk, (total, count) in sa.query_parts.items():
            assert count == sb.query_parts[chunk][1] == 6 * 2 and torch.equal(total, sb.query_parts[chunk][0])


def _one_request(seed):
    """A query-aware cache with one request after two decode steps of layer 0 (the second adds in place), the step
    function, and the step memo's arguments for `step_parts` on chunk 0 of that layer."""
    (cache,) = _query_caches("quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true", [False])
    rid, _ = cache.add_request()
    gen = torch.Generator().manual_seed(seed)

    def step():
        k, v, q = (torch.randn(1, h, 16, generator=gen).to(DEVICE, torch.bfloat16) for h in (2, 2, 4))
        cache.append_step([rid], 0, k, v, queries=q)

    for _ in range(2):
        step()
    state = cache.page_table(rid).states[0]
    return state, step, ([state], [0], cache._step_memos[0], 2, 16, torch.device(DEVICE))


def test_a_part_moved_or_reshaped_is_not_written_through_a_stale_address():
    """`step_parts` keeps its address table while the parts stay where they were: a part whose storage was swapped
    in place gets a new table (its values land in the new storage), and a part that is no longer a contiguous
    float32 [H, D, D] sends the step back through the buffered adds."""
    from kvbackend.codecs.base import step_parts

    state, step, args = _one_request(2)
    chunk = 0
    table = step_parts(*args)
    assert table is not None and step_parts(*args) is table  # kept
    if DEVICE == "cuda":  # another stream makes its own table (the first one's copy is queued on the first stream)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            other = step_parts(*args)
        side.synchronize()  # its table's copy was queued on the side stream: read it once that copy is done
        assert other is not None and other is not table and torch.equal(other.cpu(), table.cpu())
        table = step_parts(*args)
    total, count = state.query_parts[chunk]
    old = total.clone()
    total.set_(total.clone().untyped_storage(), 0, total.shape, total.stride())  # same tensor, new storage
    moved = step_parts(*args)
    assert moved is not None and int(moved[0, 0]) == total.data_ptr() != int(table[0, 0])
    step()
    assert state.query_parts[chunk][0] is total and state.query_parts[chunk][1] == count + 2
    assert not torch.equal(total, old)  # the step's moments went into the new storage
    total.set_(total.untyped_storage(), 0, (2, 16, 8), (128, 8, 1))  # no longer [H, D, D]
    assert step_parts(*args) is None


def test_a_part_restrided_or_retyped_where_it_sits_is_not_written_in_place():
    """A part that keeps its address and shape but is no longer a contiguous float32 tensor (restrided, or its data
    seen as another dtype) sends the step back through the buffered adds, which follow its strides or refuse it."""
    from kvbackend.codecs.base import step_parts

    state, _, args = _one_request(4)
    total = state.query_parts[0][0]
    assert step_parts(*args) is not None
    total.as_strided_((2, 16, 16), (1, 32, 2))  # same address, same shape, heads interleaved
    assert step_parts(*args) is None
    total.as_strided_((2, 16, 16), (256, 16, 1))
    assert step_parts(*args) is not None
    total.data = total.data.view(torch.int32)  # same address, same shape, another dtype
    assert step_parts(*args) is None


def test_in_place_statistics_tell_autograd_their_parts_changed():
    """A step that adds into the parts marks them changed in place (as the multi-tensor add does): a graph that
    saved one raises on backward instead of using the new values."""
    state, step, _ = _one_request(5)
    total = state.query_parts[0][0]
    weight = torch.ones_like(total, requires_grad=True)
    saved = (weight * total).sum()
    version = total._version
    step()  # (in place: the memo of the last step matches)
    assert total._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_serving_histories_keep_in_place_statistics_bitwise(seed, monkeypatch):
    """Random histories on two caches, one adding its steps' statistics in place and one through the buffered adds
    (``KVBACKEND_STEP_PARTS=0``): requests joining, freed and forked, batches reordered or cut, inference mode on
    and off, a chunk's sum of q dropped, prefill appends between steps, steps without queries. Every part, count,
    sum and packed page stays bitwise equal, and the in-place path is taken."""
    import random

    import kvbackend.manager as manager

    real, taken = manager.step_parts, []
    monkeypatch.setattr(manager, "step_parts", lambda *a: taken.append(real(*a)) or taken[-1])
    rng, layers = random.Random(seed), 2
    fused, buffered = _query_caches("quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true", [False, True])
    gen = torch.Generator().manual_seed(seed)
    live = []

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)

    def both(call):
        results = [call(cache) for cache in (fused, buffered)]
        assert results[0] == results[1]
        return results[0]

    for _ in range(30):
        op = rng.random()
        if op < 0.15 or len(live) < 2:
            live.append(both(lambda c: c.add_request()[0]))
        elif op < 0.22 and len(live) > 2:
            rid = rng.choice(live)
            both(lambda c: c.free(rid))
            live.remove(rid)
        elif op < 0.3:
            rid = rng.choice(live)
            live.append(both(lambda c: c.fork(rid)))
        elif op < 0.35:
            rid, layer = rng.choice(live), rng.randrange(layers)
            for cache in (fused, buffered):
                sums = cache.page_table(rid).states[layer].query_sums
                if sums:
                    sums.pop(max(sums))
        elif op < 0.42:
            rid, n = rng.choice(live), rng.randrange(1, 4)
            k, v, q = rand(n, 2, 16), rand(n, 2, 16), rand(n, 4, 16)
            for cache in (fused, buffered):
                for layer in range(layers):
                    cache.append(rid, layer, k, v, queries=q)
        ids = live[:] if rng.random() < 0.85 else rng.sample(live, rng.randrange(1, len(live) + 1))
        k, v, q = rand(layers, len(ids), 2, 16), rand(layers, len(ids), 2, 16), rand(layers, len(ids), 4, 16)
        queries = rng.random() > 0.05
        with torch.inference_mode(rng.random() < 0.3):
            for cache, off in ((fused, "1"), (buffered, "0")):
                monkeypatch.setenv("KVBACKEND_STEP_PARTS", off)
                for layer in range(layers):
                    cache.append_step(ids, layer, k[layer], v[layer], queries=q[layer] if queries else None)
    assert sum(t is not None for t in taken) >= 5
    for rid in live:
        a, b = fused.page_table(rid), buffered.page_table(rid)
        assert a.lengths == b.lengths
        for layer in range(layers):
            sa, sb = a.states[layer], b.states[layer]
            assert sa.query_parts.keys() == sb.query_parts.keys() and sa.query_sums.keys() == sb.query_sums.keys()
            for chunk, (total, count) in sa.query_parts.items():
                assert count == sb.query_parts[chunk][1] and torch.equal(total, sb.query_parts[chunk][0])
            for chunk, total in sa.query_sums.items():
                assert torch.equal(total, sb.query_sums[chunk])
            for pa, pb in zip(a.packed, b.packed):
                assert torch.equal(fused.packed.pages[layer][pa], buffered.packed.pages[layer][pb])
    fused.check()
    buffered.check()
