"""AlignPred over a whole sequence: page groups of ``page_size`` tokens, every layer at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbackend.alignpred.codec import AlignPredCodec


@dataclass
class SequenceResult:
    k: torch.Tensor  # reconstructed keys [L, T, H, D], float32
    v: torch.Tensor  # reconstructed values
    stored_bytes: int  # bytes of every stream written
    max_error: tuple[float, float]  # largest stored per-value bound of K and V over the groups


def reconstruct(codec: AlignPredCodec, k: torch.Tensor, v: torch.Tensor, page_size: int = 64) -> SequenceResult:
    """Encode ``k``/``v`` [L, T, H, D] page group by page group, decode, and count the bytes."""
    kn = k.detach().to("cpu", torch.float32).numpy()
    vn = v.detach().to("cpu", torch.float32).numpy()
    outk, outv = np.empty_like(kn), np.empty_like(vn)
    stored, bound_k, bound_v = 0, 0.0, 0.0
    for start in range(0, kn.shape[1], page_size):
        part = slice(start, start + page_size)
        blob = codec.encode(kn[:, part], vn[:, part])
        stored += len(blob)
        outk[:, part], outv[:, part] = codec.decode(blob, shape=kn[:, part].shape)
        report_k, report_v = codec.last_report  # the bounds the encoder stored in this stream
        bound_k, bound_v = max(bound_k, report_k.max_error), max(bound_v, report_v.max_error)
    return SequenceResult(torch.from_numpy(outk), torch.from_numpy(outv), stored, (bound_k, bound_v))
