"""The entries of an AlignPred stream, checked before anything is allocated or entropy decoded.

:func:`read_header` turns the arrays of a container (whose crc32c already held) into a
:class:`StreamHeader`: every entry must be present with its exact dtype and shape, every count must
add up to what the group's shape needs, every length must match the bytes the stream holds, and the
group may not be larger than the caller expects (its shape, or :data:`MAX_UNSHAPED_VALUES` values per
kind in :data:`MAX_UNSHAPED_BLOCKS` blocks). So the decoder never allocates more than a small multiple of
the group it returns, and a malformed stream is a :class:`CorruptStream`, never another exception.

:func:`value_checksum` covers the decoded float32 values together with every header field that
shapes them (group shape, predictor, step, bounds, calibration): the last check before values
are returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c
import numpy as np

from kvbackend.alignpred.align import pairs
from kvbackend.alignpred.entropy import COMP_BITS, MAX_CLASS, ClassCode, low_bits
from kvbackend.alignpred.stream import CorruptStream

ALIGN_CODES = {"none": 0, "heads": 1, "layers": 2}
PREDICT_CODES = {"mean": 0, "prev": 1}
QUANT_CODES = {"lattice": 0, "trellis": 1}  # byte 6 of "spec"; streams of six bytes are lattice streams
MAX_GROUP_VALUES = 1 << 25  # values per kind of a group the encoder takes (128 MiB of float32)
# values per kind of a stream decoded without an expected shape: a crafted stream of a few hundred bytes can make the
# decoder work in proportion to the count it claims (a one-symbol table decodes any count from one rANS word)
MAX_UNSHAPED_VALUES = 1 << 20
# (layer, head) blocks of such a stream: aligned blocks are predicted pair by pair in Python (about 30 us a pair), so
# a 4 MB stream of 2^20 one-channel heads took 48 s to refuse; real groups hold a few hundred blocks
MAX_UNSHAPED_BLOCKS = 1 << 14
_F32_MAX = float(np.finfo(np.float32).max)
KIND_FIELDS = ("f", "i", "cls", "cnt", "tab", "lo", "w", "esc")  # plus "rot" when blocks are aligned


@dataclass(frozen=True)
class KindHeader:
    """What the stream says about K or V, already checked against the group's shape."""

    floats: np.ndarray  # float64 [4]: step, target NRMSE, reached NRMSE, per-value error bound
    cm_off: int  # offset of the class map
    lattice_crc: int  # crc32c of the decoded integer lattice
    value_crc: int  # crc32c of the header context and the decoded float32 values
    codes: list[ClassCode]  # class map, means (predict=mean), then the row classes, ascending
    words: np.ndarray  # uint32 rANS words
    escapes: np.ndarray  # int32
    rots: np.ndarray | None  # float16 [pairs, D, D] for align=heads|layers (not frozen)

    @property
    def step(self) -> float:
        return float(self.floats[0])


@dataclass(frozen=True)
class StreamHeader:
    shape: tuple[int, int, int, int]  # L, T, H, D
    align: str
    predict: str
    blend: float
    quant: str  # "lattice" or "trellis"
    spec_codes: np.ndarray  # uint8 [6] or [7], as stored
    calibration: int | None  # fingerprint of the frozen predictors, None when fitted per group
    kinds: dict[str, KindHeader]


def _entry(a: dict[str, np.ndarray], name: str, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """Entry ``name`` with exactly this dtype and shape (None: any length on that axis)."""
    x = a.get(name)
    if x is None:
        raise CorruptStream(f"AlignPred stream lacks its {name!r} entry")
    if x.dtype != np.dtype(dtype).newbyteorder("<") or x.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(x.shape, shape)):
        want = ["n" if w is None else w for w in shape]
        raise CorruptStream(f"AlignPred entry {name!r} is {x.dtype}{list(x.shape)}; expected {dtype}{want}")
    return x


def group_shape(a: dict[str, np.ndarray], expected: tuple[int, ...] | None, max_values: int = MAX_UNSHAPED_VALUES,
                max_blocks: int = MAX_UNSHAPED_BLOCKS) -> tuple[int, int, int, int]:
    """The stored [L, T, H, D], which must equal ``expected`` (when given) and hold at most ``max_values`` values
    in at most ``max_blocks`` (layer, head) blocks (otherwise)."""
    shape = tuple(int(s) for s in _entry(a, "shape", "uint32", (4,)))
    if min(shape) < 1:
        raise CorruptStream(f"AlignPred group shape {shape} has an empty axis")
    if expected is not None and shape != tuple(int(s) for s in expected):
        raise CorruptStream(f"AlignPred group shape {shape}; this page group is {tuple(expected)}")
    if expected is None and math.prod(shape) > max_values:
        raise CorruptStream(f"AlignPred group shape {shape} holds more than {max_values} values")
    if expected is None and shape[0] * shape[2] > max_blocks:
        raise CorruptStream(f"AlignPred group shape {shape} holds more than {max_blocks} (layer, head) blocks")
    return shape  # type: ignore[return-value]


def _codes(a: dict[str, np.ndarray], tag: str, shape: tuple[int, int, int, int],
           mean: bool) -> list[ClassCode]:
    """The per-class codes, with counts checked against the shape and low-bit lengths against the stream."""
    L, T, H, D = shape
    channels = L * H * D
    cls = _entry(a, f"{tag}.cls", "uint8", (None,))
    n = cls.size
    side = 1 + mean  # the class map, then the means
    if n < side + 1:
        raise CorruptStream(f"AlignPred {tag}: {n} classes, fewer than its side classes and one row class")
    cnt = _entry(a, f"{tag}.cnt", "uint32", (n,)).astype(np.int64)
    tab = _entry(a, f"{tag}.tab", "uint16", (n, 1 << COMP_BITS))
    lo = _entry(a, f"{tag}.lo", "uint8", (None,))
    if int(cls.max()) > MAX_CLASS:
        raise CorruptStream(f"AlignPred {tag}: class {int(cls.max())} above {MAX_CLASS}")
    rows = cls[side:].astype(np.int64)
    if np.any(np.diff(rows) <= 0):
        raise CorruptStream(f"AlignPred {tag}: row classes not strictly ascending")
    if np.any(cnt[:side] != channels):
        raise CorruptStream(f"AlignPred {tag}: side classes of {cnt[:side].tolist()} values; "
                            f"the shape needs {channels}")
    row_counts = cnt[side:]
    if np.any(row_counts < T) or np.any(row_counts % T) or int(row_counts.sum()) != channels * T:
        raise CorruptStream(f"AlignPred {tag}: row classes of {int(row_counts.sum())} values; the shape needs "
                            f"{channels * T} in whole rows of {T}")
    if np.any(tab.astype(np.int64).sum(1) == 0):
        raise CorruptStream(f"AlignPred {tag}: a class with an all-zero frequency table")
    sizes = [low_bits(int(c)) * ((int(m) + 7) // 8) for c, m in zip(cls, cnt)]
    if sum(sizes) != lo.size:
        raise CorruptStream(f"AlignPred {tag}: {lo.size} bytes of low bits; the classes need {sum(sizes)}")
    ends = np.cumsum([0, *sizes])
    return [ClassCode(int(c), int(m), t, lo[s:e]) for c, m, t, s, e in zip(cls, cnt, tab, ends[:-1], ends[1:])]


def _kind(a: dict[str, np.ndarray], tag: str, shape: tuple[int, int, int, int], align: str, mean: bool,
          frozen: bool) -> KindHeader:
    L, _, H, D = shape
    floats = _entry(a, f"{tag}.f", "float64", (4,))
    step, max_error = float(floats[0]), float(floats[3])
    if not np.isfinite(floats).all() or not 0.0 < step <= _F32_MAX or max_error < 0.0:
        raise CorruptStream(f"AlignPred {tag}: step {step!r} or error bound {max_error!r} out of range")
    cm_off, lattice_crc, value_crc = (int(x) for x in _entry(a, f"{tag}.i", "int64", (3,)))
    if not 0 <= cm_off <= MAX_CLASS or not 0 <= lattice_crc < 1 << 32 or not 0 <= value_crc < 1 << 32:
        raise CorruptStream(f"AlignPred {tag}: class-map offset or checksums out of range")
    codes = _codes(a, tag, shape, mean)
    words = _entry(a, f"{tag}.w", "uint32", (None,))
    if words.size and words[-1] == 0:
        raise CorruptStream(f"AlignPred {tag}: rANS words end in a zero word")
    escapes = _entry(a, f"{tag}.esc", "int32", (None,))
    if escapes.size > sum(c.count for c in codes):
        raise CorruptStream(f"AlignPred {tag}: more escapes than values")
    npairs = 0 if frozen else len(pairs(align, L, H))
    rots = None
    if npairs:
        rots = _entry(a, f"{tag}.rot", "float16", (npairs, D, D))
        if not np.isfinite(rots).all():
            raise CorruptStream(f"AlignPred {tag}: non-finite rotations")
    return KindHeader(floats, cm_off, lattice_crc, value_crc, codes, words, escapes, rots)


def read_header(a: dict[str, np.ndarray], expected: tuple[int, ...] | None, max_values: int = MAX_UNSHAPED_VALUES,
                max_blocks: int = MAX_UNSHAPED_BLOCKS) -> StreamHeader:
    """Check every entry of a stream against the others and the expected shape.

    Raises:
        CorruptStream: a missing, unknown or mistyped entry, or counts, lengths or a shape that do not add up.
    """
    shape = group_shape(a, expected, max_values, max_blocks)
    spec = _entry(a, "spec", "uint8", (None,))
    if spec.size not in (6, 7):
        raise CorruptStream(f"AlignPred entry 'spec' holds {spec.size} bytes; expected 6 or 7")
    if spec[0] >= len(ALIGN_CODES) or spec[1] >= len(PREDICT_CODES):
        raise CorruptStream("AlignPred stream names an unknown predictor")
    if spec.size == 7 and spec[6] != QUANT_CODES["trellis"]:
        raise CorruptStream("AlignPred stream names an unknown quantizer")
    quant = list(QUANT_CODES)[int(spec[6])] if spec.size == 7 else "lattice"
    align, predict = list(ALIGN_CODES)[int(spec[0])], list(PREDICT_CODES)[int(spec[1])]
    blend = float(np.frombuffer(spec[2:6].tobytes(), "<f4")[0])
    if not 0.0 <= blend <= 1.0:
        raise CorruptStream(f"AlignPred stream blend {blend!r} outside [0, 1]")
    calibration = None
    if "cal" in a:
        calibration = int(_entry(a, "cal", "uint32", (1,))[0])
    frozen = calibration is not None
    names = {"shape", "spec", *(["cal"] if frozen else [])}
    kinds = {}
    for tag in ("k", "v"):
        kinds[tag] = _kind(a, tag, shape, align, predict == "mean", frozen)
        names |= {f"{tag}.{f}" for f in KIND_FIELDS} | ({f"{tag}.rot"} if kinds[tag].rots is not None else set())
    if set(a) != names:
        raise CorruptStream(f"AlignPred stream has unexpected entries {sorted(set(a) - names)}")
    return StreamHeader(shape, align, predict, blend, quant, spec, calibration, kinds)


def value_checksum(tag: str, shape: tuple[int, ...], spec_codes: np.ndarray, calibration: int | None,
                   floats: np.ndarray, values: np.ndarray) -> int:
    """crc32c of everything that decides the decoded values of one kind, and of those values."""
    context = b"".join([tag.encode(), np.asarray(shape, "<u4").tobytes(), np.asarray(spec_codes, np.uint8).tobytes(),
                        np.asarray([-1 if calibration is None else calibration], "<i8").tobytes(),
                        np.asarray(floats, "<f8").tobytes()])
    return crc32c.crc32c(memoryview(np.ascontiguousarray(values, "<f4")).cast("B"), crc32c.crc32c(context))
