"""Orthogonal alignment of related blocks (Generalized Procrustes with one reference block).

A block is one head of one layer over the group's tokens, ``[T, D]``. ``heads`` registers heads
1..H-1 of a layer onto head 0; ``layers`` registers each head of layer l onto the same head of layer
l-1. The cross-block prediction of block b is ``rint(blend * centered(a) @ R_b)``, computed from the
*decoded* lattice of block a, so the decoder repeats it exactly. Rotations are stored as float16 and
counted in the stored bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c
import numpy as np


def procrustes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The orthogonal ``R`` minimizing ``||a @ R - b||`` (a, b: [T, D])."""
    u, _, vt = np.linalg.svd(a.T.astype(np.float64) @ b.astype(np.float64))
    return (u @ vt).astype(np.float16)


def centered(n: np.ndarray) -> np.ndarray:
    """Integer lattice of blocks [..., T, D] minus its per-channel rounded mean (the sums are exact in float64,
    so the mean is the same on every machine), as float64 integers."""
    return n - np.rint(n.mean(-2, keepdims=True, dtype=np.float64))


# Centered lattice indices stay below 2^25 in magnitude (indices below 2^24): with the weights in fixed point of
# 53 - 25 - log2(rows) bits, every product and partial sum of `exact_product` is an integer below 2^53.
_CENTERED_BITS = 25


def exact_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` for integer-valued ``x`` (|x| < 2^25) and real ``w`` [..., C, E], with the same bits on every
    machine: ``w`` is rounded to the finest fixed point (a power-of-two step, about 2^-20 of its largest entry for
    C = 192) that keeps every product and partial sum an integer below 2^53, exact in float64 whatever the BLAS
    kernel, thread count or summation order; the result is then scaled back by that power of two. (Float32
    products rounded to integers differ between BLAS builds and thread counts, and the decoder must repeat the
    encoder's predictions exactly.)"""
    rows = w.shape[-2]
    budget = 53 - _CENTERED_BITS - max(1, math.ceil(math.log2(rows)))  # bits of |w| in fixed point
    peak = float(np.abs(w).max()) if w.size else 0.0
    if not peak > 0.0 or not math.isfinite(peak):  # all zero (or a damaged stream: its checksum refuses it)
        return np.zeros(x.shape[:-1] + w.shape[-1:], np.float64) if peak == 0.0 else np.full(
            x.shape[:-1] + w.shape[-1:], np.nan)
    shift = budget - (math.floor(math.log2(peak)) + 1)  # peak * 2^shift < 2^budget
    fixed = np.rint(w.astype(np.float64) * 2.0**shift)
    return (x.astype(np.float64) @ fixed) * 2.0**-shift


def cross_prediction(ref: np.ndarray, rot: np.ndarray, blend: float) -> np.ndarray:
    """``rint(blend * centered(ref) @ rot)`` for stacks of blocks: ref [..., T, D], rot [..., D, D]."""
    return np.rint(float(np.float32(blend)) * exact_product(centered(ref), rot)).astype(np.int32)


def pairs(align: str, layers: int, heads: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(reference block, predicted block) pairs as ((layer, head), (layer, head)), in decode order."""
    if align == "heads":
        return [((l, 0), (l, h)) for l in range(layers) for h in range(1, heads)]
    if align == "layers":
        return [((l - 1, h), (l, h)) for l in range(1, layers) for h in range(heads)]
    return []


@dataclass(frozen=True)
class Calibration:
    """Cross-layer predictors frozen from calibration KV (not from the data being coded).

    ``maps[kind][l - 1]`` maps layer l-1's centered values [T, C] to a prediction of layer l's
    (least squares; C = heads * head_dim). Codec streams record :meth:`fingerprint`, so a stream is
    never decoded with another calibration.
    """

    maps: dict[str, np.ndarray]  # "k"/"v" -> float32 [L - 1, C, C]

    @classmethod
    def fit(cls, k: np.ndarray, v: np.ndarray, ridge: float = 1e-3) -> "Calibration":
        """Fit from exact calibration K/V ``[L, T, H, D]`` (T of a few hundred tokens or more)."""
        maps = {}
        for kind, x in (("k", k), ("v", v)):
            x = np.asarray(x, np.float64)
            L, T = x.shape[:2]
            c = (x - x.mean(1, keepdims=True)).reshape(L, T, -1)
            out = []
            for layer in range(1, L):
                a, b = c[layer - 1], c[layer]
                gram = a.T @ a
                gram += ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
                out.append(np.linalg.solve(gram, a.T @ b).astype(np.float32))
            maps[kind] = np.stack(out)
        return cls(maps)

    def fingerprint(self) -> int:
        return crc32c.crc32c(b"".join(np.ascontiguousarray(self.maps[kd]).tobytes() for kd in ("k", "v")))

    def save(self, path: str) -> None:
        np.savez(path, k=self.maps["k"], v=self.maps["v"])

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with np.load(path, allow_pickle=False) as f:
            return cls({"k": f["k"].astype(np.float32), "v": f["v"].astype(np.float32)})


def frozen_prediction(prev: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Prediction of one layer's lattice [T, H, D] from the previous layer's decoded lattice."""
    t = prev.shape[0]
    return np.rint(exact_product(centered(prev.reshape(t, -1)), w)).astype(np.int32).reshape(prev.shape)
