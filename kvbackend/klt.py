"""``klt:`` keys by transform coding along frozen, query-weighted principal axes; values rotated and rounded.

Keys, per layer and KV head, are turned back to their pre-RoPE frame, scaled per channel by the square root of the
query energy ``w`` of the query heads that read them (each RoPE pair averaged: relative rotations mix a pair), so
that an error in the scaled frame is the logit error a typical query sees, and projected on the principal axes of
the scaled keys of a calibration text. The axes get integer widths 0-8 by reverse water-filling of their calibration
variances over every layer and head at once, the level chosen so that codes plus scales meet ``kbits`` bits per
key value; each coded axis is rounded uniformly inside a per-64-token absmax kept in fp16, and an axis of width 0
reads as its calibration mean. The bases (``KeyBases``) are fitted once per model on another text and are not part
of a request's bytes (like AlignPred's frozen predictors); `KeyBases.nbytes` says what they weigh.
``axes=channels`` codes the weighted channels themselves instead (widths by their variances, no rotation, so a
reader needs no D x D product per key; on SmolLM2's technical text its keys cost 1.8x the principal axes' KL).

Values are Hadamard-rotated and rounded per token and head at ``vbits`` with fp8 scale and zero (the clipped steps
of `kvbackend.quant` by default). The first ``sink`` tokens are kept exact in fp16 as well.

This is a sequence-level format measured by `kvbackend eval` (``--calibration TEXT``). With ``paged=true``
(``axes=channels`` only) `page_specs` turns it into one ``chw:`` page codec per layer, which the paged cache serves
through its torch reference (no kernel reads it yet), and `kvbackend eval` measures it there.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kvbackend import bitpack
from kvbackend.errors import InvalidKV, SpecError
from kvbackend.levers import rotate_values
from kvbackend.quant import dequantize, quantize, round_to
from kvbackend.rope import pair_mean
from kvbackend.spec import Checked, SpecKind, _convert, one_of, ranged, spec_kind, split_spec

GROUP = 64  # tokens sharing one scale per key axis
AXES = ("principal", "channels")
MAX_WIDTH = 8


@dataclass(frozen=True)
class KltSpec(Checked):
    kbits: float = ranged(3.5, 0.5, 8.5)  # key bits per value, codes and scales together
    vbits: int = ranged(3, 2, 8)  # value bits (2, 3, 4 or 8), fp8 scale and zero per token and head
    sink: int = ranged(4, 0, 1 << 20)  # first tokens kept exact (fp16)
    clip: bool = True  # the values' clipped steps (`kvbackend.quant.quantize`)
    vstep: float = ranged(1.0, 0.5, 2.0)  # with clip: the values' step as a multiple of the Gaussian MSE-optimal one
    axes: str = one_of("principal", AXES)  # keys on the principal axes, or on the weighted channels
    # served by the paged cache: `page_specs` writes one ``chw:`` page codec per layer (axes=channels only)
    paged: bool = False
    # the paged keys' frame: before RoPE (``pre``: the kernels rotate each key) or as attention reads them
    # (``post``: widths from the channels' variances after RoPE; a kernel can fold the scales into the query)
    rope: str = one_of("pre", ("pre", "post"))
    # paged: each head's row of key bits a whole number of 32-bit words (`word_widths`), which the tensor-core decode
    # reads from each row's own base (`kernels/mma_decode.cu`'s ``CHW_W32``)
    words: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vbits not in bitpack.SUPPORTED_BITS:
            raise SpecError(f"klt vbits={self.vbits}: choose one of {bitpack.SUPPORTED_BITS}")
        if self.vstep != 1.0 and not self.clip:
            raise SpecError(f"klt vstep={self.vstep:g} widens the clipped value step: it needs clip=true")
        if self.paged and self.axes != "channels":
            raise SpecError("klt paged=true: the paged cache serves axes=channels only (the principal axes need a "
                            "D x D product per key that no page codec has yet)")
        if self.words and not self.paged:
            raise SpecError("klt words=true: whole-word key rows are a page layout (paged=true)")
        if self.rope != "pre" and not self.paged:
            raise SpecError(f"klt rope={self.rope}: only the paged codec (paged=true) stores keys after RoPE")

    @property
    def spec_string(self) -> str:
        step = f",vstep={self.vstep:g}" if self.vstep != 1.0 else ""
        axes = f",axes={self.axes}" if self.axes != "principal" else ""
        paged = ",paged=true" if self.paged else ""
        rope = f",rope={self.rope}" if self.rope != "pre" else ""
        words = ",words=true" if self.words else ""
        return (f"klt:kbits={self.kbits:g},vbits={self.vbits},sink={self.sink},clip={str(self.clip).lower()}"
                f"{step}{axes}{paged}{rope}{words}")


_TYPES = {"kbits": float, "vbits": int, "sink": int, "clip": bool, "vstep": float, "axes": str, "paged": bool,
          "rope": str, "words": bool}


def is_klt(text: str) -> bool:
    return spec_kind(text) is SpecKind.KLT


def parse_klt(text: str) -> KltSpec:
    """Parse ``klt:kbits=3.5[,vbits=3][,sink=4][,clip=true][,vstep=1][,axes=principal|channels][,paged=false]
    [,rope=pre|post]``.

    Raises:
        SpecError: another spec family, an unknown option or a value out of range.
    """
    name, options = split_spec(text)
    if name != "klt":
        raise SpecError(f"{text!r} is not a klt: spec")
    unknown = sorted(set(options) - set(_TYPES))
    if unknown:
        raise SpecError(f"{text!r}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(_TYPES)}")
    return KltSpec(**{k: _convert(v, _TYPES[k], k, "klt") for k, v in options.items()})


@dataclass(frozen=True)
class KeyBases:
    """Per layer: query weights ``w``, mean ``mu``, axes ``basis`` (columns) and their variances ``lam`` per KV
    head, and the variances ``var`` of the weighted channels themselves (`along` ``"channels"``), before RoPE and
    (``var_post``) after it, over the calibration text's positions.

    Shapes: w, mu, lam, var, var_post ``[L, H, D]``; basis ``[L, H, D, D]`` (float32)."""

    w: torch.Tensor
    mu: torch.Tensor
    basis: torch.Tensor
    lam: torch.Tensor
    var: torch.Tensor
    var_post: torch.Tensor

    @staticmethod
    def fit(queries: list[torch.Tensor], keys: list[torch.Tensor], rotary) -> "KeyBases":
        """From one text's exact tensors per layer: queries ``[Hq, T, D]`` and keys ``[H, T, D]`` after RoPE at
        positions 0..T-1 (`kvbackend.tools.evaluate.capture_exact`)."""
        ws, mus, bases, lams, variances, posts = [], [], [], [], [], []
        for q_post, k_post in zip(queries, keys):
            h, t, d = k_post.shape
            if q_post.shape[0] % h or t < 2:
                raise InvalidKV(f"calibration: {q_post.shape[0]} query heads over {h} KV heads, {t} tokens")
            k = rotary.derotate(k_post.float(), torch.arange(t))
            q = rotary.derotate(q_post.float(), torch.arange(q_post.shape[1]))
            group = q.shape[0] // h
            w = pair_mean(q.reshape(h, group * q.shape[1], d).square().mean(1)).clamp_min(1e-8)  # [H, D]
            y = k * w.sqrt()[:, None]
            mu = y.mean(1)
            centred = y - mu[:, None]
            cov = centred.transpose(1, 2) @ centred / (t - 1)
            lam, basis = torch.linalg.eigh(cov.double())
            ws.append(w)
            mus.append(mu)
            bases.append(basis.float())
            lams.append(lam.float().clamp_min(1e-12))
            variances.append(cov.diagonal(dim1=1, dim2=2).clamp_min(1e-12))
            posts.append((k_post.float() * w.sqrt()[:, None]).var(1).clamp_min(1e-12))
        return KeyBases(torch.stack(ws), torch.stack(mus), torch.stack(bases), torch.stack(lams),
                        torch.stack(variances), torch.stack(posts))

    def along(self, axes: str) -> "KeyBases":
        """``"principal"``: these bases; ``"channels"``: the weighted channels as axes (no rotation: widths by the
        channels' own variances, a key decodes without a D x D product)."""
        if axes == "principal":
            return self
        eye = torch.eye(self.w.shape[-1]).expand_as(self.basis).contiguous()
        return KeyBases(self.w, self.mu, eye, self.var, self.var, self.var_post)

    @property
    def nbytes(self) -> int:
        """What the frozen bases weigh (once per model, not per request)."""
        return sum(t.nbytes for t in (self.w, self.mu, self.basis, self.lam, self.var, self.var_post))

    def check(self, layers: int, heads: int, dim: int) -> None:
        if tuple(self.lam.shape) != (layers, heads, dim):
            raise InvalidKV(f"klt bases for {tuple(self.lam.shape)} (layers, heads, dim); the keys are "
                            f"{(layers, heads, dim)}")


def widths(lam: torch.Tensor, kbits: float, tokens: int, group: int = GROUP) -> torch.Tensor:
    """Integer widths ``[L, H, D]`` in 0..8 by reverse water-filling of ``lam``: the largest widths whose codes and
    fp16 scales (one per coded axis and group of ``group`` tokens) fit ``kbits`` bits per key value of ``tokens``."""
    groups = math.ceil(tokens / group)
    flat = lam.double().flatten()

    def at(level: float) -> tuple[float, torch.Tensor]:
        b = (0.5 * torch.log2(flat / level)).round().clamp(0, MAX_WIDTH)
        bits = float(b.sum()) * tokens + float((b > 0).sum()) * groups * 16
        return bits / (flat.numel() * tokens), b

    lo, hi = float(flat.min()) * 1e-6, float(flat.max()) * 4.0 ** MAX_WIDTH
    for _ in range(100):  # bisection on the level's logarithm; ``hi`` always meets the budget
        mid = math.sqrt(lo * hi)
        if at(mid)[0] > kbits:
            lo = mid
        else:
            hi = mid
    return at(hi)[1].to(torch.uint8).reshape(lam.shape)


def word_widths(lam: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """``width`` ``[L, H, D]`` with each head's sum moved to the nearer multiple of 32 (up from a remainder of 16) by
    single bits where they matter most: a bit added where it takes the most distortion off (``lam * 4^-w``, largest
    first), one taken where it adds the least (smallest first); only channels already coded change (1-8), so the
    coded channels and their scales stay as planned."""
    out = width.clone().long()
    lam = lam.double()
    for idx in itertools.product(*(range(n) for n in out.shape[:-1])):
        row, v = out[idx], lam[idx]
        rem = int(row.sum()) % 32
        up = rem >= 16
        for _ in range(32 - rem if up else rem):
            ok = (row >= 1) & (row < MAX_WIDTH) if up else row >= 2
            if not bool(ok.any()):
                raise SpecError(f"klt words=true: head {idx} cannot reach a whole number of 32-bit words")
            worth = v * 4.0 ** -row.double()  # the distortion one bit takes off (up) or adds (down), up to a factor
            if up:
                row[int(torch.where(ok, worth, -math.inf).argmax())] += 1
            else:
                row[int(torch.where(ok, worth, math.inf).argmin())] -= 1
    return out.to(width.dtype)


def pack_widths(codes: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Codes ``[T, A]`` (axis a below ``2**width[a]``) as one bit string, most significant bit first, in uint8."""
    shifts = torch.arange(MAX_WIDTH - 1, -1, -1)  # bit k of a code of width b is bit (b - 1 - k)
    valid = shifts[None, :] < width[:, None].long()  # [A, 8]: the low ``width`` bits of each code
    bits = (codes.long()[..., None] >> shifts) & 1  # [T, A, 8]
    flat = bits[:, valid].flatten()
    pad = (-flat.numel()) % 8
    flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.reshape(-1, 8) << torch.arange(7, -1, -1)).sum(1).to(torch.uint8)


def unpack_widths(packed: torch.Tensor, width: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of `pack_widths`: int64 codes ``[tokens, A]``."""
    shifts = torch.arange(MAX_WIDTH - 1, -1, -1)
    valid = shifts[None, :] < width[:, None].long()
    per_token = int(valid.sum())
    if packed.numel() != math.ceil(tokens * per_token / 8):
        raise InvalidKV(f"klt key codes: {packed.numel()} bytes for {tokens} tokens of {per_token} bits")
    bits = ((packed.long()[:, None] >> torch.arange(7, -1, -1)) & 1).flatten()[: tokens * per_token]
    full = torch.zeros(tokens, width.numel(), MAX_WIDTH, dtype=torch.long)
    full[:, valid] = bits.reshape(tokens, per_token)
    return (full << shifts).sum(-1)


def page_specs(spec: KltSpec, bases: KeyBases, page_size: int) -> list[str]:
    """One ``chw:`` page codec spec per layer (`kvbackend.codecs.chw`) serving ``spec`` in the paged cache: the key
    widths of ``axes=channels`` by reverse water-filling over every layer and head, with one fp16 scale per coded
    channel and page of ``page_size`` tokens counted in ``kbits`` (the chunk's channel means are not: 16 bits per
    channel and chunk), keys before RoPE (``rope=post``: after it, widths by the variances after RoPE), values
    Hadamard-rotated, ``sink`` first tokens exact; ``words=true``: each head's row whole 32-bit words (`word_widths`).

    Raises:
        SpecError: a spec on the principal axes (no page codec reads them).
    """
    if spec.axes != "channels":
        raise SpecError(f"{spec.spec_string}: the paged cache serves axes=channels only")
    lam = bases.var_post if spec.rope == "post" else bases.along("channels").lam
    width = widths(lam, spec.kbits, page_size, group=page_size)
    if spec.words:
        width = word_widths(lam, width)
    step = f",vstep={spec.vstep:g}" if spec.vstep != 1.0 else ""
    sink = f",sink={spec.sink}" if spec.sink else ""
    rope = ",prerope=true" if spec.rope == "pre" else ""
    return [f"chw:kw={''.join(str(int(b)) for b in layer.flatten())},vbits={spec.vbits},"
            f"vclip={str(spec.clip).lower()}{step}{sink}{rope},vrot=hadamard" for layer in width]


@dataclass
class KltLayer:
    """What one layer of a sequence stores: every tensor here is counted in `nbytes`."""

    key_codes: list[torch.Tensor]  # per KV head, `pack_widths` of its coded axes over the tokens
    key_scales: torch.Tensor  # fp16 [groups, coded axes of all heads]
    value_codes: torch.Tensor  # uint8 [T, H, packed D]
    value_scales: torch.Tensor  # fp8 [T, H]
    value_zeros: torch.Tensor  # fp8 [T, H]
    sink_k: torch.Tensor  # fp16 [sink, H, D]
    sink_v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.key_codes, self.key_scales, self.value_codes, self.value_scales,
                                      self.value_zeros, self.sink_k, self.sink_v))


def encode_layer(spec: KltSpec, bases: KeyBases, layer: int, width: torch.Tensor, k_post: torch.Tensor,
                 v: torch.Tensor, rotary) -> KltLayer:
    """One layer of a sequence from position 0: ``k_post``, ``v`` ``[T, H, D]`` (keys after RoPE)."""
    t, h, d = k_post.shape
    if t < 1:
        raise InvalidKV("klt: no tokens to encode")
    if not (torch.isfinite(k_post).all() and torch.isfinite(v).all()):
        raise InvalidKV("klt: keys or values hold NaN or Inf")
    n = min(spec.sink, t)
    if n and max(float(k_post[:n].abs().max()), float(v[:n].abs().max())) > torch.finfo(torch.float16).max:
        raise InvalidKV(f"klt: a sink token's key or value exceeds fp16's range (the first {n} tokens are kept in it)")
    k = rotary.derotate(k_post.float().transpose(0, 1), torch.arange(t))  # [H, T, D]
    codes, scales = [], []
    for head in range(h):
        y = (k[head] * bases.w[layer, head].sqrt() - bases.mu[layer, head]) @ bases.basis[layer, head]
        coded = width[head] > 0
        yc, b = y[:, coded], width[head][coded].float()
        levels = 2.0 ** b
        q = torch.empty_like(yc)
        head_scales = []
        for g0 in range(0, t, GROUP):
            blk = yc[g0 : g0 + GROUP]
            peak = blk.abs().amax(0)
            if bool((peak > torch.finfo(torch.float16).max).any()):  # `round_to` would saturate: clipped keys
                raise InvalidKV("klt: a key axis exceeds fp16's range in the calibrated frame")
            amax = round_to(peak.clamp_min(1e-30), torch.float16, "up")
            q[g0 : g0 + GROUP] = torch.floor((blk + amax) / (2 * amax / levels)).clamp(torch.zeros_like(levels),
                                                                                         levels - 1)
            head_scales.append(amax.half())
        codes.append(pack_widths(q, width[head][coded]))
        scales.append(torch.stack(head_scales))  # t >= 1: one group at least
    rotated = rotate_values(v.float())
    if float(rotated.abs().max()) > torch.finfo(torch.float8_e4m3fn).max:  # zeros would saturate: clipped values
        raise InvalidKV("klt: a rotated value exceeds fp8-e4m3's range (448), which its zero points are stored in")
    quant = quantize(rotated, spec.vbits, False, torch.float8_e4m3fn, clip=spec.clip, widen=spec.vstep)
    return KltLayer(codes, torch.cat(scales, 1), bitpack.pack(quant.codes, spec.vbits), quant.scale, quant.zero,
                    k_post[:n].half(), v[:n].half())


def decode_layer(spec: KltSpec, bases: KeyBases, layer: int, width: torch.Tensor, stored: KltLayer, tokens: int,
                 rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys (after RoPE) and values ``[T, H, D]`` of one layer."""
    h, d = width.shape
    keys = torch.empty(h, tokens, d)
    offset = 0
    for head in range(h):
        coded = width[head] > 0
        count = int(coded.sum())
        q = unpack_widths(stored.key_codes[head], width[head][coded], tokens).float()
        amax = stored.key_scales[:, offset : offset + count].float().repeat_interleave(GROUP, 0)[:tokens]
        offset += count
        levels = 2.0 ** width[head][coded].float()
        y = torch.zeros(tokens, d)
        y[:, coded] = -amax + (q + 0.5) * (2 * amax / levels)
        keys[head] = (y @ bases.basis[layer, head].T + bases.mu[layer, head]) / bases.w[layer, head].sqrt()
    keys = rotary.rotate(keys, torch.arange(tokens)).transpose(0, 1).contiguous()
    codes = bitpack.unpack(stored.value_codes, spec.vbits)
    values = rotate_values(dequantize(codes, stored.value_scales, stored.value_zeros, spec.vbits))
    n = stored.sink_k.shape[0]
    keys[:n], values[:n] = stored.sink_k.float(), stored.sink_v.float()
    return keys, values


@dataclass
class KltSequence:
    k: torch.Tensor  # float32 [L, T, H, D], after RoPE
    v: torch.Tensor
    stored_bytes: int  # every tensor a sequence keeps (the frozen bases are the model's: `KeyBases.nbytes`)


def reconstruct(spec: KltSpec, bases: KeyBases, k_all: torch.Tensor, v_all: torch.Tensor, rotary) -> KltSequence:
    """Encode and decode ``k_all``, ``v_all`` ``[L, T, H, D]`` (a sequence from position 0, keys after RoPE)."""
    layers, t, h, d = k_all.shape
    if t < 1:
        raise InvalidKV("klt: no tokens to encode")
    bases.check(layers, h, d)
    bases = bases.along(spec.axes)
    width = widths(bases.lam, spec.kbits, t)
    ks, vs, stored = [], [], 0
    for layer in range(layers):
        kept = encode_layer(spec, bases, layer, width[layer], k_all[layer], v_all[layer], rotary)
        stored += kept.nbytes
        k, v = decode_layer(spec, bases, layer, width[layer], kept, t, rotary)
        ks.append(k)
        vs.append(v)
    return KltSequence(torch.stack(ks), torch.stack(vs), stored)
