"""Per-layer options by relative depth: one spec string that gives each layer of any model its own codec.

``depth:base=SPEC,OPTION=VALUE@LO-HI/VALUE@LO-HI,...`` is ``SPEC`` (its own commas written as ``;``) in every
layer, with OPTION set to VALUE in the layers whose relative depth ``layer / num_layers`` lies in ``[LO, HI)``.
Bands of one option apply in the order written, a later band winning where two overlap; layers outside every band
keep the base's value. For example ``depth:base=kivi:bits=2;group=64,kbits=3@0.15-0.3`` gives 3-bit keys to layers
5-8 of a 30-layer model and 5-9 of a 32-layer one.

A depth spec expands to one codec spec per layer (`layer_specs`): the paged cache (``CacheConfig.codec``),
``KVBackendCache(codec=...)`` and ``kvbackend eval --codec`` take it where they take a codec spec, and every
expanded layer is an ordinary per-layer plan (its layout and fingerprint are each layer's own).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbackend import codecs
from kvbackend.errors import SpecError
from kvbackend.spec import SpecKind, spec_kind, split_spec

log = logging.getLogger(__name__)
_UNCOVERED: set = set()  # (band, layers) already reported: expansions repeat for every cache and check


@dataclass(frozen=True)
class Band:
    option: str  # an option of the base codec (or one of its levers)
    value: str  # as written in a spec
    lo: float  # relative depth, inclusive
    hi: float  # relative depth, exclusive

    def covers(self, layer: int, num_layers: int) -> bool:
        return self.lo <= layer / num_layers < self.hi


@dataclass(frozen=True)
class DepthSpec:
    base: str  # a page codec spec, with commas
    bands: tuple[Band, ...]

    def layer_specs(self, num_layers: int) -> list[str]:
        """One codec spec per layer: the base with each covering band's value (the last band written wins)."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise SpecError(f"a depth: spec needs a positive layer count, got {num_layers!r}")
        name, base_options = split_spec(self.base)
        specs = []
        for layer in range(num_layers):
            options = dict(base_options)
            for band in self.bands:
                if band.covers(layer, num_layers):
                    options[band.option] = band.value
            specs.append(f"{name}:" + ",".join(f"{key}={value}" for key, value in options.items()))
        for band in self.bands:  # bands are relative: on a shallow model one may fall between two layers
            if not any(band.covers(layer, num_layers) for layer in range(num_layers)) \
                    and (band, num_layers) not in _UNCOVERED:
                _UNCOVERED.add((band, num_layers))
                log.warning("depth: %s=%s@%g-%g covers no layer of a %d-layer model (layer / %d never falls in "
                            "[%g, %g)); those layers keep the base's value", band.option, band.value, band.lo,
                            band.hi, num_layers, num_layers, band.lo, band.hi)
        return specs


def is_depth(text) -> bool:
    return spec_kind(text) is SpecKind.DEPTH


def parse_depth(text: str) -> DepthSpec:
    """The DepthSpec of ``text``; every value of every band is checked by parsing the base with it.

    Raises:
        SpecError: not a depth spec, no or a nested base, a malformed band, a depth outside 0..1, or a value the
            base codec refuses.
    """
    name, options = split_spec(text)
    if name != "depth":
        raise SpecError(f"{text!r} is not a depth: spec")
    if "base" not in options:
        raise SpecError(f"{text!r}: a depth: spec needs base=SPEC (the codec of every layer, its commas written as ';')")
    base = options.pop("base").replace(";", ",")
    if spec_kind(base) is not SpecKind.CODEC:
        raise SpecError(f"{text!r}: base={base!r} must be a page codec, not an {split_spec(base)[0]}: spec")
    try:
        codecs.get(base)
    except SpecError as exc:
        raise SpecError(f"{text!r}: base={base!r}: {exc}") from None
    if not options:
        raise SpecError(f"{text!r}: no option set by depth; write e.g. kbits=3@0.15-0.3 (or use the base spec alone)")
    base_name, base_options = split_spec(base)
    bands = []
    for option, written in options.items():
        for part in written.split("/"):
            value, at, span = part.partition("@")
            lo, dash, hi = span.partition("-")
            try:
                lo_f, hi_f = float(lo), float(hi)
            except ValueError:
                lo_f = hi_f = math.nan
            if not (value and at and dash) or not 0.0 <= lo_f < hi_f <= 1.0:
                raise SpecError(f"{text!r}: {option}={written!r}: each band is VALUE@LO-HI with 0 <= LO < HI <= 1 "
                                f"(relative depth, LO included), bands separated by '/', e.g. {option}=3@0.15-0.3")
            trial = f"{base_name}:" + ",".join(f"{k}={v}" for k, v in {**base_options, option: value}.items())
            try:
                codecs.get(trial)
            except SpecError as exc:
                raise SpecError(f"{text!r}: {option}={value} in layers {lo}-{hi}: {exc}") from None
            bands.append(Band(option, value, lo_f, hi_f))
    return DepthSpec(base, tuple(bands))


def layer_specs(codec: str | Sequence[str], num_layers: int) -> list[str]:
    """Every layer's codec spec: a depth: spec expanded, one spec repeated, or a per-layer sequence as given
    (whose entries must be page codec specs).

    Raises:
        SpecError: a malformed depth: spec, or a depth: spec inside a per-layer sequence.
    """
    if isinstance(codec, str):
        return parse_depth(codec).layer_specs(num_layers) if is_depth(codec) else [codec] * num_layers
    specs = list(codec)
    nested = [spec for spec in specs if is_depth(spec)]
    if nested:
        raise SpecError(f"a per-layer plan holds one codec spec per layer, not a depth: spec ({nested[0]!r}); give "
                        "the depth: spec alone as the cache's codec")
    return specs


def check_layouts(codec: str | Sequence[str], geometry, page_size: int) -> None:
    """Build every distinct layer's page layout for ``geometry`` (what a cache would build), so that a spec the
    model's pages cannot take fails before a model loads.

    Raises:
        SpecError: a bad spec, or a layer's codec that cannot lay out these pages.
    """
    for spec in dict.fromkeys(layer_specs(codec, geometry.num_layers)):
        codecs.get(spec).layout(geometry, page_size)
