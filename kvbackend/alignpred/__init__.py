"""AlignPred: error-bounded compression of page groups for the host and file tiers."""

from .align import Calibration
from .codec import AlignPredCodec, KindReport, fp8_nrmse
from .spec import AlignPredSpec, ErrorBudget, is_alignpred, parse_alignpred
from .stream import CorruptStream

__all__ = ["AlignPredCodec", "Calibration", "AlignPredSpec", "CorruptStream", "ErrorBudget", "KindReport", "fp8_nrmse",
           "is_alignpred", "parse_alignpred"]
