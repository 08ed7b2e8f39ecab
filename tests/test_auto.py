"""auto:bpv=B / auto:kl=K plan per-layer key/value widths within a byte or KL budget, deterministically."""

import pytest
import torch

from kvbackend import Geometry, SpecError, codecs
from kvbackend.tools.auto import parse_auto, plan_widths
from kvbackend.tools.reconstruct import reconstruct_sequence
from kvbackend.rope import Rotary

GEOM = Geometry(3, 2, 64, torch.float32)


def capture(seed=0, tokens=128):
    gen = torch.Generator().manual_seed(seed)
    scales = [0.5, 2.0, 8.0]  # layers differ in how much their keys matter
    q = [torch.randn(4, tokens, 64, generator=gen) * s for s in scales]
    k = [torch.randn(tokens, 2, 64, generator=gen) for _ in scales]
    v = [torch.randn(tokens, 2, 64, generator=gen) for _ in scales]
    return q, k, v


def plan(text, seed=0):
    q, k, v = capture(seed)
    return plan_widths(parse_auto(text), q, k, v, GEOM, 32, 128, Rotary.default(64, 10000.0))


def test_meets_the_budget_from_stored_bytes_and_is_deterministic():
    base = "kivi:group=32,sink=4,prerope=true,vrot=hadamard"
    # 128 tokens, 4 fp16 sinks, 32-token key groups: the narrowest widths (K2 V2) cost 3.5 bpv here
    with pytest.raises(SpecError, match="cannot be met.*3.500"):
        plan(f"auto:bpv=3.4,base={base.replace(',', ';')}")
    tight = plan(f"auto:bpv=3.9,base={base.replace(',', ';')}")
    again = plan(f"auto:bpv=3.9,base={base.replace(',', ';')}")
    assert tight.specs == again.specs and tight.bits_per_value == again.bits_per_value
    assert 3.5 < tight.bits_per_value <= 3.9
    # the measured bpv is that of the chosen per-layer codecs' stored bytes
    q, k, v = capture()
    stored = sum(reconstruct_sequence(codecs.get(s), k[i], v[i], GEOM, 32, 128, Rotary.default(64, 10000.0), q[i])
                 .stored_bytes for i, s in enumerate(tight.specs))
    assert tight.bits_per_value == pytest.approx(8 * stored / (3 * 128 * GEOM.values_per_token))
    loose = plan(f"auto:bpv=4.6,base={base.replace(',', ';')}")
    widths = lambda p: sum(codecs.parse(s).key_bits + codecs.parse(s).value_bits for s in p.specs)  # noqa: E731
    assert widths(loose) > widths(tight) and loose.error < tight.error and loose.bits_per_value <= 4.6


def test_bad_auto_specs():
    assert parse_auto("kivi:bits=2") is None
    with pytest.raises(SpecError, match="exactly one"):
        parse_auto("auto:bpv=0")
    with pytest.raises(SpecError, match="exactly one"):
        parse_auto("auto:bpv=3,kl=0.01")
    assert parse_auto("auto:kl=0.01").kl == 0.01
    with pytest.raises(SpecError, match="needs the model"):
        plan("auto:kl=0.05,base=kivi:group=32")
    with pytest.raises(SpecError, match="kivi"):
        plan("auto:bpv=3,base=rtn:bits=2")


def test_kl_budget_takes_the_shortest_path_prefix_within_budget():
    """kl=K: the plan is the first state of the greedy path whose measured KL is within K; a stand-in
    KL (decreasing with total width) makes the choice checkable."""
    widths = lambda specs: sum(codecs.parse(s).key_bits + codecs.parse(s).value_bits for s in specs)  # noqa: E731
    seen = []

    def kl_of(specs):
        seen.append(widths(specs))
        return 1.0 / widths(specs)

    base = "base=kivi:group=32;sink=4;prerope=true;vrot=hadamard"
    spec = parse_auto(f"auto:kl=0.08,{base}")
    p = plan_widths(spec, *capture(), GEOM, 32, 128, Rotary.default(64, 10000.0), kl_of)
    assert p.calib_kl is not None and p.calib_kl <= 0.08
    assert 1.0 / (widths(p.specs) - 1) > 0.08 or widths(p.specs) == min(seen)  # one step narrower would miss
    assert len(seen) <= 12  # binary search, not a walk of the whole path
    again = plan_widths(spec, *capture(), GEOM, 32, 128, Rotary.default(64, 10000.0), kl_of)
    assert again.specs == p.specs  # deterministic
    strict = plan_widths(parse_auto(f"auto:kl=0.0001,{base}"), *capture(), GEOM, 32, 128, Rotary.default(64, 10000.0), kl_of)
    assert strict.calib_kl > 0.0001 and widths(strict.specs) == max(seen)  # unreachable: the widest plan


def test_clip_variants_never_worse_per_entry_and_same_bytes():
    from kvbackend.tools.auto import _error_table

    q, k, v = capture()
    base = "base=kivi:group=32;sink=4;prerope=true;vrot=hadamard"
    rotary = Rotary.default(64, 10000.0)
    ladders = [("kbits", [2, 3]), ("vbits", [2, 3])]
    tables = {kind: _error_table(parse_auto(f"auto:bpv=3,{base},variants={kind}"), ladders, q, k, v, GEOM, 32, 128,
                                 rotary) for kind in ("plain", "clip", "levers", "all")}
    plain = tables["plain"]
    for kind, table in tables.items():  # every variant set includes the base itself: never worse, same bytes
        assert table.keys() == plain.keys()
        for key in plain:
            assert table[key][0] <= plain[key][0] and table[key][1] == plain[key][1], kind
    assert any("vclip=true" in entry[2] for entry in tables["clip"].values())  # on Gaussian data clipping wins somewhere
    for key in plain:
        assert tables["all"][key][0] <= min(tables["clip"][key][0], tables["levers"][key][0])
    with pytest.raises(SpecError, match="variants"):
        parse_auto("auto:bpv=3,variants=lots")


def test_qvg_family_takes_separate_key_and_value_widths():
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(64, 2, 64, generator=gen), torch.randn(64, 2, 64, generator=gen)

    def decoded(spec):
        codec = codecs.get(spec)
        return codec.decode(codec.encode(k, v, codec.layout(GEOM, 32)))

    mixed, wide, narrow = (decoded(f"qvg:centroids=4,{w}") for w in ("kbits=4,vbits=2", "bits=4", "bits=2"))
    assert torch.equal(mixed[0], wide[0]) and torch.equal(mixed[1], narrow[1])  # the centroids do not depend on widths
    layout = codecs.get("qvg:centroids=4,kbits=4,vbits=2").layout(GEOM, 32)
    assert layout.page.fields["k_codes"].nbytes == 2 * layout.page.fields["v_codes"].nbytes
    with pytest.raises(SpecError, match="kbits=5"):
        codecs.get("quantwm:kbits=5").layout(GEOM, 32)


def test_auto_plans_widths_of_a_quantwm_base():
    base = "quantwm:centroids=4,rank=2,kchannel=32,sink=4,prerope=true,vrot=hadamard"
    first = plan(f"auto:bpv=4.6,widths=2-4,base={base.replace(',', ';')}")
    again = plan(f"auto:bpv=4.6,widths=2-4,base={base.replace(',', ';')}")
    assert first.specs == again.specs and first.bits_per_value <= 4.6
    parsed = [codecs.parse(s) for s in first.specs]
    assert all(p.name == "quantwm" and p.rank == 2 for p in parsed)
    assert {(p.key_bits, p.value_bits) for p in parsed} != {(2, 2)}  # the budget bought wider codes somewhere
    # the qvg family spells clipped steps clip=true (kivi's kclip/vclip would raise SpecError here)
    from kvbackend.tools.auto import _error_table, _ladders

    q, k, v = capture()
    spec = parse_auto(f"auto:bpv=4.6,widths=2-4,variants=clip,base={base.replace(',', ';')}")
    table = _error_table(spec, _ladders(spec), q, k, v, GEOM, 32, 128, Rotary.default(64, 10000.0))
    assert any(codecs.parse(entry[2]).clip for entry in table.values())  # clipping wins somewhere on Gaussian data
    clipped = plan(f"auto:bpv=4.6,widths=2-4,variants=clip,base={base.replace(',', ';')}")
    assert clipped.bits_per_value <= 4.6 and all(codecs.parse(s).name == "quantwm" for s in clipped.specs)


def test_stages_are_a_ladder_of_the_plan():
    base = "qvg:centroids=4,kchannel=32,sink=4,prerope=true,vrot=hadamard".replace(",", ";")
    wide = plan(f"auto:bpv=6,widths=2-4,stages=1-2,base={base}")
    assert wide.specs == plan(f"auto:bpv=6,widths=2-4,stages=1-2,base={base}").specs and wide.bits_per_value <= 6
    parsed = [codecs.parse(s) for s in wide.specs]
    assert {p.stages for p in parsed} <= {1, 2} and any(p.stages == 2 for p in parsed)  # the budget bought stages
    with pytest.raises(SpecError, match="stages"):
        parse_auto("auto:bpv=3,stages=1-2")  # the default base (kivi) has no stages


def test_lever_variants_toggle_the_bases_own_key_frame():
    """variants=levers tries the key frame the base stores keys in: page-relative keys on and off for a
    pagerope base (not pre-RoPE keys on top of it, which no codec takes), pre-RoPE keys otherwise."""
    from kvbackend import codecs
    from kvbackend.tools.auto import candidate_specs

    page = candidate_specs(parse_auto("auto:bpv=3,widths=2,variants=levers,base=kivi:group=16;pagerope=true"))
    pre = candidate_specs(parse_auto("auto:bpv=3,widths=2,variants=levers,base=kivi:group=16;prerope=true"))
    for texts, frame in ((page, "pagerope"), (pre, "prerope")):
        parsed = [codecs.get(t).levers for t in texts]  # every candidate is a valid codec
        assert {getattr(lv, frame) for lv in parsed} == {False, True}
        assert not any(lv.prerope and lv.pagerope for lv in parsed)
        assert {lv.vrot for lv in parsed} == {"none", "hadamard"}


def test_key_outliers_are_a_ladder_of_the_plan():
    base = "quantwm:centroids=4,kchannel=32,rank=0,clip=true,vcluster=false,sink=4,prerope=true".replace(",", ";")
    spec = f"auto:bpv=4.2,widths=2-3,outliers=0-8-32,base={base}"
    chosen = plan(spec)
    assert chosen.specs == plan(spec).specs and chosen.bits_per_value <= 4.2  # deterministic, within budget
    parsed = [codecs.parse(s) for s in chosen.specs]
    assert {p.outliers for p in parsed} <= {0, 8, 32} and any(p.outliers for p in parsed)  # the budget bought some
    narrow = plan(spec.replace("outliers=0-8-32", "outliers=0"))
    assert chosen.error < narrow.error  # and they lowered the attention error the planner minimises
    with pytest.raises(SpecError, match="outliers"):
        parse_auto("auto:bpv=3,outliers=0-16")  # the default base (kivi) stores no outliers
    with pytest.raises(SpecError, match="outliers"):
        parse_auto(f"auto:bpv=3,outliers=0-9999,base={base}")


def test_planseeds_average_each_entry_over_seedings_and_keep_the_bases_seed():
    """planseeds=N: every table entry's error is the mean of the entries planned from the base's seed and the N - 1
    after it (the bytes do not move with the seed), and the specs served keep the base's own seed."""
    from kvbackend.tools.auto import _error_table, _ladders

    q, k, v = capture()
    base = "quantwm:centroids=4,rank=2,kchannel=32,sink=4,prerope=true,vrot=hadamard,seed=5".replace(",", ";")
    rot = Rotary.default(64, 10000.0)

    def table(text):
        spec = parse_auto(text)
        return _error_table(spec, _ladders(spec), q, k, v, GEOM, 32, 128, rot)

    averaged = table(f"auto:bpv=4.6,widths=2-4,planseeds=3,base={base}")
    singles = [table(f"auto:bpv=4.6,widths=2-4,base={base.replace('seed=5', f'seed={s}')}") for s in (5, 6, 7)]
    assert averaged.keys() == singles[0].keys()
    for key, (error, stored, text) in averaged.items():
        errors = [single[key][0] for single in singles]
        assert error == pytest.approx(sum(errors) / 3, rel=1e-12)
        assert stored == singles[0][key][1] == singles[2][key][1]
        assert codecs.parse(text).seed == 5
    assert len({round(single[key][0], 12) for single in singles for key in single}) > len(singles[0])  # seeds differ
    planned = plan(f"auto:bpv=4.6,widths=2-4,planseeds=3,base={base}")
    assert planned.specs == plan(f"auto:bpv=4.6,widths=2-4,planseeds=3,base={base}").specs
    assert all(codecs.parse(s).seed == 5 for s in planned.specs) and planned.bits_per_value <= 4.6
    with pytest.raises(SpecError, match="planseeds"):
        parse_auto("auto:bpv=3,planseeds=2,base=kivi:group=32")  # KIVI draws no seeds
    with pytest.raises(SpecError):
        parse_auto(f"auto:bpv=3,planseeds=0,base={base}")
