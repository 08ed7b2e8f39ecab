"""Encode a whole sequence of one layer's K/V through a codec, chunk by chunk, and measure it.

This is what the quality meter uses: every token goes through the codec (the last, partial chunk
included), and the bytes are those of the encoded chunks as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import codecs
from .codecs.base import CodecState
from .geometry import Geometry


@dataclass
class Reconstruction:
    k: torch.Tensor  # [T, H, D] reconstructed keys, geometry dtype
    v: torch.Tensor  # [T, H, D] reconstructed values
    stored_bytes: int  # bytes of every encoded chunk (pages + codebook)


def reconstruct_layer(codec: codecs.Codec, k: torch.Tensor, v: torch.Tensor, geometry: Geometry, page_size: int,
                      chunk_tokens: int, state: CodecState | None = None) -> Reconstruction:
    """Encode ``k, v [T, H, D]`` in chunks of ``chunk_tokens`` (warm-starting each from the last) and decode."""
    layout = codec.layout(geometry, page_size)
    state = state if state is not None else CodecState()
    keys, values, stored = [], [], 0
    for start in range(0, k.shape[0], chunk_tokens):
        chunk = codec.encode(k[start : start + chunk_tokens], v[start : start + chunk_tokens], layout, state)
        kh, vh = codec.decode(chunk)
        keys.append(kh)
        values.append(vh)
        stored += chunk.nbytes
    return Reconstruction(torch.cat(keys), torch.cat(values), stored)
