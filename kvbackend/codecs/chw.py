"""Keys per channel at a width of their own: ``chw:kw=3320...,vbits=2``, the page form of ``klt:...,axes=channels``.

Each key channel of each KV head has a fixed code width 0-8 (``kw``: one digit per channel, heads in order; ``""``
gives every channel ``kbits``), chosen once per model by `kvbackend.klt.page_specs` from the channels' calibration
variances weighted by the query energy that reads them (reverse water-filling over every layer and head). Per page,
a coded channel is rounded uniformly inside its absmax around the chunk's mean of that channel (fp16, one per page
and coded channel); a channel of width 0 reads as that mean (fp16 in the chunk's codebook slot). The codes of a page
are one bit string a KV head (`BitLayout`): token after token, each token's coded channels in order at their widths,
most significant bit first, each head's string padded to whole 32-bit words. Values are rounded per token and head
at ``vbits`` with fp8 scale and zero (clipped steps by default).

``order=lane`` (field ``k_lcodes`` instead of ``k_hcodes``) orders each token's channels for a tensor-core reader:
per 16-channel tile and thread column ``j`` of an m16n8k16 operand, channels ``2j, 2j + 1, 2j + 8, 2j + 9`` of the
tile, so the four codes one thread feeds the MMA lie in one 32-bit window of the bit string (at most 4 x 8 bits),
and each head's block starts on a 16-byte boundary (asynchronous 16-byte copies). The same codes and bits per
token; only their places differ. The chw Triton kernels read either order; the tensor-core decode
(`kernels/mma_decode.cu`, ``K_CHW``) reads this one, for keys after RoPE (no ``prerope`` or ``pagerope``).

Used with ``prerope=true,vrot=hadamard,sink=N`` (what the planner writes): keys before RoPE, where a channel's
statistics do not turn with the position, and values Hadamard-rotated. The generic kernels do not read these fields
(`kvbackend.scheme.kernel_schemes` refuses them by name); on a CUDA device `kvbackend.backends.ChwBackend` serves such
layers with kernels of their own (`kernels/chw_gather.py`, `kernels/chw_decode.py`), elsewhere the torch reference
does, its bit strings packed and unpacked by `kvbackend.fastchw`'s compiled loops where numba is installed.
"""

from __future__ import annotations

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
ORDERS = ("natural", "lane")
LANE_TILE = 16  # channels per tensor-core k tile (``order=lane``)
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
    order: str = one_of("natural", ORDERS)  # each token's channels in the bit string: in order, or as MMA lanes read

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


@dataclass(frozen=True)
class BitLayout:
    """Where the codes of a page's coded key channels sit in its key code bytes: one block a KV head, at byte
    ``block[h]``, holding the head's tokens one after another, each token's coded channels at their widths in the
    order ``sequence`` gives (channel order, or lane order: `lane_order`), most significant bit first; each block
    padded with zero bits to whole 32-bit words (16 bytes in lane order), so a kernel reading one head reads one
    contiguous, aligned block. Code ``(t, a)`` starts at bit ``start[a] + t * stride[a]``."""

    width: torch.Tensor  # int64 [A]: the coded channels' widths (1-8), heads in order
    start: torch.Tensor  # int64 [A]: the bit of the channel's first code (its head block's first bit + its offset)
    stride: torch.Tensor  # int64 [A]: bits between a channel's consecutive codes (its head's bits a token)
    head: torch.Tensor  # int64 [A]: the channel's KV head
    block: tuple[int, ...]  # each head's first byte, then the field's size (H + 1 entries)
    sequence: torch.Tensor  # int64 [A]: the coded channels (indices into the above) in the order their bits follow

    @property
    def nbytes(self) -> int:
        return self.block[-1]


def lane_order(dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the channels of a head in lane order (``dim`` a multiple of 16): per 16-channel tile, per
    thread column ``j`` (0-3) of an m16n8k16 operand, channels ``2j, 2j + 1, 2j + 8, 2j + 9`` of the tile."""
    j = torch.arange(4)
    group = torch.stack([2 * j, 2 * j + 1, 2 * j + 8, 2 * j + 9], 1).reshape(-1)  # one tile
    return (LANE_TILE * torch.arange(dim // LANE_TILE)[:, None] + group[None, :]).reshape(-1)


def bit_layout(width: torch.Tensor, heads: int, page_size: int, order: str = "natural") -> BitLayout:
    """The `BitLayout` of key widths ``width [heads * D]`` (uint8, 0 = uncoded) on pages of ``page_size`` tokens,
    each token's channels in ``order`` (`ORDERS`)."""
    w = width.to(torch.int64).reshape(heads, -1)
    d = w.shape[1]
    perm = lane_order(d) if order == "lane" else torch.arange(d)
    per_head = w.sum(1)  # bits a token
    unit = 16 if order == "lane" else 4  # each block's bytes: whole 32-bit words, or 16-byte copies
    sizes = (page_size * per_head + 8 * unit - 1) // (8 * unit) * unit
    block = [0] + sizes.cumsum(0).tolist()
    offset = torch.empty_like(w)  # within the token
    offset[:, perm] = torch.cumsum(w[:, perm], 1) - w[:, perm]
    start = 8 * torch.tensor(block[:-1], dtype=torch.int64)[:, None] + offset
    coded = w.reshape(-1) > 0
    index = torch.full((heads * d,), -1, dtype=torch.int64)
    index[coded] = torch.arange(int(coded.sum()))
    sequence = index.reshape(heads, d)[:, perm].reshape(-1)
    return BitLayout(w.reshape(-1)[coded], start.reshape(-1)[coded],
                     per_head[:, None].expand(heads, d).reshape(-1)[coded],
                     torch.arange(heads)[:, None].expand(heads, d).reshape(-1)[coded], tuple(block),
                     sequence[sequence >= 0])


def _first_bits(bits: BitLayout, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first bit of each code of a page (int64 [P, A]) and the widths (int64 [A]), on ``device``."""
    t = torch.arange(page_size, device=device)[:, None]
    return bits.start.to(device)[None, :] + t * bits.stride.to(device)[None, :], bits.width.to(device)


def pack_pages(codes: torch.Tensor, bits: BitLayout) -> torch.Tensor:
    """Codes ``[n, P, A]`` (channel a below ``2**bits.width[a]``) as each page's key bytes, uint8 ``[n,
    bits.nbytes]``. A code of at most 8 bits spans two bytes at most: its bits are placed as one 16-bit window
    starting at its first byte, whose two halves are added into the bytes (no two codes share a bit, so adding is
    or-ing)."""
    n, p, _ = codes.shape
    first, w = _first_bits(bits, p, codes.device)
    window = (codes.to(torch.int64) << (16 - (first & 7) - w)[None]).reshape(n, -1)  # [n, P * A]
    byte = (first >> 3).reshape(-1).expand(n, -1)
    out = torch.zeros(n, bits.nbytes + 1, dtype=torch.int64, device=codes.device)  # one spare byte for the last window
    out.scatter_add_(1, byte, window >> 8)
    out.scatter_add_(1, byte + 1, window & 0xFF)
    return out[:, : bits.nbytes].to(torch.uint8)


def unpack_pages(packed: torch.Tensor, bits: BitLayout, page_size: int) -> torch.Tensor:
    """Inverse of `pack_pages`: int32 codes ``[n, page_size, A]``."""
    n = packed.shape[0]
    if packed.shape[1] != bits.nbytes:
        raise ValueError(f"chw: {packed.shape[1]} code bytes per page, the widths need {bits.nbytes}")
    first, w = _first_bits(bits, page_size, packed.device)
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
        self._bit_layouts: dict[tuple[int, int, int], BitLayout] = {}  # (heads, dim, page size) -> where codes sit

    any_float_input: ClassVar[bool] = True  # the compiled key loops and `encode_token_groups` read bf16

    @property
    def kernel_encodes(self) -> bool:
        return False

    def _widths(self, geometry: Geometry) -> torch.Tensor:
        key = (geometry.num_kv_heads, geometry.head_dim)
        if key not in self._parsed_widths:
            self._parsed_widths[key] = self.spec.key_widths(*key)
        return self._parsed_widths[key]

    @property
    def codes_field(self) -> str:
        """The page field of the key codes: ``k_hcodes`` in channel order, ``k_lcodes`` in lane order."""
        return "k_lcodes" if self.spec.order == "lane" else "k_hcodes"

    def bits(self, geometry: Geometry, page_size: int) -> BitLayout:
        """Where each coded key channel's codes sit in a page's key code bytes."""
        key = (geometry.num_kv_heads, geometry.head_dim, page_size)
        if key not in self._bit_layouts:
            self._bit_layouts[key] = bit_layout(self._widths(geometry), geometry.num_kv_heads, page_size,
                                                self.spec.order)
        return self._bit_layouts[key]

    def validate(self, geometry: Geometry, page_size: int) -> None:
        self._widths(geometry)
        if self.spec.order == "lane" and geometry.head_dim % LANE_TILE:
            raise SpecError(f"chw: order=lane needs a head_dim that is a multiple of {LANE_TILE}, got "
                            f"{geometry.head_dim}")

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        s, h, d = self.spec, geometry.num_kv_heads, geometry.head_dim
        width = self._widths(geometry)
        coded = int((width > 0).sum())
        page: FieldSpecs = []
        if coded:
            page += [(self.codes_field, torch.uint8, (self.bits(geometry, page_size).nbytes,)),
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
        # each chunk's channel means in float64 (the compiled loop sums token after token, torch in its own order:
        # the same fp16 but where a sum lands within float64's rounding of an fp16 tie, which needs channels
        # spanning about 2^50 in magnitude; decoding reads the stored mean, so both encodings read back consistently)
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
            # a key reads back inside |mean| + amax: past fp16's range the kernels' fp16 operands would overflow
            reach = mean32.abs()[:, column].repeat_interleave(n // units, 0) + amax
            if float(reach.max()) > _FP16_MAX:
                raise InvalidKV("chw: a key channel's mean and spread reach past fp16's range (|mean| + absmax > "
                                "65504): its keys would not read back within it")
            codes_view = layout.page.view(pages, self.codes_field)
            bits = self.bits(geometry, p)
            fused = None if y is not None else fastchw.packed(x, mean32, n // units, column, amax, bits)
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
                    codes_view[at : at + per_slice] = pack_pages(q[at : at + per_slice].to(torch.int32), bits)
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
            packed = layout.page.view(pages, self.codes_field)
            amax = layout.page.view(pages, "k_wscales").float()  # [n, A]
            column = torch.nonzero(coded).flatten()
            bits = self.bits(geometry, p)
            keys = fastchw.unpacked(packed, amax, bits, column, mean, p)
            if keys is None:
                keys = mean[:, None].expand(n, p, h * d).clone()
                levels = 2.0 ** width[coded].float()
                per_slice = max(1, SLICE_CODES // (p * int(coded.sum())))
                for at in range(0, n, per_slice):
                    q = unpack_pages(packed[at : at + per_slice], bits, p).float()  # [slice, P, A]
                    part = amax[at : at + per_slice, None]
                    keys[at : at + per_slice, :, coded] += -part + (q + 0.5) * (2 * part / levels)
            keys = keys.reshape(n * p, h * d)
        values = decode_token_groups(layout, pages, "v", self.spec.vbits, d)
        return keys.reshape(n * p, h, d), values
