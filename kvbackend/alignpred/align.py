"""Orthogonal alignment of related blocks (Generalized Procrustes with one reference block).

A block is one head of one layer over the group's tokens, ``[T, D]``. ``heads`` registers heads
1..H-1 of a layer onto head 0; ``layers`` registers each head of layer l onto the same head of layer
l-1. The cross-block prediction of block b is ``rint(blend * centered(a) @ R_b)``, computed from the
*decoded* lattice of block a, so the decoder repeats it exactly. Rotations are stored as float16 and
counted in the stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import crc32c
import numpy as np


def procrustes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The orthogonal ``R`` minimizing ``||a @ R - b||`` (a, b: [T, D])."""
    u, _, vt = np.linalg.svd(a.T.astype(np.float64) @ b.astype(np.float64))
    return (u @ vt).astype(np.float16)


def centered(n: np.ndarray) -> np.ndarray:
    """Integer lattice of blocks [..., T, D] minus its per-channel rounded mean, as float32."""
    return (n - np.rint(n.mean(-2, keepdims=True))).astype(np.float32)


def cross_prediction(ref: np.ndarray, rot: np.ndarray, blend: float) -> np.ndarray:
    """``rint(blend * centered(ref) @ rot)`` for stacks of blocks: ref [..., T, D], rot [..., D, D]."""
    return np.rint(np.float32(blend) * (centered(ref) @ rot.astype(np.float32))).astype(np.int32)


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
    return np.rint(centered(prev.reshape(t, -1)) @ w).astype(np.int32).reshape(prev.shape)
