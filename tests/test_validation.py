"""Bad input fails at once with a message naming it: spec options out of range, eval arguments, output
paths and plans, all before any model loads (the loader is replaced by one that fails the test)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from kvbackend import CacheConfig, Geometry, InvalidKV, KVCache, SpecError, codecs
from kvbackend.tools.auto import AutoSpec, parse_auto
from kvbackend.codecs.qvg import QVGSpec

TEXT = str(Path(__file__).parent / "data" / "sample.txt")
SMOLLM2 = Geometry(30, 3, 64, torch.float32)  # the shipped model's KV geometry


@pytest.mark.parametrize("spec, shown", [
    ("qvg:stages=100000", "stages=100000 is out of range; valid: 1..16"),
    ("qvg-pro:stages=0", "stages=0 is out of range; valid: 1..16"),
    ("kivi:bits=5", "bits=5 is not supported; valid: 2, 3, 4, 8"),
    ("rtn:bits=1", "bits=1 is not supported; valid: 2, 3, 4, 8"),
    ("rtn:group=0", "group=0 is out of range; valid: 1..1024"),
    ("kivi:group=4096", "group=4096 is out of range; valid: 1..1024"),
    ("kivi:kbits=1", "kbits=1 is not supported; valid: 0, 2, 3, 4, 8"),
    ("qvg:vbits=16", "vbits=16 is not supported; valid: 0, 2, 3, 4, 8"),
    ("qvg:centroids=0", "centroids=0 is out of range; valid: 1..256"),
    ("qvg:iters=-1", "iters=-1 is out of range; valid: 0..1000"),
    ("qvg:seed=-1", "seed=-1 is out of range"),
    ("qvg:kchannel=-8", "kchannel=-8 is out of range; valid: 0..1024"),
    ("qvg:init=zeros", "init='zeros' is not supported; valid: kmeans++, greedy, random"),
    ("rtn:scale=fp4", "scale='fp4' is not supported; valid: fp8, fp16, bf16, fp32"),
    ("quantwm:candidates=0", "candidates=0 is out of range; valid: 1..256"),
    ("quantwm:rank=-1", "rank=-1 is out of range; valid: 0..1024"),
    ("quantwm:keep=0", "keep=0.0 is out of range; valid: (0, 1]"),
    ("quantwm:keep=1.5", "keep=1.5 is out of range; valid: (0, 1]"),
    ("quantwm:keep=nan", "keep=nan must be a finite number; valid: (0, 1]"),
])
def test_codec_options_out_of_range_name_option_value_and_range(spec, shown):
    with pytest.raises(SpecError) as err:
        codecs.parse(spec)
    assert shown in str(err.value)


@pytest.mark.parametrize("raw", ["1e20", "2.5", "two", "100000000000000000000"])
def test_non_integer_or_huge_stages_are_spec_errors(raw):
    with pytest.raises(SpecError, match=r"stages=.*valid: 1\.\.16"):
        codecs.parse(f"qvg:stages={raw}")


def test_specs_built_in_python_are_checked_too():
    geometry = Geometry(1, 2, 64)
    with pytest.raises(SpecError, match="stages=1e\\+20 must be an integer"):  # was a TypeError at encode
        codecs.get(QVGSpec("qvg", stages=1e20)).layout(geometry, 64)
    with pytest.raises(SpecError, match="symmetric=1 must be true or false"):
        QVGSpec("qvg", symmetric=1)
    with pytest.raises(SpecError, match="stages=True must be an integer"):
        QVGSpec("qvg", stages=True)
    assert QVGSpec("qvg", stages=16).stages == 16  # the range's ends are valid
    assert codecs.parse("qvg:stages=16,centroids=256,iters=0,kchannel=0,seed=0").stages == 16


def test_every_option_of_every_codec_and_auto_is_bounded():
    from kvbackend.codecs import _REGISTRY
    from kvbackend.spec import bound_of

    for spec_type in {entry.spec_type for entry in _REGISTRY.values()} | {AutoSpec}:
        hints = {f.name: f.type for f in dataclasses.fields(spec_type)}
        for field in dataclasses.fields(spec_type):
            if field.name == "name" or hints[field.name] in ("bool", bool):
                continue
            if spec_type is AutoSpec and field.name in ("base", "widths", "stages", "outliers"):
                continue  # parsed and checked by parse_auto (below)
            if spec_type.__name__ == "HeadsSpec":
                continue  # dash lists and a base spec, checked by heads.head_specs and each head's own spec
            if spec_type.__name__ == "ChwSpec" and field.name == "kw":
                continue  # a digit string, checked by ChwSpec itself and per geometry by `key_widths`
            assert bound_of(field) is not None, f"{spec_type.__name__}.{field.name} has no declared range"


@pytest.mark.parametrize("spec, shown", [
    ("fp8:sink=10000000", "sink=10000000 is out of range; valid: 0..1048576"),
    ("kivi:psac=5000", "psac=5000 is out of range; valid: 0..1024"),
])
def test_lever_options_out_of_range(spec, shown):
    with pytest.raises(SpecError) as err:
        codecs.get(spec)
    assert shown in str(err.value)


def test_alignpred_relative_budget_is_bounded():
    from kvbackend.alignpred import parse_alignpred

    assert parse_alignpred("alignpred:error=100x").error.value == 100
    with pytest.raises(SpecError, match=r"error='1e300x'.*at most 100x"):
        parse_alignpred("alignpred:error=1e300x")


@pytest.mark.parametrize("spec, shown", [
    ("auto:bpv=100", "bpv=100.0 is out of range; valid: 0..32"),
    ("auto:kl=nan", "kl=nan must be a finite number"),
    ("auto:bpv=3,calib=8", "calib=8 is out of range"),
    ("auto:bpv=3,queries=0", "queries=0 is out of range"),
    ("auto:bpv=3,widths=2-5", "widths='2-5' must be dash-separated integers, each of 2, 3, 4, 8"),
    ("auto:bpv=3,widths=two", "widths='two' must be dash-separated integers"),
    ("auto:bpv=3,base=qvg,stages=1-100", "stages='1-100' must be dash-separated integers, each of 1..16"),
    ("auto:bpv=3,base=qvg,stages=1.5", "stages='1.5' must be dash-separated integers"),
    ("auto:bpv=3,base=kivi:bits=5", "base='kivi:bits=5': kivi: option bits=5 is not supported"),
    ("auto:bpv=3,base=rtn", "base must be a codec with kbits/vbits"),
    ("auto:bpv=3,base=auto:bpv=2", "not another auto"),
])
def test_auto_options_out_of_range(spec, shown):
    with pytest.raises(SpecError) as err:
        parse_auto(spec)
    assert shown in str(err.value)


def test_auto_base_written_with_commas_hints_at_semicolons():
    with pytest.raises(SpecError) as err:
        parse_auto("auto:bpv=3,base=kivi:group=64,sink=4,prerope=true")
    assert "prerope, sink" in str(err.value) and "base=kivi:group=64;sink=4" in str(err.value)
    assert parse_auto("auto:bpv=3,base=kivi:group=64;sink=4;prerope=true").base == "kivi:group=64,sink=4,prerope=true"


def test_every_layer_argument_is_checked():
    geometry = Geometry(2, 2, 16, torch.float32)
    cache = KVCache(geometry, CacheConfig(codec="identity", page_size=4, chunk_pages=2, dense_pages=8,
                                          packed_pages=8))
    rid, _ = cache.add_request(list(range(3)))
    kv = torch.randn(3, 2, 16)
    for layer in range(2):
        cache.append(rid, layer, kv, kv)
    plan = cache.plan([rid])
    for bad in (-1, 2, True):
        for call in (lambda: cache.append(rid, bad, kv, kv), lambda: cache.read(rid, bad),
                     lambda: cache.read_packed(rid, bad), lambda: cache.read_dense(rid, bad),
                     lambda: cache.gather(plan, bad), lambda: cache.plan([rid], bad),
                     lambda: cache.decode(plan, bad, torch.randn(1, 2, 16))):
            with pytest.raises(InvalidKV, match="layer"):
                call()


# -- kvbackend eval: everything checked before the model loads ---------------------------------------
class _Loaded(Exception):
    """Raised by the stand-in model loader: reaching it means the checks let the input through."""


@pytest.fixture
def no_model(monkeypatch):
    """Replace the model loader (fails the run) and the config read (the shipped model's geometry)."""
    import kvbackend.tools.evaluate
    import kvbackend.tools.models

    calls = []

    def load_model(*args, **kwargs):
        calls.append(args)
        raise _Loaded()

    monkeypatch.setattr(kvbackend.tools.models, "load_model", load_model)
    monkeypatch.setattr(kvbackend.tools.evaluate, "model_geometry", lambda model_dir=None: SMOLLM2, raising=False)
    return calls


def _eval(*args: str) -> list[str]:
    return ["eval", "--text", TEXT, "--tokens", "320", "--prefix", "256", "--continue", "64", *args]


@pytest.mark.parametrize("option, value, shown", [
    ("--prefix", "0", "--prefix: must be an integer >= 1, got '0'"),
    ("--tokens", "-5", "--tokens: must be an integer >= 1, got '-5'"),
    ("--continue", "1", "--continue: must be an integer >= 2, got '1'"),
    ("--prefix", "1e3", "--prefix: must be an integer >= 1, got '1e3'"),
    ("--seeds", "0", "--seeds: must be an integer >= 1, got '0'"),
    ("--chunk", "32", "--chunk: must be an integer >= 64, got '32'"),
])
def test_eval_numeric_arguments_are_checked_by_the_parser(no_model, capsys, option, value, shown):
    from kvbackend.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(_eval("--codec", "fp8", option, value))
    assert exit_.value.code == 2 and shown in capsys.readouterr().err and not no_model


def test_eval_settings_reject_numbers_no_run_can_use():
    from kvbackend.tools.evaluate import EvalSettings

    with pytest.raises(ValueError, match="prefix=0 must be an integer >= 1"):
        EvalSettings(prefix=0)
    with pytest.raises(ValueError, match="cont=1 must be an integer >= 2"):
        EvalSettings(cont=1)
    with pytest.raises(ValueError, match="queries=300 must be at most tokens=256"):
        EvalSettings(tokens=256, queries=300)
    with pytest.raises(ValueError, match="chunk_tokens=96 must be a multiple of page_size=64"):
        EvalSettings(chunk_tokens=96)
    assert EvalSettings(chunk_tokens=64).chunk_tokens == 64  # one page per chunk, as SGLang stores pages


def test_eval_chunk_that_splits_a_page_is_refused_before_the_model_loads(no_model, capsys):
    from kvbackend.tools.cli import main

    assert main(_eval("--codec", "fp8", "--chunk", "96")) != 0
    assert "chunk_tokens=96 must be a multiple of page_size=64" in capsys.readouterr().err and not no_model


@pytest.mark.parametrize("spec, shown", [
    ("kivi:bits=5", "bits=5 is not supported"),
    ("kivi:group=33", "group=33 must divide head_dim=64"),  # needs the model's geometry (from its config)
    ("rtn:group=48", "group=48 must divide head_dim=64"),  # needs the model's geometry (from its config)
    ("qvg:kchannel=48", "kchannel=48 tokens must divide page_size=64"),
    ("auto:bpv=3,base=kivi:group=64,sink=4", "base=kivi:group=64;sink=4"),
    ("auto:bpv=3,base=kivi:group=4", "3-bit codes need group to be a multiple of 8"),  # the plan's K3/V3 candidates
    ("auto:kl=0.05,calib=250", "calib=250 leaves 6 prefix tokens"),
    ("alignpred:error=0", "error='0'"),
])
def test_eval_specs_are_checked_before_the_model_loads(no_model, capsys, spec, shown):
    from kvbackend.tools.cli import main

    assert main(_eval("--codec", "fp8", "--codec", spec)) == 2
    assert shown in capsys.readouterr().err
    assert not no_model


def test_eval_output_folders_are_made_or_refused_before_the_model_loads(no_model, tmp_path, capsys):
    from kvbackend.tools.cli import main

    out = tmp_path / "new" / "folder" / "out.json"
    with pytest.raises(_Loaded):  # every check passed: the run reaches the model
        main(_eval("--codec", "fp8", "--json", str(out), "--plot", str(tmp_path / "plots" / "p.png")))
    assert out.parent.is_dir() and (tmp_path / "plots").is_dir() and len(no_model) == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(_eval("--codec", "fp8", "--json", str(blocker / "out.json"))) == 2
    assert "--json" in capsys.readouterr().err
    assert main(_eval("--codec", "fp8", "--plot", str(tmp_path))) == 2  # a folder, not a file
    assert "--plot" in capsys.readouterr().err
    assert len(no_model) == 1


def test_eval_calibration_text_is_read_before_the_model_loads(no_model, tmp_path, capsys):
    from kvbackend.tools.cli import main

    missing = tmp_path / "missing.txt"
    assert main(_eval("--codec", "alignpred:error=1x,align=layers,fit=frozen", "--calibration", str(missing))) == 2
    assert "missing.txt" in capsys.readouterr().err and not no_model


# -- KVBackendCache.from_plan ------------------------------------------------------------------------
@pytest.mark.parametrize("plan, shown", [
    (None, "has no plan"),
    ("kivi:bits=2", "a list of per-layer codec specs, not one string"),
    ([], "empty"),
    (["kivi", 3], "plan[1]=3 is not a codec spec string"),
])
def test_from_plan_rejects_what_is_not_a_plan(plan, shown):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from kvbackend.integration.transformers import KVBackendCache

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=32)
    with pytest.raises(SpecError) as err:
        KVBackendCache.from_plan(config, plan)
    assert shown in str(err.value)


# -- found by an adversarial pass over inputs (each failed before its fix) -------------------------------------
@pytest.mark.parametrize("command", [["eval", "--text", TEXT, "--codec", "fp8"], ["probe", "--text", TEXT,
                                     "--codec", "fp8"], ["demo", "--codec", "fp8"]])
@pytest.mark.parametrize("device", ["foo", "cuda:99" if torch.cuda.is_available() else "cuda", "meta"])
def test_a_bad_device_is_refused_by_the_parser(no_model, capsys, command, device):
    """`--device` was never checked: the model loaded (seconds), then a traceback from deep inside."""
    from kvbackend.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--device", device])
    assert exit_.value.code == 2 and "--device" in capsys.readouterr().err and not no_model


@pytest.mark.parametrize("command", [["probe", "--text", TEXT], ["demo"]])
def test_probe_and_demo_check_specs_against_the_model_before_it_loads(no_model, capsys, command):
    """`eval` refused a spec the model's pages cannot take before loading it; probe and demo loaded it first."""
    from kvbackend.tools.cli import main

    assert main([*command, "--codec", "kivi:group=33"]) == 2
    assert "group=33" in capsys.readouterr().err and not no_model


def test_probe_refuses_a_folder_for_json_before_the_model_loads(no_model, tmp_path):
    """The probe ran for minutes, then failed to write its JSON into a folder."""
    from kvbackend.tools.cli import main

    assert main(["probe", "--text", TEXT, "--codec", "fp8", "--json", str(tmp_path)]) == 2 and not no_model


@pytest.mark.parametrize("field, value", [("codebook_slots", -1), ("codebook_slots", 0), ("codebook_slots", 1.5),
                                          ("codebook_slots", "4"), ("page_size", True), ("check_finite", "no"),
                                          ("codec", 5), ("codec", None), ("codec", b"kivi"), ("device", "foo"),
                                          ("device", "cuda:99" if torch.cuda.is_available() else "cuda")])
def test_cache_config_refuses_nonsense_with_the_field_named(field, value):
    """These passed the config and failed later, deep inside (a RuntimeError from the pool, an AttributeError from
    the codec registry), or never (codebook_slots=0: no chunk ever packed; check_finite='no': still checked)."""
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_geometry_refuses_bools_as_sizes():
    with pytest.raises(ValueError, match="num_layers"):
        Geometry(True, 2, 64)


def test_a_spec_object_that_is_not_a_codec_spec_is_a_spec_error():
    for bad in (5, None, b"kivi", ["kivi"]):
        with pytest.raises(SpecError, match="codec spec"):
            codecs.get(bad)


def test_the_triton_backend_on_the_cpu_is_refused_outside_the_interpreter(monkeypatch):
    """Every chunk encode failed and was only logged: the cache never compressed anything."""
    pytest.importorskip("triton")  # imported with the interpreter on (triton reads it on import: importing it first
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # without it broke every later interpreted kernel call)
    with pytest.raises(SpecError, match="CUDA device"):
        KVCache(Geometry(1, 2, 64, torch.bfloat16), CacheConfig(codec="kivi:bits=2,group=16", page_size=16,
                                                                chunk_pages=2, backend="triton"))


def test_bpv_refuses_levers_it_would_not_measure(capsys):
    """`kvbackend bpv --codec kivi:sink=4,vrot=hadamard` printed the levers' spec beside the plain codec's bytes and
    error (no sink bytes counted, no rotation applied)."""
    from kvbackend.tools.cli import main

    assert main(["bpv", "--codec", "kivi:bits=2,group=64,sink=4,vrot=hadamard"]) == 2
    assert "levers" in capsys.readouterr().err


def test_eval_chunk_reaches_the_settings(no_model, monkeypatch):
    """``--chunk`` sets the codec chunk of the run (it decides where every codebook is shared)."""
    import kvbackend.tools.evaluate
    import kvbackend.tools.models
    from kvbackend.tools.cli import main

    seen = []

    class Tokens:
        def __call__(self, text, return_tensors):
            return type("Ids", (), {"input_ids": torch.zeros(1, 400, dtype=torch.long)})()

    def evaluate(model, ids, specs, settings, progress=None, calibration=None, plan_ids=None, key_bases=None):
        seen.append(settings)
        raise _Loaded()

    monkeypatch.setattr(kvbackend.tools.models, "load_model", lambda **kwargs: (None, Tokens()))
    monkeypatch.setattr(kvbackend.tools.evaluate, "evaluate", evaluate)
    for chunk, want in ((None, 2048), ("64", 64), ("192", 192)):
        with pytest.raises(_Loaded):
            main(_eval("--codec", "fp8", *(("--chunk", chunk) if chunk else ())))
        assert seen[-1].chunk_tokens == want


def test_eval_plan_text_needs_an_auto_spec_and_reaches_evaluate(no_model, monkeypatch, tmp_path):
    """``--plan-text`` plans ``auto:`` specs on another text: refused when no codec is one, else its tokens reach
    ``evaluate`` (and the evaluated text's tokens stay the evaluated ones)."""
    import kvbackend.tools.evaluate
    import kvbackend.tools.models
    from kvbackend.tools.cli import main

    plan_file = tmp_path / "plan.txt"
    plan_file.write_text("another text")
    seen = []

    class Tokens:
        def __call__(self, text, return_tensors):
            n = 700 if text == "another text" else 400
            return type("Ids", (), {"input_ids": torch.zeros(1, n, dtype=torch.long)})()

    def evaluate(model, ids, specs, settings, progress=None, calibration=None, plan_ids=None, key_bases=None):
        seen.append((ids.shape[1], None if plan_ids is None else plan_ids.shape[1]))
        raise _Loaded()

    monkeypatch.setattr(kvbackend.tools.models, "load_model", lambda **kwargs: (None, Tokens()))
    monkeypatch.setattr(kvbackend.tools.evaluate, "evaluate", evaluate)
    with pytest.raises(SystemExit, match="plan-text"):
        main(_eval("--codec", "fp8", "--plan-text", str(plan_file)))
    assert seen == []
    with pytest.raises(_Loaded):
        main(_eval("--codec", "auto:bpv=3.2", "--plan-text", str(plan_file)))
    assert seen == [(400, 700)]


def test_eval_skip_drops_the_first_tokens_and_refuses_too_few(no_model, monkeypatch):
    """``--skip N`` drops the text's first N tokens before anything else (the same continuation at two prefix
    lengths); a skip that leaves too few tokens is refused before any run, naming the counts."""
    import kvbackend.tools.evaluate
    import kvbackend.tools.models
    from kvbackend.tools.cli import main

    seen = []

    class Tokens:
        def __call__(self, text, return_tensors):
            return type("Ids", (), {"input_ids": torch.arange(400).unsqueeze(0)})()

    def evaluate(model, ids, specs, settings, progress=None, calibration=None, plan_ids=None, key_bases=None):
        seen.append(ids[0].tolist())
        raise _Loaded()

    monkeypatch.setattr(kvbackend.tools.models, "load_model", lambda **kwargs: (None, Tokens()))
    monkeypatch.setattr(kvbackend.tools.evaluate, "evaluate", evaluate)
    with pytest.raises(_Loaded):
        main(_eval("--codec", "fp8", "--skip", "80"))
    assert seen == [list(range(80, 400))]
    with pytest.raises(_Loaded):
        main(_eval("--codec", "fp8"))
    assert seen[-1] == list(range(400))
    with pytest.raises(SystemExit, match="--skip 81 leaves 319"):
        main(_eval("--codec", "fp8", "--skip", "81"))
    assert len(seen) == 2
    with pytest.raises(SystemExit):
        main(_eval("--codec", "fp8", "--skip", "-1"))


def test_frozen_formats_need_a_calibration_text_before_the_model_loads(no_model, capsys):
    """``klt:`` (key bases) and ``alignpred:...,fit=frozen`` (predictors) are fitted on another text: without
    ``--calibration`` the run stops before loading anything; a bad ``klt:`` option stops it too."""
    from kvbackend.tools.cli import main

    for spec in ("klt:kbits=3.5", "alignpred:error=1x,align=layers,fit=frozen"):
        with pytest.raises(SystemExit, match="need --calibration TEXT"):
            main(_eval("--codec", spec))
    assert main(_eval("--codec", "klt:vbits=5", "--calibration", TEXT)) == 2
    assert "klt vbits=5: choose one of" in capsys.readouterr().err and not no_model
