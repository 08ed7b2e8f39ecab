"""`add_step_moments`: one decode step's query statistics added to many states at once, as `add_moment` one state
at a time adds them (the same float32 sums, each part its own storage, an unknown mean staying unknown)."""

import pytest
import torch

from kvbackend.codecs.base import CodecState, add_step_moments, query_moments


def _states(gen):
    """Four states: one holding chunk 0 with its sum of q, one holding chunk 0 without it (mean unknown), one holding
    only another chunk, one empty."""
    states = [CodecState() for _ in range(4)]
    for state in states[:2]:
        q = torch.randn(5, 4, 8, generator=gen)
        state.add_queries(0, q, 2)
    states[1].add_moment(0, torch.randn(2, 8, 8, generator=gen), 3)  # no sum: the chunk's mean is not known
    states[2].add_queries(1, torch.randn(2, 4, 8, generator=gen), 2)
    return states


def _copy(states):
    return [s.clone() for s in states]


def test_equals_add_moment_per_state_over_several_steps():
    gen = torch.Generator().manual_seed(0)
    batched = _states(gen)
    single = _copy(batched)
    chunks = [0, 0, 0, 3]  # existing parts, a new chunk beside another, a new state
    for _ in range(3):
        queries = torch.randn(4, 4, 8, generator=gen).bfloat16()
        moments, sums = query_moments(queries, 2)
        add_step_moments(batched, chunks, moments, 2, sums)
        for i, state in enumerate(single):
            state.add_moment(chunks[i], moments[i], 2, sums[i])
    for a, b in zip(single, batched):
        assert a.query_parts.keys() == b.query_parts.keys()
        for chunk, (total, count) in a.query_parts.items():
            got, got_count = b.query_parts[chunk]
            assert count == got_count and torch.equal(total, got)
            assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # not a view of a batch
        assert a.query_sums.keys() == b.query_sums.keys()
        for chunk, total in a.query_sums.items():
            assert torch.equal(total, b.query_sums[chunk])
    assert 0 not in batched[1].query_sums  # the unknown mean stayed unknown
    for a, b in zip(single, batched):  # and the chunk's statistics close alike
        for chunk in list(a.query_parts):
            a.close_chunk(chunk)
            b.close_chunk(chunk)
        assert torch.equal(a.query_moment, b.query_moment)
        assert (a.query_mean is None) == (b.query_mean is None)
        assert a.query_mean is None or torch.equal(a.query_mean, b.query_mean)


def test_a_step_does_not_touch_the_parts_of_a_clone():
    """In-place adds reach only the state's own tensors: a clone taken before the step keeps its figures."""
    gen = torch.Generator().manual_seed(1)
    state = _states(gen)[0]
    before = state.clone()
    moments, sums = query_moments(torch.randn(1, 4, 8, generator=gen), 2)
    add_step_moments([state], [0], moments, 2, sums)
    assert before.query_parts[0][1] + 2 == state.query_parts[0][1]
    assert not torch.equal(before.query_parts[0][0], state.query_parts[0][0])
    fresh = _states(torch.Generator().manual_seed(1))[0]
    assert torch.equal(before.query_parts[0][0], fresh.query_parts[0][0])
    assert torch.equal(before.query_sums[0], fresh.query_sums[0])


def test_refuses_mismatched_rows_and_dtypes():
    gen = torch.Generator().manual_seed(2)
    states = _states(gen)
    moments, sums = query_moments(torch.randn(4, 4, 8, generator=gen), 2)
    with pytest.raises(ValueError, match="one chunk and one row"):
        add_step_moments(states, [0, 0, 0], moments, 2, sums)
    with pytest.raises(ValueError, match="one chunk and one row"):
        add_step_moments(states[:3], [0, 0, 0], moments, 2, sums)
    with pytest.raises(ValueError, match="float32"):
        add_step_moments(states, [0, 0, 0, 0], moments.half(), 2, sums)


def _cache(check_finite):
    from kvbackend import CacheConfig, Geometry, KVCache

    geometry = Geometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    return KVCache(geometry, CacheConfig(codec="quantwm:group=16,rank=2,centroids=2,vbits=2", page_size=4,
                                         chunk_pages=2, dense_pages=8, packed_pages=8, check_finite=check_finite))


def test_unchecked_queries_holding_nan_are_dropped_when_the_chunk_closes(caplog):
    """With ``check_finite=False`` queries are not read at append (a device read per layer of a decode step); a
    chunk whose booked queries hold NaN closes without statistics, logged, and encodes to the bytes of the same
    chunk appended without queries. Finite unchecked queries keep theirs (the bytes of a checked cache)."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen)
    q = torch.randn(8, 4, 16, generator=gen)
    bad = q.clone()
    bad[5, 2, 7] = float("nan")
    pages = {}
    for name, check, queries in (("nan", False, bad), ("none", False, None), ("unchecked", False, q),
                                 ("checked", True, q)):
        cache = _cache(check)
        rid, _ = cache.add_request()
        for t in range(8):  # a decode step at a time: the eighth completes the chunk
            cache.append_step([rid], 0, k[t : t + 1], v[t : t + 1],
                              queries=None if queries is None else queries[t : t + 1])
        table = cache.page_table(rid)
        assert len(table.packed) == 2
        state = table.states[0]
        pages[name] = torch.stack([cache.packed.pages[0][p] for p in table.packed])
        if name == "nan":
            assert state.query_moment is None and state.query_mean is None and not state.query_parts
        elif queries is not None:
            assert state.query_moment is not None and bool(torch.isfinite(state.query_moment).all())
    assert "hold NaN or Inf" in caplog.text
    assert torch.equal(pages["nan"], pages["none"])
    assert torch.equal(pages["unchecked"], pages["checked"])
    assert not torch.equal(pages["unchecked"], pages["none"])  # the statistics move the bytes
    with pytest.raises(Exception, match="queries contain NaN"):  # checked: refused at append, as before
        cache = _cache(True)
        rid, _ = cache.add_request()
        cache.append_step([rid], 0, k[:1], v[:1], queries=bad[5:6])


def _closed(*chunks):
    """A state given the queries ``chunks`` ([(chunk, queries)]) and closed at the last chunk."""
    state = CodecState()
    for chunk, q in chunks:
        state.add_queries(chunk, q, 2)
    state.close_chunk(chunks[-1][0])
    return state


def test_a_chunk_with_non_finite_statistics_is_dropped_alone():
    """Statistics add up across chunks: a chunk whose queries held Inf is dropped, the earlier chunks' (finite) part
    is kept, and later chunks add to what is left."""
    gen = torch.Generator().manual_seed(4)
    first, later = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, 8, generator=gen)
    bad = torch.randn(2, 4, 8, generator=gen)
    bad[1, 2, 3] = float("inf")
    state = CodecState()
    state.add_queries(0, first, 2)
    assert state.close_chunk(0) == []
    state.add_queries(1, bad, 2)
    state.add_queries(2, later, 2)
    assert state.close_chunk(1) == [1]
    expected = _closed((0, first), (1, first[:0]))  # chunk 0's statistics alone, as a part of chunk 1
    assert torch.equal(state.query_moment, expected.query_moment)
    assert torch.equal(state.query_mean, expected.query_mean) and sorted(state.query_parts) == [1, 2]
    assert state.close_chunk(2) == []
    expected = _closed((0, first), (2, later))
    assert torch.equal(state.query_moment, expected.query_moment)
    assert torch.equal(state.query_mean, expected.query_mean)


def test_a_first_chunk_dropped_or_an_overflowing_sum_leaves_no_statistics():
    gen = torch.Generator().manual_seed(5)
    state = CodecState()
    state.add_queries(0, torch.full((2, 4, 8), float("nan")), 2)
    assert state.close_chunk(0) == [0]
    assert state.query_moment is None and state.query_mean is None and not state.query_parts
    big = CodecState()  # two finite parts whose sum is past float32's range
    for chunk in (0, 1):
        big.add_moment(chunk, torch.full((2, 8, 8), 3e38), 1, torch.randn(2, 8, generator=gen))
    assert big.close_chunk(1) == [0, 1]
    assert big.query_moment is None and big.query_mean is None and not big.query_parts


def test_parts_it_does_not_own_are_added_out_of_place():
    """Parts booked under inference mode, a caller's tensor shared by two states (a view of a prior), and a state
    named twice: each ends with `add_moment`'s figures, and nothing else is written to."""
    gen = torch.Generator().manual_seed(6)
    q0 = torch.randn(3, 4, 8, generator=gen)
    with torch.inference_mode():
        booked = CodecState()
        booked.add_queries(0, q0, 2)
    prior = torch.randn(2, 2, 8, 8, generator=gen)
    before = prior.clone()
    shared = [CodecState(), CodecState()]
    for state in shared:  # both hold a view of the same tensor
        state.query_parts[0] = (prior[0], 3)
    twice = _states(gen)[0]
    states = [booked, *shared, twice, twice]
    reference = [s.clone() for s in states[:4]]
    reference[1].query_parts[0] = (prior[0].clone(), 3)
    reference[2].query_parts[0] = (prior[0].clone(), 3)
    moments, sums = query_moments(torch.randn(5, 4, 8, generator=gen), 2)
    add_step_moments(states, [0] * 5, moments, 2, sums)
    for i, state in enumerate(reference):
        state.add_moment(0, moments[i], 2, sums[i])
    reference[3].add_moment(0, moments[4], 2, sums[4])
    assert torch.equal(prior, before)  # the caller's tensor is untouched
    for got, want in zip(states[:4], reference):
        assert got.query_parts[0][1] == want.query_parts[0][1]
        assert torch.equal(got.query_parts[0][0], want.query_parts[0][0])
        assert (0 in got.query_sums) == (0 in want.query_sums)
        assert 0 not in want.query_sums or torch.equal(got.query_sums[0], want.query_sums[0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's fused multi-tensor add"))])
def test_a_state_named_twice_takes_both_rows(device):
    """The same part twice in one fused in-place add could keep one row of the two: a state named twice takes its
    second row after the in-place adds."""
    gen = torch.Generator().manual_seed(7)
    state = CodecState()
    state.add_moment(0, torch.randn(2, 8, 8, generator=gen).to(device), 1, torch.randn(2, 8, generator=gen).to(device))
    reference = state.clone()
    moments, sums = query_moments(torch.randn(3, 4, 8, generator=gen).to(device), 2)
    add_step_moments([state, state, state], [0, 0, 0], moments, 2, sums)
    for i in range(3):
        reference.add_moment(0, moments[i], 2, sums[i])
    assert state.query_parts[0][1] == reference.query_parts[0][1] == 7
    assert torch.equal(state.query_parts[0][0], reference.query_parts[0][0])
    assert torch.equal(state.query_sums[0], reference.query_sums[0])


def _reference_step(states, chunks, moments, sums, count=2):
    for i, state in enumerate(states):
        state.add_moment(chunks[i], moments[i], count, sums[i])


def _assert_same(got_states, want_states):
    for got, want in zip(got_states, want_states):
        assert got.query_parts.keys() == want.query_parts.keys()
        for chunk, (total, count) in want.query_parts.items():
            assert got.query_parts[chunk][1] == count and torch.equal(got.query_parts[chunk][0], total)
        assert got.query_sums.keys() == want.query_sums.keys()
        for chunk, total in want.query_sums.items():
            assert torch.equal(got.query_sums[chunk], total)


def test_a_memo_reuses_the_last_partition_only_while_every_part_is_the_same():
    """With a memo (as `KVCache.append_step` keeps one per layer) the adds match `add_moment` step after step, and
    whatever a caller changes between steps (a part replaced by a view of its own tensor, a sum replaced, a part
    popped, the states reordered, inference mode) is seen: the caller's tensors are never written to."""
    gen = torch.Generator().manual_seed(8)
    states = [CodecState() for _ in range(3)]
    for state in states:
        state.add_queries(0, torch.randn(3, 4, 8, generator=gen), 2)
    reference = _copy(states)
    memo, chunks = {}, [0, 0, 0]
    prior = torch.randn(3, 2, 8, 8, generator=gen)
    prior_sums = torch.randn(3, 2, 8, generator=gen)
    before, before_sums = prior.clone(), prior_sums.clone()

    def step(order=(0, 1, 2), inference=False):
        moments, sums = query_moments(torch.randn(3, 4, 8, generator=gen), 2)
        picked = [states[i] for i in order]
        with torch.inference_mode(inference):
            add_step_moments(picked, [chunks[i] for i in order], moments, 2, sums, memo=memo)
        _reference_step([reference[i] for i in order], [chunks[i] for i in order], moments, sums)
        _assert_same(states, reference)

    step()
    assert memo["step"] is not None  # every part went in place: the partition is kept
    step()
    step()
    for copies in (states, reference):  # a caller's view of its own tensor as a part
        copies[1].query_parts[0] = (prior[1] if copies is states else prior[1].clone(), 9)
    step()
    assert torch.equal(prior, before)
    step()  # (the part it made in its place is owned: in place again)
    for copies in (states, reference):  # a caller's view as a sum
        copies[2].query_sums[0] = prior_sums[2] if copies is states else prior_sums[2].clone()
    step()
    assert torch.equal(prior_sums, before_sums)
    step(order=(2, 0, 1))
    for copies in (states, reference):  # a part popped: the next step opens it again
        copies[0].query_parts.pop(0)
        copies[0].query_sums.pop(0)
    step()
    step()
    chunks[1] = 1  # another chunk named
    step()
    step()
    step(inference=True)
    step()
    assert torch.equal(prior, before) and torch.equal(prior_sums, before_sums)


def test_a_memo_is_not_kept_when_a_part_went_one_by_one():
    gen = torch.Generator().manual_seed(9)
    states = [CodecState(), CodecState()]
    memo = {}
    moments, sums = query_moments(torch.randn(2, 4, 8, generator=gen), 2)
    add_step_moments(states, [0, 0], moments, 2, sums, memo=memo)  # both parts opened by the step
    assert memo["step"] is None
    add_step_moments(states, [0, 0], moments, 2, sums, memo=memo)
    assert memo["step"] is not None
    add_step_moments([states[0], states[0]], [0, 0], moments, 2, sums, memo=memo)  # a state named twice
    assert memo["step"] is None


def test_moment_buffers_give_each_batch_its_rows_and_the_statistics_of_query_moments():
    from kvbackend.step_state import MomentBuffers

    gen = torch.Generator().manual_seed(10)
    buffers = MomentBuffers(2, 8, torch.device("cpu"))
    for batch in (3, 5, 2, 5, 7):  # grows, then smaller batches take the first rows
        queries = torch.randn(batch, 4, 8, generator=gen)
        moments, sums, rows, row_sums = buffers.get(batch)
        assert moments.shape == (batch, 2, 8, 8) and sums.shape == (batch, 2, 8) and len(rows) == len(row_sums) == batch
        got = query_moments(queries, 2, out=(moments, sums))
        want = query_moments(queries, 2)
        assert got[0] is moments and torch.equal(moments, want[0]) and torch.equal(sums, want[1])
        assert all(torch.equal(row, want[0][i]) and torch.equal(s, want[1][i])
                   for i, (row, s) in enumerate(zip(rows, row_sums)))


def test_rows_of_another_batch_are_refused():
    gen = torch.Generator().manual_seed(11)
    states = _states(gen)
    moments, sums = query_moments(torch.randn(4, 4, 8, generator=gen), 2)
    with pytest.raises(ValueError, match="one row of moments and sums per state"):
        add_step_moments(states, [0] * 4, moments, 2, sums, rows=(moments.unbind(0)[:3], sums.unbind(0)))


def test_a_memo_made_in_inference_mode_is_not_used_outside_it():
    """Parts booked under inference mode take in-place adds only there: the step after, outside it, adds them out
    of place (in place it would raise) with `add_moment`'s figures."""
    gen = torch.Generator().manual_seed(12)
    with torch.inference_mode():
        states = [CodecState() for _ in range(2)]
        for state in states:
            state.add_queries(0, torch.randn(3, 4, 8, generator=gen), 2)
    reference = _copy(states)
    memo = {}
    for inference, kept in ((True, True), (True, True), (False, False), (False, True)):
        moments, sums = query_moments(torch.randn(2, 4, 8, generator=gen), 2)
        with torch.inference_mode(inference):
            add_step_moments(states, [0, 0], moments, 2, sums, memo=memo)
        assert (memo["step"] is not None) == kept  # (outside, the inference parts went one by one, then in place)
        _reference_step(reference, [0, 0], moments, sums)
        _assert_same(states, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="buffers per CUDA stream")
def test_moment_buffers_keep_a_pair_per_stream_for_the_last_streams_only():
    from kvbackend.step_state import MAX_STREAMS, MomentBuffers

    buffers = MomentBuffers(2, 8, torch.device("cuda"))
    first = buffers.get(3)[0]
    assert buffers.get(3)[0].data_ptr() == first.data_ptr()  # reused on the same stream
    streams = [torch.cuda.Stream() for _ in range(MAX_STREAMS + 2)]
    for stream in streams:
        with torch.cuda.stream(stream):
            assert buffers.get(3)[0].data_ptr() != first.data_ptr()
    assert len(buffers._by_stream) == MAX_STREAMS


def test_moment_buffers_keep_a_pair_per_thread():
    """Two threads appending to other layers of one cache must not share a buffer: one's product would overwrite
    the other's between its product and its adds."""
    import threading

    from kvbackend.step_state import MomentBuffers

    buffers = MomentBuffers(2, 8, torch.device("cpu"))
    first = buffers.get(3)[0]
    assert buffers.get(3)[0].data_ptr() == first.data_ptr()  # reused by the same thread
    seen = []
    thread = threading.Thread(target=lambda: seen.append(buffers.get(3)[0].data_ptr()))
    thread.start()
    thread.join()
    assert seen and seen[0] != first.data_ptr()
    assert buffers.get(3)[0].data_ptr() == first.data_ptr()  # the first thread's pair is still its own


def test_two_threads_stepping_other_layers_of_one_cache_give_one_threads_statistics():
    import threading

    from kvbackend import CacheConfig, Geometry, KVCache

    batch, heads, steps = 8, 2, 30

    def make():
        geometry = Geometry(num_layers=2, num_kv_heads=heads, head_dim=16, dtype=torch.float32)
        return KVCache(geometry, CacheConfig(codec="quantwm:group=16,rank=2,centroids=2,vbits=2", page_size=64,
                                             chunk_pages=2, dense_pages=batch + 2, packed_pages=8))

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, steps, batch, heads, 16, generator=gen)
    q = torch.randn(2, steps, batch, 2 * heads, 16, generator=gen) * 10
    alone, threaded = make(), make()
    for cache in (alone, threaded):
        ids = [cache.add_request()[0] for _ in range(batch)]
    for layer in range(2):
        for s in range(steps):
            alone.append_step(ids, layer, k[layer, s], k[layer, s], queries=q[layer, s])
    barrier = threading.Barrier(2)

    def worker(layer):
        barrier.wait()
        for s in range(steps):
            threaded.append_step(ids, layer, k[layer, s], k[layer, s], queries=q[layer, s])

    threads = [threading.Thread(target=worker, args=(layer,)) for layer in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rid in ids:
        for layer in range(2):
            a, b = alone.page_table(rid).states[layer], threaded.page_table(rid).states[layer]
            assert a.query_parts[0][1] == b.query_parts[0][1]
            torch.testing.assert_close(b.query_parts[0][0], a.query_parts[0][0])
            torch.testing.assert_close(b.query_sums[0], a.query_sums[0])


def _step_cache():
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.rope import Rotary

    geometry = Geometry(num_layers=1, num_kv_heads=2, head_dim=16)
    config = CacheConfig(codec="quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true", page_size=4, chunk_pages=2,
                         dense_pages=12, packed_pages=24)
    return KVCache(geometry, config, rotary=Rotary.default(16, 10000.0))


def _decode_steps(cache, rid, gen, n):
    for _ in range(n):
        cache.append_step([rid], 0, torch.randn(1, 2, 16, generator=gen), torch.randn(1, 2, 16, generator=gen),
                          queries=torch.randn(1, 4, 16, generator=gen))


def test_a_step_after_a_caller_dropped_the_parts_opens_them_again():
    """The memo's weak reference to a part the caller popped (and freed) is dead: it must not match the part now
    missing (a crash on every later step before the fix)."""
    cache, gen = _step_cache(), torch.Generator().manual_seed(13)
    rid, _ = cache.add_request()
    _decode_steps(cache, rid, gen, 2)  # the second step went in place: the memo holds the parts
    state = cache.page_table(rid).states[0]
    state.query_parts.pop(0)
    state.query_sums.pop(0)
    _decode_steps(cache, rid, gen, 3)
    assert state.query_parts[0][1] == 3 * 2 and 0 in state.query_sums  # three steps of two queries per KV head


def test_steps_inside_and_outside_inference_mode_alternate():
    """Buffers made by a step under inference mode are normal tensors: the next step outside it writes them (it
    raised before the fix), and the statistics equal those of a cache that never entered inference mode."""
    caches = [_step_cache(), _step_cache()]
    for modes, cache in zip(((True, False, True, False), (False,) * 4), caches):
        gen = torch.Generator().manual_seed(14)
        rid, _ = cache.add_request()
        for inference in modes:
            with torch.inference_mode(inference):
                _decode_steps(cache, rid, gen, 1)
    a, b = (cache.page_table(0).states[0] for cache in caches)
    assert a.query_parts[0][1] == b.query_parts[0][1] == 8
    assert torch.equal(a.query_parts[0][0], b.query_parts[0][0]) and torch.equal(a.query_sums[0], b.query_sums[0])


def test_a_part_that_needs_a_gradient_since_the_last_step_is_added_out_of_place():
    cache, gen = _step_cache(), torch.Generator().manual_seed(15)
    rid, _ = cache.add_request()
    _decode_steps(cache, rid, gen, 3)
    state = cache.page_table(rid).states[0]
    part = state.query_parts[0][0]
    before = part.detach().clone()
    part.requires_grad_()
    _decode_steps(cache, rid, gen, 1)
    assert torch.equal(part.detach(), before)  # the caller's tensor is not written to
    assert state.query_parts[0][1] == 8 and state.query_parts[0][0] is not part


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_a_layer_on_another_stream_copies_the_step_ints_there():
    """The step's ints are copied to the device asynchronously on the stream of its first layer: a layer of the same
    step on another stream makes its own copy (it would not wait for the first), and the pools get the same values
    as a cache stepped on one stream."""
    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.rope import Rotary

    def cache():
        config = CacheConfig(codec="quantwm:group=16,rank=2,centroids=2,vbits=2,prerope=true", page_size=4,
                             chunk_pages=2, dense_pages=12, packed_pages=24, device="cuda")
        return KVCache(Geometry(num_layers=2, num_kv_heads=2, head_dim=16), config, rotary=Rotary.default(16, 1e4))

    one, two = cache(), cache()
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(16)
    ids = [c.add_request()[0] for c in (one, two)]
    for _ in range(5):
        k, v, q = (torch.randn(2, 1, 2, 16, generator=gen).cuda(), torch.randn(2, 1, 2, 16, generator=gen).cuda(),
                   torch.randn(2, 1, 4, 16, generator=gen).cuda())
        made = []
        for layer in range(2):
            one.append_step([ids[0]], layer, k[layer], v[layer], queries=q[layer])
            stream = side if layer == 1 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                two.append_step([ids[1]], layer, k[layer], v[layer], queries=q[layer])
                made.append(two._step)
            torch.cuda.current_stream().wait_stream(stream)
        assert made[0] is not made[1] and made[0].key[1:] == made[1].key[1:]
    torch.cuda.synchronize()
    assert torch.equal(one.dense.data, two.dense.data)
    for layer in range(2):
        a, b = one.page_table(ids[0]).states[layer], two.page_table(ids[1]).states[layer]
        assert a.query_parts[0][1] == 10 and torch.equal(a.query_parts[0][0], b.query_parts[0][0])


def test_a_stepped_cache_pickles_and_its_copies_step_alike():
    """A cache's step state (weak references to the last step's parts) is not carried by a pickle or a deep copy:
    both work after decode steps, and the copies step on to the statistics of the original."""
    import copy
    import pickle

    cache, gen = _step_cache(), torch.Generator().manual_seed(17)
    rid, _ = cache.add_request()
    _decode_steps(cache, rid, gen, 3)
    copies = [pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)]
    for c in [cache, *copies]:
        state_gen = torch.Generator().manual_seed(18)
        _decode_steps(c, rid, state_gen, 3)
    want = cache.page_table(rid).states[0]
    for c in copies:
        got = c.page_table(rid).states[0]
        assert got.query_parts[0][1] == want.query_parts[0][1] == 12
        assert torch.equal(got.query_parts[0][0], want.query_parts[0][0])
        assert torch.equal(got.query_sums[0], want.query_sums[0])
