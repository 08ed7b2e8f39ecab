"""Sequence-level levers any codec can combine with: exact sink tokens, keys stored before RoPE (or
relative to their page's first position), an
orthogonal (Hadamard) rotation of values before quantization, and QuantWM's principal-subspace
attention compensation (PSAC) of key errors along the directions queries use.

They are options of every codec spec (``kivi:bits=2,sink=4,pagerope=true,vrot=hadamard``), parsed
apart from the codec's own options. The paged `KVCache` serves sinks, both key frames (``prerope``,
``pagerope``) and the value rotation per layer (`kvbackend.frames`; the kernels read them too);
``psac=`` is applied by `kvbackend eval`'s simulation only (``quantwm``'s ``rank=`` stores the same
correction in pages). Sink tokens are kept at 16 bits and counted in the bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvbackend import fastquant

from kvbackend.errors import SpecError
from kvbackend.spec import Checked, _convert, one_of, ranged

ROTATIONS = ("none", "hadamard")


@dataclass(frozen=True)
class Levers(Checked):
    sink: int = ranged(0, 0, 1 << 20)  # first tokens of the sequence kept exact (fp16)
    prerope: bool = False  # quantize keys before RoPE (de-rotate, encode, decode, re-rotate)
    vrot: str = one_of("none", ROTATIONS)  # rotation of values before quantization: "none" or "hadamard"
    psac: int = ranged(0, 0, 1024)  # rank of the query-subspace key correction (QuantWM's PSAC); 0 = off
    # keys stored relative to their page's first position p0 (de-rotated by R(p0) only): within a page
    # a channel turns by at most P steps of its frequency, so slow channels keep their pre-RoPE
    # statistics, and a reader rotates the query once per page instead of every key
    pagerope: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prerope and self.pagerope:
            raise SpecError("prerope=true and pagerope=true are two frames for the keys: pick one")

    @property
    def active(self) -> bool:
        return self != Levers()

    @property
    def rope(self) -> bool:
        """Keys are stored in a frame other than the model's (either RoPE lever): reading needs the RoPE."""
        return self.prerope or self.pagerope

    def suffix(self) -> str:
        parts = []
        if self.sink:
            parts.append(f"sink={self.sink}")
        if self.prerope:
            parts.append("prerope=true")
        if self.vrot != "none":
            parts.append(f"vrot={self.vrot}")
        if self.psac:
            parts.append(f"psac={self.psac}")
        if self.pagerope:
            parts.append("pagerope=true")
        return ",".join(parts)


_TYPES = {"sink": int, "prerope": bool, "vrot": str, "psac": int, "pagerope": bool}


def split_levers(options: dict[str, str], spec_name: str) -> tuple[dict[str, str], Levers]:
    """Take the lever options out of a spec's options."""
    rest = {k: v for k, v in options.items() if k not in _TYPES}
    values = {k: _convert(v, _TYPES[k], k, spec_name) for k, v in options.items() if k in _TYPES}
    return rest, Levers(**values)


def rotate_values(v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``v @ hadamard(D)`` over the last dim, in float32: the rotation of ``vrot=hadamard`` and its inverse (the
    matrix is symmetric and orthonormal). A fast Walsh-Hadamard transform: one product by 1/sqrt(D) (first, so
    nothing overflows where the matrix product would not), then log2(D) stages of pair sums and differences; no sum
    is reordered, so every device and the fused CPU loop (`kvbackend.fastquant.hadamard_rows`) give the same bits,
    at D log D additions instead of D^2 products. ``out``: a float32 tensor of ``v``'s shape (not overlapping it) that
    receives the result where the fused CPU loop runs (the returned tensor is then ``out``); elsewhere a new one."""
    d = v.shape[-1]
    if d & (d - 1):
        raise SpecError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    scale = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    rows = None if out is None else out.view(-1, d)
    fused = fastquant.hadamard_rows(v.reshape(-1, d), scale, rows)  # float32 or bfloat16 rows, widened in the loop
    if fused is not None:
        return fused.view(v.shape)
    x = v.float().reshape(-1, d) * scale.to(v.device)
    h = 1
    while h < d:
        pairs = x.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return x.view(v.shape)


@functools.lru_cache(maxsize=8)
def hadamard(dim: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix of size ``dim`` (a power of two), float32."""
    if dim & (dim - 1):
        raise SpecError(f"a Hadamard rotation needs a power-of-two head_dim, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)
