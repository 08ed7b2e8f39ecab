"""Encoded pages whose float fields saturated are refused, never served.

Every encoder (the torch reference, the fused CPU loops and the GPU kernels alike) clamps a float it stores at
its dtype's largest finite value: an fp8 value or scale past 448, an fp16 zero past 65504. A clamped field decodes
to other values than the chunk holds, silently. So once a chunk is encoded, each float field narrower than the
cache's own dtype is read for a value at its dtype's largest magnitude; one there (a clamp, or a value that
happened to land exactly on it, which the check cannot tell apart and refuses too) makes the encode raise
InvalidKV. The fields are read as their bits (no float conversion), all of them with one device-to-host read.
"""

from __future__ import annotations

import torch

from kvbackend.errors import InvalidKV
from kvbackend.layout import FieldSet, PageLayout

# dtype -> (integer view, mask of the magnitude bits, bits of the largest finite magnitude)
_LARGEST = {
    torch.float8_e4m3fn: (torch.uint8, 0x7F, 0x7E),  # 448 (0x7F is NaN; e4m3fn has no inf)
    torch.float16: (torch.int16, 0x7FFF, 0x7BFF),  # 65504 (0x7C00 and above: inf, NaN)
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F7F),
}


def _narrow(fields: FieldSet, dtype: torch.dtype) -> list:
    """The fields stored in a float dtype narrower than ``dtype`` (the values' own)."""
    width = torch.finfo(dtype).max
    return [f for f in fields.fields.values() if f.dtype in _LARGEST and torch.finfo(f.dtype).max < width]


def _flags(layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor, full_scale: tuple[str, ...],
           prefix: str = "", rows: torch.Tensor | None = None) -> list:
    """(name, flag tensor) for each narrow float field of one layout's ``pages`` (only its rows ``rows`` where
    given: a pool's pages, read in place) and ``codebooks``."""
    found = []
    for fields, raw, pick in ((layout.page, pages, rows), (layout.codebook, codebooks, None)):
        if raw.numel() == 0:
            continue
        raw = raw.reshape(-1, raw.shape[-1])
        for f in _narrow(fields, layout.geometry.dtype):
            view, mask, largest = _LARGEST[f.dtype]
            if f.name in full_scale:
                largest += 1  # past the largest finite value: NaN (fp8), inf or NaN (16-bit)
            columns = raw[:, f.offset : f.offset + f.nbytes]
            bits = (columns.contiguous() if pick is None else columns[pick]).view(view)  # only the field's bytes
            found.append((prefix + f.name, (bits & mask).amax() >= largest))  # in its own width: no widening
    return found


def _read(found: list) -> list[str]:
    if not found:
        return []
    flags = torch.stack([flag for _, flag in found]).tolist()  # one read for every field
    return [name for (name, _), bad in zip(found, flags) if bad]


def saturated_fields(layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor,
                     full_scale: tuple[str, ...] = ()) -> list[str]:
    """Names of the float fields of ``pages`` [..., page_bytes] and ``codebooks`` [..., codebook_bytes] (uint8)
    that hold a value at their dtype's largest magnitude (or past it: inf or NaN bits). ``full_scale``: fields
    scaled so that their largest value is the dtype's by design (fp8 centroids with a scale of their own), read
    for inf or NaN bits only."""
    return _read(_flags(layout, pages, codebooks, full_scale))


def codec_saturated_fields(codec, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor,
                           rows: torch.Tensor | None = None) -> list[str]:
    """`saturated_fields` of every part ``codec`` (a `Codec`) stores: its own layout's fields, or for a codec whose
    fields are opaque bytes holding other codecs' pages (`Codec.saturation_parts`: a ``heads:`` spec's heads),
    each part's own fields, named ``part.field``; one device read for all. ``rows``: the pages to read (int64
    indices into ``pages`` [num_pages, page_bytes]; None: all)."""
    found = []
    for prefix, sub, sub_pages, sub_books, full_scale in codec.saturation_parts(layout, pages, codebooks):
        found.extend(_flags(sub, sub_pages, sub_books, full_scale, prefix, rows))
    return _read(found)


def refuse_saturated(codec, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor,
                     rows: torch.Tensor | None = None) -> None:
    """Raise InvalidKV where `codec_saturated_fields` finds one: the chunk's values lie past what ``codec`` (a
    `Codec`) stores."""
    bad = codec_saturated_fields(codec, layout, pages, codebooks, rows)
    if bad:
        dtypes = {prefix + f.name: f.dtype
                  for prefix, sub, *_ in codec.saturation_parts(layout, pages, codebooks)
                  for fs in (sub.page, sub.codebook) for f in fs.fields.values()}
        named = ", ".join(f"{name} ({str(dtypes[name]).replace('torch.', '')})" for name in bad)
        raise InvalidKV(f"encoding with {codec.spec_string} saturated {named} at its largest value: the K/V lie past what it "
                        "stores (a wider field holds them: scale=fp16 or scale=fp32, cdtype=bf16, or the fp16/bf16 "
                        "codec); nothing was stored")
