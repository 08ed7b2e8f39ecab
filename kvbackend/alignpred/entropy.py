"""Entropy coding of lattice indices: rANS (``constriction``) over pairs of split symbols.

Each coded value ``v`` (an integer residual) is split as ``v = (hi << k) + lo``: the ``k`` low bits
are close to uniform and are stored raw (bit planes); ``hi`` has a small alphabet and is entropy
coded. Channels are grouped into *classes* by the spread of their residuals; a class fixes ``k`` and
owns one 16-entry frequency table, so channels of very different scales each get a fitting model
without per-channel tables. Two ``hi`` symbols form one rANS symbol (alphabet 256, product model):
rANS decoding in ``constriction`` costs per symbol, so pairs halve its share of decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

import constriction
import numpy as np

from kvbackend.alignpred.stream import CorruptStream

COMP_BITS = 4  # bits of one hi component: 16 values, hi in [-7, 7] plus an escape
GROUP = 2  # hi components per rANS symbol (alphabet 2**(COMP_BITS*GROUP))
MAX_CLASS = 63
SPLIT = 0  # k = floor(log2 spread) + SPLIT raw low bits (measured on SmolLM2 KV: 0.03 bpv below -1, fewer escapes)


def class_of(spread: np.ndarray) -> np.ndarray:
    """Class id from a channel's residual spread (std in lattice steps): half-octave steps."""
    return np.clip(np.rint(2.0 * np.log2(spread + 1.0)), 0, MAX_CLASS).astype(np.uint8)


def low_bits(cls: int) -> int:
    """Raw low bits of a class: ``floor(log2 spread) + SPLIT``, never negative."""
    return max(0, cls // 2 + SPLIT)


@dataclass
class ClassCode:
    """What one class stores, besides its rANS symbols (which share one stream)."""

    cls: int  # the class id
    count: int  # number of values
    table: np.ndarray  # uint16 [16]: the hi component frequencies
    lo: np.ndarray  # uint8: k bit planes of the low bits, packed


def _consts() -> tuple[int, int, int]:
    size = 1 << COMP_BITS
    return size, size // 2 - 1, size - 1  # alphabet, offset, escape


def _joint_model(table: np.ndarray):
    p = table.astype(np.float64)
    p /= p.sum()
    joint = p
    for _ in range(GROUP - 1):
        joint = np.outer(joint, p).ravel()
    return constriction.stream.model.Categorical(joint, perfect=False)


def _table(comps: np.ndarray) -> np.ndarray:
    counts = np.bincount(comps, minlength=1 << COMP_BITS).astype(np.float64)
    scaled = np.floor(counts * (65535.0 / counts.max()))  # the most frequent maps to 65535, never past it
    return np.maximum(scaled, counts > 0).astype(np.uint16)  # every present component keeps a count >= 1


def _pack_planes(lo: np.ndarray, k: int) -> np.ndarray:
    if k == 0:
        return np.zeros(0, np.uint8)
    planes = np.empty((k, lo.size), np.uint8)
    for b in range(k):
        planes[b] = (lo >> b) & 1
    return np.packbits(planes, axis=1).ravel()


def _unpack_planes(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    lo = np.zeros(n, np.int32)
    if k == 0:
        return lo
    planes = np.unpackbits(packed.reshape(k, -1), axis=1, count=n)
    for b in range(k):
        lo |= planes[b].astype(np.int32) << b
    return lo


def encode_classes(values: list[np.ndarray], classes: list[int]) -> tuple[list[ClassCode], np.ndarray, np.ndarray]:
    """Code each class's int32 values. Returns (per-class codes, rANS words uint32, escapes int32)."""
    coder = constriction.stream.stack.AnsCoder()
    codes, symbols, escapes = [], [], []
    _, offset, escape = _consts()
    for v, cls in zip(values, classes):
        k = low_bits(cls)
        hi = v >> k
        comps = hi + offset
        outside = (comps < 0) | (comps >= escape)
        comps[outside] = escape
        escapes.append(hi[outside])
        if comps.size % GROUP:
            comps = np.append(comps, np.full(GROUP - comps.size % GROUP, offset, comps.dtype))
        table = _table(comps)
        codes.append(ClassCode(cls, v.size, table, _pack_planes(v & ((1 << k) - 1), k)))
        sym = comps[0::GROUP].astype(np.int32)
        for j in range(1, GROUP):
            sym = (sym << COMP_BITS) | comps[j::GROUP]
        symbols.append(sym)
    for code, sym in zip(reversed(codes), reversed(symbols)):  # a stack: the first class is decoded first
        coder.encode_reverse(sym, _joint_model(code.table))
    esc = np.concatenate(escapes).astype(np.int32) if escapes else np.zeros(0, np.int32)
    return codes, coder.get_compressed(), esc


def decode_classes(codes: list[ClassCode], words: np.ndarray, escapes: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`encode_classes`; raises :class:`CorruptStream` when the streams do not add up.

    The caller has checked the counts against the group's shape (they decide how many symbols are
    decoded and allocated) and each class's low bits against its count.
    """
    coder = constriction.stream.stack.AnsCoder(words)
    out, used = [], 0
    _, offset, escape = _consts()
    mask = (1 << COMP_BITS) - 1
    for code in codes:
        k = low_bits(code.cls)
        sym = coder.decode(_joint_model(code.table), -(-code.count // GROUP))
        comps = np.empty((sym.size, GROUP), np.int32)
        for j in range(GROUP):
            comps[:, GROUP - 1 - j] = (sym >> (COMP_BITS * j)) & mask
        hi = comps.ravel()[: code.count] - offset
        outside = np.flatnonzero(hi == escape - offset)
        if outside.size:
            if used + outside.size > escapes.size:
                raise CorruptStream("AlignPred escape list shorter than the escaped symbols")
            hi[outside] = escapes[used : used + outside.size]
            used += outside.size
        out.append((hi << k) | _unpack_planes(code.lo, k, code.count))
    if used != escapes.size or not coder.is_empty():
        raise CorruptStream("AlignPred rANS stream or escape list longer than the symbols it should hold")
    return out
