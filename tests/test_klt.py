"""``klt:`` keys on frozen query-weighted axes (`kvbackend.klt`): packing, widths, the round trip, bad input, and
`kvbackend eval` with the shipped model."""

import math

import pytest
import torch

from kvbackend import codecs
from kvbackend.errors import InvalidKV, SpecError
from kvbackend.klt import (GROUP, KeyBases, KltSpec, encode_layer, pack_widths, parse_klt, reconstruct,
                           unpack_widths, widths)
from kvbackend.rope import Rotary


def test_codes_of_mixed_widths_pack_to_their_bits_and_back():
    gen = torch.Generator().manual_seed(0)
    for tokens, axes in ((1, 1), (7, 5), (65, 13), (130, 64)):
        width = torch.randint(0, 9, (axes,), generator=gen, dtype=torch.uint8)
        codes = (torch.rand(tokens, axes, generator=gen) * (2.0 ** width.float())).floor().long()
        packed = pack_widths(codes, width)
        assert packed.dtype == torch.uint8
        assert packed.numel() == math.ceil(tokens * int(width.sum()) / 8)
        assert torch.equal(unpack_widths(packed, width, tokens), codes)
    # the first code's most significant bit comes first
    assert pack_widths(torch.tensor([[1, 3]]), torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0b11100000]
    with pytest.raises(InvalidKV, match="bytes for"):
        unpack_widths(torch.zeros(3, dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8), 7)


def test_widths_fill_the_budget_by_variance():
    lam = torch.logspace(-4, 2, 2 * 3 * 16).reshape(2, 3, 16)
    previous = -1.0
    for kbits in (1.0, 2.0, 3.5, 5.0):
        b = widths(lam, kbits, 200)
        assert b.shape == lam.shape and int(b.max()) <= 8
        groups = math.ceil(200 / GROUP)
        spent = (float(b.float().sum()) * 200 + float((b > 0).sum()) * groups * 16) / (lam.numel() * 200)
        assert spent <= kbits + 1e-9
        assert spent > kbits - 0.6  # the level is the largest that fits, within a rounding step of one axis group
        assert spent > previous
        previous = spent
        order = lam.flatten().argsort()
        assert torch.all(b.flatten()[order].diff() >= 0)  # a larger variance never gets fewer bits


def _synthetic(layers=2, heads=2, qheads=4, dim=16, tokens=150, seed=0):
    """Keys with very unequal axes and queries that read a few of them, after RoPE at positions 0..T-1."""
    gen = torch.Generator().manual_seed(seed)
    rotary = Rotary.default(dim, 10000.0)
    mix = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0]
    spread = torch.logspace(1, -2, dim)
    k_pre = (torch.randn(layers, heads, tokens, dim, generator=gen) * spread) @ mix.T + 0.3
    q_pre = torch.randn(layers, qheads, tokens, dim, generator=gen) * torch.logspace(0, -1, dim)
    pos = torch.arange(tokens)
    keys = [rotary.rotate(k_pre[i], pos) for i in range(layers)]
    queries = [rotary.rotate(q_pre[i], pos) for i in range(layers)]
    values = torch.randn(layers, tokens, heads, dim, generator=gen)
    return rotary, queries, keys, values


def _kv(keys, values):
    return torch.stack([k.transpose(0, 1) for k in keys]), values


def test_round_trip_counts_every_stored_byte_and_meets_the_key_budget():
    rotary, queries, keys, values = _synthetic()
    bases = KeyBases.fit(queries, keys, rotary)
    k_all, v_all = _kv(keys, values)
    spec = parse_klt("klt:kbits=3,vbits=4,sink=3")
    seq = reconstruct(spec, bases, k_all, v_all, rotary)
    assert seq.k.shape == k_all.shape and seq.v.shape == v_all.shape
    width = widths(bases.lam, spec.kbits, k_all.shape[1])
    stored, key_bytes = 0, 0
    for layer in range(k_all.shape[0]):
        kept = encode_layer(spec, bases, layer, width[layer], k_all[layer], v_all[layer], rotary)
        stored += kept.nbytes
        key_bytes += sum(t.nbytes for t in kept.key_codes) + kept.key_scales.nbytes
        assert kept.key_scales.dtype == torch.float16 and kept.value_scales.dtype == torch.float8_e4m3fn
    assert seq.stored_bytes == stored
    assert 8 * key_bytes / k_all.numel() <= spec.kbits + 0.01  # codes padded to whole bytes per head
    # the sinks come back exact (to fp16), the rest does not
    assert torch.equal(seq.k[:, :3], k_all[:, :3].half().float())
    assert torch.equal(seq.v[:, :3], v_all[:, :3].half().float())
    assert not torch.equal(seq.k[:, 3:], k_all[:, 3:])


def test_more_key_bits_lower_the_error_and_the_logit_error_most():
    rotary, queries, keys, values = _synthetic(seed=1)
    bases = KeyBases.fit(queries, keys, rotary)
    k_all, v_all = _kv(keys, values)
    errors = []
    for kbits in (2.0, 3.0, 4.5, 8.5):
        seq = reconstruct(parse_klt(f"klt:kbits={kbits},sink=0"), bases, k_all, v_all, rotary)
        errors.append(float((seq.k - k_all).norm() / k_all.norm()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.01, errors


def test_a_wider_value_step_changes_the_values_not_the_keys_or_bytes():
    rotary, queries, keys, values = _synthetic(seed=3)
    bases = KeyBases.fit(queries, keys, rotary)
    k_all, v_all = _kv(keys, values)
    plain = reconstruct(parse_klt("klt:kbits=3,vbits=2"), bases, k_all, v_all, rotary)
    wide = reconstruct(parse_klt("klt:kbits=3,vbits=2,vstep=1.3"), bases, k_all, v_all, rotary)
    assert torch.equal(plain.k, wide.k) and plain.stored_bytes == wide.stored_bytes
    assert not torch.equal(plain.v, wide.v)


def test_channel_axes_code_the_weighted_channels_without_rotation():
    rotary, queries, keys, values = _synthetic(seed=4)
    bases = KeyBases.fit(queries, keys, rotary)
    channels = bases.along("channels")
    assert torch.equal(channels.basis[0, 1], torch.eye(16)) and torch.equal(channels.lam, bases.var)
    assert bases.along("principal") is bases
    k_all, v_all = _kv(keys, values)
    errors = {}
    for axes in ("principal", "channels"):
        for kbits in (3.0, 8.5):
            seq = reconstruct(parse_klt(f"klt:kbits={kbits},sink=0,axes={axes}"), bases, k_all, v_all, rotary)
            errors[axes, kbits] = float((seq.k - k_all).norm() / k_all.norm())
    assert errors["channels", 8.5] < 0.01 and errors["channels", 3.0] > errors["channels", 8.5]
    assert errors["channels", 3.0] != errors["principal", 3.0]


def test_bases_fitted_on_one_sequence_serve_another():
    rotary, queries, keys, _ = _synthetic(seed=2)
    _, _, other_keys, other_values = _synthetic(seed=2, tokens=97)  # the same model (mix), other draws
    bases = KeyBases.fit(queries, keys, rotary)
    k_all, v_all = _kv(other_keys, other_values)
    seq = reconstruct(parse_klt("klt:kbits=4"), bases, k_all, v_all, rotary)
    assert float((seq.k - k_all).norm() / k_all.norm()) < 0.1
    assert bases.nbytes == sum(t.nbytes for t in (bases.w, bases.mu, bases.basis, bases.lam, bases.var, bases.var_post))


def test_bad_input_is_refused():
    rotary, queries, keys, values = _synthetic()
    bases = KeyBases.fit(queries, keys, rotary)
    k_all, v_all = _kv(keys, values)
    spec = parse_klt("klt:kbits=3")
    bad = k_all.clone()
    bad[1, 5, 0, 2] = float("nan")
    with pytest.raises(InvalidKV, match="NaN"):
        reconstruct(spec, bases, bad, v_all, rotary)
    bad_v = v_all.clone()
    bad_v[0, 0, 0, 0] = float("inf")
    with pytest.raises(InvalidKV, match="NaN or Inf"):
        reconstruct(spec, bases, k_all, bad_v, rotary)
    with pytest.raises(InvalidKV, match="bases for"):
        reconstruct(spec, bases, k_all[:1], v_all[:1], rotary)
    huge = k_all.clone()
    huge[0, 10] *= 1e6
    with pytest.raises(InvalidKV, match="fp16"):
        reconstruct(spec, bases, huge, v_all, rotary)
    with pytest.raises(InvalidKV, match="448"):
        reconstruct(spec, bases, k_all, v_all * 1000, rotary)
    sink_key = k_all.clone()
    sink_key[0, 1, 0, 0] = 1e5  # a sink token is kept in fp16: refused, never stored as inf
    with pytest.raises(InvalidKV, match="sink token"):
        reconstruct(parse_klt("klt:kbits=3,sink=2"), bases, sink_key, v_all, rotary)
    with pytest.raises(InvalidKV, match="no tokens"):
        reconstruct(spec, bases, k_all[:, :0], v_all[:, :0], rotary)


@pytest.mark.parametrize("text, message", [
    ("klt:kbits=0.1", "out of range"),
    ("klt:vbits=5", "choose one of"),
    ("klt:bits=3", "unknown option"),
    ("klt:kbits=x", "not a valid float"),
    ("rtn:bits=2", "not a klt"),
    ("klt:vstep=1.2,clip=false", "needs clip=true"),
    ("klt:vstep=3", "out of range"),
    ("klt:axes=pca", "not supported"),
])
def test_bad_specs(text, message):
    with pytest.raises(SpecError, match=message):
        parse_klt(text)


def test_a_model_whose_rope_cannot_be_undone_is_refused():
    from kvbackend.tools.evaluate import EvalSettings, check_specs

    settings = EvalSettings(tokens=320, prefix=256, cont=64, queries=64, chunk_tokens=128)
    with pytest.raises(SpecError, match="klt codes keys before RoPE.*partial rotary"):
        check_specs(["klt:kbits=3"], settings, rope_unfit="partial rotary")


def test_the_spec_names_itself_and_is_no_page_codec():
    assert parse_klt("klt:kbits=3.5").spec_string == "klt:kbits=3.5,vbits=3,sink=4,clip=true"
    assert parse_klt("klt:vstep=1.15").spec_string == "klt:kbits=3.5,vbits=3,sink=4,clip=true,vstep=1.15"
    assert KltSpec() == parse_klt("klt:")
    with pytest.raises(SpecError, match="sequence-level format"):
        codecs.get("klt:kbits=3")


@pytest.mark.model
def test_eval_measures_klt_with_bases_from_another_text():
    pytest.importorskip("transformers")
    from pathlib import Path

    from kvbackend.tools.evaluate import EvalSettings, check_specs, evaluate, key_bases_from_text
    from kvbackend.tools.models import load_model

    model, tokenizer = load_model()
    text = (Path(__file__).parent / "data" / "sample.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids
    calib = tokenizer(open("/usr/share/common-licenses/GPL-3").read(), return_tensors="pt").input_ids
    settings = EvalSettings(tokens=320, prefix=256, cont=64, queries=64, chunk_tokens=128)
    assert check_specs(["klt:kbits=3"], settings) is True  # needs a calibration text
    with pytest.raises(ValueError, match="--calibration"):
        evaluate(model, ids, ["klt:kbits=3"], settings)
    bases = key_bases_from_text(model, calib, tokens=512)
    low, high = evaluate(model, ids, ["klt:kbits=2,vbits=2", "klt:kbits=6,vbits=8"], settings, key_bases=bases)
    for r in (low, high):
        assert r.path == "sequence" and r.stored_bytes > 0
        assert math.isclose(r.bpv, 8 * r.stored_bytes / (2 * 30 * 256 * 3 * 64))
    assert low.bpv < high.bpv and low.kl > high.kl and high.kl < 0.01
    assert low.k_nrmse > high.k_nrmse
