"""Parsing codec spec strings such as ``"qvg:bits=2,group=64,centroids=16"`` into typed dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, get_type_hints

from .errors import SpecError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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


def _convert(raw: str, kind: Any, key: str, spec_name: str) -> Any:
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
        raise SpecError(f"option {key}={raw!r} of codec {spec_name!r} is not a valid {kind.__name__}") from None


def build_spec(cls: type[T], spec_name: str, options: dict[str, str], defaults: dict[str, Any] | None = None) -> T:
    """Build the dataclass ``cls`` from string options, with typed conversion.

    Raises:
        SpecError: an unknown option (the message lists the valid ones) or a value of the wrong type.
    """
    hints = get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "name"]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise SpecError(
            f"unknown option(s) {', '.join(unknown)} for codec {spec_name!r}; valid options: {', '.join(fields)}"
        )
    values: dict[str, Any] = dict(defaults or {})
    for key, raw in options.items():
        values[key] = _convert(raw, hints[key], key, spec_name)
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
