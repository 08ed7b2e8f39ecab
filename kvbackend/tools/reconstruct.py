"""Encode a whole sequence of one layer's K/V through a codec, chunk by chunk, and measure it.

This is what the quality meter uses: every token goes through the codec (the last, partial chunk
included), and the bytes are those of the encoded chunks as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend import codecs
from kvbackend.codecs.base import CodecState
from kvbackend.frames import rope_positions, without_sinks
from kvbackend.geometry import Geometry
from kvbackend.levers import rotate_values
from kvbackend.psac import correct_keys, query_mean, query_second_moment
from kvbackend.rope import Rotary


@dataclass
class Reconstruction:
    k: torch.Tensor  # [T, H, D] reconstructed keys, geometry dtype
    v: torch.Tensor  # [T, H, D] reconstructed values
    stored_bytes: int  # bytes of every encoded chunk (pages + codebook)


def reconstruct_layer(codec: codecs.Codec, k: torch.Tensor, v: torch.Tensor, geometry: Geometry, page_size: int,
                      chunk_tokens: int, state: CodecState | None = None,
                      queries: torch.Tensor | None = None) -> Reconstruction:
    """Encode ``k, v [T, H, D]`` in chunks of ``chunk_tokens`` (warm-starting each from the last) and decode.

    ``queries [Hq, >= T, D]`` (in the frame of ``k``) give query-aware codecs their statistics: each
    chunk sees only the queries up to its own last token.
    """
    layout = codec.layout(geometry, page_size)
    state = state if state is not None else CodecState()
    keys, values, stored = [], [], 0
    for start in range(0, k.shape[0], chunk_tokens):
        if codec.uses_queries and queries is not None:
            end = min(start + chunk_tokens, k.shape[0])
            state.query_moment = query_second_moment(queries[:, :end], geometry.num_kv_heads)
            state.query_mean = query_mean(queries[:, :end], geometry.num_kv_heads)
        chunk = codec.encode(k[start : start + chunk_tokens], v[start : start + chunk_tokens], layout, state)
        kh, vh = codec.decode(chunk)
        keys.append(kh)
        values.append(vh)
        stored += chunk.nbytes
    return Reconstruction(torch.cat(keys), torch.cat(values), stored)


def reconstruct_sequence(codec: codecs.Codec, k: torch.Tensor, v: torch.Tensor, geometry: Geometry, page_size: int,
                         chunk_tokens: int, rotary: Rotary | None = None,
                         queries: torch.Tensor | None = None) -> Reconstruction:
    """`reconstruct_layer` with the codec's sequence-level levers applied (see `kvbackend.levers`).

    ``k`` are post-RoPE keys at positions 0..T-1; ``queries`` [Hq, >= T, D] (post-RoPE) feed PSAC,
    which uses for each chunk only the queries up to that chunk's last token. Sink tokens are stored
    as fp16 and counted.
    """
    levers = codec.levers
    sink = min(levers.sink, k.shape[0])
    head_k, head_v = k[:sink].to(torch.float16), v[:sink].to(torch.float16)
    # as the paged cache: every token is encoded on pages from position 0, the sinks' rows replaced by
    # copies of the next token (`without_sinks`), then the exact sinks written over the decoded rows;
    # their fp16 copy is counted once per chunk (a codebook slot field of every chunk)
    stored = (head_k.nbytes + head_v.nbytes) * -(-k.shape[0] // chunk_tokens)
    positions = rope_positions(levers, torch.arange(k.shape[0]), page_size)
    enc_k, enc_v = k.float(), v.float()  # the frame is computed in float32, as `LeverFrame.to_stored` does
    if levers.rope:
        if rotary is None:
            raise ValueError("prerope=true and pagerope=true need the model's RoPE (pass rotary)")
        enc_k = rotary.derotate(enc_k.transpose(0, 1), positions).transpose(0, 1)
    if levers.vrot == "hadamard":
        enc_v = rotate_values(enc_v)
    enc_k, enc_v = without_sinks(enc_k, enc_v, sink)  # in the stored frame, as `KVCache` does
    frame_queries = None
    if codec.uses_queries and queries is not None:  # the queries of the same tokens, in the keys' frame
        frame_queries = queries[:, : k.shape[0]]
        if levers.rope:  # approximate: q.k depends on relative rotation; de-rotated as a key there would be
            frame_queries = rotary.derotate(frame_queries, positions[: frame_queries.shape[1]])
    rec = reconstruct_layer(codec, enc_k.contiguous(), enc_v.contiguous(), geometry, page_size, chunk_tokens,
                            queries=frame_queries)
    kh, vh = rec.k, rec.v
    if levers.vrot == "hadamard":
        vh = rotate_values(vh).to(v.dtype)
    if levers.rope:
        kh = rotary.rotate(kh.transpose(0, 1), positions).transpose(0, 1)
    if levers.psac:
        if queries is None:
            raise ValueError("psac needs the queries attention saw (pass queries)")
        parts = []
        for start in range(0, kh.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, kh.shape[0])
            seen = queries[:, :end]  # causal: up to this chunk's last token
            moment = query_second_moment(seen, k.shape[1])
            fixed = correct_keys(k[start:end], kh[start:end], moment, levers.psac)
            parts.append(fixed.keys)
            stored += fixed.stored_bytes
        kh = torch.cat(parts)
    kh, vh = kh.to(k.dtype).clone(), vh.to(v.dtype).clone()
    kh[:sink], vh[:sink] = head_k.to(k.dtype), head_v.to(v.dtype)
    stored += rec.stored_bytes
    return Reconstruction(kh, vh, stored)
