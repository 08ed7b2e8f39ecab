"""Torch references for what the attention kernels compute."""

from __future__ import annotations

import math

import torch


def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per request against its whole cache, GQA.

    Args:
        q: [B, Hq, D]; keys[b], values[b]: [T_b, H, D] with Hq a multiple of H.
    Returns:
        (output [B, Hq, D] float32, log-sum-exp [B, Hq] float32 in natural log).
    """
    b, hq, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    outs, lses = [], []
    for i in range(b):
        k = keys[i].float().repeat_interleave(hq // keys[i].shape[1], dim=1)  # [T, Hq, D]
        v = values[i].float().repeat_interleave(hq // values[i].shape[1], dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    if not outs:  # an empty batch
        return q.new_empty(0, hq, d, dtype=torch.float32), q.new_empty(0, hq, dtype=torch.float32)
    return torch.stack(outs), torch.stack(lses)

