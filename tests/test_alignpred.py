"""AlignPred: the error budget holds on every page group, streams are exact and self-checking."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbackend.alignpred import AlignPredCodec, Calibration, CorruptStream, fp8_nrmse, parse_alignpred
from kvbackend.errors import SpecError


def _nrmse(x, y):
    x = x.astype(np.float64)
    return math.sqrt(float(((x - y) ** 2).sum()) / float((x**2).sum()))


def _structured(rng, L, T, H, D):
    """KV-like data: per-channel offsets and scales (outlier channels), slow drift over tokens."""
    scale = np.exp(rng.normal(0, 1.0, (L, 1, H, D)))
    offset = rng.normal(0, 2.0, (L, 1, H, D))
    drift = np.cumsum(rng.normal(0, 0.1, (L, T, H, D)), axis=1)
    return (offset + scale * (rng.normal(0, 1, (L, T, H, D)) + drift)).astype(np.float32)


def _check(codec, k, v):
    blob = codec.encode(k, v)
    kh, vh = codec.decode(blob)
    bound_k, bound_v = codec.max_errors(blob)
    assert kh.shape == k.shape and vh.shape == v.shape
    assert np.abs(k.astype(np.float64) - kh).max() <= bound_k
    assert np.abs(v.astype(np.float64) - vh).max() <= bound_v
    for x, xh, report in ((k, kh, codec.last_report[0]), (v, vh, codec.last_report[1])):
        budget = codec.spec.error.value * (fp8_nrmse(x) if codec.spec.error.relative_to_fp8 else 1.0)
        assert _nrmse(x, xh) <= max(budget, 1e-6) * (1 + 1e-9)
        assert report.nrmse <= report.target
    return blob


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 4), T=st.sampled_from([1, 7, 64, 65]), H=st.integers(1, 3), D=st.sampled_from([4, 16, 64]),
       error=st.sampled_from(["0.5x", "1x", "2x", "8x", "0.01", "0.2"]), predict=st.sampled_from(["mean", "prev"]),
       align=st.sampled_from(["none", "heads", "layers"]), kind=st.sampled_from(["random", "structured"]),
       seed=st.integers(0, 2**16))
def test_budget_holds_on_every_group(L, T, H, D, error, predict, align, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "random":
        k = rng.standard_normal((L, T, H, D)).astype(np.float32) * 3
        v = rng.standard_t(3, (L, T, H, D)).astype(np.float32)
    else:
        k, v = _structured(rng, L, T, H, D), _structured(rng, L, T, H, D)
    _check(AlignPredCodec(f"alignpred:error={error},predict={predict},align={align}"), k, v)


@pytest.mark.parametrize("quant,seed,skip", [("trellis", 1, 1), ("lattice", 2806, 2)])
def test_budget_holds_where_the_error_does_not_fall_with_the_step(quant, seed, skip):
    """Twelve or sixteen values on which the error rises as the step falls over the search's passes: the step search
    alone never met 0.2 there (found on a GPU machine's run of the test above); the codec must still meet it."""
    rng = np.random.default_rng(seed)
    shapes = [(1, 1, 3, 4), (1, 1, 3, 4)] if quant == "trellis" else [(1, 1, 3, 4), (1, 1, 1, 4), (2, 1, 2, 4)]
    x = [_structured(rng, *shape) for shape in shapes][skip]
    _check(AlignPredCodec(f"alignpred:error=0.2,predict=mean,quant={quant}"), x, x)


@pytest.fixture(scope="module")
def real_kv():
    """Keys and values of the shipped SmolLM2 model on a shipped text, [L, T, H, D]."""
    torch = pytest.importorskip("torch")
    from kvbackend.tools.evaluate import capture_exact
    from kvbackend.tools.models import load_model

    model, tok = load_model()
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    cap = capture_exact(model, ids)
    k = torch.stack([x.transpose(0, 1) for x in cap.k]).float().numpy()
    v = torch.stack([x.transpose(0, 1) for x in cap.v]).float().numpy()
    return k, v


@pytest.mark.model
def test_budget_and_bytes_on_real_kv(real_kv):
    k, v = real_kv
    bpv = {}
    for error in (1, 2, 4, 8):
        codec = AlignPredCodec(f"alignpred:error={error}x")
        stored = sum(len(_check(codec, k[:, s : s + 64], v[:, s : s + 64])) for s in range(0, k.shape[1], 64))
        bpv[error] = 8 * stored / (2 * k.size)  # from the bytes of every stream kept
    # A uniform lattice saves about one bit per value each time its step doubles (high-rate theory);
    # headers and side information keep the saving a little under one bit.
    for lo, hi in ((1, 2), (2, 4), (4, 8)):
        assert 0.6 < bpv[lo] - bpv[hi] < 1.1, bpv
    assert bpv[1] < 6.0, bpv  # FP8-level error at well under FP8's 8 bits


@pytest.mark.model
def test_frozen_calibration_round_trip_and_mismatch(real_kv):
    k, v = real_kv
    cal = Calibration.fit(k[:, :128], v[:, :128])
    codec = AlignPredCodec("alignpred:error=1x,align=layers,fit=frozen", cal)
    blob = _check(codec, k[:, 128:192], v[:, 128:192])
    other = AlignPredCodec("alignpred:error=1x,align=layers,fit=frozen", Calibration.fit(k[:, 64:128], v[:, 64:128]))
    with pytest.raises(CorruptStream, match="calibration"):
        other.decode(blob)
    with pytest.raises(ValueError, match="Calibration"):
        AlignPredCodec("alignpred:error=1x,align=layers,fit=frozen")


def test_round_trip_is_deterministic():
    rng = np.random.default_rng(1)
    k, v = _structured(rng, 3, 64, 2, 16), _structured(rng, 3, 64, 2, 16)
    codec = AlignPredCodec("alignpred:error=1x,align=heads")
    a, b = codec.encode(k, v), codec.encode(k, v)
    assert a == b
    k1, v1 = codec.decode(a)
    k2, v2 = codec.decode(b)
    assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


def test_corrupted_streams_raise():
    rng = np.random.default_rng(2)
    k, v = _structured(rng, 2, 64, 2, 16), _structured(rng, 2, 64, 2, 16)
    codec = AlignPredCodec("alignpred:error=1x")
    blob = codec.encode(k, v)
    for trial in range(200):
        damaged = bytearray(blob)
        pos = int(rng.integers(0, len(blob)))
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CorruptStream):
            codec.decode(bytes(damaged))
    with pytest.raises(CorruptStream):
        codec.decode(blob[: len(blob) // 2])
    with pytest.raises(CorruptStream):
        codec.decode(b"not a stream at all")


def test_zero_and_constant_groups():
    codec = AlignPredCodec("alignpred:error=1x")
    z = np.zeros((2, 64, 1, 8), np.float32)
    kh, vh = codec.decode(codec.encode(z, z))
    assert np.array_equal(kh, z) and np.array_equal(vh, z)
    c = np.full((1, 64, 1, 8), 0.5, np.float32)  # exact in FP8: the budget falls back to a tight absolute one
    kh, _ = codec.decode(codec.encode(c, c))
    assert np.abs(kh - c).max() <= 1e-5


@pytest.mark.parametrize("spec, message", [
    ("alignpred", "error budget"),
    ("alignpred:error=0", "> 0"),
    ("alignpred:error=abc", "NRMSE"),
    ("alignpred:error=1x,align=rows", "align"),
    ("alignpred:error=1x,fit=frozen", "align=layers"),
    ("alignpred:error=1x,speed=9", "unknown"),
])
def test_bad_specs(spec, message):
    with pytest.raises(SpecError, match=message):
        parse_alignpred(spec)


def test_bad_input():
    codec = AlignPredCodec("alignpred:error=1x")
    with pytest.raises(ValueError, match="layers, tokens, heads"):
        codec.encode(np.zeros((4, 8)), np.zeros((4, 8)))
    bad = np.zeros((1, 4, 1, 4), np.float32)
    bad[0, 1, 0, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(bad, bad)


@pytest.mark.parametrize("quant", ["trellis", "lattice"])
def test_both_quantizers_keep_the_budget_and_name_themselves(quant):
    rng = np.random.default_rng(3)
    k, v = _structured(rng, 3, 64, 2, 16), _structured(rng, 3, 64, 2, 16)
    codec = AlignPredCodec(f"alignpred:error=1x,quant={quant}")
    assert codec.spec_string.endswith(f"quant={quant}")
    from kvbackend.alignpred.stream import unpack

    blob = _check(codec, k, v)
    assert unpack(blob)["spec"].size == (7 if quant == "trellis" else 6)  # lattice streams keep their format
    # a stream decodes by what it says, whatever quantizer the decoding codec was built with
    other = AlignPredCodec(f"alignpred:error=1x,quant={'lattice' if quant == 'trellis' else 'trellis'}")
    for a, b in zip(codec.decode(blob), other.decode(blob)):
        assert np.array_equal(a, b)
    with pytest.raises(SpecError, match="quant"):
        parse_alignpred("alignpred:error=1x,quant=vector")


def test_trellis_spends_fewer_bytes_than_the_lattice_at_the_same_budget():
    """About 1 dB less squared error at the same index entropy (16-state trellis, high rate): at equal NRMSE
    the trellis stores about 0.1-0.2 bit per value less on Gaussian-like rows."""
    rng = np.random.default_rng(4)
    k, v = _structured(rng, 4, 64, 2, 64), _structured(rng, 4, 64, 2, 64)
    sizes = {q: len(_check(AlignPredCodec(f"alignpred:error=1x,quant={q}"), k, v)) for q in ("trellis", "lattice")}
    saved = 8 * (sizes["lattice"] - sizes["trellis"]) / (2 * k.size)
    assert 0.08 < saved < 0.25, sizes


def test_trellis_rows_decode_to_the_encoders_values():
    from kvbackend.alignpred import trellis

    rng = np.random.default_rng(5)
    rows = rng.normal(0, 7, (50, 33))
    index, values = trellis.quantize(rows, 0.5)
    assert np.array_equal(trellis.dequantize(index, 0.5), values)
    # every value's error stays within two fine steps (the farther subset point of an allowed pair)
    assert np.abs(rows - values).max() <= 2 * 0.5
    # and the trellis beats rounding to the allowed points' spacing (2 steps): about 1.2 dB (x 1.32)
    plain = np.square(rows - np.rint(rows / 1.0) * 1.0).mean()
    assert np.square(rows - values).mean() < plain / 1.2
    # zero stays reachable in both quantizers: tiny values between large ones (which steer the path through
    # Q1 states) mostly stay zero. Plain TCQ's odd-multiple quantizer gave them +-1 step in Q1 states
    # (measured 0.255 step^2 of squared error here against 0.044 now), which quadrupled KL at 4x FP8's NRMSE.
    mixed = rng.normal(0, 0.05, (200, 64))
    mixed[:, ::2] = rng.normal(0, 20, (200, 32))
    index, values = trellis.quantize(mixed, 0.5)
    assert np.square(mixed - values)[:, 1::2].mean() < 0.1 * 0.5**2


def test_trellis_compiled_and_numpy_paths_agree(monkeypatch):
    from kvbackend import fastquant
    from kvbackend.alignpred import trellis

    rng = np.random.default_rng(6)
    rows = rng.standard_t(3, (40, 65)) * 5  # heavy tails, an odd row length
    index, values = trellis.quantize(rows, 0.37)
    numpy_index, numpy_values = trellis._quantize_numpy(rows, 0.37)
    assert np.array_equal(index, numpy_index) and np.array_equal(values, numpy_values)
    monkeypatch.setattr(fastquant, "_usable", lambda: False)
    assert np.array_equal(trellis.dequantize(index, 0.37), values)


def test_specs_built_in_python_are_checked_too():
    from kvbackend.alignpred.spec import AlignPredSpec, ErrorBudget

    with pytest.raises(SpecError, match="quant"):
        AlignPredSpec(ErrorBudget(1.0, True), quant="Trellis")
    with pytest.raises(SpecError, match="align"):
        AlignPredSpec(ErrorBudget(1.0, True), align="rows")


@pytest.mark.parametrize("quant", ["trellis", "lattice"])
@pytest.mark.parametrize("case", ["huge at 100x", "constant at 1e-7", "sparse exact in fp8"])
def test_edge_groups_encode_to_streams_that_decode(quant, case):
    """Found by an adversarial pass: at 100x every trellis index rounded to zero and the step grew past float32's
    range (a stream its own decoder refused); an exact first pass divided by a zero error; a group FP8 stores
    exactly fell under the trellis's index floor."""
    rng = np.random.default_rng(8)
    if case == "huge at 100x":
        spec, k = "error=100x", (rng.standard_normal((2, 8, 2, 8)) * 1e15).astype(np.float32)
    elif case == "constant at 1e-7":
        spec, k = "error=1e-7", np.full((1, 16, 1, 8), 1.2345, np.float32)
    else:
        spec, k = "error=1x", np.zeros((2, 64, 2, 8), np.float32)
        k[0, 3, 1, 2] = 1.0
    _check(AlignPredCodec(f"alignpred:{spec},quant={quant}"), k, k * 2)


@pytest.mark.model
def test_eval_measures_alignpred_as_a_whole_sequence():
    """`kvbackend eval` codes alignpred: over every layer of the prefix at once (not through the paged cache), and
    reports bytes, errors and KL of that coding."""
    pytest.importorskip("transformers")
    import math
    from pathlib import Path

    from kvbackend.tools.evaluate import EvalSettings, evaluate
    from kvbackend.tools.models import load_model

    model, tokenizer = load_model()
    ids = tokenizer((Path(__file__).parent / "data" / "sample.txt").read_text(), return_tensors="pt").input_ids
    settings = EvalSettings(tokens=320, prefix=256, cont=64, queries=64, chunk_tokens=128)
    tight, loose = evaluate(model, ids, ["alignpred:error=1x", "alignpred:error=8x"], settings)
    for r in (tight, loose):
        assert r.path == "sequence" and r.stored_bytes > 0
        assert math.isclose(r.bpv, 8 * r.stored_bytes / (2 * 30 * 256 * 3 * 64))
    assert tight.bpv > loose.bpv and tight.k_nrmse < loose.k_nrmse and tight.kl < 0.01
