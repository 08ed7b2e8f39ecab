"""Codec registry: ``kvbackend.codecs.get("qvg:bits=2,centroids=16")``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvbackend.errors import SpecError
from kvbackend.levers import Levers, split_levers
from kvbackend.spec import SpecKind, build_spec, spec_kind, split_spec
from kvbackend.codecs.base import Codec, CodecState, EncodedChunk, check_kv
from kvbackend.codecs.chw import ChwCodec, ChwSpec
from kvbackend.codecs.floats import FloatCodec, FloatSpec
from kvbackend.codecs.heads import HeadsCodec, HeadsSpec
from kvbackend.codecs.kivi import KIVICodec, KIVISpec
from kvbackend.codecs.quantwm import QuantWMCodec, QuantWMSpec
from kvbackend.codecs.qvg import QVGCodec, QVGSpec
from kvbackend.codecs.rtn import RTNCodec, RTNSpec


@dataclass(frozen=True)
class _Entry:
    spec_type: type
    codec_type: Callable[[Any], Codec]
    defaults: dict[str, Any]
    summary: str


_REGISTRY: dict[str, _Entry] = {
    "identity": _Entry(FloatSpec, FloatCodec, {}, "lossless: the model's own dtype"),
    "fp16": _Entry(FloatSpec, FloatCodec, {}, "float16 values"),
    "bf16": _Entry(FloatSpec, FloatCodec, {}, "bfloat16 values"),
    "fp8": _Entry(FloatSpec, FloatCodec, {}, "float8 e4m3 values (K/V past 432 are refused)"),
    "rtn": _Entry(RTNSpec, RTNCodec, {}, "round-to-nearest per token, channel groups"),
    "kivi": _Entry(KIVISpec, KIVICodec, {}, "keys per channel, values per token"),
    "qvg": _Entry(QVGSpec, QVGCodec, {"stages": 1, "group": 64}, "k-means smoothing + INT2 residual"),
    "qvg-pro": _Entry(QVGSpec, QVGCodec, {"stages": 4, "group": 16}, "4 residual stages, groups of 16"),
    "quantwm": _Entry(QuantWMSpec, QuantWMCodec, {"stages": 1, "group": 64},
                      "qvg + query-aware centroid choice (QSAC) + INT8 key correction along query directions (PSAC)"),
    "chw": _Entry(ChwSpec, ChwCodec, {}, "a key width per channel (klt's page form), values per token "
                  "(Triton kernels on CUDA in channel order; order=lane: torch reference only)"),
    # the registry's own factory builds each head's codec (no import of this module from heads.py)
    "heads": _Entry(HeadsSpec, lambda spec: HeadsCodec(spec, get), {},
                    "a base codec with widths, stages or outliers per KV head (torch reference only)"),
}


def register(name: str, spec_type: type, codec_type: Callable[[Any], Codec], defaults: dict[str, Any] | None = None,
             summary: str = "") -> None:
    """Add a codec to the registry (later issues and third parties add theirs this way)."""
    _REGISTRY[name] = _Entry(spec_type, codec_type, dict(defaults or {}), summary)


def names() -> list[str]:
    return sorted(_REGISTRY)


def parse(text: str) -> Any:
    """Parse a spec string into its typed spec dataclass.

    Raises:
        SpecError: unknown codec (the message lists them), unknown option, or a bad value.
    """
    return _parse_with_levers(text)[0]


def _parse_with_levers(text: str) -> tuple[Any, Levers]:
    name, options = split_spec(text)
    entry = _REGISTRY.get(name)
    if entry is None and spec_kind(text) is not SpecKind.CODEC:
        article = "an" if name[0] in "aeiou" else "a"
        raise SpecError(f"{text!r} is {article} {name}: spec, not a page codec: `kvbackend eval` runs it (auto: plans "
                        "are chosen on a prompt; alignpred: formats are file-tier formats, tiers.persist; depth: "
                        "specs give each layer its own codec: a KVCache, KVBackendCache and `kvbackend eval` "
                        "expand them per layer; klt: is a sequence-level format, `kvbackend eval --calibration`)")
    if entry is None:
        raise SpecError(f"unknown codec {name!r}; valid codecs: {', '.join(names())}")
    options, levers = split_levers(options, name)
    return build_spec(entry.spec_type, name, options, entry.defaults), levers


def get(spec: str | Any) -> Codec:
    """A codec instance for a spec string (or an already parsed spec)."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str) and getattr(spec, "name", None) not in _REGISTRY:
        raise SpecError(f"a codec spec is a string such as 'kivi:bits=2' (or a parsed spec), got {spec!r}")
    parsed, levers = _parse_with_levers(spec) if isinstance(spec, str) else (spec, Levers())
    codec = _REGISTRY[parsed.name].codec_type(parsed)
    codec.levers = levers
    return codec


__all__ = ["Codec", "CodecState", "EncodedChunk", "check_kv", "get", "parse", "names", "register", "SpecError"]
