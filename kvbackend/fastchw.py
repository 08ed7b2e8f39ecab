"""Fused CPU loops for the ``chw:`` page codec's keys: a width per channel, one bit string per KV head and page.

The torch path (`kvbackend.codecs.chw.pack_pages` / `unpack_pages`) places every code as a 16-bit window through
int64 scatters and gathers: a dozen passes over memory per code. Here compiled loops walk each page once (where the
codes sit: `kvbackend.codecs.chw.BitLayout`): `packed` rounds and packs (the same float32 operations as the torch
path: the distance from the mean plus the absmax, over the step, floored and clamped), and `unpacked` unpacks and
dequantizes straight into the keys (the mean plus the code's level: the torch path's three roundings, in its
order), so both paths give the same bytes and values: `tests/test_chw.py` holds them together.

Served where `kvbackend.fastquant`'s loops serve (numba imports, its JIT is on, ``KVBACKEND_FASTQUANT`` is not off)
for CPU float32 and bf16 tensors; every function returns None otherwise, or after a compiled loop failed once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvbackend.fastquant import _FAILED, _jit, _run, _usable, numba

if TYPE_CHECKING:
    from kvbackend.codecs.chw import BitLayout

if numba is not None:

    @_jit
    def _row(x, i, t, wide):
        # token t of page i of x ([n, P, C] float32, or bf16 bits as uint16) as float32 [C] in ``wide``'s bytes
        # (bf16 widened exactly); both branches compile for either input, the item size picks one
        f = wide.view(np.float32)
        if x.itemsize == 2:
            for c in range(wide.shape[0]):
                wide[c] = np.uint32(x[i, t, c]) << np.uint32(16)
        else:
            for c in range(wide.shape[0]):
                f[c] = x[i, t, c]
        return f

    @_jit
    def _sums(x, per_unit, out):
        # x [n, P, C] (pages, ``per_unit`` to a chunk) -> out float64 [U, C]: each chunk's channel sums, token
        # after token
        n, p, c_n = x.shape
        wide = np.empty(c_n, np.uint32)
        for i in range(n):
            acc = out[i // per_unit]
            for t in range(p):
                r = _row(x, i, t, wide)
                for c in range(c_n):
                    acc[c] += np.float64(r[c])

    @_jit
    def _peaks(x, mean, per_unit, column, out):
        # out float32 [n, A]: each page's largest |x - mean| per coded channel (``column[a]`` of C); mean float32
        # [U, C], rounded as the torch path rounds (the difference in float32, then its magnitude). Every channel
        # is measured (a straight loop the compiler vectorizes), the coded ones kept
        n, p, c_n = x.shape
        wide = np.empty(c_n, np.uint32)
        peak = np.empty(c_n, np.float32)
        for i in range(n):
            m = mean[i // per_unit]
            peak[:] = 0
            for t in range(p):
                r = _row(x, i, t, wide)
                for c in range(c_n):
                    peak[c] = max(peak[c], abs(r[c] - m[c]))
            for a in range(column.shape[0]):
                out[i, a] = peak[column[a]]

    @_jit
    def _pack(x, mean, per_unit, column, amax, width, head_first, block, sequence, out):
        # -> out uint8 [n, bytes] (zeros on entry): codes floor((x - mean + amax) / step) in [0, 2^w - 1], step =
        # 2 * amax / 2^w (the torch path's float32 operations in its order), one block a head from byte block[h]:
        # token after token, the head's coded channels (sequence[head_first[h] .. head_first[h + 1] - 1]) most
        # significant bit first, the block's tail left zero
        n, p, c_n = x.shape
        a_n = column.shape[0]
        wide = np.empty(c_n, np.uint32)
        q = np.empty((p, c_n), np.uint8)
        amp = np.ones(c_n, np.float32)  # per channel of the page (uncoded channels: any finite step, codes unused)
        step = np.ones(c_n, np.float32)
        top = np.zeros(c_n, np.float32)
        for i in range(n):
            m = mean[i // per_unit]
            for a in range(a_n):
                c = column[a]
                levels = np.float32(np.int32(1) << np.int32(width[a]))
                amp[c] = amax[i, a]
                step[c] = np.float32(2.0) * amax[i, a] / levels
                top[c] = levels - np.float32(1.0)
            for t in range(p):  # every channel's code first (a straight loop the compiler vectorizes)
                r = _row(x, i, t, wide)
                qt = q[t]
                for c in range(c_n):
                    v = np.floor(((r[c] - m[c]) + amp[c]) / step[c])
                    qt[c] = np.uint8(min(max(v, np.float32(0.0)), top[c]))
            for h in range(head_first.shape[0] - 1):  # then each head's block of the coded ones' bits
                acc = np.uint64(0)
                held = np.int64(0)
                at = block[h]
                for t in range(p):
                    qt = q[t]
                    for k in range(head_first[h], head_first[h + 1]):
                        a = sequence[k]
                        w = np.int64(width[a])
                        acc = (acc << np.uint64(w)) | np.uint64(qt[column[a]])
                        held += w
                        if held >= 32:
                            held -= 32
                            word = acc >> np.uint64(held)
                            out[i, at] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
                            out[i, at + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
                            out[i, at + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
                            out[i, at + 3] = np.uint8(word & np.uint64(0xFF))
                            at += 4
                while held >= 8:
                    held -= 8
                    out[i, at] = np.uint8((acc >> np.uint64(held)) & np.uint64(0xFF))
                    at += 1
                if held > 0:
                    out[i, at] = np.uint8((acc << np.uint64(8 - held)) & np.uint64(0xFF))

    @_jit
    def _codes_of_token(row, t, start, stride, shift, mask, column, q):
        # the codes of token t (code a's bits from start[a] + t * stride[a] of the page's bytes ``row``) into
        # q[column[a]], each from the two bytes its bits start in (the page's last token: `_codes_of_last_token`).
        # Unsigned indices: numba wraps negative signed ones around, and that check keeps LLVM from scheduling the
        # loop well (2x here)
        for aa in range(start.shape[0]):
            a = np.uint64(aa)
            b = start[a] + t * stride[a]
            byte = b >> np.uint64(3)
            window = (np.uint32(row[byte]) << np.uint32(8)) | np.uint32(row[byte + np.uint64(1)])
            q[column[a]] = np.float32((window >> (shift[a] - np.uint32(b & np.uint64(7)))) & mask[a])

    @_jit
    def _codes_of_last_token(row, t, start, stride, shift, mask, column, q):
        # `_codes_of_token` for the page's last token: the field's last byte has no successor (a code inside one
        # byte ignores the second, so that byte is read twice)
        end = np.uint64(row.shape[0] - 1)
        for aa in range(start.shape[0]):
            a = np.uint64(aa)
            b = start[a] + t * stride[a]
            byte = b >> np.uint64(3)
            window = (np.uint32(row[byte]) << np.uint32(8)) | np.uint32(row[min(byte + np.uint64(1), end)])
            q[column[a]] = np.float32((window >> (shift[a] - np.uint32(b & np.uint64(7)))) & mask[a])

    @_jit
    def _unpack(packed, amax, width, start, stride, column, mean, out):
        # packed uint8 [n, bytes] -> out float32 [n, P, C]: coded channel a (at ``column[a]`` of C, its codes from
        # bit start[a] + t * stride[a]) reads mean + (-amax + (code + 0.5) * (2 * amax / 2^w)), rounded as the torch
        # path rounds, every other channel the mean itself. mean float32 [n, C] (each page's chunk mean); column,
        # start, stride uint64 [A]
        n, p, c_n = out.shape
        a_n = width.shape[0]
        q = np.zeros(c_n, np.float32)
        amp = np.zeros(c_n, np.float32)
        step = np.zeros(c_n, np.float32)
        coded = np.zeros(c_n, np.bool_)
        shift = np.zeros(a_n, np.uint32)  # 16 - width: the window's shift for a code starting at its byte's top bit
        mask = np.zeros(a_n, np.uint32)
        for a in range(a_n):
            coded[column[a]] = True
            shift[a] = np.uint32(16 - np.int32(width[a]))
            mask[a] = (np.uint32(1) << np.uint32(width[a])) - np.uint32(1)
        for i in range(n):
            m = mean[i]
            for a in range(a_n):
                c = column[a]
                amp[c] = amax[i, a]
                step[c] = np.float32(2.0) * amax[i, a] / np.float32(np.int32(1) << np.int32(width[a]))
            for t in range(p):
                if t < p - 1:
                    _codes_of_token(packed[i], np.uint64(t), start, stride, shift, mask, column, q)
                else:
                    _codes_of_last_token(packed[i], np.uint64(t), start, stride, shift, mask, column, q)
                row = out[i, t]
                for c in range(c_n):  # then every channel (a straight loop the compiler vectorizes)
                    level = (q[c] + np.float32(0.5)) * step[c]
                    row[c] = m[c] + (level - amp[c]) if coded[c] else m[c]


def _serves(*tensors: torch.Tensor) -> bool:
    return _usable() and all(x.device.type == "cpu" for x in tensors)


def _array(x: torch.Tensor) -> np.ndarray:
    """float32 as is, bf16 as its bits (the loops widen it exactly)."""
    x = x.contiguous()
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _readable(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float32, torch.bfloat16)


def channel_sums(x: torch.Tensor, per_unit: int) -> torch.Tensor | None:
    """float64 ``[U, C]``: the channel sums of each chunk of ``per_unit`` pages of ``x [n, P, C]`` (float32 or
    bf16), or None where the loop does not serve."""
    if not _serves(x) or not _readable(x):
        return None
    out = torch.zeros(x.shape[0] // per_unit, x.shape[2], dtype=torch.float64)
    return None if _run(_sums, _array(x), per_unit, out.numpy()) is _FAILED else out


def peaks(x: torch.Tensor, mean: torch.Tensor, per_unit: int, column: torch.Tensor) -> torch.Tensor | None:
    """float32 ``[n, A]``: each page's largest ``|x - mean|`` of coded channel ``column[a]``, ``x [n, P, C]``
    (float32 or bf16) around its chunk's float32 ``mean [U, C]``; or None where the loop does not serve."""
    if not _serves(x, mean) or not _readable(x):
        return None
    out = torch.zeros(x.shape[0], column.shape[0], dtype=torch.float32)
    done = _run(_peaks, _array(x), mean.float().contiguous().numpy(), per_unit,
                column.to(torch.int64).contiguous().numpy(), out.numpy())
    return None if done is _FAILED else out


def _u64(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.int64).contiguous().numpy().astype(np.uint64)


def packed(x: torch.Tensor, mean: torch.Tensor, per_unit: int, column: torch.Tensor, amax: torch.Tensor,
           bits: BitLayout) -> torch.Tensor | None:
    """uint8 ``[n, bits.nbytes]``: the codes of coded channels ``column`` of ``x [n, P, C]`` (float32 or bf16)
    around their chunk's ``mean [U, C]``, under float32 absmaxes ``amax [n, A]``, placed as ``bits`` says; or None
    where the loop does not serve."""
    if not _serves(x, mean, amax) or not _readable(x):
        return None
    heads = len(bits.block) - 1
    head_first = torch.searchsorted(bits.head.contiguous(), torch.arange(heads + 1)).to(torch.int64)
    out = torch.zeros(x.shape[0], bits.nbytes, dtype=torch.uint8)
    done = _run(_pack, _array(x), mean.float().contiguous().numpy(), per_unit,
                column.to(torch.int64).contiguous().numpy(), amax.float().contiguous().numpy(),
                bits.width.to(torch.uint8).contiguous().numpy(), head_first.numpy(),
                torch.tensor(bits.block, dtype=torch.int64).numpy(), bits.sequence.to(torch.int64).contiguous().numpy(),
                out.numpy())
    return None if done is _FAILED else out


def unpacked(codes: torch.Tensor, amax: torch.Tensor, bits: BitLayout, column: torch.Tensor, mean: torch.Tensor,
             page_size: int) -> torch.Tensor | None:
    """float32 keys ``[n, P, C]`` of packed ``codes [n, bits.nbytes]``: coded channel ``a`` (column ``column[a]``)
    placed as ``bits`` says, under ``amax [n, A]`` around ``mean [n, C]``, every other column the mean; or None where
    the loop does not serve."""
    if not _serves(codes, amax, mean):
        return None
    n, c = mean.shape
    mean = mean.float().contiguous()
    out = torch.empty(n, page_size, c, dtype=torch.float32)
    done = _run(_unpack, codes.contiguous().numpy(), amax.float().contiguous().numpy(),
                bits.width.to(torch.uint8).contiguous().numpy(), _u64(bits.start), _u64(bits.stride), _u64(column),
                mean.numpy(), out.numpy())
    return None if done is _FAILED else out
