"""Packing small unsigned integers into bytes, first value in the most significant bits.

Widths 2, 3, 4 and 8 are supported. A group of ``lcm(8, bits) / bits`` values becomes
``lcm(8, bits) / 8`` bytes: 4 values per byte at 2 bits, 8 values in 3 bytes at 3 bits.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def _group(bits: int) -> tuple[int, int]:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bit width {bits} not supported; choose one of {SUPPORTED_BITS}")
    word_bits = math.lcm(8, bits)
    return word_bits // bits, word_bits // 8


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits occupy; ``n`` must fill whole groups."""
    values, nbytes = _group(bits)
    if n % values:
        raise ValueError(f"{n} values of {bits} bits do not fill whole groups of {values}")
    return n // values * nbytes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the last dimension of ``codes`` (integers in ``[0, 2**bits)``) into uint8."""
    values, nbytes = _group(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    packed_size(n, bits)
    if nbytes == 1:  # 2 and 4 bits: whole values per byte, in uint8 (a quarter of int32's memory traffic)
        grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // values, values)
        out = grouped[..., 0] << (bits * (values - 1))
        for i in range(1, values):
            out |= grouped[..., i] << (bits * (values - 1 - i))
        return out
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], n // values, values)
    shifts = torch.arange(values - 1, -1, -1, device=codes.device, dtype=torch.int32) * bits
    word = (grouped << shifts).sum(dim=-1, dtype=torch.int32)
    byte_shifts = torch.arange(nbytes - 1, -1, -1, device=codes.device, dtype=torch.int32) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], n // values * nbytes).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 ``[..., bytes]`` to uint8 codes ``[..., values]``."""
    values, nbytes = _group(bits)
    if bits == 8:
        return packed.to(torch.uint8)
    m = packed.shape[-1]
    if m % nbytes:
        raise ValueError(f"{m} bytes do not hold whole groups of {nbytes} bytes at {bits} bits")
    if nbytes == 1:  # 2 and 4 bits, in uint8
        src = packed.to(torch.uint8)
        out = torch.empty(*packed.shape, values, dtype=torch.uint8, device=packed.device)
        mask = (1 << bits) - 1
        for i in range(values):
            torch.bitwise_and(src >> (bits * (values - 1 - i)), mask, out=out[..., i])
        return out.reshape(*packed.shape[:-1], m * values)
    grouped = packed.to(torch.int32).reshape(*packed.shape[:-1], m // nbytes, nbytes)
    byte_shifts = torch.arange(nbytes - 1, -1, -1, device=packed.device, dtype=torch.int32) * 8
    word = (grouped << byte_shifts).sum(dim=-1, dtype=torch.int32)
    shifts = torch.arange(values - 1, -1, -1, device=packed.device, dtype=torch.int32) * bits
    out = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return out.reshape(*packed.shape[:-1], m // nbytes * values).to(torch.uint8)
