"""`kvbackend probe` (far-away recall) on the shipped SmolLM2 model (marked `model`; runs in `make test`)."""

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.model

from kvbackend.tools.probe import probe_rows, run_probe  # noqa: E402

FILLER = ("The licensee may copy and distribute the program's source code as received, in any medium, provided "
          "that each copy carries an appropriate copyright notice and a disclaimer of warranty. ") * 40


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from kvbackend.tools.models import load_model

    return load_model()


def test_rows_plant_each_passcode_before_the_filler_and_ask_it(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    rows = probe_rows(tokenizer, FILLER, prefix_tokens=150, questions=3, seed=1)
    assert len({row.name for row in rows}) == 3 and len({row.truth for row in rows}) <= 3
    for row in rows:
        context = row.prompt.split("Question:")[0]
        assert context.startswith(f"Remember: the passcode of {row.name} is {row.truth}.\n")
        assert context.count("Remember:") == 1  # no distractors by default
        assert row.prompt.endswith(f"Answer: the passcode of {row.name} is")
    assert rows == probe_rows(tokenizer, FILLER, prefix_tokens=150, questions=3, seed=1)  # seeded
    with pytest.raises(ValueError, match="fewer than --prefix"):
        probe_rows(tokenizer, FILLER, prefix_tokens=10**6, questions=3)
    with pytest.raises(ValueError, match="questions"):
        probe_rows(tokenizer, FILLER, prefix_tokens=150, questions=0)
    with pytest.raises(ValueError, match="distractors"):
        probe_rows(tokenizer, FILLER, prefix_tokens=150, questions=3, distractors=3)


def test_distractors_plant_other_rows_passcodes_beside_the_asked_one(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    rows = probe_rows(tokenizer, FILLER, prefix_tokens=150, questions=4, seed=2, distractors=2)
    truths = {row.name: row.truth for row in rows}
    for row in rows:
        facts = [line for line in row.prompt.split("Question:")[0].splitlines() if line.startswith("Remember:")]
        assert len(facts) == 3 and f"Remember: the passcode of {row.name} is {row.truth}." in facts
        for line in facts:  # every planted fact is another row's true passcode
            name, code = line.removeprefix("Remember: the passcode of ").rstrip(".").split(" is ")
            assert truths[name] == code


def test_lossless_cache_recalls_as_the_exact_one_through_packed_pages(model_and_tokenizer):
    """With 64-token chunks the planted facts sit in packed pages; the identity codec answers every
    row as the exact cache does, and a 2-bit codec is scored on the same rows."""
    model, tokenizer = model_and_tokenizer
    rows = probe_rows(tokenizer, FILLER, prefix_tokens=200, questions=2, seed=0)
    exact, lossless, kivi = run_probe(model, tokenizer, rows, ["identity", "kivi:bits=2,group=32"], chunk_pages=1)
    assert exact.agree == 1.0 and lossless.answers == exact.answers and lossless.agree == 1.0
    assert lossless.correct == exact.correct and all(a.isdigit() for a in exact.answers)
    assert lossless.packed_tokens >= 192 and kivi.packed_tokens == lossless.packed_tokens
    assert 0.0 <= kivi.agree <= 1.0 and len(kivi.answers) == 2


def test_an_auto_plan_is_planned_on_the_filler_and_served_per_layer(model_and_tokenizer):
    """`auto:bpv=B` entries are planned on the filler's first tokens (per-layer widths within the budget) and
    answered through a cache of those per-layer specs; `auto:kl=K` is refused (the probe has no continuation)."""
    from kvbackend import codecs
    from kvbackend.errors import SpecError
    from kvbackend.tools.probe import plan_layers

    model, tokenizer = model_and_tokenizer
    spec = "auto:bpv=3.5,widths=2-4,base=kivi:group=32"
    plan = plan_layers(model, tokenizer, FILLER, spec, tokens=256, chunk_tokens=64)
    layers = model.config.num_hidden_layers
    assert len(plan) == layers and all(codecs.get(s).spec.name == "kivi" for s in plan)
    assert len(set(plan)) > 1  # widths differ between layers: a plan, not one spec
    rows = probe_rows(tokenizer, FILLER, prefix_tokens=200, questions=2, seed=0)
    exact, planned = run_probe(model, tokenizer, rows, [spec], chunk_pages=1, plans={spec: plan})
    assert planned.cache == spec and planned.packed_tokens >= 192 and len(planned.answers) == 2
    with pytest.raises(SpecError, match="auto:bpv"):
        plan_layers(model, tokenizer, FILLER, "auto:kl=0.01,base=kivi:group=32", tokens=256)


def test_a_paged_klt_spec_is_served_per_layer_with_widths_from_another_text(model_and_tokenizer):
    """``klt:...,paged=true`` becomes one chw: codec per layer (widths from bases fitted on another text) and is
    answered through the cache; the CLI refuses a sequence-level klt spec and one without --calibration before
    loading the model."""
    import argparse

    from kvbackend import codecs
    from kvbackend.errors import SpecError
    from kvbackend.klt import page_specs, parse_klt
    from kvbackend.tools.evaluate import key_bases_from_text
    from kvbackend.tools.probe import PAGE_SIZE, run_probe_cli

    model, tokenizer = model_and_tokenizer
    spec = "klt:kbits=3,vbits=2,axes=channels,paged=true"
    calib = tokenizer(open("/usr/share/common-licenses/GPL-3").read(), return_tensors="pt").input_ids
    plan = page_specs(parse_klt(spec), key_bases_from_text(model, calib, tokens=512), PAGE_SIZE)
    assert len(plan) == model.config.num_hidden_layers and all(codecs.get(s).spec.name == "chw" for s in plan)
    rows = probe_rows(tokenizer, FILLER, prefix_tokens=200, questions=2, seed=0)
    exact, planned = run_probe(model, tokenizer, rows, [spec], chunk_pages=1, plans={spec: plan})
    assert planned.cache == spec and planned.packed_tokens >= 192 and len(planned.answers) == 2
    args = argparse.Namespace(codec=["klt:kbits=3"], calibration="x", text="x", model_dir=None)
    with pytest.raises(SpecError, match="axes=channels,paged=true"):
        run_probe_cli(args)
    args.codec, args.calibration = [spec], None
    with pytest.raises(SpecError, match="--calibration"):
        run_probe_cli(args)
