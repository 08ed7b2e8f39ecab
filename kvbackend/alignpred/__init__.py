"""AlignPred: error-bounded compression of page groups for the host and file tiers.

The codec itself needs the ``codecs`` extra (``constriction``); spec parsing and the stream's error
type do not, so the tiers import this package without it.
"""

from kvbackend.alignpred.spec import AlignPredSpec, ErrorBudget, is_alignpred, parse_alignpred
from kvbackend.alignpred.stream import CorruptStream

_LAZY = {"AlignPredCodec": "codec", "KindReport": "codec", "fp8_nrmse": "codec", "Calibration": "align"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AlignPredCodec", "AlignPredSpec", "Calibration", "CorruptStream", "ErrorBudget", "KindReport",
           "fp8_nrmse", "is_alignpred", "parse_alignpred"]
