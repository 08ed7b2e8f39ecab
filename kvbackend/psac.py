"""PSAC: correct key errors along the dominant query directions (QuantWM).

For each chunk and KV head, M = mean(q q^T) over the queries of that head's group seen up to the
chunk's last token (causal: the chunk is encoded when it completes, after its own queries). The
top-r eigenvectors U_r of M are stored in bf16; each token's key error E = K - K^ is projected,
C = E U_r, and stored as INT8 with one fp16 scale per (token, head). The reconstruction adds
C U_r^T, so the logit error q . e shrinks where queries look.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.quant import round_to


@dataclass
class Correction:
    keys: torch.Tensor  # corrected keys [n, H, D]
    stored_bytes: int  # INT8 coefficients + fp16 scales + bf16 bases, as stored


def principal_directions(moment: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading eigenvectors of each symmetric ``moment`` [H, D, D] (ascending order, as
    `torch.linalg.eigh` gives them): [H, D, rank] float32 on ``moment``'s device.

    Solved on the host: a batched eigh of a few 128 x 128 matrices takes about 22 ms on an H200 (one
    solver kernel per sweep) and a few ms in LAPACK, and the basis is then the same on every device."""
    _, vectors = torch.linalg.eigh(moment.detach().float().cpu())  # ascending eigenvalues
    return vectors[:, :, -rank:].to(moment.device)


def query_second_moment(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """mean(q q^T) per KV head, float32 [H, D, D], from queries [Hq, T, D] (GQA groups averaged)."""
    hq, t, d = queries.shape
    q = queries.float().reshape(kv_heads, (hq // kv_heads) * t, d)
    return q.transpose(1, 2) @ q / q.shape[1]


def correct_keys(keys: torch.Tensor, approx: torch.Tensor, moment: torch.Tensor, rank: int) -> Correction:
    """PSAC for one chunk: ``keys``/``approx`` [n, H, D] (exact and reconstructed), ``moment`` [H, D, D]."""
    n, h, d = keys.shape
    rank = min(rank, d)
    basis = principal_directions(moment, rank).to(torch.bfloat16)  # [H, D, r] as stored
    u = basis.float()
    error = (keys.float() - approx.float()).transpose(0, 1)  # [H, n, D]
    coeff = error @ u  # [H, n, r]
    scale = round_to((coeff.abs().amax(-1) / 127).clamp_min(2**-24), torch.float16, "up")  # [H, n]
    codes = torch.round(coeff / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    scale = scale.to(torch.float16)
    fix = (codes.float() * scale.float().unsqueeze(-1)) @ u.transpose(1, 2)  # [H, n, D]
    corrected = (approx.float() + fix.transpose(0, 1)).to(approx.dtype)
    return Correction(corrected, codes.nbytes + scale.nbytes + basis.nbytes)
