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


def gathered_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` over gathered rows: ``k, v [total, H, D]``, request b's rows ``cu_seqlens[b] ..
    cu_seqlens[b+1]`` (as `gather_dequant` writes them). Requests of one length take one batched product (float32,
    as `decode_attention`); others are read one by one."""
    b, hq, d = q.shape
    bounds = cu_seqlens.tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in range(b)]
    if b == 0 or len(set(lengths)) != 1 or lengths[0] == 0:
        return decode_attention(q, [k[bounds[i] : bounds[i + 1]] for i in range(b)],
                                [v[bounds[i] : bounds[i + 1]] for i in range(b)], scale)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    length, h = lengths[0], k.shape[1]
    group = hq // h
    keys = k.view(b, length, h, d).permute(0, 2, 3, 1).float()  # [B, H, D, T]
    scores = torch.matmul(q.float().view(b, h, group, d), keys) * scale  # [B, H, G, T]
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, v.view(b, length, h, d).permute(0, 2, 1, 3).float())  # [B, H, G, D]
    return out.reshape(b, hq, d), lse.reshape(b, hq)
