"""Adversarial checks of the transformers integration on small random models (no downloads): the cache
must serve what `DynamicCache` serves with a lossless codec, or refuse clearly."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvbackend.errors import InvalidKV, SpecError  # noqa: E402
from kvbackend.integration.transformers import KVBackendCache  # noqa: E402
from kvbackend.tools.models import cache_argument  # noqa: E402

SMALL = dict(codec="identity", page_size=4, chunk_pages=2, max_tokens=64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the models and their inputs live (the Triton
# backend runs on CUDA, or in Triton's interpreter on a CPU: tests/conftest.py)


def _generate(model, ids: torch.Tensor, cache, n: int = 8, **kwargs):
    """Greedy generation of exactly ``n`` tokens with per-step logits."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              **cache_argument(model, cache), **kwargs)


def _largest_gap(got, want) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))


def _gpt_oss():
    """A tiny gpt-oss: attention sinks (``s_aux``) in every layer, eager attention, one sliding layer."""
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                       max_position_embeddings=256, pad_token_id=0,
                                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval().to(DEVICE)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)  # sinks that matter (they start at zero)
    return model


def _gemma2():
    """A tiny Gemma 2: attention logits soft-capped (eager attention; SDPA refuses ``softcap``)."""
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                       sliding_window=8, max_position_embeddings=256, pad_token_id=0,
                                       attn_logit_softcapping=5.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).float().eval().to(DEVICE)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("build", [_gpt_oss, _gemma2], ids=["gpt-oss-sinks", "gemma2-softcap"])
def test_attach_keeps_the_models_own_attention(build, backend):
    """attach() must wrap the attention the model runs, not swap in SDPA: gpt-oss's sinks (``s_aux``) were
    dropped silently (different tokens), and Gemma 2's soft-capping made SDPA raise. With the Triton
    backend a decode step must not go to the paged kernel, which knows no sinks."""
    model = build()
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (2, 13)).to(DEVICE)
    want = _generate(model, ids, DynamicCache(config=model.config))
    cache = KVBackendCache(model.config, codec="identity", page_size=16, chunk_pages=1, max_tokens=64, backend=backend)
    previous = model.config._attn_implementation
    cache.attach(model)
    try:
        got = _generate(model, ids, cache)
    finally:
        cache.detach(model)
    assert model.config._attn_implementation == previous
    assert torch.equal(got.sequences, want.sequences)
    assert _largest_gap(got, want) < 1e-4


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def test_a_deep_copy_of_an_attached_cache_serves_every_token(model):
    """A deep copy (transformers' way to reuse a prompt's cache for several continuations) of an attached
    cache is attached to no model: the model's attention hands its calls to the original. With the Triton
    backend the copy sent its decode steps to the paged kernel anyway, and the model attended the new token
    alone (silently wrong logits)."""
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (2, 20)).to(DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=16, chunk_pages=1, max_tokens=64,
                           backend="triton")
    exact = DynamicCache(config=model.config)
    cache.attach(model)
    try:
        with torch.no_grad():
            for piece in (ids, ids[:, :1]):  # a prompt, then a decode step that goes on the pages
                model(piece, **cache_argument(model, cache))
                model(piece, **cache_argument(model, exact))
            copied, exact_copy = copy.deepcopy(cache), copy.deepcopy(exact)
            step = ids[:, 1:2]
            got = model(step, **cache_argument(model, copied)).logits
            want = model(step, **cache_argument(model, exact_copy)).logits
            got_original = model(step, **cache_argument(model, cache)).logits
            want_original = model(step, **cache_argument(model, exact)).logits
    finally:
        cache.detach(model)
    assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())
    assert float((got_original - want_original).abs().max()) < 1e-3 * float(want_original.abs().max())
    assert copied.get_seq_length() == cache.get_seq_length() == 22


def _three_rows(model):
    """A cache and a DynamicCache holding the same three rows of ten tokens."""
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (3, 10)).to(DEVICE)
    cache = KVBackendCache(model.config, **SMALL)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_argument(model, cache))
        model(ids, **cache_argument(model, exact))
    return ids, cache, exact


@pytest.mark.parametrize("indices", [[True, True, True], [True, False, True], [0, -1], [-1, 0, -3]],
                         ids=["all-true-mask", "mask", "negative", "negatives"])
def test_batch_select_takes_what_a_dynamic_cache_takes(model, indices):
    """Row selection as torch indexes: a boolean mask keeps the rows it marks (it was read as row numbers, so
    an all-True mask made every row a copy of row 1, silently), and negative numbers count from the end (row
    -1 was freed as dropped, then used)."""
    ids, cache, exact = _three_rows(model)
    select = torch.tensor(indices)
    cache.batch_select_indices(select)
    exact.batch_select_indices(select)
    rows = exact.layers[0].keys.shape[0]
    assert len(cache.request_ids) == rows
    with torch.no_grad():
        got = model(ids[:rows, :1], **cache_argument(model, cache)).logits
        want = model(ids[:rows, :1], **cache_argument(model, exact)).logits
    assert float((got - want).abs().max()) < 1e-4
    cache.engine.check()


@pytest.mark.parametrize("indices", [[0, 3], [-4], [], [[0, 1]], [0.0, 1.0], [True, False]],
                         ids=["past-the-end", "before-the-start", "empty", "2-d", "float", "short-mask"])
def test_a_bad_row_selection_is_refused_before_anything_changes(model, indices):
    """A row number out of range freed every row not named before failing with a bare IndexError (the cache
    then held freed requests); now: a clear error, and the cache serves its rows as before."""
    ids, cache, exact = _three_rows(model)
    before = list(cache.request_ids)
    with pytest.raises((ValueError, IndexError), match="row"):
        cache.batch_select_indices(torch.tensor(indices))
    with pytest.raises((ValueError, IndexError), match="row"):
        cache.reorder_cache(torch.tensor(indices))
    assert cache.request_ids == before and len(cache.engine.request_ids) == 3
    with torch.no_grad():
        got = model(ids[:, :1], **cache_argument(model, cache)).logits
        want = model(ids[:, :1], **cache_argument(model, exact)).logits
    assert float((got - want).abs().max()) < 1e-4
    cache.engine.check()


def test_a_model_whose_layers_share_kv_is_refused_up_front():
    """Gemma 3n's last layers reuse an earlier layer's K/V and never call the cache: every forward after the
    first failed with "an earlier forward call failed ... call cache.reset()", which reset() does not cure
    (and no chunk could ever be packed). The constructor now says what the cache cannot serve."""
    config = transformers.Gemma3nTextConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=4, vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
        sliding_window=8, max_position_embeddings=256, pad_token_id=0, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4)
    try:  # transformers releases that cannot say which layers hold K/V: the check stands aside (best effort)
        from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer, DynamicSlidingWindowLayer,
                                              get_layer_types_and_kwargs)

        types, _ = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        pytest.skip(f"this transformers release does not name the layers that hold no K/V ({exc})")
    plain = (None, DynamicLayer, DynamicSlidingWindowLayer)
    if all(DYNAMIC_LAYER_TYPE_MAPPING.get(kind) in plain for kind in types):
        pytest.skip(f"this transformers release gives Gemma 3n's shared layers no type of their own ({types})")
    with pytest.raises(ValueError, match=r"layers 2, 3 .*share"):
        KVBackendCache(config, **SMALL)


@pytest.mark.parametrize("codec", [None, 4])
def test_a_codec_that_is_not_a_spec_is_named(model, codec):
    """``codec=None`` (as if it meant the default) failed with "'NoneType' object is not iterable"."""
    with pytest.raises(SpecError, match="codec spec string"):
        KVBackendCache(model.config, codec=codec)


@pytest.mark.parametrize("shapes", [((1, 2, 3, 32), (1, 2, 2, 32)), ((1, 2, 3, 32), (1, 2, 3, 16)),
                                    ((2, 3, 32), (2, 3, 32))], ids=["tokens", "head-dim", "3-d"])
def test_keys_and_values_of_other_shapes_are_named(model, shapes):
    """Keys and values whose shapes differ failed inside a reshape ("shape '[3, 2, 32]' is invalid for input
    of size 128"), 3-D ones with "not enough values to unpack"; now an InvalidKV naming both shapes, and a
    cache that still serves the next call."""
    cache = KVBackendCache(model.config, **SMALL)
    k_shape, v_shape = shapes
    with pytest.raises(InvalidKV, match="keys and values must be"):
        cache.layers[0].update(torch.randn(k_shape), torch.randn(v_shape))
    k, v = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32)
    for layer in cache.layers:
        keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and cache.get_seq_length() == 3


def test_left_padded_sinks_are_reported_under_an_eager_mask():
    """An attached model on eager attention (Gemma 2) gets additive float masks, not SDPA's boolean ones: the
    warning that a left-padded row's sinks hold padding must still come, once, and an unpadded batch none."""
    import warnings

    model = _gemma2()
    torch.manual_seed(9)
    ids = torch.randint(1, 256, (2, 24)).to(DEVICE)
    padded = torch.ones_like(ids)
    padded[1, :5] = 0
    for mask, want in ((torch.ones_like(ids), 0), (padded, 1)):
        cache = KVBackendCache(model.config, codec="kivi:bits=2,group=16", page_size=16, chunk_pages=1, sink=4,
                               max_tokens=64)
        cache.attach(model)
        try:
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                model(ids, attention_mask=mask, **cache_argument(model, cache))
                step = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                model(ids[:, :1], attention_mask=step, **cache_argument(model, cache))
        finally:
            cache.detach(model)
        assert sum("left-padded" in str(w.message) for w in caught) == want


def _phi_config():
    """Phi rotates half of each head's channels (``partial_rotary_factor=0.5``)."""
    return transformers.PhiConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_hidden_layers=2,
                                  vocab_size=256, partial_rotary_factor=0.5, max_position_embeddings=256)


def _gemma3_config():
    """Gemma 3 gives its full-attention layers another RoPE base than its sliding ones."""
    return transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                         sliding_window=8, max_position_embeddings=256,
                                         layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("build", [_phi_config, _gemma3_config], ids=["partial-rotary", "per-layer-type-rope"])
@pytest.mark.parametrize("lever", [dict(pre_rope=True), dict(codec="kivi:bits=2,group=4,pagerope=true")])
def test_a_rope_the_cache_cannot_undo_is_refused_for_rope_levers(build, lever):
    """``prerope``/``pagerope`` store keys after undoing the model's RoPE with one full-width rotation. Phi's
    partial rotation and Gemma 3's per-layer-type bases were undone with the wrong rotation (Llama's full-width
    RoPE at the config's first base): identity still round-tripped, but lossy codecs compressed keys in a
    frame that is neither pre- nor post-RoPE, silently. Without those levers the cache takes these models."""
    config = build()
    with pytest.raises(SpecError, match="RoPE"):
        KVBackendCache(config, **dict(SMALL, **lever))
    KVBackendCache(config, **SMALL)  # no RoPE lever: nothing to undo


def test_attach_leaves_a_vision_towers_attention_alone():
    """On a vision-language model attach() routes every attention module through the cache's function, the
    vision tower's included: its encoder attention (no ``layer_idx``) crashed with an AttributeError. It now
    runs as before, and generation matches a DynamicCache."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                           num_hidden_layers=2, image_size=28, patch_size=14)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
                                    pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=299,
                                      vision_feature_layer=-1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval().to(DEVICE)
    ids = torch.cat([torch.full((1, 4), 299), torch.randint(1, 256, (1, 6))], 1).to(DEVICE)
    pixels = torch.randn(1, 3, 28, 28).to(DEVICE)

    def run(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True, **cache_argument(model, cache))

    want = run(DynamicCache(config=config.text_config))
    cache = KVBackendCache(config, codec="identity", page_size=4, chunk_pages=1, max_tokens=64)
    cache.attach(model)
    try:
        got = run(cache)
    finally:
        cache.detach(model)
    assert torch.equal(got.sequences, want.sequences)
    assert _largest_gap(got, want) < 1e-4
    assert all(layer.attention_seen for layer in cache.layers)  # the decoder's layers did go through the cache


@pytest.mark.parametrize("repeats", [0, -1])
def test_repeating_rows_no_times_is_refused_before_anything_changes(model, repeats):
    """``batch_repeat_interleave(0)`` freed every row's request and left a cache of no rows, whose next call failed
    far from the cause; now a ValueError, and the rows still serve."""
    ids, cache, exact = _three_rows(model)
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(repeats)
    assert len(cache.request_ids) == 3 and len(cache.engine.request_ids) == 3
    with torch.no_grad():
        got = model(ids[:, :1], **cache_argument(model, cache)).logits
        want = model(ids[:, :1], **cache_argument(model, exact)).logits
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("head_dim", [48, 80, 96])
def test_a_hadamard_rotation_over_a_head_that_is_not_a_power_of_two_is_refused_up_front(head_dim):
    """``vrot=hadamard`` on head sizes such as Phi-2's 80 or Phi-3's 96: the cache was built, and then every
    chunk's encoding failed (a line on stderr, the chunk left in the dense pool), so nothing was ever
    compressed. Refused when the cache is built, by the paged cache as well."""
    from kvbackend.geometry import CacheConfig, Geometry
    from kvbackend.manager import KVCache

    config = transformers.LlamaConfig(hidden_size=2 * head_dim, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=head_dim, num_hidden_layers=2, vocab_size=256)
    with pytest.raises(SpecError, match="power-of-two head_dim"):
        KVBackendCache(config, **dict(SMALL, codec="kivi:bits=2,group=4"), v_rotation="hadamard")
    with pytest.raises(SpecError, match="power-of-two head_dim"):
        KVCache(Geometry(2, 1, head_dim, torch.float32), CacheConfig(codec="kivi:bits=2,group=4,vrot=hadamard",
                                                                    page_size=4, chunk_pages=2))
    KVBackendCache(config, **dict(SMALL, codec="kivi:bits=2,group=4"))  # without the rotation it is served


def test_attached_decode_steps_of_an_eager_model_attend_on_the_pages(monkeypatch):
    """A model on eager attention gets additive masks (zero where visible); once attach() wrapped the eager
    attention, its unpadded decode steps must still go to the paged kernel (no dense read of the sequence) and
    give DynamicCache's logits."""
    from kvbackend.integration.transformers import KVBackendLayer

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                      max_position_embeddings=256, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to(DEVICE)
    assert model.config._attn_implementation == "eager"
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 20)).to(DEVICE)
    cache = KVBackendCache(model.config, codec="identity", page_size=16, chunk_pages=1, max_tokens=64,
                           backend="triton")
    exact = DynamicCache(config=model.config)
    reads = []
    real_read = KVBackendLayer.read
    monkeypatch.setattr(KVBackendLayer, "read", lambda self: reads.append(self.layer_idx) or real_read(self))
    cache.attach(model)
    try:
        with torch.no_grad():
            model(ids[:, :18], **cache_argument(model, cache))
            model(ids[:, :18], **cache_argument(model, exact))
            reads.clear()
            for i in range(18, 20):
                got = model(ids[:, i:i + 1], **cache_argument(model, cache)).logits
                want = model(ids[:, i:i + 1], **cache_argument(model, exact)).logits
                assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())
    finally:
        cache.detach(model)
    assert model.config._attn_implementation == "eager"
    assert reads == []  # no dense read in the decode steps


def test_one_cache_attached_to_two_models_restores_each_to_its_own_attention(model):
    """The attention a model ran before attach() was kept on the cache: attaching the same cache to a second
    model overwrote it, so the first model (Gemma 2, eager: soft-capping) ran SDPA while attached, which
    refuses soft-capping, and detach() left it on SDPA for good."""
    gemma = _gemma2()
    torch.manual_seed(2)
    ids = torch.randint(1, 256, (1, 12)).to(DEVICE)
    with torch.no_grad():
        want = gemma(ids).logits
    cache = KVBackendCache(model.config, **SMALL)
    cache.attach(gemma)
    cache.attach(model)  # the tiny Llama, on SDPA
    try:
        with torch.no_grad():
            attached = gemma(ids, use_cache=False).logits  # the attached function, on Gemma's eager attention
    finally:
        cache.detach(gemma)
        cache.detach(model)
    assert gemma.config._attn_implementation == "eager" and model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        after = gemma(ids).logits
    assert float((attached - want).abs().max()) < 1e-5 and float((after - want).abs().max()) < 1e-5


def test_detaching_one_of_two_models_leaves_the_other_attached(model):
    """detach(model_a) cleared the cache's attached flag and its wish for queries while model_b was still
    attached: model_b's query-aware codec then got no query statistics (a silent quality loss) and its decode
    steps left the pages. Each model now detaches alone; the cache is detached once the last one is."""
    gemma = _gemma2()
    cache = KVBackendCache(model.config, codec="quantwm:centroids=4,group=16,rank=2", page_size=4, chunk_pages=2,
                           max_tokens=64)
    cache.attach(gemma)
    cache.attach(model)
    cache.detach(gemma)
    assert cache.attached and cache.wants_queries
    assert getattr(model, "_kvbackend_cache", None) is cache
    ids = torch.randint(1, 256, (1, 12)).to(DEVICE)
    seen = []
    for layer in cache.layers:
        original = layer.observe_queries
        layer.observe_queries = lambda q, original=original: seen.append(q.shape) or original(q)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert len(seen) == model.config.num_hidden_layers  # the queries still reach the cache
    cache.detach(model)
    assert not cache.attached and not cache.wants_queries


def test_eval_captures_the_keys_and_values_the_model_computes():
    """`kvbackend eval` captures the exact K/V by wrapping the model's attention: it ran SDPA whatever the model
    ran, so with Gemma 2's soft-capping every layer after the first saw other hidden states, and the "exact" K/V
    the codecs were measured against were not the model's. They are now those of a plain forward."""
    from kvbackend.tools.evaluate import capture_exact

    model = _gemma2()
    torch.manual_seed(4)
    ids = torch.randint(1, 256, (1, 24)).to(DEVICE)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_argument(model, exact))
    captured = capture_exact(model, ids)
    assert model.config._attn_implementation == "eager"  # restored
    for layer, (k, v) in enumerate(zip(captured.k, captured.v)):
        want_k, want_v = exact.layers[layer].keys[0], exact.layers[layer].values[0]  # a sliding layer keeps its window
        n = want_k.shape[1]
        assert torch.allclose(k[:, -n:], want_k, atol=1e-5), layer
        assert torch.allclose(v[:, -n:], want_v, atol=1e-5), layer


@pytest.mark.parametrize("build", [_phi_config, _gemma3_config], ids=["partial-rotary", "per-layer-type-rope"])
def test_eval_refuses_rope_levers_on_a_rope_it_cannot_undo(build):
    """`kvbackend eval` undid any model's RoPE with one full-width rotation at one base, so pre-RoPE and
    page-relative specs were measured with keys in a wrong frame on Phi or Gemma 3; such specs are refused, the
    others still checked as before."""
    from kvbackend.rope import rope_not_undoable
    from kvbackend.tools.evaluate import EvalSettings, check_specs, geometry_from_config

    config = build()
    settings = EvalSettings(tokens=64, prefix=64, cont=8, queries=8, page_size=16, chunk_tokens=32)
    unfit = rope_not_undoable(config)
    assert unfit
    for spec in ("kivi:bits=2,group=16,prerope=true", "kivi:bits=2,group=16,pagerope=true",
                 "auto:bpv=2.6,widths=2-3,base=kivi:bits=2;group=16;prerope=true"):
        with pytest.raises(SpecError, match="RoPE is not one"):
            check_specs([spec], settings, geometry_from_config(config), unfit)
    assert check_specs(["kivi:bits=2,group=16", "kivi:bits=2,group=16,sink=4"], settings,
                       geometry_from_config(config), unfit) is False


def test_a_model_that_does_not_call_the_attached_attention_gets_every_token(monkeypatch):
    """A decode step went on the pages once any model had called the attached attention: a second model with its
    own config, or the attached one after `set_attn_implementation("sdpa")`, then attended to the new token alone
    (logits 0.66 apart, another argmax, with a lossless codec). A step is paged only inside a forward call of an
    attached model whose attention is still the attached function; the attached model still takes paged steps."""
    from kvbackend.integration.transformers import KVBackendLayer

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128)
    torch.manual_seed(0)
    attached = transformers.LlamaForCausalLM(config).eval().to(DEVICE)
    other = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval().to(DEVICE)  # its own config: not attached
    other.load_state_dict(attached.state_dict())
    cache = KVBackendCache(config, codec="identity", page_size=16, chunk_pages=1, max_tokens=64, backend="triton")
    cache.attach(attached)
    reference = DynamicCache(config=config)
    reads = []
    real_read = KVBackendLayer.read
    monkeypatch.setattr(KVBackendLayer, "read", lambda self: reads.append(self.layer_idx) or real_read(self))
    ids = torch.randint(1, 128, (1, 20)).to(DEVICE)
    with torch.no_grad():
        attached(ids, past_key_values=cache)
        reads.clear()
        attached(ids[:, :1], past_key_values=cache)
        assert reads == []  # the attached model's step went on the pages (no dense read)
        other(ids, past_key_values=reference)
        other(ids[:, :1], past_key_values=reference)
        for step, model in ((1, other), (2, attached)):
            if step == 2:
                attached.set_attn_implementation("sdpa")  # no longer the attached function
            reads.clear()
            got = model(ids[:, step : step + 1], past_key_values=cache).logits[0, -1]
            assert reads == [0, 1], step  # every token read for the model's own attention
            want = other(ids[:, step : step + 1], past_key_values=reference).logits[0, -1]
            assert float((got - want).abs().max()) < 1e-3, step


def test_a_cache_passed_to_a_model_of_another_layer_count_is_a_clear_error():
    """A cache of 2 layers on a 3-layer model raised transformers' bare IndexError; one of 3 layers on a 2-layer
    model was accepted once, then blamed a failed earlier call."""

    def llama(layers):
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval().to(DEVICE)

    two, three = llama(2), llama(3)
    ids = torch.randint(1, 128, (1, 9)).to(DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match="holds 2 layers and layer 2 called it"):
            three(ids, past_key_values=KVBackendCache(two.config, **SMALL))
        cache = KVBackendCache(three.config, **SMALL)
        two(ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match="built for a model with more layers"):
            two(ids[:, :1], past_key_values=cache)
