"""Fused CPU loops for the group quantizer, compiled with numba where it is installed.

The torch quantizer (`kvbackend.quant`) makes about a dozen passes over memory per value (range, subtract,
divide, round, clamp, narrow, pack); on a CPU that, not arithmetic, bounds the storage adapters' throughput.
Here the groups' ranges come from torch's reductions (already one vectorized pass each), and one compiled loop
computes and packs the codes. The per-group parameters (scale and zero, rounded to their storage dtype) come
from the same torch function as the torch path, and the per-value arithmetic is the same float32 operations in
the same order (subtract the zero, divide by the scale, round half to even, clamp), so both paths write
identical bytes: `tests/test_fastquant.py` holds them together. Decoding goes the other way in one loop: each
packed byte's codes from a 256-entry table, times the scale, plus the zero (float32, two roundings, as torch's
`mul_` and `add_`), rounded to bf16 to nearest even as torch's conversion does (`unpacked_bf16`).

Used for CPU float32 and bf16 inputs of at least `MIN_VALUES` values (clipped steps too: their scales and zeros
come from torch's mean and deviation, `quant.clipped_params`, and only the codes from here), when numba imports,
its JIT is on and ``KVBACKEND_FASTQUANT`` is not ``0``/``false``/``off``/``no``. Inputs with NaN or Inf take the
torch path, and so does everything after a compiled loop fails once (said once in the log). Every public function returns None where it does not serve.
The loops release the GIL, so the adapters' worker threads run them in parallel.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbackend.switches import switched_off

try:
    import numba
except ImportError:  # optional: the torch path serves without it
    numba = None

MIN_VALUES = 1 << 15  # below this, numba's call overhead is not worth it
PACK_BITS = (2, 4, 8)  # widths whose codes never straddle a byte
_broken: list[str] = []  # why the compiled loops failed once (then the torch path serves for the process)


def _usable() -> bool:
    return (numba is not None and not _broken and not numba.config.DISABLE_JIT
            and not switched_off("KVBACKEND_FASTQUANT"))


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused loops take ``x``."""
    return (_usable() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() >= MIN_VALUES and not x.requires_grad)


_FAILED = object()


def _run(kernel, *args):
    """``kernel(*args)``, or `_FAILED` after telling once why the compiled loops cannot serve (a numba cache
    that cannot be read, a failed compilation): the callers then take the torch path, which gives the same
    bytes."""
    try:
        return kernel(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional fast path falls back to torch
        if not _broken:
            import logging

            logging.getLogger(__name__).warning("kvbackend: the fused CPU loops failed (%s: %s); using torch",
                                                type(exc).__name__, exc)
        _broken.append(f"{type(exc).__name__}: {exc}")
        return _FAILED


def _jit(fn):
    # error_model="numpy": a division by a flushed subnormal scale gives inf/NaN as in torch (clamped to a code),
    # never a Python ZeroDivisionError. The on-disk cache is tried first; where numba finds no place to keep it
    # (a read-only install without a writable cache folder), the loops compile in memory instead.
    try:
        return numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")(fn)
    except RuntimeError:
        return numba.njit(cache=False, nogil=True, boundscheck=False, error_model="numpy")(fn)


if numba is not None:

    @_jit
    def _codes(x, zero, scale, symmetric, qmax, out):  # x float32 [n, G] -> uint8 codes [n, G]
        n, g = x.shape
        for i in range(n):
            z = zero[i]
            s = scale[i]
            for j in range(g):
                if symmetric:
                    q = np.rint(x[i, j] / s)
                    q = min(max(q, np.float32(-qmax)), np.float32(qmax)) + np.float32(qmax)
                else:
                    q = np.rint((x[i, j] - z) / s)
                    q = min(max(q, np.float32(0.0)), np.float32(qmax))
                out[i, j] = np.uint8(q)

    @_jit
    def _pack_bytes(q, bits, out_row):  # codes [D] -> bytes, first code in the top bits (as bitpack.pack)
        n = out_row.shape[0]
        if bits == 2:  # the widths spelled out: straight loops the compiler vectorizes
            for b in range(n):
                out_row[b] = (q[4 * b] << np.uint8(6)) | (q[4 * b + 1] << np.uint8(4)) | (q[4 * b + 2] << np.uint8(2)) | q[4 * b + 3]
        elif bits == 4:
            for b in range(n):
                out_row[b] = (q[2 * b] << np.uint8(4)) | q[2 * b + 1]
        elif bits == 8:
            for b in range(n):
                out_row[b] = q[b]
        else:
            per = 8 // bits
            for b in range(n):
                byte = np.uint32(0)
                for k in range(per):
                    byte = (byte << bits) | np.uint32(q[b * per + k])
                out_row[b] = np.uint8(byte)

    @_jit
    def _widen_bf16(bits_row, wide):  # bf16 bits -> float32 (exact: the bits shifted into the top half)
        for j in range(bits_row.shape[0]):
            wide[j] = np.uint32(bits_row[j]) << np.uint32(16)
        return wide.view(np.float32)

    @_jit
    def _pack_row(xr, r, zero, scale, symmetric, qmax, bits, group, q, out):  # one row of float32 values
        ng = xr.shape[0] // group
        lo = np.float32(-qmax) if symmetric else np.float32(0.0)
        hi = np.float32(qmax)
        shift = np.float32(qmax) if symmetric else np.float32(0.0)
        for gg in range(ng):
            gi = r * ng + gg
            z = np.float32(0.0) if symmetric else zero[gi]
            s = scale[gi]
            base = gg * group
            for j in range(group):  # a straight loop the compiler vectorizes
                v = np.rint((xr[base + j] - z) / s)
                q[base + j] = np.uint8(min(max(v, lo), hi) + shift)
        _pack_bytes(q, bits, out[r])  # the whole row, as bitpack.pack does: groups need not fill whole bytes

    @_jit
    def _packed(x, zero, scale, symmetric, qmax, bits, group, out):  # x float32 [rows, D] -> uint8 [rows, D*bits/8]
        q = np.empty(x.shape[1], np.uint8)
        for r in range(x.shape[0]):
            _pack_row(x[r], r, zero, scale, symmetric, qmax, bits, group, q, out)

    @_jit
    def _packed_bf16(x, zero, scale, symmetric, qmax, bits, group, out):  # x bf16 bits (uint16) [rows, D]
        rows, d = x.shape
        q = np.empty(d, np.uint8)
        wide = np.empty(d, np.uint32)
        for r in range(rows):
            _pack_row(_widen_bf16(x[r], wide), r, zero, scale, symmetric, qmax, bits, group, q, out)


    @_jit
    def _range_bf16(x, lo, hi):
        # x bf16 bits (uint16) [n, G] -> float32 (min, max) per group through integer keys (sign-magnitude to
        # two's complement: monotone in the value, and integer reductions vectorize); False if NaN or Inf
        n, g = x.shape
        special = np.int32(0)
        for i in range(n):
            a = np.int32(32767)
            b = np.int32(-32768)
            for j in range(g):
                u = np.int32(x[i, j])
                mag = u & np.int32(0x7FFF)
                key = mag - ((u >> np.int32(15)) * (mag + mag))  # +mag or -mag
                a = min(a, key)
                b = max(b, key)
                special |= np.int32(mag >= np.int32(0x7F80))
            lo[i] = a
            hi[i] = b
        return special == 0

    @_jit
    def _peak_bf16(x):  # x bf16 bits (uint16), flat: the largest magnitude's bits (NaN and Inf above 0x7F7F)
        peak = np.int32(0)
        for j in range(x.shape[0]):
            peak = max(peak, np.int32(x[j]) & np.int32(0x7FFF))
        return peak

    @_jit
    def _finite_bf16(x):  # x bf16 bits (uint16), flat: no NaN or Inf
        special = np.int32(0)
        for j in range(x.shape[0]):
            special |= np.int32((np.int32(x[j]) & np.int32(0x7F80)) == np.int32(0x7F80))
        return special == 0


    @_jit
    def _table_codes(packed_row, table, tmp):  # each byte's codes (as floats) from a 256-entry table
        per = table.shape[1]
        for b in range(packed_row.shape[0]):
            byte = packed_row[b]
            for k in range(per):
                tmp[b * per + k] = table[byte, k]

    @_jit
    def _to_bf16(tmp, out_row):  # float32 -> bf16 bits, to nearest even as torch rounds (NaN: 0x7FC0)
        u = tmp.view(np.uint32)
        for k in range(out_row.shape[0]):
            j = np.uint64(k)  # unsigned: no wraparound check, so the loop vectorizes
            x = u[j]
            if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out_row[j] = np.uint16(0x7FC0)
            else:
                out_row[j] = np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @_jit
    def _dequant_row(packed_row, r, zero, scale, add_zero, group, table, row):
        # row r of packed uint8 [rows, D / per] -> float32 [D]: each byte's codes as floats from ``table`` (codes,
        # or codes - qmax for symmetric layouts), times the scale, plus the zero where there is one (two
        # roundings, as torch's mul_ then add_)
        ng = row.shape[0] // group
        _table_codes(packed_row, table, row)
        for gg in range(ng):
            gi = r * ng + gg
            s = scale[gi]
            z = zero[gi]
            base = gg * group
            if add_zero:
                for j in range(group):
                    row[base + j] = row[base + j] * s + z
            else:
                for j in range(group):
                    row[base + j] = row[base + j] * s

    @_jit
    def _unpacked(packed, zero, scale, add_zero, group, table, tmp, out):
        # -> bf16 bits (uint16) [rows, D]: `_dequant_row`, rounded to nearest even as torch does
        for r in range(out.shape[0]):
            _dequant_row(packed[r], r, zero, scale, add_zero, group, table, tmp)
            _to_bf16(tmp, out[r])

    @_jit
    def _unpacked_f32(packed, zero, scale, add_zero, group, table, out):  # -> float32 [rows, D]
        for r in range(out.shape[0]):
            _dequant_row(packed[r], r, zero, scale, add_zero, group, table, out[r])


    @_jit
    def _range_channels_bf16(x, group, lo, hi):
        # x bf16 bits (uint16) [T, C] -> integer keys (see _range_bf16) of each channel's min and max over each
        # group of `group` tokens, [T / group, C], vectorized over channels; False if NaN or Inf
        t, c = x.shape
        special = np.int32(0)
        for tg in range(t // group):
            for j in range(c):
                lo[tg, j] = np.int32(32767)
                hi[tg, j] = np.int32(-32768)
            for i in range(tg * group, (tg + 1) * group):
                for j in range(c):
                    u = np.int32(x[i, j])
                    mag = u & np.int32(0x7FFF)
                    key = mag - ((u >> np.int32(15)) * (mag + mag))
                    lo[tg, j] = min(lo[tg, j], key)
                    hi[tg, j] = max(hi[tg, j], key)
                    special |= np.int32(mag >= np.int32(0x7F80))
        return special == 0

    @_jit
    def _pack_channels_row(xr, zr, sr, qmax, bits, q, out_row):  # one token: each channel its own scale and zero
        for j in range(xr.shape[0]):
            v = np.rint((xr[j] - zr[j]) / sr[j])
            q[j] = np.uint8(min(max(v, np.float32(0.0)), np.float32(qmax)))
        _pack_bytes(q, bits, out_row)

    @_jit
    def _packed_channels(x, zero, scale, qmax, bits, group, out):  # x float32 [T, C]; zero/scale [T / group, C]
        q = np.empty(x.shape[1], np.uint8)
        for i in range(x.shape[0]):
            _pack_channels_row(x[i], zero[i // group], scale[i // group], qmax, bits, q, out[i])

    @_jit
    def _packed_channels_bf16(x, zero, scale, qmax, bits, group, out):  # x bf16 bits (uint16) [T, C]
        t, c = x.shape
        q = np.empty(c, np.uint8)
        wide = np.empty(c, np.uint32)
        for i in range(t):
            _pack_channels_row(_widen_bf16(x[i], wide), zero[i // group], scale[i // group], qmax, bits, q, out[i])

    @_jit
    def _channels_row(packed_row, tg, zero, scale, table, row):
        # one token of packed uint8 [T, C / per] -> float32 [C]: codes * scale + zero of its channels' token group
        _table_codes(packed_row, table, row)
        for j in range(row.shape[0]):
            row[j] = row[j] * scale[tg, j] + zero[tg, j]

    @_jit
    def _unpacked_channels(packed, zero, scale, group, table, tmp, out):  # -> bf16 bits [T, C]
        for i in range(out.shape[0]):
            _channels_row(packed[i], i // group, zero, scale, table, tmp)
            _to_bf16(tmp, out[i])

    @_jit
    def _unpacked_channels_f32(packed, zero, scale, group, table, out):  # -> float32 [T, C]
        for i in range(out.shape[0]):
            _channels_row(packed[i], i // group, zero, scale, table, out[i])


if numba is not None:

    @_jit
    def _plus_rows(x, raw, ids, page_of, scale, table, out):
        # out[t, h] = x[t, h] + table[raw[page_of[t], h, ids[t, h]]] * scale[page_of[t], h]: float32, the torch
        # path's two roundings (the product, then the sum)
        t_n, h_n, d_n = x.shape
        for t in range(t_n):
            p = page_of[t]
            for h in range(h_n):
                s = scale[p, h]
                row = raw[p, h, ids[t, h]]
                for d in range(d_n):
                    out[t, h, d] = x[t, h, d] + table[row[d]] * s


if numba is not None:

    @_jit
    def _butterflies(a, d_n, h):
        # one stage of the transform on row ``a``: pairs (i, i + h) of each block of 2h, a sum and a difference.
        # Unsigned indices: numba wraps negative signed ones around, and that check keeps LLVM from vectorizing
        # (3x the throughput at D=128)
        step = np.uint64(h)
        for blk in range(0, d_n, 2 * h):
            first = np.uint64(blk)
            for k in range(h):
                i = first + np.uint64(k)
                u = a[i]
                v = a[i + step]
                a[i] = u + v
                a[i + step] = u - v

    @_jit
    def _hadamard_row(a):
        # FWHT of row ``a`` in place: the butterflies of `kvbackend.levers.rotate_values` (pairs (i, i + h) of each
        # block of 2h, h = 1, 2, 4, ...), each one float32 sum or difference. Every output of a stage is one sum or
        # difference of two outputs of the stage before, so the order in which a stage's pairs are taken changes no
        # bit: stages 1, 2 and 4 run in registers per group of 8 channels, the rest over contiguous runs (2-3x the
        # throughput of 16 rows held transposed).
        d_n = a.shape[0]
        if d_n % 8:
            h = 1
            while h < d_n:
                _butterflies(a, d_n, h)
                h *= 2
            return
        for first in range(0, d_n, 8):
            g = np.uint64(first)
            x0 = a[g]
            x1 = a[g + np.uint64(1)]
            x2 = a[g + np.uint64(2)]
            x3 = a[g + np.uint64(3)]
            x4 = a[g + np.uint64(4)]
            x5 = a[g + np.uint64(5)]
            x6 = a[g + np.uint64(6)]
            x7 = a[g + np.uint64(7)]
            y0, y1, y2, y3 = x0 + x1, x0 - x1, x2 + x3, x2 - x3  # h = 1
            y4, y5, y6, y7 = x4 + x5, x4 - x5, x6 + x7, x6 - x7
            z0, z2, z1, z3 = y0 + y2, y0 - y2, y1 + y3, y1 - y3  # h = 2
            z4, z6, z5, z7 = y4 + y6, y4 - y6, y5 + y7, y5 - y7
            a[g] = z0 + z4  # h = 4
            a[g + np.uint64(4)] = z0 - z4
            a[g + np.uint64(1)] = z1 + z5
            a[g + np.uint64(5)] = z1 - z5
            a[g + np.uint64(2)] = z2 + z6
            a[g + np.uint64(6)] = z2 - z6
            a[g + np.uint64(3)] = z3 + z7
            a[g + np.uint64(7)] = z3 - z7
        h = 8
        while h < d_n:
            _butterflies(a, d_n, h)
            h *= 2

    @_jit
    def _hadamard_rows(x, scale, out):
        # out[r] = FWHT(x[r] * scale): one float32 product, then `_hadamard_row`
        r_n, d_n = x.shape
        s = scale[0]
        for r in range(r_n):
            a = out[r]
            for d in range(d_n):
                a[d] = x[r, d] * s
            _hadamard_row(a)


    @_jit
    def _hadamard_rows_bf16(bits, scale, out):
        # `_hadamard_rows` of bf16 rows given as their uint16 bits, each widened to float32 exactly (bits << 16) in
        # the output row itself: no float32 copy of the input is made first
        r_n, d_n = bits.shape
        s = scale[0]
        wide = out.view(np.uint32)
        for r in range(r_n):
            for d in range(d_n):
                wide[r, d] = np.uint32(bits[r, d]) << np.uint32(16)
            a = out[r]
            for d in range(d_n):
                a[d] = a[d] * s
            _hadamard_row(a)


def hadamard_rows(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The fast Walsh-Hadamard transform of each row of float32 or bfloat16 ``x [R, D]`` (bfloat16 widened exactly)
    times the float32 ``scale`` (one value, applied first), in float32: the bits of `kvbackend.levers.rotate_values`'s
    torch path; None where the fused loops do not serve. ``out``: a contiguous float32 CPU tensor of ``x``'s shape,
    not overlapping ``x``, to write into (a caller's buffer reused across batches has no fresh pages to fault in)."""
    if not (_usable() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() >= MIN_VALUES and x.dim() == 2):
        return None
    if out is not None and (out.shape != x.shape or out.dtype != torch.float32 or out.device.type != "cpu"
                            or not out.is_contiguous()):
        raise ValueError(f"hadamard_rows: out must be a contiguous float32 CPU tensor of shape {tuple(x.shape)}")
    target = out
    out = np.empty(tuple(x.shape), np.float32) if target is None else target.numpy()
    if x.dtype == torch.bfloat16:  # a batch's float32 copy costs more (its fresh pages) than the transform
        done = _run(_hadamard_rows_bf16, x.contiguous().view(torch.int16).numpy().view(np.uint16),
                    scale.reshape(1).numpy(), out)
    else:
        done = _run(_hadamard_rows, x.contiguous().numpy(), scale.reshape(1).numpy(), out)
    if done is _FAILED:
        return None
    return torch.from_numpy(out) if target is None else target


_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # every e4m3fn byte

if numba is not None:

    @_jit
    def _fp8_values(codes, table, out):  # flat e4m3fn bytes -> float32, through the table of every byte
        for i in range(codes.shape[0]):
            out[i] = table[codes[i]]


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    """float32 values of float8_e4m3fn ``x`` (any shape), the values of ``x.float()`` bit for bit (NaN bytes
    included: the table is that conversion of every byte): one compiled pass through the table on the CPU, where
    torch's own conversion costs about 4 ns a value (0.4 here); ``x.float()`` wherever the loops do not serve."""
    if _usable() and x.device.type == "cpu" and x.dtype == torch.float8_e4m3fn and x.numel() >= MIN_VALUES:
        out = np.empty(x.numel(), np.float32)
        if _run(_fp8_values, x.contiguous().view(torch.uint8).reshape(-1).numpy(), _FP8_TABLE, out) is not _FAILED:
            return torch.from_numpy(out).view(x.shape)
    return x.float()


def plus_fp8_rows(x: torch.Tensor, raw: torch.Tensor, ids: torch.Tensor, page_of: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor | None:
    """``x + fp8(raw[page_of, h, ids]) * scale[page_of, h]`` for float32 ``x [T, H, D]``, fp8 bytes ``raw [n, H, C,
    D]`` (uint8), ids ``[T, H]``, ``page_of [T]`` and float32 ``scale [n, H]``: the torch path's values, bit for bit,
    in one pass; None where the fused loops do not serve (then the caller's torch path does)."""
    if not (_usable() and x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() >= MIN_VALUES):
        return None
    if int(ids.max()) >= raw.shape[2] or int(ids.min()) < 0:  # damaged ids: let torch's indexing raise
        return None
    out = np.empty(tuple(x.shape), np.float32)
    done = _run(_plus_rows, x.contiguous().numpy(), raw.contiguous().numpy(), ids.contiguous().numpy(),
                page_of.contiguous().numpy(), scale.float().contiguous().numpy(), _FP8_TABLE, out)
    return None if done is _FAILED else torch.from_numpy(out)


def _keys_to_float(keys: np.ndarray) -> torch.Tensor:
    """float32 values of integer keys of bf16 bits (`_range_bf16`); a zero key is +0."""
    mag = np.abs(keys).astype(np.uint32)
    bits = ((mag | np.where(keys < 0, np.uint32(0x8000), np.uint32(0))) << np.uint32(16)).view(np.float32)
    return torch.from_numpy(np.ascontiguousarray(bits))


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def channel_range(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 (min, max) of each channel of ``x [T, C]`` over each group of ``group`` tokens, ``[T / group, C]``;
    None where a value is NaN or Inf (as `group_range`, for groups of tokens)."""
    t, c = x.shape
    if x.dtype == torch.bfloat16:
        keys = np.empty((2, t // group, c), np.int32)
        if _run(_range_channels_bf16, _bf16_bits(x), group, keys[0], keys[1]) is not True:
            return None
        return _keys_to_float(keys[0]), _keys_to_float(keys[1])
    grouped = x.reshape(t // group, group, c)
    lo, hi = grouped.amin(dim=1).float(), grouped.amax(dim=1).float()
    if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        return None
    return lo, hi


def packed_channels(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group: int) -> torch.Tensor | None:
    """uint8 ``[T, C * bits / 8]``: ``x [T, C]`` quantized per channel over groups of ``group`` tokens (float32
    ``scale``/``zero [T / group, C]``, asymmetric) and packed along channels, as `bitpack.pack` does."""
    t, c = x.shape
    out = np.empty((t, c * bits // 8), np.uint8)
    z, s = zero.contiguous().numpy(), scale.contiguous().numpy()
    if x.dtype == torch.bfloat16:
        done = _run(_packed_channels_bf16, _bf16_bits(x), z, s, (1 << bits) - 1, bits, group, out)
    else:
        done = _run(_packed_channels, x.float().contiguous().numpy(), z, s, (1 << bits) - 1, bits, group, out)
    return None if done is _FAILED else torch.from_numpy(out)


def unpacked_channels_bf16(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                           c: int) -> torch.Tensor | None:
    """bf16 ``[T, C]`` of ``packed [T, C * bits / 8]`` with per-channel ``scale``/``zero [T / group, C]`` (storage
    dtype): the torch path's float32 reconstruction rounded by torch, bit for bit."""
    t = packed.shape[0]
    out = np.empty((t, c), np.uint16)
    done = _run(_unpacked_channels, packed.contiguous().numpy(), zero.float().contiguous().numpy(),
                scale.float().contiguous().numpy(), group, _TABLES[(bits, 0)], np.empty(c, np.float32), out)
    return None if done is _FAILED else torch.from_numpy(out).view(torch.bfloat16)


def group_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 (min, max) of each group of the last dimension of ``x``, or None where a value is NaN or Inf.
    float32: torch's reductions (vectorized, threaded: the very numbers the torch path uses). bf16: integer keys
    of the bits in one compiled pass (torch's bf16 reductions are slower than the float32 copy they avoid); the
    same numbers, as bf16 -> float32 is exact and monotone, except that a group whose extreme is a zero reports
    +0 where torch may say -0 (`quant.group_params` takes +0 for both, so the bytes agree)."""
    if x.dtype == torch.bfloat16:
        flat = _bf16_bits(x.reshape(-1, x.shape[-1]))
        keys = np.empty((2, flat.shape[0]), np.int32)
        if _run(_range_bf16, flat, keys[0], keys[1]) is not True:
            return None
        return _keys_to_float(keys[0]).reshape(x.shape[:-1]), _keys_to_float(keys[1]).reshape(x.shape[:-1])
    lo, hi = x.amin(dim=-1).float(), x.amax(dim=-1).float()  # NaN propagates through both; Inf shows in one
    if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        return None
    return lo, hi


def all_finite(x: torch.Tensor) -> bool | None:
    """Whether bf16 CPU ``x`` holds no NaN or Inf, in one compiled pass over its bits; None where the fused
    loops do not take ``x``."""
    if not (enabled(x) and x.dtype == torch.bfloat16 and x.is_contiguous()):
        return None
    done = _run(_finite_bf16, x.reshape(-1).view(torch.int16).numpy().view(np.uint16))
    return None if done is _FAILED else bool(done)


def largest_abs(x: torch.Tensor) -> float | None:
    """The largest magnitude in bf16 CPU ``x`` (NaN where it holds a NaN, inf for an Inf), in one compiled pass
    over its bits; None where the fused loops do not take ``x``."""
    if not (enabled(x) and x.dtype == torch.bfloat16 and x.is_contiguous()):
        return None
    peak = _run(_peak_bf16, x.reshape(-1).view(torch.int16).numpy().view(np.uint16))
    if peak is _FAILED:
        return None
    return float(np.array([int(peak) << 16], np.uint32).view(np.float32)[0])  # 0x7F80.. -> inf, above -> NaN


def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
          symmetric: bool) -> torch.Tensor | None:
    """(None where the compiled loops fail: take the torch path) uint8 codes of float32 ``x [..., G]`` with float32 ``scale``/``zero [...]`` (as `quant.quantize` computes)."""
    flat = x.reshape(-1, x.shape[-1]).numpy()
    out = np.empty(flat.shape, np.uint8)
    qmax = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
    z = (zero if zero is not None else scale).reshape(-1).contiguous().numpy()  # symmetric: never read
    done = _run(_codes, flat, z, scale.reshape(-1).contiguous().numpy(), symmetric, qmax, out)
    return None if done is _FAILED else torch.from_numpy(out).reshape(x.shape)


def packed(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
           symmetric: bool) -> torch.Tensor | None:
    """`bitpack.pack` of `codes`, fused: float32 ``x [..., D]`` in groups of ``group`` channels, ``scale``/
    ``zero [..., D / group]``; uint8 ``[..., D * bits / 8]``."""
    d = x.shape[-1]
    out = np.empty((x.numel() // d, d * bits // 8), np.uint8)
    qmax = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
    z = (zero if zero is not None else scale).reshape(-1).contiguous().numpy()  # symmetric: never read
    s = scale.reshape(-1).contiguous().numpy()
    if x.dtype == torch.bfloat16:
        done = _run(_packed_bf16, x.reshape(-1, d).contiguous().view(torch.int16).numpy().view(np.uint16), z, s,
                    symmetric, qmax, bits, group, out)
    else:
        done = _run(_packed, x.reshape(-1, d).float().numpy(), z, s, symmetric, qmax, bits, group, out)
    if done is _FAILED:
        return None
    return torch.from_numpy(out).reshape(*x.shape[:-1], d * bits // 8)


def _code_table(bits: int, offset: int) -> np.ndarray:
    """float32 [256, 8 / bits]: the codes of every byte value (first code in the top bits), minus ``offset``."""
    per = 8 // bits
    b = np.arange(256)[:, None]
    shifts = bits * (per - 1 - np.arange(per))[None, :]
    return (((b >> shifts) & ((1 << bits) - 1)) - offset).astype(np.float32)


_TABLES = {(bits, sym): _code_table(bits, (1 << (bits - 1)) - 1 if sym else 0) for bits in PACK_BITS for sym in (0, 1)}


def unpacked_bf16(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
                  d: int) -> torch.Tensor | None:
    """`quant.dequantize` of `bitpack.unpack` of ``packed [..., D * bits / 8]``, rounded to bf16, fused:
    ``scale``/``zero [..., D / group]`` in their storage dtype (no zero: a symmetric layout); bf16 ``[..., D]``."""
    flat = packed.reshape(-1, packed.shape[-1]).contiguous().numpy()
    out = np.empty((flat.shape[0], d), np.uint16)
    s = scale.float().reshape(-1).contiguous().numpy()
    z = zero.float().reshape(-1).contiguous().numpy() if zero is not None else s  # symmetric: never read
    done = _run(_unpacked, flat, z, s, zero is not None, group, _TABLES[(bits, int(zero is None))],
                np.empty(d, np.float32), out)
    return None if done is _FAILED else torch.from_numpy(out).view(torch.bfloat16).reshape(*packed.shape[:-1], d)


def unpacked_f32(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
                 d: int) -> torch.Tensor | None:
    """As `unpacked_bf16`, in float32: `quant.dequantize`'s values bit for bit (``[..., D]``)."""
    flat = packed.reshape(-1, packed.shape[-1]).contiguous().numpy()
    out = np.empty((flat.shape[0], d), np.float32)
    s = scale.float().reshape(-1).contiguous().numpy()
    z = zero.float().reshape(-1).contiguous().numpy() if zero is not None else s  # symmetric: never read
    done = _run(_unpacked_f32, flat, z, s, zero is not None, group, _TABLES[(bits, int(zero is None))], out)
    return None if done is _FAILED else torch.from_numpy(out).reshape(*packed.shape[:-1], d)


def unpacked_channels_f32(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                          c: int) -> torch.Tensor | None:
    """As `unpacked_channels_bf16`, in float32."""
    out = np.empty((packed.shape[0], c), np.float32)
    done = _run(_unpacked_channels_f32, packed.contiguous().numpy(), zero.float().contiguous().numpy(),
                scale.float().contiguous().numpy(), group, _TABLES[(bits, 0)], out)
    return None if done is _FAILED else torch.from_numpy(out)


def decode_enabled(packed: torch.Tensor, bits: int, out_dtype: torch.dtype | None) -> bool:
    """Whether `unpacked_bf16` (``out_dtype`` bf16) or `unpacked_f32` (None or float32) serves a decode of
    ``packed``."""
    return (_usable() and out_dtype in (torch.bfloat16, torch.float32, None) and bits in PACK_BITS and packed.device.type == "cpu" and packed.numel() * 8 // bits >= MIN_VALUES)
