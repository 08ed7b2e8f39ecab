"""Parsing codec spec strings such as ``"qvg:bits=2,group=64,centroids=16"`` into typed dataclasses.

The grammar has three families, told apart here alone (`spec_kind`): page codecs (``kvbackend.codecs``),
``auto:`` plan searches (``kvbackend.tools.auto``, run by the evaluator) and ``alignpred:`` persistent
formats (``kvbackend.alignpred``). All three share `split_spec` and the option checks below.

Every option of a spec dataclass declares its valid values (`ranged`, `one_of`); `Checked` dataclasses
refuse anything else when built, from a string or in Python, with a `SpecError` naming the option,
its value and the valid range.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

from kvbackend.errors import SpecError

T = TypeVar("T")

_BOUND = "kvbackend.bound"  # dataclass field metadata key of an option's valid values

# One page codec for every layer, the best measured at about 2.55 bits per value through the paged cache
# (perf/NOTES.md): quantwm keys (per-channel steps over 64-token groups, 32 QSAC centroids stored as fp8, a rank-4
# PSAC correction, the 16 key entries of each page and head with the largest query-weighted error stored exactly),
# clipped steps, 4 sink tokens kept at 16 bits, Hadamard-rotated values, keys stored before RoPE. At 2.552 bpv it
# beats the previous page codec (the same without fp8 centroids and outliers, 2.573 bpv) on all six texts measured:
# KL 0.033 / 0.026 / 0.051 against 0.050 / 0.035 / 0.084 on the tuned texts (eval18), 0.036 / 0.054 / 0.037 against
# 0.045 / 0.094 / 0.050 on held-out ones (eval23), 0.026 / 0.057 / 0.062 against 0.048 / 0.072 / 0.082 at a
# 6144-token prefix (eval20). Page-relative keys (`pagerope=true`) decode faster but lose 8-62% in KL at 6144 tokens
# (eval15, eval26). What takes a single page codec uses it (`kvbackend.codecs.get`, the kernel benchmarks; the SGLang
# and vLLM adapters refuse its sink, prerope and rank levers); the base of `RECOMMENDED_SPEC`.
RECOMMENDED_PAGE_SPEC = ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,"
                         "vrot=hadamard,prerope=true,cdtype=fp8,outliers=16")

# The default of `KVBackendCache` and `kvbackend demo` (perf/NOTES.md, sessions 27-30): the page codec above with 8
# Lloyd steps, 3-bit keys in the layers at 23-30%, 59-62% and 65-68% of the depth (layers 7-8, 18 and 20 of SmolLM2's
# 30; 8-9, 19 and 21 of a 32-layer model: the layers whose key error costs most KL, by a scan of one layer at a time)
# and no key outliers there nor in the layer at 20-23% and the first and last 10%: 2.596 bpv. Session 27's bands
# (layers 6-8 and 18; they beat the page codec on every text, and per-layer plans made on each text in the mean) had
# layer 6, among the least sensitive, where layer 20, among the most, now is: lower mean KL on 13 of 14 text-prefix
# pairs measured. The keys' k-means measures distance under the chunk's query channel weights (`kmetric=0.5`, session
# 32-33: lower mean KL on 11 of 14 text-prefix pairs at the same bytes, recall probes 55 of 56 against 54 of 56),
# and per chunk and head the 4 keys of largest logit under the chunk's mean query, where they stand 3 standard
# deviations out, take their page's outlier slots and PSAC rows first (`heavy=4,heavyz=3`, session 33: lower or equal
# mean KL on all eight texts at 1536 tokens, within 1% at 6144). The values' clipped step is 1.15 times the Gaussian
# MSE-optimal one (`vstep=1.15`, session 36: 3-18% lower mean KL on all eight texts at 1536 tokens and 5-10% on the
# four measured at 6144, at the same bytes; a clipped value's shrinkage does not average out in the attention sum).
# Session 39 (p27l18k4f): layer 18's keys at 4 bits (on all three texts scanned, its key error costs most KL after
# 6144 cached tokens, session 37), paid for by no key outliers in seven more layers whose exact keys change KL least
# (layers 11-13, 16, 19, 22, 25 of 30; layer 4's outliers carry subprocess.py and stay): 2.598 bpv, lower mean KL
# than session 36's spec (`SESSION36_SPEC`) on all 18 text-prefix pairs measured (by 2.7-28.4%), recall probes 54 of
# 56 against its 55 (one more one-digit slip). The tensor-core kernel reads the 4-bit keys (H100: 254.7 us for that
# layer against 272.1 us for a 3-bit one).
RECOMMENDED_SPEC = ("depth:base=quantwm:kchannel=64;rank=4;keep=0.0625;centroids=32;clip=true;vcluster=false;sink=4;"
                    "vrot=hadamard;prerope=true;cdtype=fp8;outliers=16;iters=8;kmetric=0.5;heavy=4;heavyz=3;vstep=1.15,"
                    "kbits=3@0.23-0.3/4@0.59-0.62/3@0.65-0.68,outliers="
                    "0@0-0.1/0@0.2-0.3/0@0.36-0.45/0@0.53-0.55/0@0.59-0.68/0@0.73-0.76/0@0.83-0.86/0@0.9-1")
# The recommended spec of sessions 36-38 (the bands above without the 4-bit layer and the seven outlier-free layers:
# 3-bit keys in layers 7-8, 18 and 20); `QUALITY_SPEC` is built on it.
SESSION36_SPEC = ("depth:base=quantwm:kchannel=64;rank=4;keep=0.0625;centroids=32;clip=true;vcluster=false;sink=4;"
                  "vrot=hadamard;prerope=true;cdtype=fp8;outliers=16;iters=8;kmetric=0.5;heavy=4;heavyz=3;vstep=1.15,"
                  "kbits=3@0.23-0.3/3@0.59-0.62/3@0.65-0.68,"
                  "outliers=0@0-0.1/0@0.2-0.3/0@0.59-0.62/0@0.65-0.68/0@0.9-1")
# Session 36's recommended spec (`SESSION36_SPEC`) with whole key rows (`whole=1`, session 34) in the layers at 0-10%,
# 13-30%, 59-62% and 65-68% of the depth (layers 0-2, 4-8, 18 and 20 of SmolLM2's 30), where they take the place of
# the PSAC rows (`rank=0`) and, in layers 4-5, of the outliers: 2.597 bpv, lower mean KL than that spec on 12 of 14
# text-prefix pairs (27% on pyenv's CHANGELOG), within 0.6% on the other two, but 53 of 56 recall-probe answers as
# the exact cache gave them against its 55 (perf/NOTES.md, sessions 34-35); `vstep=1.15` as that spec (session 36:
# 1-17% lower mean KL on all 20 text-prefix pairs measured). Not the default: that, and no GPU has timed its decode
# step yet (the CUDA kernels' whole-row paths passed their tests on an H100, session 39).
QUALITY_SPEC = ("depth:base=quantwm:kchannel=64;rank=4;keep=0.0625;centroids=32;clip=true;vcluster=false;sink=4;"
                "vrot=hadamard;prerope=true;cdtype=fp8;outliers=16;iters=8;kmetric=0.5;heavy=4;heavyz=3;vstep=1.15,"
                "whole=1@0-0.1/1@0.13-0.3/1@0.59-0.62/1@0.65-0.68,rank=0@0-0.3/0@0.59-0.62/0@0.65-0.68,"
                "kbits=3@0.23-0.3/3@0.59-0.62/3@0.65-0.68,"
                "outliers=0@0-0.1/0@0.13-0.3/0@0.59-0.62/0@0.65-0.68/0@0.9-1")


@dataclass(frozen=True)
class Range:
    """Valid numbers of an option: ``lo..hi`` inclusive (``lo`` excluded when ``open_lo``)."""

    lo: float
    hi: float
    open_lo: bool = False

    def __contains__(self, value: float) -> bool:
        return (self.lo < value if self.open_lo else self.lo <= value) and value <= self.hi

    def __str__(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        return f"({lo}, {hi}]" if self.open_lo else f"{lo}..{hi}"


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Choices:
    """Valid values of an option, listed."""

    values: tuple

    def __contains__(self, value: Any) -> bool:
        return value in self.values

    def __str__(self) -> str:
        return ", ".join(str(v) for v in self.values)


def ranged(default: Any, lo: float, hi: float, open_lo: bool = False) -> Any:
    """A spec dataclass field whose value must lie in ``lo..hi`` (see `check_options`)."""
    return dataclasses.field(default=default, metadata={_BOUND: Range(lo, hi, open_lo)})


def one_of(default: Any, values: Sequence) -> Any:
    """A spec dataclass field whose value must be one of ``values`` (see `check_options`)."""
    return dataclasses.field(default=default, metadata={_BOUND: Choices(tuple(values))})


def bound_of(field: dataclasses.Field) -> Range | Choices | None:
    """The declared valid values of a spec field (None: any value of its type)."""
    return field.metadata.get(_BOUND)


def check_options(spec: Any) -> None:
    """Raise `SpecError` for an option of the spec dataclass ``spec`` of the wrong type or outside its
    declared range or choices, naming the option, its value and the valid values. Called by the spec
    dataclasses' ``__post_init__`` (`Checked`), so specs built in Python are checked as parsed ones are."""
    hints = _hints(type(spec))
    name = f"{spec.name}: " if isinstance(getattr(spec, "name", None), str) else ""
    for field in dataclasses.fields(spec):
        if field.name == "name" or not field.init:
            continue
        value, kind, bound = getattr(spec, field.name), hints.get(field.name), bound_of(field)
        valid = f"; valid: {bound}" if bound is not None else ""
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"{name}option {field.name}={value!r} must be an integer{valid}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float and not (number and math.isfinite(value)):
            raise SpecError(f"{name}option {field.name}={value!r} must be a finite number{valid}")
        if kind is bool and not isinstance(value, bool):
            raise SpecError(f"{name}option {field.name}={value!r} must be true or false")
        if kind is str and not isinstance(value, str):
            raise SpecError(f"{name}option {field.name}={value!r} must be a string{valid}")
        if bound is not None and value not in bound:
            problem = "is out of range" if isinstance(bound, Range) else "is not supported"
            raise SpecError(f"{name}option {field.name}={value!r} {problem}; valid: {bound}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


class Checked:
    """Mixin of a spec dataclass: its options are checked (`check_options`) whenever it is built."""

    def __post_init__(self) -> None:
        check_options(self)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SpecKind(enum.Enum):
    CODEC = "codec"  # a page codec (kvbackend.codecs.get)
    AUTO = "auto"  # a per-layer plan search, chosen on a prompt (kvbackend.tools.auto.parse_auto)
    ALIGNPRED = "alignpred"  # the error-bounded persistent format (kvbackend.alignpred.parse_alignpred)
    DEPTH = "depth"  # a base codec with options by relative layer depth (kvbackend.depth.parse_depth)
    KLT = "klt"  # keys on frozen query-weighted axes, a sequence-level format (kvbackend.klt.parse_klt)


def spec_kind(text: str) -> SpecKind:
    """The family of the spec grammar ``text`` belongs to, from its name alone (options unparsed)."""
    name = text.partition(":")[0].strip().lower() if isinstance(text, str) else ""
    return {"auto": SpecKind.AUTO, "alignpred": SpecKind.ALIGNPRED, "depth": SpecKind.DEPTH,
            "klt": SpecKind.KLT}.get(name, SpecKind.CODEC)


def split_spec(text: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:a=1,b=2"`` into ``("name", {"a": "1", "b": "2"})``."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"a codec spec must be a non-empty string, got {text!r}")
    name, _, rest = text.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"option {item!r} in spec {text!r} is not of the form key=value")
        key = key.strip()
        if key in options:
            raise SpecError(f"option {key!r} given twice in spec {text!r}")
        options[key] = value.strip()
    return name.strip().lower(), options


def _convert(raw: str, kind: Any, key: str, spec_name: str, valid: Any = None) -> Any:
    """``raw`` as a ``kind`` value; ``valid`` (the option's range or choices) goes into the error."""
    try:
        if kind is bool:
            low = raw.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return str(raw)
    except ValueError:
        valid = "true, false" if kind is bool else valid
        raise SpecError(f"option {key}={raw!r} of codec {spec_name!r} is not a valid {kind.__name__}"
                        f"{_valid_suffix(valid)}") from None


def _valid_suffix(valid: Any) -> str:
    return f"; valid: {valid}" if valid is not None else ""


def build_spec(cls: type[T], spec_name: str, options: dict[str, str], defaults: dict[str, Any] | None = None) -> T:
    """Build the dataclass ``cls`` from string options, with typed conversion.

    Raises:
        SpecError: an unknown option (the message lists the valid ones), a value of the wrong type, or
            (for `Checked` dataclasses) a value outside the option's range.
    """
    hints = get_type_hints(cls)
    bounds = {f.name: bound_of(f) for f in dataclasses.fields(cls)}
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "name"]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise SpecError(
            f"unknown option(s) {', '.join(unknown)} for codec {spec_name!r}; valid options: {', '.join(fields)}"
        )
    values: dict[str, Any] = dict(defaults or {})
    for key, raw in options.items():
        values[key] = _convert(raw, hints[key], key, spec_name, bounds[key])
    return cls(name=spec_name, **values)  # type: ignore[call-arg]


def format_spec(spec: Any) -> str:
    """The canonical string of a spec dataclass: its name and every option, in field order."""
    parts = [
        f"{f.name}={_format_value(getattr(spec, f.name))}" for f in dataclasses.fields(spec) if f.name != "name"
    ]
    return f"{spec.name}:{','.join(parts)}" if parts else spec.name


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
