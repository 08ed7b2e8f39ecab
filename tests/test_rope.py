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
