"""transformers integration on the shipped SmolLM2 model (marked `model`; runs in `make test`)."""

import json
import math

import pytest
import torch

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvbackend.integration.transformers import KVBackendCache  # noqa: E402

PROMPTS = ["The capital of France is", "Write one sentence about the sea. The waves of the ocean are",
           "def fibonacci(n):"]


@pytest.fixture(scope="session")
def model_and_tokenizer():
    from kvbackend.tools.models import load_model

    return load_model()


def encode(tokenizer, prompts):
    tokenizer.padding_side = "left"
    return tokenizer(prompts, return_tensors="pt", padding=True)


def generate(model, batch, cache, n=12, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, cache=cache,
                             pad_token_id=model.config.pad_token_id, **kw)
    return out[:, batch["input_ids"].shape[1] :]


@pytest.mark.parametrize("options", [
    dict(),  # nothing completes a chunk: all dense
    dict(page_size=4, chunk_pages=2),  # chunks complete during prefill and decode
    dict(page_size=4, chunk_pages=1, sink=3, pre_rope=True),  # sink + pre-RoPE keys, re-rotated on read
])
def test_lossless_codec_matches_dynamic_cache(model_and_tokenizer, options):
    model, tokenizer = model_and_tokenizer
    for prompts in (PROMPTS[:1], PROMPTS[1:2], PROMPTS[:2]):  # single prompts, then a padded batch of 2
        batch = encode(tokenizer, prompts)
        expected = generate(model, batch, DynamicCache(config=model.config))
        cache = KVBackendCache(model.config, codec="identity", **options)
        got = generate(model, batch, cache)
        assert torch.equal(got, expected), (prompts, options)
        if options:
            assert cache.engine.stats().packed_pages_used > 0  # the packed path was really exercised


def test_beam_search_matches_dynamic_cache(model_and_tokenizer):
    """Beam search reorders rows every step: forks share packed pages, copy the active chunk."""
    model, tokenizer = model_and_tokenizer
    batch = encode(tokenizer, PROMPTS[:2])
    expected = generate(model, batch, DynamicCache(config=model.config), n=8, num_beams=2)
    cache = KVBackendCache(model.config, codec="identity", page_size=4, chunk_pages=2)
    calls = []
    reselect = cache._reselect
    cache._reselect = lambda rows: (calls.append(rows), reselect(rows))
    got = generate(model, batch, cache, n=8, num_beams=2)
    assert torch.equal(got, expected)
    assert calls, "beam search never reordered the cache: the test exercised nothing"
    assert len(cache.request_ids) == 4  # 2 prompts x 2 beams, old rows freed
    cache.engine.check()
    with pytest.raises(ValueError, match="cannot drop tokens"):
        cache.crop(1)


def test_compressed_generation_runs_and_stores_less(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    batch = encode(tokenizer, PROMPTS)
    for spec in ("fp8", "kivi:bits=2,group=16", "qvg:centroids=4,group=32"):
        cache = KVBackendCache(model.config, codec=spec, page_size=16, chunk_pages=1)
        tokens = generate(model, batch, cache, n=6)
        assert tokens.shape == (3, 6)
        held = cache.kv_bytes()
        assert 0 < held["packed"] and held["stored"] < held["exact"]
    torch.manual_seed(0)
    sampled = generate(model, batch, KVBackendCache(model.config, codec="kivi:bits=4,group=16", page_size=16,
                                                    chunk_pages=1), n=5, do_sample=True, top_k=20)
    assert sampled.shape == (3, 5)


@pytest.fixture(scope="session")
def sample_ids(model_and_tokenizer):
    from pathlib import Path

    _, tokenizer = model_and_tokenizer
    text = (Path(__file__).parent / "data" / "sample.txt").read_text()
    return tokenizer(text, return_tensors="pt").input_ids


SMALL = dict(tokens=320, prefix=256, cont=64, queries=64, chunk_tokens=128)


def test_eval_kl_matches_independent_computation(model_and_tokenizer, sample_ids):
    """fp8 KL from `evaluate` equals a direct computation: cast the exact prefix K/V to fp8 and score."""
    from kvbackend.tools.evaluate import EvalSettings, evaluate

    model, _ = model_and_tokenizer
    (result,) = evaluate(model, sample_ids, ["fp8"], EvalSettings(**SMALL))
    ids = sample_ids[:, :320]
    with torch.no_grad():
        exact = DynamicCache(config=model.config)
        model(ids[:, :256], cache=exact)
        fp8 = DynamicCache(config=model.config)
        for i, layer in enumerate(exact.layers):
            fp8.update(layer.keys.to(torch.float8_e4m3fn).float(), layer.values.to(torch.float8_e4m3fn).float(), i)
        ref = model(ids[:, 256:320], cache=exact).logits[0].log_softmax(-1)
        test = model(ids[:, 256:320], cache=fp8).logits[0].log_softmax(-1)
    kl = float((ref.exp() * (ref - test)).sum(-1).mean())
    assert result.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert result.kl > 0
    assert result.top1_agree == pytest.approx(float((ref.argmax(-1) == test.argmax(-1)).float().mean()))


QUANTWM = "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true"


def test_paged_eval_agrees_with_the_simulation(model_and_tokenizer, sample_ids):
    """`kvbackend eval` measures through the paged KVCache; the sequence-level simulation stays beside it as
    a cross-check. Without sinks both encode the same chunks: every figure is equal. With sinks the paged
    cache encodes the sink tokens in the first chunk too (the simulation cuts them out first) and every
    chunk's slot holds sink fields: close figures, and exactly that many more bytes."""
    from kvbackend.tools.evaluate import EvalSettings, evaluate

    model, _ = model_and_tokenizer
    specs = ["kivi:bits=2,group=32", "qvg", "kivi:bits=2,group=32,kbits=4,prerope=true,vrot=hadamard", QUANTWM]
    results = evaluate(model, sample_ids, specs, EvalSettings(**SMALL, path="both"))
    figures = ("bpv", "k_nrmse", "v_nrmse", "kl", "top1_agree")
    for r in results[:3]:
        assert r.path == "both"
        for key in figures:
            assert getattr(r, key) == pytest.approx(r.sim[key], rel=1e-5, abs=1e-7), (r.spec, key)
    levered = results[3]
    assert levered.k_nrmse == pytest.approx(levered.sim["k_nrmse"], rel=0.05)
    assert levered.v_nrmse == pytest.approx(levered.sim["v_nrmse"], rel=0.05)
    assert levered.kl == pytest.approx(levered.sim["kl"], rel=0.3, abs=0.01)
    layers, heads, head_dim = 30, 3, 64
    chunks = SMALL["prefix"] // SMALL["chunk_tokens"]
    extra = (chunks - 1) * 4 * heads * head_dim * 2 * 2 * layers  # unused sink fields of the later chunks (fp16)
    values = SMALL["prefix"] * layers * heads * head_dim * 2
    assert levered.bpv - levered.sim["bpv"] == pytest.approx(8 * extra / values, rel=1e-6)


def test_eval_cli_writes_json_and_png(model_and_tokenizer, tmp_path):
    from pathlib import Path

    from kvbackend.tools.cli import main
    from kvbackend.tools.evaluate import COLUMNS

    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    text = str(Path(__file__).parent / "data" / "sample.txt")
    code = main(["eval", "--text", text, "--codec", "identity", "--codec", "fp16", "--codec", "fp8",
                 "--codec", "kivi:bits=2,group=32", "--codec", "qvg",
                 "--codec", "kivi:bits=2,group=32,kbits=4,sink=4,prerope=true,vrot=hadamard",
                 "--codec", QUANTWM, "--codec", "auto:bpv=3.2", "--tokens", "320", "--prefix", "256",
                 "--continue", "64", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    data = json.loads(out_json.read_text())
    rows = {row["spec"]: row for row in data["codecs"]}
    levered = "kivi:bits=2,group=32,kbits=4,sink=4,prerope=true,vrot=hadamard"
    assert list(rows) == ["identity", "fp16", "fp8", "kivi:bits=2,group=32", "qvg", levered, QUANTWM, "auto:bpv=3.2"]
    # QSAC + sparse PSAC rows + levers: fewer bytes than KIVI-2 (every PSAC row, index and centroid
    # counted) and a lower next-token KL
    assert rows[QUANTWM]["bpv"] < rows["kivi:bits=2,group=32"]["bpv"]
    assert rows[QUANTWM]["kl"] < rows["kivi:bits=2,group=32"]["kl"]
    auto = rows["auto:bpv=3.2"]
    assert len(auto["plan"]) == 30 and auto["bpv"] <= 3.2 and all(r["plan"] is None for r in rows.values() if r is not auto)
    # 4-bit pre-RoPE keys, sinks and rotated values: more bytes than KIVI-2, less KL
    assert rows[levered]["bpv"] > rows["kivi:bits=2,group=32"]["bpv"]
    assert rows[levered]["kl"] < rows["kivi:bits=2,group=32"]["kl"]
    for row in rows.values():
        for key in (*COLUMNS, "ppl_ref", "spec"):
            assert key in row
        assert all(math.isfinite(row[k]) for k in (*COLUMNS, "ppl_ref"))
    lossless = rows["identity"]
    assert lossless["k_nrmse"] == 0 and lossless["v_nrmse"] == 0 and lossless["kl"] == 0
    assert lossless["top1_shift"] == 0 and lossless["attn_out_err"] == 0 and lossless["top1_agree"] == 1
    # fp16 of a float32 model: half-ulp error 2^-11 relative, so zero to three decimals.
    assert rows["fp16"]["k_nrmse"] < 1e-3 and rows["fp16"]["kl"] < 1e-4 and rows["fp16"]["bpv"] == 16
    assert rows["kivi:bits=2,group=32"]["bpv"] == pytest.approx(3.0)
    assert rows["kivi:bits=2,group=32"]["kl"] > rows["fp8"]["kl"] > rows["fp16"]["kl"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_rejects_short_text(model_and_tokenizer, sample_ids):
    from kvbackend.tools.evaluate import EvalSettings, evaluate

    model, _ = model_and_tokenizer
    with pytest.raises(ValueError, match="tokens"):
        evaluate(model, sample_ids[:, :100], ["fp8"], EvalSettings(**SMALL))


def test_demo_runs(model_and_tokenizer, capsys):
    from kvbackend.tools.cli import main

    assert main(["demo", "--max-new-tokens", "3", "--codec", "kivi:bits=2,group=16", "--prompt", "Hello",
                 "--prompt", "Name three colours."]) == 0
    out = capsys.readouterr().out
    assert "kivi:bits=2,group=16" in out and "compression" in out and "exact (DynamicCache)" in out


def test_eval_cli_bad_input_is_a_message_not_a_traceback(model_and_tokenizer, tmp_path, capsys):
    from pathlib import Path

    from kvbackend.tools.cli import main

    text = str(Path(__file__).parent / "data" / "sample.txt")
    assert main(["eval", "--text", text, "--codec", "zip:bits=2"]) == 2
    assert "unknown codec 'zip'" in capsys.readouterr().err
    assert main(["eval", "--text", str(tmp_path / "missing.txt"), "--codec", "fp8"]) == 2
    assert "missing.txt" in capsys.readouterr().err
    # a budget the narrowest widths cannot meet, found after the model ran
    assert main(["eval", "--text", text, "--codec", "auto:bpv=1.0", "--tokens", "320", "--prefix", "256",
                 "--continue", "64"]) == 2
    assert "cannot be met" in capsys.readouterr().err


def test_plan_from_eval_runs_in_the_cache(model_and_tokenizer):
    """A per-layer plan with the eval's levers (sink, pre-RoPE keys, rotated values) stores in each
    layer what `kvbackend eval` measured for that layer's spec."""
    from kvbackend import Geometry, codecs
    from kvbackend.tools.reconstruct import reconstruct_sequence
    from kvbackend.rope import rotary_from_config

    model, tokenizer = model_and_tokenizer
    layers = model.config.num_hidden_layers
    plan = [f"kivi:group=16,kbits={4 if layer % 3 == 0 else 2},vbits=2,sink=4,prerope={layer % 2 == 0},"
            f"vrot={'hadamard' if layer % 4 < 2 else 'none'}" for layer in range(layers)]  # levers differ by layer
    text = " ".join(PROMPTS) * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : 4 + 64]  # sink + two chunks of 32
    assert ids.shape[1] == 68
    cache = KVBackendCache.from_plan(model.config, plan, page_size=16, chunk_pages=2)
    assert [(x.sink, x.pre_rope, x.v_rotation) for x in cache.layers[:4]] == [
        (4, True, "hadamard"), (4, False, "hadamard"), (4, True, "none"), (4, False, "none")]
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids, cache=exact, use_cache=True)
    assert len({lay.page_bytes for lay in cache.engine.layouts}) == 2  # two layouts really in use
    assert cache.engine.stats().packed_tokens == 64
    rotary = rotary_from_config(model.config)
    for layer in range(layers):
        k, v = exact.layers[layer].keys[0].transpose(0, 1), exact.layers[layer].values[0].transpose(0, 1)
        geometry = Geometry(layers, k.shape[1], k.shape[2], k.dtype)
        rec = reconstruct_sequence(codecs.get(plan[layer]), k, v, geometry, 16, 32, rotary)
        got_k, got_v = (x[0].transpose(0, 1) for x in cache.layers[layer]._gather())
        for got, want, exact_x in ((got_k, rec.k, k), (got_v, rec.v, v)):
            # the eval's reconstruction, not the exact tensor: a rare code flips where the rotation's or
            # RoPE's float rounding order differs, ten times below the codec's own error
            off = float((got - want).norm() / want.norm())
            assert off < 0.1 * float((got - exact_x).norm() / exact_x.norm()), layer


def test_plan_errors_are_clear(model_and_tokenizer):
    from kvbackend.errors import SpecError

    model, _ = model_and_tokenizer
    with pytest.raises(SpecError, match="same sink"):
        KVBackendCache.from_plan(model.config, ["kivi:sink=4"] + ["kivi"] * (model.config.num_hidden_layers - 1))
    with pytest.raises(SpecError, match="psac"):
        KVBackendCache.from_plan(model.config, ["kivi:psac=4"] * model.config.num_hidden_layers)
    with pytest.raises(SpecError, match="per-layer plan of 2 specs"):
        KVBackendCache(model.config, codec=["kivi", "kivi"])
    with pytest.raises(SpecError, match="vrot"):
        KVBackendCache(model.config, v_rotation="random")
