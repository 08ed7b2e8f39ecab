"""Keys per channel at a width of their own: ``chw:kw=3320...,vbits=2``, the page form of ``klt:...,axes=channels``.

Each key channel of each KV head has a fixed code width 0-8 (``kw``: one digit per channel, heads in order; ``""``
gives every channel ``kbits``), chosen once per model by `kvbackend.klt.page_specs` from the channels' calibration
variances weighted by the query energy that reads them (reverse water-filling over every layer and head). Per page,
a coded channel is rounded uniformly inside its absmax around the chunk's mean of that channel (fp16, one per page
and coded channel); a channel of width 0 reads as that mean (fp16 in the chunk's codebook slot). The codes of a page
are one bit string: token after token, each token's coded channels in order at their widths, most significant bit
first. Values are rounded per token and head at ``vbits`` with fp8 scale and zero (clipped steps by default).

Used with ``prerope=true,vrot=hadamard,sink=N`` (what the planner writes): keys before RoPE, where a channel's
statistics do not turn with the position, and values Hadamard-rotated. The generic kernels do not read these fields
(`kvbackend.scheme.kernel_schemes` refuses them by name); on a CUDA device `kvbackend.backends.ChwBackend` serves such
layers with kernels of their own (`kernels/chw_gather.py`, `kernels/chw_decode.py`), elsewhere the torch reference
does, its bit strings packed and unpacked by `kvbackend.fastchw`'s compiled loops where numba is installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbackend import fastchw
from kvbackend.errors import InvalidKV, SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.quant import round_to
from kvbackend.spec import Checked, one_of, ranged
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs
from kvbackend.codecs.groups import decode_token_groups, encode_token_groups, token_group_fields
from kvbackend.codecs.widths import WIDTHS

MAX_WIDTH = 8
_FP16_MAX = torch.finfo(torch.float16).max
# codes (un)packed per slice of pages: the temporaries take a few int64 per code, so a slice of this many codes
# keeps them near 256 MiB whatever the chunk or request length
SLICE_CODES = 1 << 23


@dataclass(frozen=True)
class ChwSpec(Checked):
    name: str
    kw: str = ""  # one key width 0-8 per channel of every KV head (H * D digits); "": every channel at kbits
    kbits: int = ranged(2, 0, MAX_WIDTH)  # the width of every key channel where kw is ""
    vbits: int = one_of(2, WIDTHS)  # value code width, per token and head with fp8 scale and zero
    vclip: bool = True  # the values' clipped steps (`kvbackend.quant.quantize`)
    vstep: float = ranged(1.0, 0.5, 2.0)  # with vclip: the step as a multiple of the Gaussian MSE-optimal one

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.kw, str) or not all(c in "012345678" for c in self.kw):
            raise SpecError(f"chw: kw must be digits 0-8 (one key width per channel), got {self.kw!r}")
        if self.vstep != 1.0 and not self.vclip:
            raise SpecError(f"chw: vstep={self.vstep:g} widens the clipped value step: it needs vclip=true")

    def key_widths(self, heads: int, dim: int) -> torch.Tensor:
        """uint8 ``[heads * dim]`` widths, heads in order.

        Raises:
            SpecError: ``kw`` not one digit per channel of this geometry.
        """
        if not self.kw:
            return torch.full((heads * dim,), self.kbits, dtype=torch.uint8)
        if len(self.kw) != heads * dim:
            raise SpecError(f"chw: kw has {len(self.kw)} widths; this geometry has {heads} KV heads x {dim} channels "
                            f"= {heads * dim} (a plan made for another model?)")
        return torch.tensor([int(c) for c in self.kw], dtype=torch.uint8)


def _positions(width: torch.Tensor, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For codes ``[page_size, A]`` at ``width`` [A]: the first bit of each (int64 [P, A]), the widths as int64 [A],
    and the page's byte count."""
    w = width.to(device=device, dtype=torch.int64)
    per_token = int(w.sum())
    offset = torch.cumsum(w, 0) - w  # each code's first bit within its token
    first = torch.arange(page_size, device=device)[:, None] * per_token + offset[None, :]
    return first, w, math.ceil(page_size * per_token / 8)


def pack_pages(codes: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Codes ``[n, P, A]`` (channel a below ``2**width[a]``) as one bit string per page, most significant bit first:
    uint8 ``[n, ceil(P * sum(width) / 8)]``. A code of at most 8 bits spans two bytes at most: its bits are placed
    as one 16-bit window starting at its first byte, whose two halves are added into the bytes (no two codes share a
    bit, so adding is or-ing)."""
    n, p, _ = codes.shape
    first, w, nbytes = _positions(width, p, codes.device)
    window = (codes.to(torch.int64) << (16 - (first & 7) - w)[None]).reshape(n, -1)  # [n, P * A]
    byte = (first >> 3).reshape(-1).expand(n, -1)
    out = torch.zeros(n, nbytes + 1, dtype=torch.int64, device=codes.device)  # one spare byte for the last window
    out.scatter_add_(1, byte, window >> 8)
    out.scatter_add_(1, byte + 1, window & 0xFF)
    return out[:, :nbytes].to(torch.uint8)


def unpack_pages(packed: torch.Tensor, width: torch.Tensor, page_size: int) -> torch.Tensor:
    """Inverse of `pack_pages`: int32 codes ``[n, page_size, A]``."""
    n = packed.shape[0]
    first, w, nbytes = _positions(width, page_size, packed.device)
    if packed.shape[1] != nbytes:
        raise ValueError(f"chw: {packed.shape[1]} code bytes per page, the widths need {nbytes}")
    wide = torch.cat([packed, packed.new_zeros(n, 1)], 1).to(torch.int32)
    byte = (first >> 3).reshape(1, -1).expand(n, -1)
    window = (wide.gather(1, byte) << 8) | wide.gather(1, byte + 1)  # [n, P * A]
    shift = (16 - (first & 7) - w[None]).reshape(1, -1).to(torch.int32)
    mask = ((1 << w) - 1).to(torch.int32).repeat(page_size)[None]
    return ((window >> shift) & mask).reshape(n, page_size, -1)


class ChwCodec(Codec):
    name: ClassVar[str] = "chw"

    def __init__(self, spec: ChwSpec) -> None:
        super().__init__(spec)
        self._parsed_widths: dict[tuple[int, int], torch.Tensor] = {}  # (heads, dim) -> widths, parsed once

    any_float_input: ClassVar[bool] = True  # the compiled key loops and `encode_token_groups` read bf16

    @property
    def kernel_encodes(self) -> bool:
        return False

    def _widths(self, geometry: Geometry) -> torch.Tensor:
        key = (geometry.num_kv_heads, geometry.head_dim)
        if key not in self._parsed_widths:
            self._parsed_widths[key] = self.spec.key_widths(*key)
        return self._parsed_widths[key]

    def validate(self, geometry: Geometry, page_size: int) -> None:
        self._widths(geometry)

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        s, h, d = self.spec, geometry.num_kv_heads, geometry.head_dim
        width = self._widths(geometry)
        coded, per_token = int((width > 0).sum()), int(width.sum())
        page: FieldSpecs = []
        if coded:
            page += [("k_wcodes", torch.uint8, (math.ceil(page_size * per_token / 8),)),
                     ("k_wscales", torch.float16, (coded,))]
        page += token_group_fields("v", page_size, h, d, s.vbits, d, False, torch.float8_e4m3fn)
        return page, [("k_mean", torch.float16, (h, d))]

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        self._encode_chunks(k, v, layout, pages, codebook[None])

    batch_encodes = True  # `_encode_units`: many one-chunk encodes in one pass (no state is read or kept)

    def _encode_units(self, k, v, layout: PageLayout, pages, codebooks, states=None) -> bool:
        self._encode_chunks(k, v, layout, pages, codebooks)
        return True

    def _encode_chunks(self, k, v, layout: PageLayout, pages, codebooks) -> None:
        """K/V ``[U*n*P, H, D]`` (float32 or bf16) of ``U`` chunks of ``n`` pages into ``pages [U*n, bytes]`` and
        ``codebooks [U, bytes]``."""
        s, geometry, p = self.spec, layout.geometry, layout.page_size
        units = codebooks.shape[0]
        t, h, d = k.shape
        n = t // p
        width = self._widths(geometry).to(k.device)
        x = k.reshape(n, p, h * d)
        # each chunk's channel means in float64, so that every device and summation order rounds them to the
        # same fp16 (the compiled loop sums token after token, torch in its own order)
        sums = fastchw.channel_sums(x, n // units)
        mean = sums / (t // units) if sums is not None else k.reshape(units, t // units, h * d).double().mean(1)
        if float(mean.abs().max()) > _FP16_MAX:
            raise InvalidKV("chw: a key channel's mean exceeds fp16's range, which the chunk stores it in")
        mean16 = mean.half()
        layout.codebook.view(codebooks, "k_mean").copy_(mean16.reshape(units, h, d))
        coded = width > 0
        count = int(coded.sum())
        if count:
            column = torch.nonzero(coded).flatten()
            mean32 = mean16.float()
            peak = fastchw.peaks(x, mean32, n // units, column)
            y = None
            if peak is None:
                y = (x.float().reshape(units, -1, h * d) - mean32[:, None])[..., column].reshape(n, p, count)
                peak = y.abs().amax(1)
            if float(peak.max()) > _FP16_MAX:  # `round_to` would saturate the scale: clipped keys
                raise InvalidKV("chw: a key's distance from its channel's mean exceeds fp16's range (its scale's)")
            amax = round_to(peak.clamp_min(1e-30), torch.float16, "up")  # [n, A]
            codes_view = layout.page.view(pages, "k_wcodes")
            fused = None if y is not None else fastchw.packed(x, mean32, n // units, column, amax, width[coded],
                                                              codes_view.shape[-1])
            if fused is not None:
                codes_view.copy_(fused)
            else:
                if y is None:
                    y = (x.float().reshape(units, -1, h * d) - mean32[:, None])[..., column].reshape(n, p, count)
                levels = 2.0 ** width[coded].float()
                step = 2 * amax[:, None] / levels
                q = torch.floor((y + amax[:, None]) / step).clamp(torch.zeros_like(levels), levels - 1)
                per_slice = max(1, SLICE_CODES // (p * count))
                for at in range(0, n, per_slice):
                    codes_view[at : at + per_slice] = pack_pages(q[at : at + per_slice].to(torch.int32),
                                                                 width[coded])
            layout.page.view(pages, "k_wscales").copy_(amax.half())
        encode_token_groups(v, layout, pages, "v", s.vbits, d, symmetric=False, clip=s.vclip, widen=s.vstep)

    per_page_codebooks = True  # `_decode` takes a slot per page too (`Codec.decode_units`)

    def _decode(self, layout: PageLayout, pages, codebook):
        geometry, p = layout.geometry, layout.page_size
        h, d = geometry.num_kv_heads, geometry.head_dim
        width = self._widths(geometry).to(pages.device)
        n = pages.shape[0]
        mean = layout.codebook.view(codebook, "k_mean").reshape(-1, h * d).float().expand(n, h * d)  # per page
        coded = width > 0
        if not bool(coded.any()):
            keys = mean[:, None].expand(n, p, h * d).reshape(n * p, h * d).clone()
        else:
            packed = layout.page.view(pages, "k_wcodes")
            amax = layout.page.view(pages, "k_wscales").float()  # [n, A]
            column = torch.nonzero(coded).flatten()
            keys = fastchw.unpacked(packed, amax, width[coded], column, mean, p)
            if keys is None:
                keys = mean[:, None].expand(n, p, h * d).clone()
                levels = 2.0 ** width[coded].float()
                per_slice = max(1, SLICE_CODES // (p * int(coded.sum())))
                for at in range(0, n, per_slice):
                    q = unpack_pages(packed[at : at + per_slice], width[coded], p).float()  # [slice, P, A]
                    part = amax[at : at + per_slice, None]
                    keys[at : at + per_slice, :, coded] += -part + (q + 0.5) * (2 * part / levels)
            keys = keys.reshape(n * p, h * d)
        values = decode_token_groups(layout, pages, "v", self.spec.vbits, d)
        return keys.reshape(n * p, h, d), values
