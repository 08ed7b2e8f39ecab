"""A fused CPU loop that decodes one tensor (K or V) of QVG-family pages straight into bf16.

The torch decode of a QVG or QuantWM page makes a pass over memory per step: unpack the residual codes, add each
stage's centroid, scatter the key outliers, add the PSAC correction, round to bf16, and for ``vrot=hadamard``
widen again, rotate and round once more. On a CPU those passes, not the arithmetic, bound a storage backend's
reads. Here one compiled loop takes each (page, head) tile of ``P x D`` values through every step while it sits in
the cache, with the same float32 operations in the same order as the torch path (the residual as codes times
scale plus zero, each centroid as one product then one sum, each outlier as one sum, the correction as one sum,
torch's round to nearest even), so both give the same bits: `tests/test_fastdecode.py` holds them together.

The caller (`kvbackend.codecs.qvg_fused`) reads the fields; this module only checks and runs. It serves where
`kvbackend.fastquant`'s loops serve (numba imports, its JIT is on, ``KVBACKEND_FASTQUANT`` is not off) and
returns None otherwise, or after a compiled loop failed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbackend import fastquant
from kvbackend.fastquant import _FAILED, _FP8_TABLE, _jit, _run, _usable, numba

CENTROIDS_NONE, CENTROIDS_FP8, CENTROIDS_FLOAT = 0, 1, 2  # how the stages' centroids are given
FIX_NONE, FIX_ZERO, FIX_TENSOR = 0, 1, 2  # the PSAC correction: absent, all +0, or a float32 tensor


@dataclass(frozen=True)
class TensorPages:
    """One tensor's fields of ``U`` pages of ``P`` tokens, ``H`` heads of ``D`` channels, as the kernel reads them."""

    codes: torch.Tensor  # uint8 [U, P, H, D * bits / 8]: the packed residual codes
    bits: int  # residual code width (one of `fastquant.PACK_BITS`)
    channels: bool  # True: scales per channel over groups of tokens; False: per token over groups of channels
    group: int  # tokens (channels=True) or channels (False) per scale
    scale: torch.Tensor  # float32 [U, P / group, H, D] (channels) or [U, P, H, D / group] (tokens)
    zero: torch.Tensor | None  # as ``scale``; None for a symmetric layout
    assign: torch.Tensor | None  # uint8 [U, S, P, H]: each stage's centroid per token and head (None: unclustered)
    fp8_centroids: torch.Tensor | None  # uint8 [U, S, H, C, D]: e4m3 bytes, times ``centroid_scale``
    centroid_scale: torch.Tensor | None  # float32 [U, S, H] of the fp8 centroids
    float_centroids: torch.Tensor | None  # float32 [U, S, H, C, D] (bf16 centroids, widened exactly)
    outlier_index: torch.Tensor | None  # int16 [U, n, H]: position t * D + d of each outlier in its page and head
    outlier_value: torch.Tensor | None  # float32 [U, n, H]: what each outlier adds
    fix: torch.Tensor | None  # float32 [U, P, H, D]: the correction added last
    zero_fix: bool  # the correction is all +0 (``fix`` None): only a -0 becomes +0, as torch's sum makes it


if numba is not None:

    @_jit
    def _unpack_row(packed, bits, offset, row):
        # the codes of packed bytes (first code in the top bits, as `bitpack.pack`) minus ``offset``, as float32: the
        # values of `fastquant`'s byte tables, by shifts the compiler vectorizes (3x the table's throughput)
        if bits == 2:
            for bb in range(packed.shape[0]):
                b = np.uint64(bb)
                byte = np.int32(packed[b])
                at = b * np.uint64(4)
                row[at] = np.float32((byte >> np.int32(6)) - offset)
                row[at + np.uint64(1)] = np.float32(((byte >> np.int32(4)) & np.int32(3)) - offset)
                row[at + np.uint64(2)] = np.float32(((byte >> np.int32(2)) & np.int32(3)) - offset)
                row[at + np.uint64(3)] = np.float32((byte & np.int32(3)) - offset)
        elif bits == 4:
            for bb in range(packed.shape[0]):
                b = np.uint64(bb)
                byte = np.int32(packed[b])
                at = b * np.uint64(2)
                row[at] = np.float32((byte >> np.int32(4)) - offset)
                row[at + np.uint64(1)] = np.float32((byte & np.int32(15)) - offset)
        else:
            for bb in range(packed.shape[0]):
                b = np.uint64(bb)
                row[b] = np.float32(np.int32(packed[b]) - offset)

    @_jit
    def _decode_tiles(codes, bits, offset, channels, group, scale, zero, add_zero, assign, cent_mode, fp8_cents, fp8_table,
                      cent_scale, float_cents, out_index, out_value, fix_mode, fix, plus_zero, rotate, hscale,
                      units_per_group, kv, tile, widened, out):
        # codes uint8 [U, P, H, Dp] -> out uint16 (bf16 bits) [G, 2, R, H, D] at [u // units_per_group, kv,
        # (u % units_per_group) * P + t, h]; `tile` float32 [P, H, D] is the scratch of one page, `widened` float32
        # [S, H, C, D] that of its fp8 centroids (scaled as torch scales them). Inner loops
        # index with unsigned integers: numba wraps negative signed ones around, and that check keeps LLVM from
        # vectorizing them.
        n_units, p_n, h_n, dp = codes.shape
        d_n = tile.shape[2]
        s_n = assign.shape[1]
        n_out = out_index.shape[1]
        tile_bits = tile.view(np.uint32)
        width = np.uint64(group)
        for u in range(n_units):
            g = u // units_per_group
            first = (u % units_per_group) * p_n
            if cent_mode == 1:  # this unit's fp8 centroids times their scale, once: the product torch takes
                for stage in range(s_n):
                    for h in range(h_n):
                        cs = cent_scale[u, stage, h]
                        for c in range(fp8_cents.shape[3]):
                            cr = fp8_cents[u, stage, h, c]
                            wr = widened[stage, h, c]
                            for jj in range(d_n):
                                j = np.uint64(jj)
                                wr[j] = fp8_table[cr[j]] * cs
            for t in range(p_n):
                for h in range(h_n):
                    row = tile[t, h]
                    _unpack_row(codes[u, t, h], bits, offset, row)
                    if channels:  # codes * scale + zero: two roundings, as torch's mul then add
                        sr = scale[u, t // group, h]
                        zr = zero[u, t // group, h]
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            row[j] = row[j] * sr[j] + zr[j]
                    else:
                        for gg in range(d_n // group):
                            s = scale[u, t, h, gg]
                            z = zero[u, t, h, gg]
                            at = np.uint64(gg) * width
                            if add_zero:
                                for jj in range(group):
                                    j = at + np.uint64(jj)
                                    row[j] = row[j] * s + z
                            else:
                                for jj in range(group):
                                    j = at + np.uint64(jj)
                                    row[j] = row[j] * s
                    for stage in range(s_n - 1, -1, -1):  # the last stage's centroid first, as torch adds them
                        c = assign[u, stage, t, h]
                        if cent_mode == 1:
                            fr = widened[stage, h, c]
                        else:
                            fr = float_cents[u, stage, h, c]
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            row[j] = row[j] + fr[j]
            for h in range(h_n):
                for i in range(n_out):  # positions t * D + d in the page and head, each added once
                    pos = out_index[u, i, h]
                    tile[pos // d_n, h, pos % d_n] += out_value[u, i, h]
            for t in range(p_n):
                for h in range(h_n):
                    row = tile[t, h]
                    if fix_mode == 2:
                        fr = fix[u, t, h]
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            row[j] = row[j] + fr[j]
                    elif fix_mode == 1:  # + (+0): a runtime zero, so the compiler cannot drop the sum
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            row[j] = row[j] + plus_zero
                    dest = out[g, kv, first + t, h]
                    fastquant._to_bf16(row, dest)
                    if rotate:  # the bf16 values, widened (exact), times the scale, then the transform
                        wide = tile_bits[t, h]
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            wide[j] = np.uint32(dest[j]) << np.uint32(16)
                        for jj in range(d_n):
                            j = np.uint64(jj)
                            row[j] = row[j] * hscale
                        fastquant._hadamard_row(row)
                        fastquant._to_bf16(row, dest)


def _array(x: torch.Tensor | None, dtype: torch.dtype, dims: int) -> np.ndarray:
    """``x`` as a contiguous numpy array (an empty one of ``dims`` dimensions for None)."""
    if x is None:
        return np.empty((0,) * dims, dtype=torch.empty((), dtype=dtype).numpy().dtype)
    if x.dtype != dtype or x.dim() != dims:
        raise ValueError(f"expected {dtype} of {dims} dimensions, got {x.dtype} {tuple(x.shape)}")
    return x.contiguous().numpy()


def decode_into(pages: TensorPages, out: torch.Tensor, kv: int, units_per_group: int,
                rotate_scale: torch.Tensor | None) -> bool:
    """Decode ``pages`` into bf16 ``out [G, 2, R, H, D]`` at ``[u // units_per_group, kv, (u % units_per_group) * P
    + t, h]``, rotated by the Hadamard transform after a first round to bf16 where ``rotate_scale`` (float32, one
    value: 1/sqrt(D)) is given; False where the loop does not serve (then nothing was written).

    Raises:
        ValueError: inputs of the wrong dtype or shape.
    """
    if not (_usable() and pages.codes.device.type == "cpu" and out.dtype == torch.bfloat16 and out.is_contiguous()
            and pages.bits in fastquant.PACK_BITS):
        return False
    u_n, p_n, h_n, dp = pages.codes.shape
    d_n = dp * 8 // pages.bits
    if out.dim() != 5 or tuple(out.shape[3:]) != (h_n, d_n) or out.shape[0] * units_per_group != u_n \
            or out.shape[2] != units_per_group * p_n or not 0 <= kv < out.shape[1]:
        raise ValueError(f"out {tuple(out.shape)} does not hold {u_n} units of [{p_n}, {h_n}, {d_n}]")
    if rotate_scale is not None and d_n & (d_n - 1):
        return False
    offset = (1 << (pages.bits - 1)) - 1 if pages.zero is None else 0  # symmetric codes are centred on qmax
    clustered = pages.assign is not None
    cent_mode = CENTROIDS_NONE if not clustered else (
        CENTROIDS_FP8 if pages.fp8_centroids is not None else CENTROIDS_FLOAT)
    fix_mode = FIX_TENSOR if pages.fix is not None else (FIX_ZERO if pages.zero_fix else FIX_NONE)
    hscale = np.float32(0.0) if rotate_scale is None else np.float32(rotate_scale.reshape(1).numpy()[0])
    done = _run(_decode_tiles, _array(pages.codes, torch.uint8, 4), pages.bits, offset, pages.channels, pages.group,
                _array(pages.scale, torch.float32, 4),
                _array(pages.zero if pages.zero is not None else pages.scale, torch.float32, 4), pages.zero is not None,
                _array(pages.assign, torch.uint8, 4), cent_mode, _array(pages.fp8_centroids, torch.uint8, 5),
                _FP8_TABLE, _array(pages.centroid_scale, torch.float32, 3),
                _array(pages.float_centroids, torch.float32, 5), _array(pages.outlier_index, torch.int16, 3),
                _array(pages.outlier_value, torch.float32, 3), fix_mode, _array(pages.fix, torch.float32, 4),
                np.float32(0.0), rotate_scale is not None, hscale, units_per_group, kv,
                np.empty((p_n, h_n, d_n), np.float32),
                np.empty((0, 0, 0, 0) if pages.fp8_centroids is None else tuple(pages.fp8_centroids.shape[1:]), np.float32),
                out.view(torch.int16).numpy().view(np.uint16))
    return done is not _FAILED
