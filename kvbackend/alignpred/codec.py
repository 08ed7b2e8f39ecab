"""AlignPred: an error-bounded codec for page groups kept on host or disk.

One page group ``[L, T, H, D]`` (every layer of T tokens) is coded per K and per V:

1. **Budget.** The NRMSE budget ``tau`` is absolute or a multiple of FP8-e4m3's NRMSE measured on
   the same values. The lattice step is ``2*eb`` with ``eb = sqrt(3) * tau * rms``; the encoder checks
   the reconstruction and shrinks the step until the group's NRMSE is within the budget, so the budget
   holds on every page group. Every value's error is at most ``max_error`` (eb plus float32 rounding
   of the output), which is stored in the stream.
2. **Lattice.** ``n = rint(x / (2 eb))``; all prediction runs on these integers, so it is lossless
   and the decoder repeats it exactly.
3. **Prediction.** Optional cross-block prediction from already decoded, orthogonally aligned blocks
   (``align=heads|layers``), then a token-wise predictor per channel: the group mean (``mean``) or
   the previous token (``prev``).
4. **Entropy coding** of the residuals with rANS (see :mod:`.entropy`).

The stream carries a crc32c of the whole container and one of the decoded lattice, so a damaged or
mismatched stream raises :class:`CorruptStream` instead of returning wrong values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from . import align as alignment
from .entropy import ClassCode, class_of, decode_classes, encode_classes, low_bits
from .spec import AlignPredSpec, parse_alignpred
from .stream import CorruptStream, pack, unpack

_ALIGN_CODES = {"none": 0, "heads": 1, "layers": 2}
_PREDICT_CODES = {"mean": 0, "prev": 1}
_MAX_INDEX = 1 << 24  # lattice indices stay far inside int32 (and exact in float32)


def fp8_nrmse(x: np.ndarray) -> float:
    """NRMSE of an FP8-e4m3 round trip (saturating at +-448, as the ``fp8`` codec stores)."""
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    r = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    norm = float(t.double().square().sum())
    return math.sqrt(float((t.double() - r.double()).square().sum()) / norm) if norm > 0 else 0.0


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
    raise ValueError(f"could not meet NRMSE budget {target:.3g} (reached {err:.3g})")


def _dequant(n: np.ndarray, step: float) -> np.ndarray:
    return (n.astype(np.float64) * step).astype(np.float32)


def _encode_kind(x: np.ndarray, spec: AlignPredSpec, tag: str,
                 frozen: np.ndarray | None) -> tuple[dict[str, np.ndarray], KindReport]:
    L, T, H, D = x.shape
    target = spec.error.value * fp8_nrmse(x) if spec.error.relative_to_fp8 else spec.error.value
    if target <= 0.0:  # FP8 is exact on this data: keep a tight absolute budget instead of failing
        target = 1e-6
    n, step, err = _lattice(x, target)
    xhat = _dequant(n, step)
    max_error = step / 2.0 + float(np.spacing(np.float32(np.abs(xhat).max() if xhat.size else 0.0)))
    assert float(np.abs(x.astype(np.float64) - xhat).max(initial=0.0)) <= max_error

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
        f"{tag}.i": np.array([cm_off, crc32c.crc32c(n.tobytes())], np.int64),
        f"{tag}.cls": np.array([c.cls for c in codes], np.uint8),
        f"{tag}.cnt": np.array([c.count for c in codes], np.uint32),
        f"{tag}.tab": np.stack([c.table for c in codes]),
        f"{tag}.lo": np.concatenate([c.lo for c in codes]),
        f"{tag}.w": words.astype(np.uint32),
        f"{tag}.esc": esc,
    }
    if rots:
        arrays[f"{tag}.rot"] = np.stack(rots)
    return arrays, KindReport(target, err, max_error, step)


def _decode_kind(a: dict[str, np.ndarray], tag: str, shape: tuple[int, ...], spec_codes: np.ndarray,
                 frozen: np.ndarray | None) -> np.ndarray:
    L, T, H, D = shape
    align = list(_ALIGN_CODES)[int(spec_codes[0])]
    predict = list(_PREDICT_CODES)[int(spec_codes[1])]
    blend = float(np.frombuffer(spec_codes[2:6].tobytes(), np.float32)[0])
    try:
        step = float(a[f"{tag}.f"][0])
        cm_off, lattice_crc = (int(v) for v in a[f"{tag}.i"])
        cls, cnt, tab, lo = a[f"{tag}.cls"], a[f"{tag}.cnt"], a[f"{tag}.tab"], a[f"{tag}.lo"]
        codes, pos = [], 0
        for c, count, table in zip(cls, cnt, tab):
            size = low_bits(int(c)) * ((int(count) + 7) // 8)
            codes.append(ClassCode(int(c), int(count), table, lo[pos : pos + size]))
            pos += size
        values = decode_classes(codes, a[f"{tag}.w"], a[f"{tag}.esc"])
        C = H * D
        cmap = values[0].reshape(L, C) + cm_off
        mu = values[1].reshape(L, H, D) if predict == "mean" else None
        rows = np.empty((L, C, T), np.int32)
        for c, v in zip(cls[1 + (mu is not None) :], values[1 + (mu is not None) :]):
            rows[cmap == int(c)] = v.reshape(-1, T)
    except (KeyError, ValueError, IndexError) as exc:  # lengths or symbols that do not add up
        raise CorruptStream(f"AlignPred {tag} section unreadable: {exc}") from None
    n = _untokenwise(rows.transpose(0, 2, 1).reshape(L, T, H, D), mu)
    rots = a.get(f"{tag}.rot")
    blocks = n.transpose(0, 2, 1, 3)  # a view: updates land in n
    if frozen is not None:
        for layer in range(1, L):
            n[layer] += alignment.frozen_prediction(n[layer - 1], frozen[layer - 1])
    for i, ((la, ha), (lb, hb)) in enumerate([] if frozen is not None else alignment.pairs(align, L, H)):
        blocks[lb, hb] += alignment.cross_prediction(blocks[la, ha], rots[i], blend)
    if crc32c.crc32c(np.ascontiguousarray(n).tobytes()) != lattice_crc:
        raise CorruptStream(f"AlignPred {tag} lattice checksum mismatch: the decoded values are not the encoded ones")
    return _dequant(n, step)


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x, np.float32)
    if x.ndim != 4:
        raise ValueError(f"a page group is [layers, tokens, heads, head_dim]; got shape {x.shape}")
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
        s = self.spec
        codes = np.zeros(6, np.uint8)
        codes[0], codes[1] = _ALIGN_CODES[s.align], _PREDICT_CODES[s.predict]
        codes[2:6] = np.frombuffer(np.float32(s.blend).tobytes(), np.uint8)
        L, _, H, D = k.shape
        ka, kr = _encode_kind(k, s, "k", self._frozen("k", L, H * D))
        va, vr = _encode_kind(v, s, "v", self._frozen("v", L, H * D))
        self.last_report = (kr, vr)
        extra = {"cal": np.array([self.calibration.fingerprint()], np.uint32)} if self.calibration else {}
        return pack({"shape": np.array(k.shape, np.uint32), "spec": codes, **extra, **ka, **va})

    def decode(self, blob) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) as float32 [L, T, H, D]. Raises :class:`CorruptStream` on any damage, and when the
        stream was coded with a calibration other than this codec's."""
        a = unpack(blob)
        if "shape" not in a or "spec" not in a or a["shape"].size != 4 or a["spec"].size != 6:
            raise CorruptStream("AlignPred stream lacks its shape or spec entry")
        shape = tuple(int(s) for s in a["shape"])
        if a["spec"][0] >= len(_ALIGN_CODES) or a["spec"][1] >= len(_PREDICT_CODES):
            raise CorruptStream("AlignPred stream names an unknown predictor")
        frozen_k = frozen_v = None
        if "cal" in a:
            if self.calibration is None or int(a["cal"][0]) != self.calibration.fingerprint():
                raise CorruptStream("AlignPred stream was coded with another calibration than this codec's")
            L, _, H, D = shape
            frozen_k, frozen_v = self._frozen("k", L, H * D), self._frozen("v", L, H * D)
        return (_decode_kind(a, "k", shape, a["spec"], frozen_k), _decode_kind(a, "v", shape, a["spec"], frozen_v))

    @staticmethod
    def max_errors(blob) -> tuple[float, float]:
        """The stored per-value error bounds of K and V."""
        a = unpack(blob)
        return float(a["k.f"][3]), float(a["v.f"][3])
