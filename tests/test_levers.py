"""Sequence-level levers (sink, pre-RoPE keys, Hadamard-rotated values) and mixed-width KIVI."""

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, SpecError, codecs
from kvbackend.levers import Levers, hadamard
from kvbackend.tools.reconstruct import reconstruct_sequence
from kvbackend.rope import Rotary

GEOM = Geometry(1, 2, 64, torch.float32)


def test_levers_parse_apart_and_round_trip():
    codec = codecs.get("kivi:bits=2,group=32,kbits=4,sink=4,prerope=true,vrot=hadamard")
    assert codec.levers == Levers(sink=4, prerope=True, vrot="hadamard")
    assert codec.spec.key_bits == 4 and codec.spec.value_bits == 2
    again = codecs.get(codec.spec_string)
    assert again.spec == codec.spec and again.levers == codec.levers
    assert codecs.get("fp8").levers == Levers() and codecs.get("fp8").spec_string == "fp8"
    with pytest.raises(SpecError, match="vrot"):
        codecs.get("fp8:vrot=fourier")
    with pytest.raises(SpecError, match="sink"):
        codecs.get("fp8:sink=-1")
    with pytest.raises(SpecError, match="kbits"):
        codecs.get("kivi:kbits=5").layout(GEOM, 32)


def test_hadamard_is_orthonormal():
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    with pytest.raises(SpecError, match="power-of-two"):
        hadamard(48)


def test_levers_with_a_lossless_codec_are_lossless_and_sinks_are_counted():
    rotary = Rotary.default(64, 10000.0)
    positions = torch.arange(100)
    k = rotary.rotate(torch.randn(2, 100, 64), positions).transpose(0, 1).contiguous()  # post-RoPE, [T, H, D]
    v = torch.randn(100, 2, 64)
    plain = codecs.get("identity")
    levered = codecs.get("identity:sink=4,prerope=true,vrot=hadamard")
    base = reconstruct_sequence(plain, k, v, GEOM, 32, 64)
    rec = reconstruct_sequence(levered, k, v, GEOM, 32, 64, rotary)
    # beyond the sinks: de-rotate, rotate back and the Hadamard round trip are exact to float32 rounding
    assert torch.allclose(rec.k[4:], k[4:], atol=1e-4) and torch.allclose(rec.v[4:], v[4:], atol=1e-5)
    assert torch.equal(rec.k[:4], k[:4].half().float())  # sinks stored as fp16
    # 4 sink tokens in fp16 replace 4 tokens in the codec; the codec's pages shrink accordingly
    assert rec.stored_bytes == 4 * 2 * 64 * 2 * 2 + reconstruct_sequence(plain, k[4:], v[4:], GEOM, 32, 64).stored_bytes
    assert base.stored_bytes > 0
    with pytest.raises(ValueError, match="RoPE"):
        reconstruct_sequence(levered, k, v, GEOM, 32, 64)


def test_prerope_helps_per_channel_keys():
    """Post-RoPE keys rotate channel pairs with position, spreading each channel's range; quantizing
    before RoPE (per-channel groups over tokens) gives a smaller key error on structured keys."""
    rotary = Rotary.default(64, 10000.0)
    positions = torch.arange(128)
    pre = (torch.randn(2, 1, 64) * 3 + torch.randn(2, 128, 64) * 0.3)  # strong per-channel offsets
    k = rotary.rotate(pre, positions).transpose(0, 1).contiguous()
    v = torch.randn(128, 2, 64)
    err = {}
    for spec in ("kivi:bits=2,group=32", "kivi:bits=2,group=32,prerope=true"):
        rec = reconstruct_sequence(codecs.get(spec), k, v, GEOM, 32, 128, rotary)
        err[spec] = float((rec.k - k).norm() / k.norm())
    assert err["kivi:bits=2,group=32,prerope=true"] < 0.5 * err["kivi:bits=2,group=32"]


def test_mixed_width_kivi_bytes():
    codec = codecs.get("kivi:bits=2,group=32,kbits=4")
    layout = codec.layout(Geometry(1, 2, 64, torch.float32), 32)
    chunk = codec.encode(torch.randn(64, 2, 64), torch.randn(64, 2, 64), layout)
    # keys 4 + 2*16/32 (fp16 scale+min per channel per 32 tokens), values 2 + 2*16/32: (5 + 3) / 2
    assert chunk.bits_per_value == pytest.approx(4.0)


def test_cache_refuses_sequence_levers():
    with pytest.raises(SpecError, match="sequences"):
        KVCache(Geometry(1, 2, 64), CacheConfig(codec="kivi:bits=2,sink=4", page_size=32))


def test_psac_full_rank_reproduces_keys_up_to_int8_rounding():
    from kvbackend.psac import correct_keys, query_second_moment

    keys = torch.randn(40, 2, 64)
    approx = keys + 0.3 * torch.randn(40, 2, 64)
    queries = torch.randn(6, 100, 64)
    fixed = correct_keys(keys, approx, query_second_moment(queries, 2), rank=64)
    error = (fixed.keys - keys).norm(dim=-1)  # per (token, head)
    coeff_max = (keys - approx).abs().amax() * 8  # |E U| <= ||E|| <= sqrt(64) * max|E|
    assert torch.all(error <= 8 * coeff_max / 127 / 2 * 1.01)  # sqrt(r) * half an INT8 step
    assert float((fixed.keys - keys).norm() / (approx - keys).norm()) < 0.02
    assert fixed.stored_bytes == 40 * 2 * 64 + 40 * 2 * 2 + 2 * 64 * 64 * 2  # int8 rows, fp16 scales, bf16 bases


def test_psac_lowers_query_weighted_error_and_is_causal():
    geometry = Geometry(1, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=gen)
    queries = torch.randn(6, 96, 64, generator=gen) * 0.2 + direction * 3  # queries look one way
    k, v = torch.randn(96, 2, 64, generator=gen), torch.randn(96, 2, 64, generator=gen)
    plain = reconstruct_sequence(codecs.get("kivi:bits=2,group=16"), k, v, geometry, 16, 32, queries=queries)
    psac = reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32, queries=queries)
    logit_error = lambda rec: float(((rec.k - k) @ direction).abs().mean())  # noqa: E731
    assert logit_error(psac) < 0.25 * logit_error(plain)
    assert psac.stored_bytes > plain.stored_bytes
    # Causality: queries after the first chunk's last token never change how that chunk is encoded.
    later = queries.clone()
    later[:, 32:] = torch.randn(6, 64, 64, generator=gen) * 5
    again = reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32, queries=later)
    assert torch.equal(again.k[:32], psac.k[:32])
    assert not torch.equal(again.k[32:], psac.k[32:])
    with pytest.raises(ValueError, match="queries"):
        reconstruct_sequence(codecs.get("kivi:bits=2,group=16,psac=4"), k, v, geometry, 16, 32)
