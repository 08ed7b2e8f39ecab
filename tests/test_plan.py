"""`kvbackend plan`: per-layer page codecs of klt:...,paged=true and auto:bpv=B specs, written as JSON that a
cache serves; specs it cannot plan are refused before the model loads."""

import json

import pytest

from kvbackend.errors import SpecError
from kvbackend.tools.cli import main
from kvbackend.tools.plan import check_plan_spec

GPL = "/usr/share/common-licenses/GPL-3"


@pytest.mark.parametrize("spec, message", [
    ("klt:kbits=3", "add axes=channels,paged=true"),
    ("kivi:bits=2", "served as it is"),
    ("auto:kl=0.01", "kvbackend eval"),
    ("klt:kbits=3,paged=true", "axes=channels only"),
])
def test_specs_without_a_plan_are_refused(spec, message):
    with pytest.raises(SpecError, match=message):
        check_plan_spec(spec)


def test_the_cli_refuses_before_loading_the_model(tmp_path, capsys):
    assert main(["plan", "--codec", "klt:kbits=3", "--calibration", GPL, "--out", str(tmp_path / "p.json")]) == 2
    assert "paged=true" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


@pytest.mark.model
def test_a_written_klt_plan_is_served_by_the_cache(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from kvbackend import codecs
    from kvbackend.integration.transformers import KVBackendCache
    from kvbackend.tools.models import load_model

    out = tmp_path / "plans" / "p.json"
    spec = "klt:kbits=3,vbits=2,axes=channels,paged=true"
    assert main(["plan", "--codec", spec, "--calibration", GPL, "--prefix", "512", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    layers = plan["plans"][0]["layers"]
    assert plan["plans"][0]["codec"] == spec and plan["page_size"] == 64 and len(layers) == 30
    assert all(codecs.get(layer).spec.name == "chw" for layer in layers) and len(set(layers)) > 1
    model, tokenizer = load_model()
    ids = tokenizer(open(GPL).read(), return_tensors="pt").input_ids[:, 1000:1208]
    cache = KVBackendCache(model.config, codec=layers, page_size=64, chunk_pages=1, max_tokens=512)
    with torch.no_grad():
        model(ids[:, :200], past_key_values=cache, use_cache=True)
        served = model(ids[:, 200:], past_key_values=cache, use_cache=True).logits[0].float()
        exact = model(ids).logits[0, 200:].float()
    assert cache.engine.stats().packed_tokens >= 128  # the first chunks are read from chw pages
    assert not torch.allclose(served, exact, atol=1e-3)  # ... and so are not the exact K/V
    kl = torch.nn.functional.kl_div(served.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert float(kl) < 0.1 and bool((served.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75)
