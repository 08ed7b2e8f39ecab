"""AlignPred: an error-bounded codec for page groups kept on host or disk.

One page group ``[L, T, H, D]`` (every layer of T tokens) is coded per K and per V:

1. **Budget.** The NRMSE budget ``tau`` is absolute or a multiple of FP8-e4m3's NRMSE measured on
   the same values. The lattice step is ``2*eb`` with ``eb = sqrt(3) * tau * rms``; the encoder checks
   the reconstruction and shrinks the step until the group's NRMSE is within the budget, so the budget
   holds on every page group. Every value's error is at most ``max_error``, stored in the stream (the
   lattice: eb plus float32 rounding of the output; the trellis: the largest error it reached).
2. **Lattice.** ``n = rint(x / (2 eb))`` (``quant=lattice``), or the indices of trellis-coded
   quantization along each token's channels (``quant=trellis``, the default; :mod:`.trellis`): about
   1 dB less squared error at the same index entropy, so a larger step meets the same budget. All
   prediction runs on these integers, so it is lossless and the decoder repeats it exactly.
3. **Prediction.** Optional cross-block prediction from already decoded, orthogonally aligned blocks
   (``align=heads|layers``), then a token-wise predictor per channel: the group mean (``mean``) or
   the previous token (``prev``).
4. **Entropy coding** of the residuals with rANS (see :mod:`.entropy`).

The stream carries a crc32c of the whole container (checked before anything is parsed), one of the
decoded lattice, and one of the decoded float32 values together with every header field that shapes
them (see :mod:`.schema`). Every count, shape and length is checked against the stream and the
expected group shape before anything is allocated, so a damaged, mismatched or crafted stream
raises :class:`CorruptStream` (and nothing else) instead of returning wrong values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from kvbackend.alignpred import align as alignment
from kvbackend.alignpred import trellis
from kvbackend.alignpred.entropy import class_of, decode_classes, encode_classes
from kvbackend.alignpred.schema import (ALIGN_CODES, MAX_GROUP_VALUES, PREDICT_CODES, QUANT_CODES, KindHeader, StreamHeader,
                                       read_header, value_checksum)
from kvbackend.alignpred.spec import AlignPredSpec, parse_alignpred
from kvbackend.alignpred.stream import CorruptStream, pack, unpack

_MAX_INDEX = 1 << 24  # lattice indices stay far inside int32 (and exact in float32)
_F32_MAX = float(np.finfo(np.float32).max)


def fp8_nrmse(x: np.ndarray) -> float:
    """NRMSE of an FP8-e4m3 round trip (saturating at +-448, as the ``fp8`` codec stores)."""
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    r = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    # float64 dot products: one pass each (the difference is exact in float32 below the clamp: r is t rounded)
    flat = t.numpy().ravel().astype(np.float64)
    diff = (t - r).numpy().ravel().astype(np.float64)
    norm = float(np.dot(flat, flat))
    return math.sqrt(float(np.dot(diff, diff)) / norm) if norm > 0 else 0.0


@dataclass(frozen=True)
class KindReport:
    """What the encoder measured for K or V of one page group."""

    target: float  # the NRMSE budget resolved for this data
    nrmse: float  # the NRMSE reached (never above target)
    max_error: float  # bound on |x - x^| for every value, stored in the stream
    step: float  # the lattice step 2*eb


def _tokenwise(m: np.ndarray, predict: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Residual of the token-wise predictor along axis 1 of m [L, T, H, D]; (residual, stored means)."""
    if predict == "mean":
        mu = np.rint(m.mean(1, keepdims=True)).astype(np.int32)
        return m - mu, mu[:, 0]
    r = m.copy()
    r[:, 1:] = m[:, 1:] - m[:, :-1]
    return r, None


def _untokenwise(r: np.ndarray, mu: np.ndarray | None) -> np.ndarray:
    return r + mu[:, None] if mu is not None else np.cumsum(r, axis=1, dtype=np.int32)


def _lattice(x: np.ndarray, target: float) -> tuple[np.ndarray, float, float]:
    """(indices, step, nrmse) with NRMSE <= target."""
    x64 = x.astype(np.float64)
    norm = math.sqrt(float(np.square(x64).sum()))
    peak = float(np.abs(x64).max()) if x.size else 0.0
    if norm == 0.0:
        return np.zeros(x.shape, np.int32), 1.0, 0.0
    step = math.sqrt(12.0) * target * norm / math.sqrt(x.size) * 0.999
    floor = peak / _MAX_INDEX
    for _ in range(12):
        if step < floor:
            raise ValueError(f"NRMSE budget {target:.3g} is below what a 2^24-step lattice resolves for this data")
        n = np.rint(x64 / step).astype(np.int32)
        err = math.sqrt(float(np.square(x64 - _dequant(n, step).astype(np.float64)).sum())) / norm
        if err <= target:
            return n, step, err
        step *= 0.995 * target / err
    # the error need not fall with the step on a few values: take a step whose worst case meets the budget, each
    # value within half a step (and float32's rounding of it): NRMSE <= step * sqrt(n) / (2 * norm)
    step = 0.99 * 2.0 * target * norm / math.sqrt(x.size)
    if step < floor:
        raise ValueError(f"NRMSE budget {target:.3g} is below what a 2^24-step lattice resolves for this data")
    n = np.rint(x64 / step).astype(np.int32)
    err = math.sqrt(float(np.square(x64 - _dequant(n, step).astype(np.float64)).sum())) / norm
    if err > target:
        raise ValueError(f"could not meet NRMSE budget {target:.3g} (reached {err:.3g})")
    return n, step, err


def _dequant(n: np.ndarray, step: float) -> np.ndarray:
    return (n.astype(np.float64) * step).astype(np.float32)


def _channel_rows(x: np.ndarray) -> np.ndarray:
    """[L, T, H, D] as one row of D channels per (layer, token, head): the trellis runs along a token's channels.
    Along a channel's tokens instead, the trellis's neighbouring errors are correlated over the tokens attention
    averages (measured on GPL-3 at 1x: attention-output error 0.073 and KL 0.0053, against 0.064 and 0.0042 along
    channels, the lattice's figures, at the same bytes)."""
    return x.reshape(-1, x.shape[-1])


def _trellis_values(n: np.ndarray, step: float) -> np.ndarray:
    return trellis.dequantize(_channel_rows(n), step).reshape(n.shape).astype(np.float32)


# TCQ's squared error at fine step s, against a plain lattice of step 2s ((2s)^2 / 12): about 1 dB lower
_TRELLIS_GAIN = 1.25
_TRELLIS_PASSES = 12  # Viterbi passes at most to bring the NRMSE within 0.3% under its budget


def _trellis(x: np.ndarray, target: float) -> tuple[np.ndarray, float, float, np.ndarray]:
    """(indices, fine step, nrmse, float32 values) of trellis-coded quantization with NRMSE <= target."""
    x64 = x.astype(np.float64)
    rows = _channel_rows(x64)
    norm = math.sqrt(float(np.square(rows).sum()))
    peak = float(np.abs(rows).max()) if x.size else 0.0
    if norm == 0.0:
        return np.zeros(x.shape, np.int32), 1.0, 0.0, np.zeros(x.shape, np.float32)
    step = math.sqrt(12.0 * _TRELLIS_GAIN) * target * norm / math.sqrt(x.size) / 2.0 * 0.999
    floor = peak / (2 * _MAX_INDEX)  # indices count steps of two fine steps
    best = None
    for _ in range(_TRELLIS_PASSES):
        if step < floor:
            raise ValueError(f"NRMSE budget {target:.3g} is below what a 2^24-step lattice resolves for this data")
        index, values = trellis.quantize(rows, step)  # values: what `_trellis_values` decodes from the indices
        n = index.reshape(x.shape).astype(np.int32)
        xhat = values.reshape(x.shape).astype(np.float32)
        err = math.sqrt(float(np.square(x64 - xhat).sum())) / norm
        if err <= target:
            if best is None or step > best[1]:
                best = (n, step, err, xhat)
            if err >= 0.997 * target:  # within 0.3% of the budget: a larger step saves under 0.005 bit
                break
            if err == 0.0 or not index.any():  # exact, or every index already zero: a larger step changes nothing
                break  # (and growing it without bound would leave float32's range: a stream nobody could read)
            step *= 0.999 * target / err  # the error grows about as the step: aim just under the budget
        else:
            step *= (0.997 if best is None else 0.999) * target / err
            if best is not None and step <= best[1]:
                break
    if best is None:  # the error need not fall with the step (a few values near a subset's edge): take a step
        # whose worst case meets the budget, each value within two fine steps: NRMSE <= 2 * step * sqrt(n) / norm
        step = 0.999 * target * norm / (2.0 * math.sqrt(x.size))
        if step < floor:
            raise ValueError(f"NRMSE budget {target:.3g} is below what a 2^24-step lattice resolves for this data")
        index, values = trellis.quantize(rows, step)
        xhat = values.reshape(x.shape).astype(np.float32)
        err = math.sqrt(float(np.square(x64 - xhat).sum())) / norm
        if err > target:
            raise ValueError(f"could not meet NRMSE budget {target:.3g} (reached {err:.3g})")
        best = (index.reshape(x.shape).astype(np.int32), step, err, xhat)
    return best


def _encode_kind(x: np.ndarray, spec: AlignPredSpec, tag: str,
                 frozen: np.ndarray | None) -> tuple[dict[str, np.ndarray], KindReport, np.ndarray]:
    """(entries, report, decoded values); the value checksum (``i[2]``) is left for the caller."""
    L, T, H, D = x.shape
    target = spec.error.value * fp8_nrmse(x) if spec.error.relative_to_fp8 else spec.error.value
    if target <= 0.0:  # FP8 is exact on this data: keep a tight absolute budget instead of failing
        target = 1e-6
    if spec.quant == "trellis":
        n, step, err, xhat = _trellis(x, target)
    else:
        n, step, err = _lattice(x, target)
        xhat = _dequant(n, step)
    if not 0.0 < step <= _F32_MAX:  # a stream its own decoder would refuse (values near float32's limit)
        raise ValueError(f"AlignPred cannot code these values within {target:.3g}: the lattice step {step:.3g} "
                         "leaves float32's range")
    reached = float(np.abs(x.astype(np.float64) - xhat).max(initial=0.0))
    if spec.quant == "trellis":
        max_error = reached  # the trellis bounds a value's error only by two fine steps: store what it reached
    else:
        max_error = step / 2.0 + float(np.spacing(np.float32(np.abs(xhat).max() if xhat.size else 0.0)))
        assert reached <= max_error
    if not (math.isfinite(max_error) and np.isfinite(xhat).all()):  # values at float32's limit round past it
        raise ValueError(f"AlignPred cannot code these values within {target:.3g}: their reconstruction or its error "
                         "bound leaves float32's range")

    m = n.copy()
    rots = []
    blocks = n.transpose(0, 2, 1, 3)  # [L, H, T, D]
    if frozen is not None:
        for layer in range(1, L):
            m[layer] -= alignment.frozen_prediction(n[layer - 1], frozen[layer - 1])
    for (la, ha), (lb, hb) in ([] if frozen is not None else alignment.pairs(spec.align, L, H)):
        rot = alignment.procrustes(alignment.centered(blocks[la, ha]), alignment.centered(blocks[lb, hb]))
        rots.append(rot)
        m[lb, :, hb] -= alignment.cross_prediction(blocks[la, ha], rot, spec.blend)
    r, mu = _tokenwise(m, spec.predict)

    # Classes per (layer, channel) by residual spread; class map and means are coded as two side classes.
    rows = r.reshape(L, T, H * D).transpose(0, 2, 1)  # [L, C, T]
    cmap = class_of(rows.std(-1)).astype(np.int32)  # [L, C]
    cm_off = int(np.rint(cmap.mean()))
    values, classes = [(cmap - cm_off).ravel()], [int(class_of(np.array([cmap.std()]))[0])]
    if mu is not None:
        mu = mu.reshape(L, H * D)
        values.append(mu.ravel())
        classes.append(int(class_of(np.array([mu.std()]))[0]))
    present = np.unique(cmap)
    for c in present:
        values.append(rows[cmap == c].ravel())
        classes.append(int(c))
    codes, words, esc = encode_classes(values, classes)
    arrays = {
        f"{tag}.f": np.array([step, target, err, max_error], np.float64),
        f"{tag}.i": np.array([cm_off, crc32c.crc32c(n.tobytes()), 0], np.int64),
        f"{tag}.cls": np.array([c.cls for c in codes], np.uint8),
        f"{tag}.cnt": np.array([c.count for c in codes], np.uint32),
        f"{tag}.tab": np.stack([c.table for c in codes]),
        f"{tag}.lo": np.concatenate([c.lo for c in codes]),
        f"{tag}.w": words.astype(np.uint32),
        f"{tag}.esc": esc,
    }
    if rots:
        arrays[f"{tag}.rot"] = np.stack(rots)
    return arrays, KindReport(target, err, max_error, step), xhat


def _rows(kind: KindHeader, values: list[np.ndarray], side: int, L: int, C: int, T: int) -> np.ndarray:
    """Residual rows [L, C, T] from the decoded classes; the class map must name exactly the row classes."""
    cmap = values[0].astype(np.int64).reshape(L, C) + kind.cm_off
    present, channels = np.unique(cmap, return_counts=True)
    row_codes = kind.codes[side:]
    if present.tolist() != [c.cls for c in row_codes] or (channels * T).tolist() != [c.count for c in row_codes]:
        raise CorruptStream("AlignPred class map does not match its row classes")
    rows = np.empty((L, C, T), np.int32)
    for code, v in zip(row_codes, values[side:]):
        rows[cmap == code.cls] = v.reshape(-1, T)
    return rows


def _decode_kind(h: StreamHeader, tag: str, frozen: np.ndarray | None) -> np.ndarray:
    """One kind's float32 values, returned only after both of its checksums held."""
    L, T, H, D = h.shape
    kind = h.kinds[tag]
    mean = h.predict == "mean"
    values = decode_classes(kind.codes, kind.words, kind.escapes)
    rows = _rows(kind, values, 1 + mean, L, H * D, T)
    mu = values[1].reshape(L, H, D) if mean else None
    n = _untokenwise(rows.transpose(0, 2, 1).reshape(L, T, H, D), mu)
    blocks = n.transpose(0, 2, 1, 3)  # a view: updates land in n
    if frozen is not None:
        for layer in range(1, L):
            n[layer] += alignment.frozen_prediction(n[layer - 1], frozen[layer - 1])
    for i, ((la, ha), (lb, hb)) in enumerate([] if frozen is not None else alignment.pairs(h.align, L, H)):
        blocks[lb, hb] += alignment.cross_prediction(blocks[la, ha], kind.rots[i], h.blend)
    if crc32c.crc32c(np.ascontiguousarray(n).tobytes()) != kind.lattice_crc:
        raise CorruptStream(f"AlignPred {tag} lattice checksum mismatch: the decoded values are not the encoded ones")
    with np.errstate(over="ignore", invalid="ignore"):  # a crafted step may overflow: the checksum refuses it
        xhat = _trellis_values(n, kind.step) if h.quant == "trellis" else _dequant(n, kind.step)
    if value_checksum(tag, h.shape, h.spec_codes, h.calibration, kind.floats, xhat) != kind.value_crc:
        raise CorruptStream(f"AlignPred {tag} value checksum mismatch: a header field differs from the encoded one")
    if not np.isfinite(xhat).all():  # no encode writes these (it refuses them): a stream crafted with its checksums
        raise CorruptStream(f"AlignPred {tag} decodes to non-finite values")
    return xhat


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x, np.float32)
    if x.ndim != 4:
        raise ValueError(f"a page group is [layers, tokens, heads, head_dim]; got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"a page group needs at least one layer, token, head and channel; got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("AlignPred refuses non-finite K/V values")
    return x


class AlignPredCodec:
    """Encode/decode page groups ``[L, T, H, D]`` of K and V under an NRMSE budget."""

    def __init__(self, spec: str | AlignPredSpec, calibration: alignment.Calibration | None = None) -> None:
        self.spec = parse_alignpred(spec) if isinstance(spec, str) else spec
        if self.spec.fit == "frozen" and calibration is None:
            raise ValueError(f"{self.spec.spec_string} needs a Calibration (alignpred.Calibration.fit on calibration KV)")
        self.calibration = calibration if self.spec.fit == "frozen" else None
        self.last_report: tuple[KindReport, KindReport] | None = None

    def _frozen(self, kind: str, layers: int, channels: int) -> np.ndarray | None:
        if self.calibration is None:
            return None
        maps = self.calibration.maps[kind]
        if maps.shape != (layers - 1, channels, channels):
            raise ValueError(f"calibration maps {maps.shape} do not fit {layers} layers x {channels} channels")
        return maps

    @property
    def spec_string(self) -> str:
        return self.spec.spec_string

    def encode(self, k, v) -> bytes:
        k, v = _as_numpy(k), _as_numpy(v)
        if k.shape != v.shape:
            raise ValueError(f"K {k.shape} and V {v.shape} of a page group must have one shape")
        if k.size > MAX_GROUP_VALUES:
            raise ValueError(f"a page group of {k.size} values per kind is above AlignPred's {MAX_GROUP_VALUES}")
        s = self.spec
        if not 0.0 <= s.blend <= 1.0:
            raise ValueError(f"blend {s.blend} outside [0, 1]")
        # a seventh byte names the trellis; lattice streams keep the six bytes they always had (one format)
        codes = np.zeros(7 if s.quant == "trellis" else 6, np.uint8)
        codes[0], codes[1] = ALIGN_CODES[s.align], PREDICT_CODES[s.predict]
        codes[2:6] = np.frombuffer(np.float32(s.blend).tobytes(), np.uint8)
        if s.quant == "trellis":
            codes[6] = QUANT_CODES[s.quant]
        L, _, H, D = k.shape
        calibration = self.calibration.fingerprint() if self.calibration else None
        ka, kr, kx = _encode_kind(k, s, "k", self._frozen("k", L, H * D))
        va, vr, vx = _encode_kind(v, s, "v", self._frozen("v", L, H * D))
        for tag, arrays, xhat in (("k", ka, kx), ("v", va, vx)):
            arrays[f"{tag}.i"][2] = value_checksum(tag, k.shape, codes, calibration, arrays[f"{tag}.f"], xhat)
        self.last_report = (kr, vr)
        extra = {"cal": np.array([calibration], np.uint32)} if self.calibration else {}
        return pack({"shape": np.array(k.shape, np.uint32), "spec": codes, **extra, **ka, **va})

    def decode(self, blob, shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) as float32 [L, T, H, D].

        ``shape`` is the [L, T, H, D] the caller expects (a stream of another shape is refused);
        without it a group may hold up to ``MAX_UNSHAPED_VALUES`` (2^20) values per kind in ``MAX_UNSHAPED_BLOCKS``
        (2^14) (layer, head) blocks (larger groups decode with their shape given).

        Raises:
            CorruptStream: on any damage or malformation (and on nothing else), and when the stream
                was coded with a calibration other than this codec's.
        """
        try:
            return self._decode(unpack(blob), shape)
        except CorruptStream:
            raise
        except Exception as exc:  # a case the explicit checks missed: still a miss, never another error
            raise CorruptStream(f"AlignPred stream undecodable: {type(exc).__name__}: {exc}") from None

    def _decode(self, a: dict[str, np.ndarray], shape: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray]:
        h = read_header(a, shape)
        frozen_k = frozen_v = None
        if h.calibration is not None:
            if self.calibration is None or h.calibration != self.calibration.fingerprint():
                raise CorruptStream("AlignPred stream was coded with another calibration than this codec's")
            L, _, H, D = h.shape
            if self.calibration.maps["k"].shape != (L - 1, H * D, H * D):
                raise CorruptStream(f"AlignPred stream shape {h.shape} does not fit this codec's calibration")
            frozen_k, frozen_v = self._frozen("k", L, H * D), self._frozen("v", L, H * D)
        return _decode_kind(h, "k", frozen_k), _decode_kind(h, "v", frozen_v)

    @staticmethod
    def max_errors(blob) -> tuple[float, float]:
        """The stored per-value error bounds of K and V (covered by the container checksum;
        :meth:`decode` also checks them against the values' checksum).

        Raises:
            CorruptStream: a damaged or malformed stream.
        """
        try:  # the header alone (no work in proportion to the values): any group the encoder takes
            h = read_header(unpack(blob), None, max_values=MAX_GROUP_VALUES, max_blocks=MAX_GROUP_VALUES)
        except CorruptStream:
            raise
        except Exception as exc:
            raise CorruptStream(f"AlignPred stream unreadable: {type(exc).__name__}: {exc}") from None
        return float(h.kinds["k"].floats[3]), float(h.kinds["v"].floats[3])
