"""transformers integration on the shipped SmolLM2 model (marked `model`; runs in `make test`)."""

import json
import math

import pytest
import torch

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvbackend.integration.transformers import KVBackendCache  # noqa: E402
from kvbackend.depth import layer_specs  # noqa: E402
from kvbackend.spec import RECOMMENDED_SPEC  # noqa: E402

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


def test_eval_plans_auto_specs_on_another_text(model_and_tokenizer, sample_ids):
    """``plan_ids``: an ``auto:`` spec is planned on another text's prefix (a plan made once for the model), so
    text A evaluated with text B's plan gets exactly the plan B gets on its own, and B's plan is served on A."""
    from kvbackend.tools.evaluate import EvalSettings, evaluate

    model, _ = model_and_tokenizer
    a, b = sample_ids[:, :320], sample_ids[:, -320:]
    spec = ["auto:bpv=3.2"]
    (own_a,) = evaluate(model, a, spec, EvalSettings(**SMALL))
    (own_b,) = evaluate(model, b, spec, EvalSettings(**SMALL))
    (a_with_b,) = evaluate(model, a, spec, EvalSettings(**SMALL), plan_ids=b)
    assert own_a.plan != own_b.plan  # the two prefixes plan differently, so the test can tell them apart
    assert a_with_b.plan == own_b.plan
    assert a_with_b.ppl_ref == pytest.approx(own_a.ppl_ref)  # still scored on A
    with pytest.raises(ValueError, match="plan text"):
        evaluate(model, a, spec, EvalSettings(**SMALL), plan_ids=b[:, :100])


QUANTWM = "quantwm:kchannel=64,rank=4,keep=0.0625,centroids=4,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true"


def test_paged_eval_agrees_with_the_simulation(model_and_tokenizer, sample_ids):
    """`kvbackend eval` measures through the paged KVCache; the sequence-level simulation stays beside it as
    a cross-check. Both put every token on the same pages from position 0, keep the sinks out of the
    codec and count their fp16 copy once per chunk: every figure is equal, levers and PSAC rows included."""
    from kvbackend.tools.evaluate import EvalSettings, evaluate

    model, _ = model_and_tokenizer
    specs = ["kivi:bits=2,group=32", "qvg", "kivi:bits=2,group=32,kbits=4,prerope=true,vrot=hadamard", QUANTWM,
             QUANTWM.replace("prerope=true", "pagerope=true")]
    results = evaluate(model, sample_ids, specs, EvalSettings(**SMALL, path="both"))
    figures = ("bpv", "k_nrmse", "v_nrmse", "kl", "top1_agree")
    for r in results:
        assert r.path == "both"
        for key in figures:
            assert getattr(r, key) == pytest.approx(r.sim[key], rel=1e-4, abs=1e-6), (r.spec, key)


def test_eval_cli_runs_seeded_codecs_per_seed(model_and_tokenizer, tmp_path):
    """`--seeds 2`: qvg runs with k-means seeds 0 and 1 (other centroids, the same bytes), fp8 once, and the
    summary is the mean and range of each spec's runs."""
    from pathlib import Path

    from kvbackend.tools.cli import main

    out = tmp_path / "seeds.json"
    text = str(Path(__file__).parent / "data" / "sample.txt")
    assert main(["eval", "--text", text, "--codec", "qvg", "--codec", "fp8", "--seeds", "2", "--tokens", "320",
                 "--prefix", "256", "--continue", "64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {row["spec"]: row for row in data["codecs"]}
    assert list(rows) == ["qvg:seed=0", "qvg:seed=1", "fp8"]
    assert rows["qvg:seed=0"]["bpv"] == rows["qvg:seed=1"]["bpv"]
    assert rows["qvg:seed=0"]["kl"] != rows["qvg:seed=1"]["kl"]  # other centroids
    summary = {m["spec"]: m for m in data["seeds"]}
    kls = [rows["qvg:seed=0"]["kl"], rows["qvg:seed=1"]["kl"]]
    assert summary["qvg"]["runs"] == 2 and summary["qvg"]["kl_min"] == min(kls) and summary["qvg"]["kl_max"] == max(kls)
    assert summary["qvg"]["kl_mean"] == pytest.approx(sum(kls) / 2)
    assert summary["fp8"]["runs"] == 1 and summary["fp8"]["kl_mean"] == rows["fp8"]["kl"]


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


def test_the_model_takes_the_cache_argument_these_tests_pass(model_and_tokenizer):
    """These tests pass caches as ``cache=``; a transformers that names it ``past_key_values`` would
    quietly build its own cache and let them test nothing, so that is a failure here."""
    import inspect

    from kvbackend.tools.models import cache_argument

    model, _ = model_and_tokenizer
    assert "cache" in inspect.signature(model.forward).parameters
    assert list(cache_argument(model, None)) == ["cache"]


def test_demo_runs(model_and_tokenizer, capsys):
    from kvbackend.tools.cli import main

    assert main(["demo", "--max-new-tokens", "3", "--codec", "kivi:bits=2,group=16", "--prompt", "Hello",
                 "--prompt", "Name three colours."]) == 0
    out = capsys.readouterr().out
    assert "kivi:bits=2,group=16" in out and "compression" in out and "exact (DynamicCache)" in out
    assert "agree" in out and "KL(exact || cache)" in out and "shorter than a chunk" in out  # short prompts: told nothing is packed


def test_demo_measures_agreement_through_packed_pages(model_and_tokenizer):
    """The demo's figures: with 64-token chunks a 200-token prompt packs 3 chunks; the lossless codec
    agrees on every token with KL 0, a 2-bit codec holds fewer bytes and agrees less than fully."""
    from kvbackend.tools.demo import DEFAULT_CODECS, _encode_prompts, agreement, default_prompt, demo_runs
    from kvbackend.spec import RECOMMENDED_SPEC

    model, tokenizer = model_and_tokenizer
    assert DEFAULT_CODECS[0] == RECOMMENDED_SPEC and len(DEFAULT_CODECS) <= 3  # the recipe, two references
    document = default_prompt(tokenizer)
    assert len(tokenizer(document).input_ids) > 2048  # the default prompt fills a 2048-token chunk
    prompt = tokenizer.decode(tokenizer(document).input_ids[:200])
    batch = _encode_prompts(tokenizer, [prompt])
    runs = demo_runs(model, batch, ["identity", "kivi:bits=2,group=16"], max_new_tokens=4, chunk_pages=1)
    exact, lossless, kivi = runs
    assert [r.codec for r in runs] == ["exact (DynamicCache)", "identity", "kivi:bits=2,group=16"]
    tokens = batch["input_ids"].shape[1] + 4
    assert lossless.packed_tokens == kivi.packed_tokens == tokens // 64 * 64 >= 192
    fit = agreement(lossless, exact)
    assert fit.top1 == 1.0 and abs(fit.kl) < 1e-4 and fit.leading_equal == [4]
    assert torch.equal(lossless.tokens, exact.tokens)
    fit = agreement(kivi, exact)
    assert kivi.stored_bytes < exact.exact_bytes / 2 and 0 < fit.kl < 1.0 and fit.top1 >= 0.5


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
    from kvbackend import CacheConfig, Geometry, KVCache, codecs
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
        one = KVCache(Geometry(1, k.shape[1], k.shape[2], k.dtype),
                      CacheConfig(codec=plan[layer], page_size=16, chunk_pages=2, dense_pages=8, packed_pages=8),
                      rotary=rotary)  # the layer's spec alone, in a paged cache of its own
        rid, _ = one.add_request()
        one.append(rid, 0, k, v)
        alone_k, alone_v = one.read(rid, 0)
        rec = reconstruct_sequence(codecs.get(plan[layer]), k, v, Geometry(layers, k.shape[1], k.shape[2], k.dtype),
                                   16, 32, rotary)  # the eval's simulation (chunks start after the sink)
        got_k, got_v = (x[0].transpose(0, 1) for x in cache.layers[layer].read())
        for got, alone, sim, exact_x in ((got_k, alone_k, rec.k, k), (got_v, alone_v, rec.v, v)):
            err = float((got - exact_x).norm() / exact_x.norm())
            assert 0 < err < 0.5, layer
            # what the paged cache stores for this spec (a rare code flips where float rounding order
            # differs, ten times below the codec's own error) ...
            assert float((got - alone).norm() / alone.norm()) < 0.1 * err, layer
            # ... at the error the eval's simulation measured for it
            assert err < 1.5 * float((sim - exact_x).norm() / exact_x.norm()) + 1e-3, layer
            assert torch.allclose(got[:4], exact_x[:4].to(torch.float16).to(got.dtype), atol=1e-3), layer  # sink


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


def _tensors(value, found: dict[int, torch.Tensor]) -> None:
    """Collect the tensors in ``value`` and in the lists, tuples and dicts it holds (keyed by storage)."""
    if isinstance(value, torch.Tensor):
        found[value.untyped_storage().data_ptr()] = value
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)


def _held_outside_pools(cache) -> list[torch.Tensor]:
    """Tensors the cache object and its layers keep in attributes (the KVCache's pools aside)."""
    found: dict[int, torch.Tensor] = {}
    for name, value in vars(cache).items():
        if name not in ("engine", "layers"):
            _tensors(value, found)
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if name != "owner":
                _tensors(value, found)
    return list(found.values())


def test_cache_holds_pages_not_reconstructions(model_and_tokenizer, sample_ids):
    """After several chunks are packed, what the cache keeps reachable is the packed pages and codebook
    slots in use plus the dense pages of the active chunk: below the exact size by the codec's ratio.
    No attribute keeps a reconstruction [.., T, D] that grows with the sequence."""
    model, _ = model_and_tokenizer
    page, prompt = 16, 64  # chunks of one 16-token page: 4 packed by the prompt, a 5th after 16 steps
    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=16", page_size=page, chunk_pages=1,
                           pre_rope=True, v_rotation="hadamard", max_tokens=128)
    assert cache.layer_specs[0] == "kivi:bits=2,group=16,prerope=true,vrot=hadamard"  # levers in the spec
    ids = sample_ids[:, :prompt]
    seen = {}  # cached tokens -> (tensors outside the pools, packed bytes, dense page bytes)
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        for step in range(21):
            if step in (0, 16, 20):
                stats = cache.engine.stats()
                seen[ids.shape[1]] = (_held_outside_pools(cache), stats.packed_bytes, stats.dense_bytes)
            if step < 20:
                token = logits[:, -1:].argmax(-1)
                ids = torch.cat([ids, token], dim=1)
                logits = model(token, cache=cache).logits
        exact_cache = DynamicCache(config=model.config)
        model(ids, cache=exact_cache)
    assert sorted(seen) == [64, 80, 84] and cache.get_seq_length() == 84
    exact = sum(layer.keys.nbytes + layer.values.nbytes for layer in exact_cache.layers)  # 84 tokens
    per_token = exact // 84
    g = cache.engine.geometry
    ratio = page * per_token / (g.num_layers * cache.engine.layout.stored_bytes(1, 1))  # the codec's own ratio
    assert ratio == 8.0  # 2-bit codes + fp16 scale and zero per 16 values, against float32
    for tokens, (tensors, packed, dense_pages) in seen.items():
        # nothing of the sequence's length lives outside the pools, and it does not grow
        assert all(t.dim() < 2 or t.shape[-2] < page for t in tensors), (tokens, [t.shape for t in tensors])
        assert sum(t.nbytes for t in tensors) == sum(t.nbytes for t in seen[64][0])
        reachable = packed + dense_pages + sum(t.nbytes for t in tensors)
        packed_tokens = tokens // page * page
        print(f"\n{tokens} tokens: exact {tokens * per_token} B, reachable {reachable} B (packed {packed}, "
              f"dense pages {dense_pages}): {tokens * per_token / reachable:.2f}x, codec {ratio:.2f}x")
        assert packed == packed_tokens * per_token / ratio  # packed pages and slots: the codec's ratio
        assert dense_pages == (tokens > packed_tokens) * page * per_token  # one dense page, or none
        # below the exact size by the codec's ratio, plus the active chunk's dense page when one is open
        assert reachable <= tokens * per_token / ratio + (tokens > packed_tokens) * page * per_token
    assert tokens * per_token == exact
    held_report = cache.kv_bytes()
    assert held_report["exact"] == exact  # what DynamicCache holds for the same tokens
    assert held_report["packed"] == seen[84][1] and held_report["dense"] == 4 * per_token  # 4 tokens held dense
    assert held_report["stored"] == held_report["packed"] + held_report["dense"] < exact / (ratio / 2)


def test_default_is_the_recommended_spec_and_asks_for_attach(model_and_tokenizer, sample_ids):
    """A cache built with no codec serves the recommended spec; its query-aware keys warn once when
    the queries were never attached, and not at all once attach() hands them over."""
    import warnings

    model, _ = model_and_tokenizer
    ids = sample_ids[:, :70]
    cache = KVBackendCache(model.config, page_size=64, chunk_pages=1)  # kchannel=64 needs 64-token pages
    assert cache.options.codec == RECOMMENDED_SPEC and cache.query_aware
    with pytest.warns(UserWarning, match="attach") as caught, torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert sum("attach" in str(w.message) for w in caught) == 1
    attached = KVBackendCache(model.config, page_size=64, chunk_pages=1)
    attached.attach(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with torch.no_grad():
                model(ids, cache=attached)
    finally:
        attached.detach(model)
    assert attached.engine.stats().packed_tokens == 64


def test_levers_go_into_every_layer_spec(model_and_tokenizer):
    """sink / pre_rope / v_rotation become lever options of each layer's spec (unless the spec names
    them); from_plan passes the plan's specs, levers included; what the paged cache refuses is refused
    when the cache is built."""
    from kvbackend.errors import SpecError

    model, _ = model_and_tokenizer
    layers = model.config.num_hidden_layers
    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=32", sink=4, pre_rope=True, v_rotation="hadamard")
    assert cache.layer_specs == ["kivi:bits=2,group=32,sink=4,prerope=true,vrot=hadamard"] * layers
    assert cache.rotary is not None and not _held_outside_pools(cache)
    named = KVBackendCache(model.config, codec="kivi:prerope=false,sink=2", sink=4, pre_rope=True)
    assert named.layer_specs[0] == "kivi:prerope=false,sink=2" and named.layers[0].sink == 2
    assert KVBackendCache(model.config, codec="identity", sink=3).layer_specs[0] == "identity:sink=3"
    assert KVBackendCache(model.config, codec="fp8").layer_specs[0] == "fp8"
    assert KVBackendCache(model.config, codec="fp8").rotary is None  # no lever needs RoPE
    default = KVBackendCache(model.config)  # the recommended spec (a depth: spec), pre-RoPE keys included
    assert default.layer_specs == layer_specs(RECOMMENDED_SPEC, layers) and default.rotary is not None
    # 2-bit keys with and without outliers, 3-bit and 4-bit keys
    assert len(set(default.layer_specs)) == 4 and all("prerope=true" in spec for spec in default.layer_specs)
    plan = [f"kivi:bits=2,prerope={i % 2 == 0}" for i in range(layers)]
    assert KVBackendCache.from_plan(model.config, plan).layer_specs == plan
    with pytest.raises(SpecError, match="exceeds the page size"):
        KVBackendCache(model.config, codec="kivi", sink=5, page_size=4)
    from kvbackend.levers import Levers

    with pytest.raises(SpecError, match="layer_levers"):
        KVBackendCache(model.config, codec="kivi:sink=2", layer_levers=[Levers(sink=4)] * layers)


def test_reset_forgets_every_token(model_and_tokenizer):
    """After reset() the cache serves a new sequence as a fresh cache does (the old tokens are freed)."""
    model, tokenizer = model_and_tokenizer
    first, second = (tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS[:2])
    cache = KVBackendCache(model.config, codec="identity", page_size=4, chunk_pages=1)
    with torch.no_grad():
        model(first, cache=cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        got = model(second, cache=cache).logits
        want = model(second, cache=DynamicCache(config=model.config)).logits
    assert cache.get_seq_length() == second.shape[1] and len(cache.request_ids) == 1
    assert torch.allclose(got, want, atol=1e-4)
    cache.engine.check()


def test_prefill_in_chunks_with_a_small_dense_pool(model_and_tokenizer, sample_ids):
    """`prefill` feeds a long prompt chunk by chunk, so a dense pool of two chunks per row serves it and
    the result equals one forward call over the prompt; one call over it with that pool raises a clear
    CacheFull and leaves no row or layer ahead of the others."""
    from kvbackend.errors import CacheFull

    model, _ = model_and_tokenizer
    ids = sample_ids[:, :70]  # 4 chunks of 16 tokens and 6 more
    options = dict(codec="identity", page_size=8, chunk_pages=2, max_tokens=96)
    with torch.no_grad():
        whole = KVBackendCache(model.config, **options)
        want = model(ids, cache=whole).logits[:, -1]
        small = KVBackendCache(model.config, dense_tokens=32, **options)
        out = small.prefill(model, ids)
        assert out.logits.shape[1] == 70 - 64  # the last piece: tokens 64..69
        assert torch.allclose(out.logits[:, -1], want, atol=1e-4)
        assert small.get_seq_length() == 70 and small.engine.stats().packed_tokens == 64
        assert small.engine.dense.allocator.num_pages == 5  # two chunks of two pages and one more, for one row
        step = out.logits[:, -1:].argmax(-1)  # decoding goes on as usual
        assert torch.allclose(model(step, cache=small).logits, model(step, cache=whole).logits, atol=1e-4)
        tight = KVBackendCache(model.config, dense_tokens=32, **options)
        with pytest.raises(CacheFull, match="KVBackendCache.prefill"):
            model(ids, cache=tight)
        assert {layer.length for layer in tight.layers} == {0}  # nothing appended anywhere
        assert tight.engine.stats().dense_bytes == 0
    with pytest.raises(ValueError, match="dense_tokens"):
        KVBackendCache(model.config, dense_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        small.prefill(model, ids[0])
