"""``alignpred:error=…`` spec strings: the error budget and the codec's options."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbackend.errors import SpecError
from kvbackend.spec import SpecKind, spec_kind, split_spec

MAX_RELATIVE = 100.0  # largest budget as a multiple of FP8's NRMSE (FP8's is a few percent: 100x is no bound)
ALIGNS = ("none", "heads", "layers")
PREDICTS = ("mean", "prev")
FITS = ("group", "frozen")
QUANTS = ("trellis", "lattice")


@dataclass(frozen=True)
class ErrorBudget:
    """An NRMSE budget, ``||x - x^|| / ||x||`` per page group and per K/V."""

    value: float  # the NRMSE itself, or the multiple of FP8's NRMSE when ``relative_to_fp8``
    relative_to_fp8: bool  # True for "2x": 2 x FP8-e4m3's NRMSE measured on the same data

    def __post_init__(self) -> None:  # built in Python as well as parsed: the same check
        try:
            value = float(self.value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value <= 0 or (
                not self.relative_to_fp8 and value >= 1) or (self.relative_to_fp8 and value > MAX_RELATIVE):
            raise SpecError(f"error={self.value!r}{'x' if self.relative_to_fp8 else ''}: the budget must be > 0 (an "
                            f"absolute NRMSE < 1, a multiple of FP8's error at most {MAX_RELATIVE:g}x)")

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative_to_fp8 else f"{self.value:g}"


@dataclass(frozen=True)
class AlignPredSpec:
    error: ErrorBudget  # the guaranteed NRMSE budget
    align: str = "none"  # blocks registered by orthogonal Procrustes: none, heads of a layer, adjacent layers
    predict: str = "mean"  # token-wise predictor of a block: per-channel mean of the group, or previous token
    fit: str = "group"  # alignment fitted per page group (stored) or frozen from calibration (not stored)
    blend: float = 0.5  # fixed weight of the per-group aligned cross-block prediction
    # "trellis": 16-state dependent (trellis-coded) quantization along each token's channels (about 0.13 bpv
    # fewer at the same NRMSE; a value's error stays within two fine steps); "lattice": each value to its
    # nearest multiple of the step (every value's error within half a step)
    quant: str = "trellis"

    def __post_init__(self) -> None:  # built in Python as well as parsed: the same checks
        if not isinstance(self.error, ErrorBudget):
            raise SpecError(f"error={self.error!r}: give an ErrorBudget (or parse 'alignpred:error=1x')")
        for name, valid in (("align", ALIGNS), ("predict", PREDICTS), ("fit", FITS), ("quant", QUANTS)):
            if getattr(self, name) not in valid:
                raise SpecError(f"{name}={getattr(self, name)!r}; valid: {', '.join(valid)}")
        if self.fit == "frozen" and self.align != "layers":
            raise SpecError("fit=frozen needs align=layers (frozen predictors map each layer from the one before)")

    @property
    def spec_string(self) -> str:
        fit = ",fit=frozen" if self.fit == "frozen" else ""
        return f"alignpred:error={self.error},align={self.align},predict={self.predict}{fit},quant={self.quant}"


def parse_error(raw: str) -> ErrorBudget:
    text = raw.strip().lower()
    relative = text.endswith("x")
    try:
        value = float(text[:-1] if relative else text)
    except ValueError:
        raise SpecError(f"error={raw!r}: give an NRMSE (error=0.03) or a multiple of FP8's error (error=2x)") from None
    try:
        return ErrorBudget(value, relative)
    except SpecError as exc:
        raise SpecError(f"error={raw!r}: {str(exc).split(': ', 1)[1]}") from None


def parse_alignpred(text: str) -> AlignPredSpec:
    """Parse ``alignpred:error=1x[,align=heads][,predict=prev][,fit=frozen][,quant=lattice]``.

    Raises:
        SpecError: another codec name, a missing budget, an unknown option or value.
    """
    name, options = split_spec(text)
    if name != "alignpred":
        raise SpecError(f"not an alignpred spec: {text!r}")
    if "error" not in options:
        raise SpecError(f"{text!r}: alignpred needs an error budget, e.g. alignpred:error=1x (FP8-level NRMSE)")
    error = parse_error(options.pop("error"))
    align = options.pop("align", "none").lower()
    predict = options.pop("predict", "mean").lower()
    if align not in ALIGNS:
        raise SpecError(f"align={align!r}; valid: {', '.join(ALIGNS)}")
    if predict not in PREDICTS:
        raise SpecError(f"predict={predict!r}; valid: {', '.join(PREDICTS)}")
    fit = options.pop("fit", "group").lower()
    if fit not in FITS:
        raise SpecError(f"fit={fit!r}; valid: {', '.join(FITS)}")
    if fit == "frozen" and align != "layers":
        raise SpecError("fit=frozen needs align=layers (frozen predictors map each layer from the one before)")
    quant = options.pop("quant", "trellis").lower()
    if quant not in QUANTS:
        raise SpecError(f"quant={quant!r}; valid: {', '.join(QUANTS)}")
    if options:
        raise SpecError(f"unknown alignpred option(s) {sorted(options)}; valid: error, align, predict, fit, quant")
    return AlignPredSpec(error, align, predict, fit, quant=quant)


def is_alignpred(text: str) -> bool:
    return spec_kind(text) is SpecKind.ALIGNPRED
