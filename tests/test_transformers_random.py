"""transformers integration on a small Llama with random weights: runs everywhere, CUDA included
(`make gpu-test`), where the shipped model is not installed."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvbackend.integration.transformers import KVBackendCache  # noqa: E402
from kvbackend.tools.models import cache_argument  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def _forward(model, ids, cache):
    return model(ids, use_cache=True, **cache_argument(model, cache))


def test_identity_cache_matches_dynamic_on_the_device(model):
    """Prefill chunk by chunk and decode: with the identity codec every logit equals DynamicCache's."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 150), device=DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=16, chunk_pages=2, max_tokens=200,
                           dense_tokens=32)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        got = cache.prefill(model, ids).logits[:, -1]
        want = _forward(model, ids, exact).logits[:, -1]
        assert torch.allclose(got, want, atol=1e-4)
        for _ in range(20):  # crosses a chunk boundary at 160
            token = want.argmax(-1, keepdim=True)
            got = _forward(model, token, cache).logits[:, -1]
            want = _forward(model, token, exact).logits[:, -1]
            assert torch.allclose(got, want, atol=1e-4)
    assert cache.engine.stats().packed_tokens == 2 * 160 and cache.get_seq_length() == 170
    assert cache.engine.dense.data.device.type == DEVICE


def test_packed_cache_holds_less_and_stays_close(model):
    """kivi-2 pages: the bytes held (pools at capacity included) fall below the float32 cache's, and
    the next-token distribution stays near the exact one."""
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 512), device=DEVICE)
    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=32", page_size=32, chunk_pages=2,
                           max_tokens=512, dense_tokens=64)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        got = cache.prefill(model, ids).logits[:, -1].float().log_softmax(-1)
        want = _forward(model, ids, exact).logits[:, -1].float().log_softmax(-1)
    kl = float((want.exp() * (want - got)).sum())
    assert 0 <= kl < 0.05
    engine = cache.engine
    held = engine.dense.data.nbytes + sum(t.nbytes for t in engine.packed.pages + engine.packed.codebooks)
    exact_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in exact.layers)
    report = cache.kv_bytes()
    assert report["exact"] == exact_bytes and report["dense"] == 0
    assert report["packed"] * 8 < exact_bytes  # 3 bits per value against 32
    assert held < exact_bytes / 3  # whole pools: packed sized for max_tokens, dense for 3 of 16 pages


def test_attached_attention_keeps_the_masks(model):
    """attach() routes attention through the cache: multi-token calls after cached tokens (chunked
    prefill, teacher forcing) and left-padded rows must get the same causal and padding masks as the
    model's own SDPA (a regression: without a registered mask function they got none)."""
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (2, 90), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1 is left-padded
    cache = KVBackendCache(model.config, codec="identity", page_size=16, chunk_pages=2, max_tokens=128)
    cache.attach(model)
    try:
        with torch.no_grad():
            got = torch.cat([_forward_masked(model, ids[:, :40], mask[:, :40], cache),
                             _forward_masked(model, ids[:, 40:], mask, cache)], dim=1)
    finally:
        cache.detach(model)
    with torch.no_grad():
        want = _forward_masked(model, ids, mask, DynamicCache(config=model.config))
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1, 7:], want[1, 7:], atol=1e-4)  # padded positions' logits are not defined


def _forward_masked(model, ids, mask, cache):
    return model(ids, attention_mask=mask, use_cache=True, **cache_argument(model, cache)).logits


def _lengths(cache):
    """(each layer's count, the paged cache's per-row per-layer lengths)."""
    return [layer.length for layer in cache.layers], [cache.engine.page_table(rid).lengths for rid in cache.request_ids]


@pytest.mark.parametrize("attached", [False, True])
def test_a_bad_row_or_a_full_pool_writes_and_counts_nothing(model, attached):
    """NaN in one row's K/V, or more tokens than the dense pool holds: a clear error, no row written,
    no layer counting what was not stored, and the next call exact (attached or not)."""
    from kvbackend.errors import CacheFull, InvalidKV

    torch.manual_seed(4)
    ids = torch.randint(0, 256, (2, 40), device=DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=8, chunk_pages=1, max_tokens=64, dense_tokens=16)
    exact = DynamicCache(config=model.config)
    embed = model.get_input_embeddings()
    if attached:
        cache.attach(model)
    try:
        with torch.no_grad():
            _forward(model, ids[:, :8], cache)
            _forward(model, ids[:, :8], exact)
            bad = embed(ids[:, 8:11]).clone()
            bad[1, 1, 0] = float("nan")  # row 1 only
            with pytest.raises(InvalidKV, match="nothing was written"):
                model(inputs_embeds=bad, use_cache=True, **cache_argument(model, cache))
            assert _lengths(cache) == ([8, 8], [[8, 8], [8, 8]])
            with pytest.raises(CacheFull, match="prefill"):
                _forward(model, ids[:, 8:40], cache)  # 32 tokens over a 16-token dense pool
            assert _lengths(cache) == ([8, 8], [[8, 8], [8, 8]])
            got = _forward(model, ids[:, 8:12], cache).logits
            want = _forward(model, ids[:, 8:12], exact).logits
    finally:
        if attached:
            cache.detach(model)
    assert torch.allclose(got, want, atol=1e-4)
    cache.engine.check()


def test_a_forward_that_failed_between_layers_is_refused_until_reset(model, monkeypatch):
    """When a later layer fails after earlier ones stored a call's tokens, the cache says so at the next
    call instead of attending with mismatched lengths; reset() makes it usable again."""
    from kvbackend.integration.transformers import KVBackendLayer

    ids = torch.randint(0, 256, (1, 12), device=DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=8, chunk_pages=1, max_tokens=64)
    original = KVBackendLayer._append

    def failing(self, *args, **kwargs):
        if self.layer_idx == 1:
            raise OSError("simulated failure in layer 1")
        return original(self, *args, **kwargs)

    with torch.no_grad():
        _forward(model, ids[:, :4], cache)
        monkeypatch.setattr(KVBackendLayer, "_append", failing)
        with pytest.raises(OSError):
            _forward(model, ids[:, 4:8], cache)
        monkeypatch.setattr(KVBackendLayer, "_append", original)
        with pytest.raises(RuntimeError, match="reset"):
            _forward(model, ids[:, 4:8], cache)
        cache.reset()
        got = _forward(model, ids, cache).logits
        want = _forward(model, ids, DynamicCache(config=model.config)).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_beam_reorders_fit_one_chunk_per_row_and_fail_whole(model):
    """Reordering rows reuses each surviving row's request and frees dropped rows before copying, so a
    dense pool of one chunk per row serves beam search for any number of steps; a reshuffle to more rows than
    the pools were sized for is refused before changing anything (no orphan requests)."""
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (3, 16), device=DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=4, chunk_pages=4, max_tokens=64, dense_tokens=16)
    exact = DynamicCache(config=model.config)
    order = torch.tensor([0, 0, 1], device=DEVICE)
    with torch.no_grad():
        cache.prefill(model, ids)
        _forward(model, ids, exact)
        token = ids[:, :1]
        for _ in range(31):  # crosses chunk boundaries with copied active chunks; ends 15 tokens into one
            got = _forward(model, token, cache).logits[:, -1]
            want = _forward(model, token, exact).logits[:, -1]
            assert torch.allclose(got, want, atol=1e-4)
            cache.reorder_cache(order)
            exact.reorder_cache(order)
            token = want.argmax(-1, keepdim=True)[order]
        before = (list(cache.request_ids), cache.engine.dense.allocator.num_free)
        with pytest.raises(ValueError, match="sized for a batch of 3 rows"):
            cache.batch_repeat_interleave(3)  # 9 rows in pools sized for 3 (the packed pool as well as the dense)
        assert (list(cache.request_ids), cache.engine.dense.allocator.num_free) == before
        assert len(cache.engine.request_ids) == 3
    cache.engine.check()


def test_options_and_attach_misuse_are_refused_up_front(model):
    """Bad options fail in the constructor (not at the first forward); prefill slices position_ids;
    a second cache cannot attach to a model another cache holds, and detach checks it is attached."""
    from kvbackend.errors import SpecError

    with pytest.raises(ValueError, match="below one chunk"):
        KVBackendCache(model.config, codec="identity", page_size=4, chunk_pages=4, dense_tokens=8)
    with pytest.raises(SpecError, match="page_size=4"):
        KVBackendCache(model.config, codec="kivi:bits=2,group=16", page_size=4)
    with pytest.raises(SpecError, match="head_dim=32"):
        KVBackendCache(model.config, codec="quantwm")  # group 64 over 32 channels
    ids = torch.randint(0, 256, (1, 20), device=DEVICE)
    positions = torch.arange(20, device=DEVICE)[None] + 3  # shifted positions, as a caller may pass
    cache = KVBackendCache(model.config, codec="identity", page_size=4, chunk_pages=2, dense_tokens=8)
    with torch.no_grad():
        got = cache.prefill(model, ids, position_ids=positions).logits[:, -1]
        want = model(ids, position_ids=positions).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-4)
    with pytest.raises(ValueError, match="inputs_embeds"):
        cache.prefill(model, ids, inputs_embeds=None)
    first, second = (KVBackendCache(model.config, codec="identity") for _ in range(2))
    previous = model.config._attn_implementation
    first.attach(model)
    try:
        with pytest.raises(ValueError, match="detach it first"):
            second.attach(model)
        with pytest.raises(ValueError, match="not attached"):
            second.detach(model)
    finally:
        first.detach(model)
    assert model.config._attn_implementation == previous


def test_every_layer_attends_the_calls_own_tokens_as_given(model):
    """A chunk that completes with this call's tokens is packed once the last layer stores them; every
    layer still attends those tokens as given (not the last layer lossy and the others exact)."""
    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=8", page_size=8, chunk_pages=1, max_tokens=32)
    g = torch.Generator().manual_seed(6)
    k = torch.randn(1, 2, 8, 32, generator=g).to(DEVICE)
    v = torch.randn(1, 2, 8, 32, generator=g).to(DEVICE)
    for layer in cache.layers:
        keys, values = layer.update(k, v)
        assert torch.equal(keys, k) and torch.equal(values, v)
    assert cache.engine.stats().packed_tokens == 8  # the chunk was packed by the last layer
    stored, _ = cache.layers[0].read()
    assert not torch.equal(stored, k) and float((stored - k).norm() / k.norm()) < 0.5  # later calls read pages


LEVERED = "quantwm:group=32,kchannel=16,rank=4,keep=0.25,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true"
# a klt plan's layer (keys at a width per channel, 2 KV heads x 32 channels): served by `ChwBackend`'s kernels
CHW = "chw:kw=" + "".join(str(i % 7) for i in range(64)) + ",vbits=2,vstep=1.15,sink=4,vrot=hadamard,prerope=true"


@pytest.mark.parametrize("codec", ["identity", LEVERED, CHW])
def test_attached_decode_steps_attend_on_the_pages(model, codec, monkeypatch):
    """With attach() and the Triton backend, one-token steps run the paged decode kernel on the pages
    (no dense read of the sequence) and give the logits of the reference path; a padded batch falls
    back to reading the pages for the model's SDPA, with its mask."""
    from kvbackend.integration.transformers import KVBackendLayer

    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 88), device=DEVICE)
    options = dict(codec=codec, page_size=16, chunk_pages=2, max_tokens=128, dense_tokens=32)
    paged = KVBackendCache(model.config, backend="triton", **options)
    reference = KVBackendCache(model.config, backend="torch", **options)
    reads = []
    real_read = KVBackendLayer.read
    monkeypatch.setattr(KVBackendLayer, "read", lambda self: reads.append(self.layer_idx) or real_read(self))
    for cache in (paged, reference):
        cache.attach(model)
        try:
            with torch.no_grad():
                cache.prefill(model, ids)
                reads.clear()
                logits = []
                token = ids[:, -1:]
                for _ in range(12):  # 88 + 12 tokens: a step completes the chunk ending at 96
                    out = _forward(model, token, cache).logits[:, -1]
                    logits.append(out)
                    token = out.argmax(-1, keepdim=True) if cache is paged else steps[len(logits) - 1]
        finally:
            cache.detach(model)
        if cache is paged:
            assert reads == [] and paged.engine.backends[0].name == "triton"  # no dense read in decode steps
            got, steps = logits, [x.argmax(-1, keepdim=True) for x in logits]
        else:
            want = logits
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) < 2e-2 * float(w.abs().max())
    # a left-padded batch: the mask hides tokens, so the step reads the pages for SDPA instead
    mask = torch.ones(2, 89, dtype=torch.long, device=DEVICE)
    mask[1, :5] = 0
    padded = KVBackendCache(model.config, backend="triton", **dict(options, dense_tokens=None))
    padded.attach(model)
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :88], use_cache=True, **cache_argument(model, padded))
            reads.clear()
            model(ids[:, -1:], attention_mask=mask, use_cache=True, **cache_argument(model, padded))
    finally:
        padded.detach(model)
    assert sorted(reads) == [0, 1]


def test_a_paged_step_that_completes_a_chunk_attends_it_like_the_other_layers(model):
    """The token that completes a chunk is stored by the last layer; every layer of that step must still
    attend the chunk as stored before the step (exact, still dense) and the new token as given, as the
    read path does. Storing first and attending after gave the last layer the packed chunk (a regression)."""
    torch.manual_seed(6)
    ids = torch.randint(0, 256, (2, 20), device=DEVICE)
    logits = {}
    for backend in ("triton", "torch"):
        cache = KVBackendCache(model.config, codec="kivi:bits=2,group=16", page_size=16, chunk_pages=1, max_tokens=64,
                               backend=backend)
        cache.attach(model)
        try:
            with torch.no_grad():
                _forward(model, ids[:, :15], cache)  # one token short of a chunk
                logits[backend] = [_forward(model, ids[:, 15 + i:16 + i], cache).logits[:, -1] for i in range(3)]
        finally:
            cache.detach(model)
        assert cache.engine.stats().packed_tokens == 2 * 16  # step 0 completed the chunk
    scale = float(logits["torch"][0].abs().max())
    for got, want in zip(logits["triton"], logits["torch"]):
        assert float((got - want).abs().max()) < 2e-2 * scale


def test_a_model_that_does_not_call_the_attached_attention_gets_every_token():
    """Models that compute attention themselves (here ImageGPT) never call the attached function:
    their decode steps must not go on the pages, or they attend to the new token alone."""
    from transformers import ImageGPTConfig, ImageGPTForCausalImageModeling

    torch.manual_seed(0)  # built on the CPU and moved (ImageGPT keeps a CPU buffer when built under a CUDA device)
    gpt = ImageGPTForCausalImageModeling(ImageGPTConfig(n_embd=128, n_head=4, n_layer=2, vocab_size=257,
                                                        n_positions=256)).float().eval().to(DEVICE)
    ids = torch.randint(0, 256, (1, 20), device=DEVICE)

    def steps(cache):
        with torch.no_grad():
            gpt(ids[:, :18], use_cache=True, **cache_argument(gpt, cache))
            return [gpt(ids[:, 18 + i:19 + i], use_cache=True, **cache_argument(gpt, cache)).logits[:, -1]
                    for i in range(2)]

    want = steps(DynamicCache(config=gpt.config))
    cache = KVBackendCache(gpt.config, codec="identity", page_size=16, chunk_pages=2, max_tokens=64, backend="triton")
    cache.attach(gpt)
    try:
        got = steps(cache)
    finally:
        cache.detach(gpt)
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) < 1e-3 * float(w.abs().max())
    assert not any(layer.attention_seen for layer in cache.layers)


def test_reads_for_the_models_attention_use_the_gather_kernel_and_match_the_reference(model, monkeypatch):
    """With the Triton backend, a layer's read (prompts after cached tokens, padded steps) is one
    gather_dequant launch for every row; it gives what the reference decodes."""
    from kvbackend.backends import TorchBackend, TritonBackend

    torch.manual_seed(7)
    ids = torch.randint(0, 256, (2, 50), device=DEVICE)
    cache = KVBackendCache(model.config, codec=LEVERED, page_size=16, chunk_pages=2, max_tokens=64, backend="triton")
    with torch.no_grad(), pytest.warns(UserWarning, match="attach"):  # unattached: no query statistics, as said
        _forward(model, ids, cache)
    calls = []
    real = TritonBackend.gather
    monkeypatch.setattr(TritonBackend, "gather", lambda self, *a: calls.append(a[-1]) or real(self, *a))
    for layer in cache.layers:
        k, v = layer.read()
        plan = cache.engine.plan(cache.request_ids, layer.layer_idx)
        rk, rv = TorchBackend().gather(cache.engine, plan, layer.layer_idx)
        assert k.shape == (2, 2, 50, 32)
        assert torch.allclose(k.transpose(1, 2).reshape(-1, 2, 32), rk, rtol=2**-7, atol=1e-3)
        assert torch.allclose(v.transpose(1, 2).reshape(-1, 2, 32), rv, rtol=2**-7, atol=1e-3)
    assert calls == [0, 1]


def test_a_per_head_plan_runs_in_the_cache_as_its_base_codec_would(model):
    """A `heads:` layer (widths per KV head, what `auto:...,perhead=true` writes) through `KVBackendCache`:
    with every head at the base's widths it gives the base codec's logits (the torch reference serves the
    heads: layer on every device; on CUDA the base layer runs the kernels, hence the tolerance); with wider
    keys on one head it holds more bytes and stays close to the exact cache."""
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 200), device=DEVICE)
    options = dict(page_size=16, chunk_pages=2, max_tokens=256, dense_tokens=64, sink=4, v_rotation="hadamard")
    base = KVBackendCache(model.config, codec="kivi:group=16", **options)
    same = KVBackendCache.from_plan(model.config, ["heads:base=kivi:group=16,kbits=2-2,vbits=2-2,sink=4,vrot=hadamard",
                                                   "kivi:group=16,sink=4,vrot=hadamard"], **options)
    wider = KVBackendCache.from_plan(model.config, ["heads:base=kivi:group=16,kbits=4-2,vbits=2-2,sink=4,vrot=hadamard",
                                                    "kivi:group=16,sink=4,vrot=hadamard"], **options)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        got = {name: c.prefill(model, ids).logits[:, -1].float() for name, c in
               (("base", base), ("same", same), ("wider", wider))}
        want = _forward(model, ids, exact).logits[:, -1].float().log_softmax(-1)
    assert torch.allclose(got["same"], got["base"], atol=1e-3 if DEVICE == "cuda" else 1e-5)
    assert same.engine.codecs[0].name == "heads" and base.kv_bytes()["packed"] > 0
    assert same.kv_bytes()["packed"] == base.kv_bytes()["packed"]
    assert wider.kv_bytes()["packed"] > base.kv_bytes()["packed"]
    kl = float((want.exp() * (want - got["wider"].log_softmax(-1))).sum())
    assert 0 <= kl < 0.05


@pytest.mark.parametrize("attach", [True, False])
def test_sinks_of_left_padded_rows_are_reported_once(model, attach):
    """`sink=S` keeps each stored row's first S positions exact; in a left-padded row those are padding (its first
    real tokens are compressed): a UserWarning says so once per cache, where the mask is seen (the attached
    attention, or `prefill`'s mask). An unpadded batch warns nothing."""
    import warnings

    torch.manual_seed(9)
    ids = torch.randint(1, 256, (2, 24), device=DEVICE)
    padded = torch.ones_like(ids)
    padded[1, :5] = 0
    for mask, want in ((torch.ones_like(ids), 0), (padded, 1)):
        cache = KVBackendCache(model.config, codec="kivi:bits=2,group=16", page_size=16, chunk_pages=1, sink=4,
                               max_tokens=64)
        if attach:
            cache.attach(model)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            cache.prefill(model, ids, attention_mask=mask)
            step = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(ids[:, :1], attention_mask=step, use_cache=True, **cache_argument(model, cache))
        if attach:
            cache.detach(model)
        assert sum("left-padded" in str(w.message) for w in caught) == want
