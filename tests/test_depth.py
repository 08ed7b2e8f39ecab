"""`depth:` specs: a base codec with options by relative layer depth, expanded to one codec spec per layer wherever
a codec spec is taken (the paged cache, transformers, `kvbackend eval`), and refused with a clear error elsewhere."""

import dataclasses

import pytest
import torch

from kvbackend import CacheConfig, Geometry, KVCache, codecs
from kvbackend.depth import layer_specs, parse_depth
from kvbackend.errors import SpecError
from kvbackend.tools.seeds import seeded

BASE = "kivi:bits=2,group=16"
SPEC = "depth:base=kivi:bits=2;group=16,kbits=3@0.25-0.5,vbits=4@0-0.25/3@0.75-1"


def _option(spec, key):
    return dict(part.split("=") for part in spec.partition(":")[2].split(","))[key]


def test_bands_follow_relative_depth_on_any_layer_count():
    for layers in (4, 8, 30):
        specs = layer_specs(SPEC, layers)
        assert len(specs) == layers
        for i, spec in enumerate(specs):
            f = i / layers
            assert _option(spec, "kbits") == "3" if 0.25 <= f < 0.5 else "kbits" not in spec.partition(":")[2]
            want_v = "4" if f < 0.25 else "3" if f >= 0.75 else None
            assert (_option(spec, "vbits") if "vbits" in spec else None) == want_v
            assert _option(spec, "group") == "16"


def test_a_later_band_wins_where_two_overlap():
    specs = layer_specs("depth:base=kivi:bits=2,kbits=3@0-1/4@0.5-1", 10)
    assert [_option(s, "kbits") for s in specs] == ["3"] * 5 + ["4"] * 5


def test_one_spec_and_a_plan_pass_through():
    assert layer_specs(BASE, 3) == [BASE] * 3
    assert layer_specs((BASE, "fp8"), 2) == [BASE, "fp8"]


@pytest.mark.parametrize("spec,match", [
    ("depth:kbits=3@0-0.5", "needs base=SPEC"),
    ("depth:base=kivi:bits=2", "no option set by depth"),
    ("depth:base=auto:bpv=2.6,kbits=3@0-1", "must be a page codec"),
    ("depth:base=nosuch,kbits=3@0-1", "nosuch"),
    ("depth:base=kivi:bits=2,kbits=3", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=3@0.5", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=3@0.5-0.5", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=3@0.2-1.5", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=3@a-b", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=@0-1", "VALUE@LO-HI"),
    ("depth:base=kivi:bits=2,kbits=5@0-1", "kbits=5 in layers 0-1"),
    ("depth:base=kivi:bits=2,nosuch=1@0-1", "nosuch"),
])
def test_malformed_depth_specs_are_refused_with_the_reason(spec, match):
    with pytest.raises(SpecError, match=match):
        parse_depth(spec)


def test_a_depth_spec_is_no_page_codec_and_no_layer_of_a_plan():
    with pytest.raises(SpecError, match="depth: specs give each layer its own codec"):
        codecs.get(SPEC)
    with pytest.raises(SpecError, match="not a depth: spec"):
        layer_specs((BASE, SPEC), 2)
    with pytest.raises(SpecError, match="positive layer count"):
        parse_depth(SPEC).layer_specs(0)


def test_the_paged_cache_serves_the_expanded_plan():
    """`CacheConfig(codec=depth:...)` is the per-layer plan it expands to: the same layouts, the same fingerprint,
    and the same stored bytes and reads."""
    geometry = Geometry(4, 2, 64, torch.float32)
    expanded = tuple(layer_specs(SPEC, 4))
    assert len(set(expanded)) == 4  # 4-bit values, 3-bit keys, the base, 3-bit values
    cfg = dict(page_size=16, chunk_pages=2, dense_pages=16, packed_pages=16)
    by_depth = KVCache(geometry, CacheConfig(codec=SPEC, **cfg))
    by_plan = KVCache(geometry, CacheConfig(layer_codecs=expanded, **cfg))
    assert by_depth.fingerprint == by_plan.fingerprint
    assert [lay.page_bytes for lay in by_depth.layouts] == [codecs.get(s).layout(geometry, 16).page_bytes
                                                             for s in expanded]
    assert by_depth.layouts[0].page_bytes != by_depth.layouts[1].page_bytes  # 4-bit values against 3-bit keys
    gen = torch.Generator().manual_seed(0)
    ids = []
    for cache in (by_depth, by_plan):
        rid, _ = cache.add_request()
        gen.manual_seed(0)
        for layer in range(4):
            cache.append(rid, layer, torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen))
        ids.append(rid)
    for layer in range(4):
        a, b = by_depth.read(ids[0], layer), by_plan.read(ids[1], layer)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert by_depth.stats().packed_bytes == by_plan.stats().packed_bytes > 0


def test_seeds_go_to_the_base():
    spec = seeded("depth:base=qvg:centroids=4,kbits=3@0-0.5", 3)
    assert parse_depth(spec).base.endswith("seed=3")
    assert all(_option(s, "seed") == "3" for s in layer_specs(spec, 4))
    assert seeded("depth:base=kivi:bits=2,kbits=3@0-0.5", 3) is None  # kivi draws no seed


def test_eval_checks_a_depth_spec_per_layer():
    from kvbackend.tools.evaluate import EvalSettings, check_specs

    geometry = Geometry(30, 3, 64, torch.bfloat16)
    check_specs([SPEC], EvalSettings(), geometry)
    with pytest.raises(SpecError, match="a layer's spec"):  # 64 is no multiple of 48: only the banded layers fail
        check_specs(["depth:base=kivi:bits=2;group=16,group=48@0.5-1"], EvalSettings(), geometry)


def test_transformers_cache_takes_a_depth_spec(tiny_llama):
    pytest.importorskip("transformers")
    from kvbackend.integration.transformers import KVBackendCache

    spec = "depth:base=kivi:bits=2;group=16,kbits=4@0.5-1"
    cache = KVBackendCache(tiny_llama.config, codec=spec, page_size=16, chunk_pages=2)
    assert cache.layer_specs == layer_specs(spec, 2)
    assert _option(cache.layer_specs[1], "kbits") == "4" and "kbits" not in cache.layer_specs[0]


def test_layouts_are_checked_per_layer_before_a_model_loads():
    from kvbackend.depth import check_layouts

    geometry = Geometry(30, 3, 64, torch.bfloat16)
    check_layouts(SPEC, geometry, 64)
    check_layouts(BASE, geometry, 64)
    with pytest.raises(SpecError):  # layers 15-29 take 48-token groups, which 64-token pages cannot hold
        check_layouts("depth:base=kivi:bits=2;group=16,group=48@0.5-1", geometry, 64)


def test_the_recommended_spec_is_the_one_measured_and_documented():
    """`RECOMMENDED_SPEC` expands on SmolLM2's 30 layers to the plan session 39 measured (p27l18k4f: 3-bit keys in
    layers 7, 8 and 20 and 4-bit keys in layer 18; no outliers in layers 0-2, 6-8, 11-13, 16, 18-20, 22, 25 and 27-29,
    16 elsewhere; 8 Lloyd steps everywhere, keys clustered under the queries' channel weights at kmetric=0.5, heavy
    keys first at heavy=4 and heavyz=3, the values' clipped step widened by vstep=1.15) over the recommended page
    codec, and on a 32-layer model to 3-bit keys in layers 8, 9 and 21 and 4-bit keys in layer 19, without outliers
    in the wider-key layers; the README names it on one line. `SESSION36_SPEC` is the same without the 4-bit layer
    (3-bit there) and the seven outlier-free layers of session 39."""
    import pathlib

    from kvbackend.spec import QUALITY_SPEC, RECOMMENDED_PAGE_SPEC, RECOMMENDED_SPEC, SESSION36_SPEC

    assert QUALITY_SPEC != RECOMMENDED_SPEC  # see the next test
    page = codecs.parse(RECOMMENDED_PAGE_SPEC)
    wider = {7: 3, 8: 3, 18: 4, 20: 3}
    no_outliers = {0, 1, 2, 6, 7, 8, 18, 20, 27, 28, 29}
    for spec, session39 in ((RECOMMENDED_SPEC, True), (SESSION36_SPEC, False)):
        for layer, layer_spec in enumerate(layer_specs(spec, 30)):
            parsed = codecs.parse(layer_spec)
            assert parsed.iters == 8 and parsed.centroids == 32 and parsed.rank == 4 and parsed.kmetric == 0.5
            assert parsed.heavy == 4 and parsed.heavyz == 3 and parsed.vstep == 1.15
            bits = wider.get(layer, 0) if session39 else (3 if layer in wider else 0)  # 0: the base's 2 bits
            assert parsed.kbits == bits, layer
            off = no_outliers | ({11, 12, 13, 16, 19, 22, 25} if session39 else set())
            assert parsed.outliers == (0 if layer in off else 16), layer
            assert dataclasses.replace(parsed, iters=page.iters, kbits=page.kbits, outliers=page.outliers,
                                       kmetric=page.kmetric, heavy=page.heavy, heavyz=page.heavyz,
                                       vstep=page.vstep) == page, layer
            assert codecs.get(layer_spec).levers == codecs.get(RECOMMENDED_PAGE_SPEC).levers
    on_32 = [codecs.parse(s) for s in layer_specs(RECOMMENDED_SPEC, 32)]
    assert {i: c.kbits for i, c in enumerate(on_32) if c.kbits} == {8: 3, 9: 3, 19: 4, 21: 3}
    assert all(c.outliers == 0 for c in on_32 if c.kbits)
    assert [i for i, s in enumerate(layer_specs(SESSION36_SPEC, 32)) if codecs.parse(s).kbits == 3] == [8, 9, 19, 21]
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    if readme.exists():  # a source checkout (an installed wheel has no README beside its tests)
        assert f"\nThe recommended spec is `{RECOMMENDED_SPEC}`.\n" in readme.read_text()


def test_the_quality_spec_is_session_36s_spec_with_whole_rows_where_measured():
    """`QUALITY_SPEC` (sessions 34-35: P45) expands on SmolLM2's 30 layers to `SESSION36_SPEC`'s layers, except: a
    whole key row per page and head in layers 0-2, 4-8, 18 and 20, no PSAC rows in layers 0-8, 18 and 20, and no
    outliers in layers 4-5 either; the README names it on one line."""
    import pathlib

    from kvbackend.spec import QUALITY_SPEC, SESSION36_SPEC

    whole = {0, 1, 2, 4, 5, 6, 7, 8, 18, 20}
    for layer, (spec, base) in enumerate(zip(layer_specs(QUALITY_SPEC, 30), layer_specs(SESSION36_SPEC, 30))):
        parsed, recommended = codecs.parse(spec), codecs.parse(base)
        assert parsed.whole == (1 if layer in whole else 0), layer
        assert parsed.rank == (0 if layer in whole | {3} else 4), layer
        assert parsed.outliers == (0 if layer in whole else recommended.outliers), layer
        assert dataclasses.replace(parsed, whole=0, rank=recommended.rank, outliers=recommended.outliers) \
            == recommended, layer
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    if readme.exists():
        assert f"\nThe quality spec is `{QUALITY_SPEC}`.\n" in readme.read_text()


def test_a_band_that_covers_no_layer_is_reported_once(caplog):
    """Bands are relative depths: on a shallow model a narrow band can fall between two layers and change nothing,
    which is logged (once per band and layer count), not silent."""
    import logging

    from kvbackend import depth

    text = "depth:base=kivi:bits=2;group=16,kbits=3@0.01-0.02/4@0.5-1"
    with caplog.at_level(logging.WARNING, logger="kvbackend.depth"):
        specs = depth.parse_depth(text).layer_specs(30)
        depth.parse_depth(text).layer_specs(30)
    assert specs[0] == specs[1] and "kbits=4" in specs[15]
    reported = [r.getMessage() for r in caplog.records if "covers no layer" in r.getMessage()]
    assert len(reported) == 1 and "kbits=3@0.01-0.02" in reported[0] and "30-layer" in reported[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbackend.depth"):
        depth.parse_depth(text).layer_specs(100)  # layer 1 of 100 lies in [0.01, 0.02)
    assert not [r for r in caplog.records if "covers no layer" in r.getMessage()]


def test_a_space_before_the_colon_names_the_same_family():
    """`kivi :bits=2` and `auto :bpv=2.5` were taken, while `depth :...` and `alignpred :...` were "unknown codec"
    (the family was read from the name with its space)."""
    from kvbackend.spec import SpecKind, spec_kind

    assert spec_kind("depth :base=kivi,kbits=3@0-0.5") is SpecKind.DEPTH
    assert spec_kind(" alignpred :error=2x") is SpecKind.ALIGNPRED
    assert spec_kind("auto\t:bpv=2.5") is SpecKind.AUTO
    spaced = KVCache(Geometry(2, 2, 64), CacheConfig(codec="depth :base=kivi:bits=2;group=64,kbits=3@0-0.5",
                                                     dense_pages=4, packed_pages=4))
    plain = KVCache(Geometry(2, 2, 64), CacheConfig(codec="depth:base=kivi:bits=2;group=64,kbits=3@0-0.5",
                                                    dense_pages=4, packed_pages=4))
    assert [c.spec_string for c in spaced.codecs] == [c.spec_string for c in plain.codecs]
    with pytest.raises(SpecError, match="is an alignpred: spec, not a page codec"):
        KVCache(Geometry(2, 2, 64), CacheConfig(codec="alignpred :error=2x", dense_pages=4, packed_pages=4))
