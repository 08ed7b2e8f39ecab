"""transformers integration on a small Llama with random weights: runs everywhere, CUDA included
(`make gpu-test`), where the shipped model is not installed."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvbackend.integration.transformers import KVBackendCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, num_hidden_layers=2, vocab_size=256, max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return LlamaForCausalLM(config).to(torch.float32).eval()


def _forward(model, ids, cache):
    keyword = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    return model(ids, use_cache=True, **{keyword: cache})


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
    keyword = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    return model(ids, attention_mask=mask, use_cache=True, **{keyword: cache}).logits
