"""Uniform group quantization shared by the reference codecs.

Groups are the last dimension of the input. Scales (and zeros) are rounded to their storage
dtype *before* the codes are computed, in the direction that keeps every value inside the
representable range, so the decoder sees exactly the numbers the encoder used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend import fastquant

SCALE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def scale_dtype(name: str) -> torch.dtype:
    from kvbackend.errors import SpecError

    try:
        return SCALE_DTYPES[name]
    except KeyError:
        raise SpecError(f"unknown scale dtype {name!r}; valid: {', '.join(SCALE_DTYPES)}") from None


def _limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """(relative step, smallest positive step, largest finite) of a float dtype."""
    info = torch.finfo(dtype)
    return info.eps, info.smallest_normal * info.eps, info.max


def round_to(x: torch.Tensor, dtype: torch.dtype, direction: str) -> torch.Tensor:
    """Round float32 ``x`` to a value representable in ``dtype``: ``"up"`` (>= x) or ``"down"`` (<= x).

    Returned in float32. Saturates at the dtype's largest finite value.
    """
    eps, tiny, big = _limits(dtype)
    x = x.clamp(-big, big)
    y = x.to(dtype).float()
    # One relative step (or the smallest subnormal step) in the wanted direction always crosses
    # at least one representable value, so re-rounding the nudged value lands on the right side.
    step = torch.maximum(x.abs() * eps, torch.full_like(x, tiny))
    if direction == "up":
        bad = y < x
        nudged = (x + step).clamp(-big, big).to(dtype).float()
    else:
        bad = y > x
        nudged = (x - step).clamp(-big, big).to(dtype).float()
    return torch.where(bad, nudged, y)


@dataclass
class Quantized:
    """Codes and per-group parameters for a tensor whose last dimension is one group."""

    codes: torch.Tensor  # uint8 [..., G], values in [0, 2**bits)
    scale: torch.Tensor  # [...] in the storage dtype
    zero: torch.Tensor | None  # [...] in the storage dtype, asymmetric only


# Step of the MSE-optimal uniform quantizer of a unit Gaussian, by number of levels (Max, 1960).
GAUSSIAN_STEP = {4: 0.9957, 8: 0.5860, 16: 0.3352, 256: 0.0308}


def clipped_step(levels: int, widen: float = 1.0) -> float:
    """The clipped quantizer's step per unit of a group's standard deviation: the Gaussian MSE-optimal step of
    ``levels`` levels times ``widen`` (one Python float, so the torch path and the encode kernel round it alike)."""
    return GAUSSIAN_STEP[levels] * widen


def quantize(x: torch.Tensor, bits: int, symmetric: bool, store: torch.dtype, clip: bool = False,
             widen: float = 1.0) -> Quantized:
    """Quantize float ``x [..., G]`` with one scale (and zero) per group of the last dimension.

    Symmetric uses levels ``-q..q`` with ``q = 2**(bits-1) - 1`` (ternary at 2 bits, as QVG's
    public code does); asymmetric uses ``0..2**bits - 1`` above a per-group minimum.
    ``clip`` (asymmetric only): the step is the smaller of the min/max step and the MSE-optimal step
    for a Gaussian of the group's standard deviation, centred on the group's mean; values beyond the
    levels are clipped. Same fields and bytes; at 2 bits it lowers the error of near-Gaussian groups
    (min/max spends levels on the tails). ``widen`` multiplies the Gaussian step (clip only): values read
    through an attention sum want a wider one than their own squared error does (`QVGSpec.vstep`).
    """
    x = x.float()
    fused = fastquant.enabled(x)  # the codes' loop serves clipped steps too (its parameters come from torch)
    if fused and not clip:
        span = fastquant.group_range(x)
        if span is not None:  # all finite: the fused loops (same parameters, same bytes)
            scale, zero = group_params(*span, bits, symmetric, store)
            codes = fastquant.codes(x, scale, zero, bits, symmetric)
            if codes is not None:
                return Quantized(codes, scale.to(store), None if zero is None else zero.to(store))
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        scale, _ = group_params(x.amin(dim=-1), x.amax(dim=-1), bits, True, store)
        q = x / scale.unsqueeze(-1)
        q.round_().clamp_(-qmax, qmax).add_(qmax)
        return Quantized(q.to(torch.uint8), scale.to(store), None)
    levels = (1 << bits) - 1
    if clip:
        span = fastquant.group_range(x) if fused else None  # None: a value is NaN or Inf (the torch path below)
        lo, hi = span if span is not None else (x.amin(dim=-1), x.amax(dim=-1))
        scale, zero = clipped_params(x, lo, hi, bits, store, widen)
        if span is not None:  # finite values: the fused loop writes the codes below would (same operations)
            codes = fastquant.codes(x, scale, zero, bits, False)
            if codes is not None:
                return Quantized(codes, scale.to(store), zero.to(store))
    else:
        scale, zero = group_params(x.amin(dim=-1), x.amax(dim=-1), bits, False, store)
    q = x - zero.unsqueeze(-1)  # one temporary, then in place: the same operations, fewer passes
    q.div_(scale.unsqueeze(-1)).round_().clamp_(0, levels)
    return Quantized(q.to(torch.uint8), scale.to(store), zero.to(store))


def clipped_params(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, store: torch.dtype,
                   widen: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) in float32, rounded to ``store``, of `quantize`'s clipped steps for the groups of the last
    dimension of float32 ``x`` (any strides), whose values span ``lo..hi``: the smaller of the min/max step and
    ``widen`` times the Gaussian MSE-optimal step of the group's standard deviation, centred on its mean. One
    function for the torch and the fused paths."""
    _, tiny, _ = _limits(store)
    levels = (1 << bits) - 1
    divisor = torch.full((), float(levels), device=x.device)  # a tensor: true division (no copy from the host)
    minmax = (hi - lo) / divisor
    # the groups' standard deviation in two passes (mean, then mean squared deviation): torch's `std`
    # costs several times more on the CPU for the same value to float32 rounding
    mean = x.mean(dim=-1)
    deviation = x - mean.unsqueeze(-1)
    gaussian = clipped_step(levels + 1, widen) * deviation.mul_(deviation).mean(dim=-1).sqrt_()
    # the mean and std of values near float32's limit overflow: those groups keep min/max steps (the
    # clamped step of `round_to`), never a NaN scale that would decode finite K/V into NaN
    use_minmax = (minmax <= gaussian) | ~torch.isfinite(gaussian) | ~torch.isfinite(mean)
    step = torch.where(use_minmax, minmax, gaussian)
    centred = torch.maximum(lo, mean - gaussian * divisor / 2)  # never below the minimum
    zero = round_to(torch.where(use_minmax, lo, centred) + 0.0, store, "down")  # -0 -> +0, as `group_params`
    return round_to(step.clamp_min(tiny), store, "up"), zero


def group_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool,
                 store: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero) in float32, rounded to ``store``, of groups whose values span ``lo..hi`` (min/max
    steps; ``zero`` None when symmetric). One function for the torch and the fused paths."""
    _, tiny, _ = _limits(store)
    lo, hi = lo + 0.0, hi + 0.0  # -0 -> +0: one zero whichever a reduction reports (same codes and values)
    # Divide by a tensor, not a Python number: CUDA torch turns division by a scalar into multiplication
    # by its reciprocal, which rounds differently from the CPU (and from the kernels' IEEE division).
    if symmetric:
        divisor = torch.tensor(float((1 << (bits - 1)) - 1), device=lo.device)
        peak = torch.maximum(lo.abs(), hi.abs())  # = max |x| of the group
        return round_to((peak / divisor).clamp_min(tiny), store, "up"), None
    divisor = torch.tensor(float((1 << bits) - 1), device=lo.device)
    zero = round_to(lo, store, "down")
    return round_to(((hi - zero) / divisor).clamp_min(tiny), store, "up"), zero


def _broadcasts_into(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without widening it (so an in-place op on ``target`` works)."""
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Inverse of `quantize`, in float32."""
    c = codes.to(torch.float32, copy=True)  # a copy of its own (float codes would alias): worked on in place
    s = scale.float().unsqueeze(-1)
    z = zero.float().unsqueeze(-1) if zero is not None else None
    if not all(_broadcasts_into(x.shape, c.shape) for x in (s, z) if x is not None):  # rare: wider scales
        c = c.expand(torch.broadcast_shapes(c.shape, s.shape, *(() if z is None else (z.shape,)))).clone()
    if z is None:
        qmax = (1 << (bits - 1)) - 1
        return c.sub_(qmax).mul_(s)
    return c.mul_(s).add_(z)
