import torch

from kvbackend.rope import Rotary


def test_derotate_then_rotate_is_identity():
    rotary = Rotary.default(64, 100000.0)
    x = torch.randn(3, 50, 64)
    positions = torch.arange(7, 57)
    pre = rotary.derotate(x, positions)
    assert torch.allclose(rotary.rotate(pre, positions), x, atol=1e-5)  # float32 round trip


def test_matches_transformers_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = Rotary.default(64, 10000.0)
    k = torch.randn(1, 2, 9, 64)
    positions = torch.arange(3, 12)
    freqs = positions[:, None].float() * rotary.inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    _, expected = apply_rotary_pos_emb(k, k, emb.cos()[None], emb.sin()[None])
    assert torch.allclose(rotary.rotate(k, positions), expected, atol=1e-6)


def test_scaled_rope_inverts():
    rotary = Rotary(torch.rand(16), scaling=1.3)
    x = torch.randn(4, 32)
    positions = torch.arange(4)
    assert torch.allclose(rotary.derotate(rotary.rotate(x, positions), positions), x, atol=1e-5)


def test_a_rope_no_cache_can_undo_is_refused_when_built():
    """Before: a cache took any Rotary; with inv_freq of another head size or scaling=0 every chunk's encode failed
    (logged only, blamed on NaN K/V) and the chunks stayed dense until the pool was full."""
    import pytest

    from kvbackend import CacheConfig, Geometry, KVCache
    from kvbackend.errors import SpecError

    for inv_freq, scaling in ((torch.rand(16), 0.0), (torch.rand(16), float("nan")), (torch.rand(16), -1.0),
                              (torch.tensor([1.0, float("nan")]), 1.0), (torch.rand(4, 4), 1.0),
                              (torch.arange(8), 1.0), (torch.rand(16), True)):
        with pytest.raises(ValueError, match="Rotary"):
            Rotary(inv_freq, scaling)
    config = CacheConfig(codec="kivi:group=8,prerope=true", page_size=8, chunk_pages=2, dense_pages=4, packed_pages=8)
    with pytest.raises(SpecError, match="32 frequencies, for a head_dim of 64; the model's head_dim is 32"):
        KVCache(Geometry(1, 2, 32, torch.float32), config, rotary=Rotary.default(64, 10000.0))
    cache = KVCache(Geometry(1, 2, 32, torch.float32), config, rotary=Rotary.default(32, 10000.0))
    rid, _ = cache.add_request()
    cache.append(rid, 0, torch.randn(16, 2, 32), torch.randn(16, 2, 32))
    assert cache.page_table(rid).packed  # the chunk is packed


def test_frequencies_are_the_tensor_read_once():
    """`Rotary.frequencies`: the float64 values of ``inv_freq``, the same tuple on every call (no read per call)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    rotary = Rotary(inv)
    got = rotary.frequencies()
    assert got == tuple(inv.double().tolist()) and len(got) == 8
    assert rotary.frequencies() is got
