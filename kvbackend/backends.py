"""The one seam between the core and the kernels.

The core never imports Triton at module level. A backend encodes completed chunks, gathers K/V
and runs decode attention; the Triton backend uses `kvbackend.kernels`, the torch backend the
reference codecs. `choose` picks Triton on CUDA when the codec's layout is one the kernels read.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvbackend.attention import decode_attention
from kvbackend.batch import BatchPlan
from kvbackend.codecs.base import CodecState
from kvbackend.errors import SpecError, UnsupportedLayout
from kvbackend.layout import PageLayout
from kvbackend.saturation import refuse_saturated

BACKENDS = ("auto", "torch", "triton")


class TorchBackend:
    """Reference implementations: exact, portable, slow."""

    name = "torch"

    def encode_chunk(self, codec, layout: PageLayout, k, v, state: CodecState, pages, page_ids, codebook) -> None:
        chunk = codec.encode(k, v, layout, state)
        pages[page_ids.long()] = chunk.pages
        codebook.copy_(chunk.codebook)

    def encode_units(self, codec, layout: PageLayout, k, v, states) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of several layers (``[L, T, H, D]``, one codec and layout) in one pass: `Codec.encode_units`."""
        return codec.encode_units(k, v, layout, states)

    def gather(self, cache, plan: BatchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        reads = [cache.read(rid, layer) for rid in plan.request_ids]
        if not reads:  # an empty batch, as the kernels answer it
            g = cache.geometry
            empty = torch.empty(0, g.num_kv_heads, g.head_dim, dtype=g.dtype, device=cache.dense.data.device)
            return empty, empty.clone()
        return torch.cat([r[0] for r in reads]), torch.cat([r[1] for r in reads])

    def decode(self, cache, plan: BatchPlan, layer: int, q: torch.Tensor, scale: float | None = None):
        reads = [cache.read(rid, layer) for rid in plan.request_ids]
        out, lse = decode_attention(q, [r[0] for r in reads], [r[1] for r in reads], scale)
        return out.to(q.dtype), lse


class ChwBackend(TorchBackend):
    """``chw:`` layers (keys at a width per channel) on a GPU: the codec's encode on the device, and the kernels of
    `kvbackend.kernels.chw_gather` and `chw_decode` (levers applied). The kernels load each head's key block once a
    page into a register tile (``tile=True``) where the tile is at most `MAX_TILE` bytes: on an H100 (B=8, L=32K)
    20-34% faster gathers and 27-60% faster decodes than reading each code's bytes from memory (perf/NOTES.md,
    session 58); a larger block (wide keys) keeps the direct reads."""

    name = "triton"
    MAX_TILE = 8192  # bytes: 16 registers a thread of a 4-warp program

    def __init__(self, codec, layout: PageLayout) -> None:
        from kvbackend.kernels.chw_gather import layer_schemes, tile_bytes

        self.scheme, self.levers = layer_schemes(codec, layout)
        self.tile = (self.scheme.codes >= 0  # (no key codes: nothing to tile)
                     and tile_bytes(self.scheme.widths, layout.geometry.num_kv_heads, layout.page_size) <= self.MAX_TILE)

    def gather(self, cache, plan: BatchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvbackend.kernels.chw_gather import chw_gather

        return chw_gather(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                          self.scheme, plan, out_dtype=cache.geometry.dtype, levers=self.levers,
                          rotary=cache.frames[layer].rotary, tile=self.tile)

    def decode(self, cache, plan: BatchPlan, layer: int, q: torch.Tensor, scale: float | None = None):
        from kvbackend.kernels.chw_decode import chw_decode

        return chw_decode(q.contiguous(), cache.packed.pages[layer], cache.packed.codebooks[layer],
                          cache.dense.data[layer], self.scheme, plan, scale, levers=self.levers,
                          rotary=cache.frames[layer].rotary, tile=self.tile)


def _is_chw(codec) -> bool:
    from kvbackend.codecs.chw import ChwCodec

    return isinstance(codec, ChwCodec)


def chw_kernels_can_serve(codec, layout: PageLayout) -> bool:
    """Whether `ChwBackend` reads this layer (a ``chw:`` codec on power-of-two pages and heads, its levers
    included)."""
    if not _is_chw(codec):
        return False
    from kvbackend.kernels.chw_gather import layer_schemes

    try:
        layer_schemes(codec, layout)
    except UnsupportedLayout:
        return False
    return True


class TritonBackend:
    """Kernels from `kvbackend.kernels`; the pools are read and written in place."""

    name = "triton"

    def __init__(self, codec, layout: PageLayout, unit_encoder=None) -> None:
        """``unit_encoder``: the one-pass encoder of `encode_units` (a `kvbackend.kernels.encode_graph.
        GraphedEncoder` a cache shares between its layers' backends); None: the kernels' eager one."""
        from kvbackend.scheme import kernel_schemes, lever_scheme

        self.schemes = kernel_schemes(codec, layout, levers_read=True)
        self.levers = lever_scheme(codec, layout)
        self.unit_encoder = unit_encoder

    def encode_chunk(self, codec, layout: PageLayout, k, v, state: CodecState, pages, page_ids, codebook) -> None:
        if not codec.kernel_encodes:  # an option the encode kernel does not implement: the reference encodes
            TorchBackend().encode_chunk(codec, layout, k, v, state, pages, page_ids, codebook)
            return
        from kvbackend.kernels.chunk_encoder import encode_chunk

        encode_chunk(codec, layout, k, v, state, pages, page_ids, codebook)
        # the kernel clamps as torch; only the chunk's pages' float fields are read, in place in the pool
        refuse_saturated(codec, layout, pages, codebook, rows=page_ids.long())

    def encode_units(self, codec, layout: PageLayout, k, v, states) -> tuple[torch.Tensor, torch.Tensor]:
        """`Codec.encode_units` with the kernels' one-pass encode first (QVG-family codecs: the recommended spec),
        warm passes replayed from CUDA graphs where the backend was given a `GraphedEncoder`."""
        encoder = self.unit_encoder
        if encoder is None:
            from kvbackend.kernels.unit_encoder import encode_units as encoder

        return codec.encode_units(k, v, layout, states, encoder=encoder)

    @staticmethod
    def clustering_key(codec) -> tuple | None:
        """What layers of other codecs must share with this one to be encoded in one pass (`encode_mixed`), or
        None (`kvbackend.kernels.unit_encoder.clustering_key`)."""
        from kvbackend.kernels.unit_encoder import clustering_key

        return clustering_key(codec)

    def encode_mixed(self, parts, k, v, states) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """One chunk of layers of several codecs and layouts that share a `clustering_key` (a ``depth:`` spec's
        layers) in one pass: ``parts`` [(codec, layout, indices into the layers)], stored K/V ``[L, T, H, D]``,
        ``states`` one per layer. Returns each part's (pages [len(indices), n, page_bytes], codebooks
        [len(indices), codebook_bytes]), the bytes its own `encode_units` gives, or None, before anything is
        written, where the kernels do not encode them together (the caller encodes each part apart).

        Raises:
            InvalidKV: wrong shapes or dtypes, or non-finite values (nothing is written).
        """
        from kvbackend.codecs.base import CPU_UNIT_VALUES, DEVICE_UNIT_VALUES, _check_values, check_kv
        from kvbackend.kernels import unit_encoder

        codec, layout = parts[0][0], parts[0][1]
        units, n = k.shape[:2]
        budget = CPU_UNIT_VALUES if k.device.type == "cpu" else DEVICE_UNIT_VALUES
        if units * k[0].numel() > budget or not codec.batch_encodes:
            return None
        check_kv(k.reshape(units * n, *k.shape[2:]), v.reshape(units * v.shape[1], *v.shape[2:]), layout.geometry)
        _check_values(k, v)
        kf, vf, num_pages = codec._padded(k, v, layout.page_size)
        flat = (units * num_pages * layout.page_size, *k.shape[2:])
        encoded = [unit_encoder.Part(c, lay, torch.zeros(len(at) * num_pages, lay.page_bytes, dtype=torch.uint8,
                                                         device=k.device),
                                     torch.zeros(len(at), lay.codebook_bytes, dtype=torch.uint8, device=k.device),
                                     list(at))
                   for c, lay, at in parts]
        mixed = getattr(self.unit_encoder, "mixed", unit_encoder.encode_mixed)  # a `GraphedEncoder` replays it
        if not mixed(encoded, kf.reshape(flat), vf.reshape(flat), states):
            return None
        for part in encoded:
            refuse_saturated(part.codec, part.layout, part.pages, part.codebooks)
        return [(part.pages.view(len(part.index), num_pages, -1), part.codebooks) for part in encoded]

    def gather(self, cache, plan: BatchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvbackend.kernels.gather_dequant import gather_dequant

        return gather_dequant(cache.packed.pages[layer], cache.packed.codebooks[layer], cache.dense.data[layer],
                              self.schemes, plan, out_dtype=cache.geometry.dtype, levers=self.levers,
                              rotary=cache.frames[layer].rotary)

    def decode(self, cache, plan: BatchPlan, layer: int, q: torch.Tensor, scale: float | None = None):
        from kvbackend.kernels.paged_decode import paged_decode

        return paged_decode(q.contiguous(), cache.packed.pages[layer], cache.packed.codebooks[layer],
                            cache.dense.data[layer], self.schemes, plan, scale, levers=self.levers,
                            rotary=cache.frames[layer].rotary)


def kernels_can_serve(codec, layout: PageLayout) -> bool:
    """Whether the Triton kernels read this layout (2/4/8-bit codes or floats, power-of-two P and D,
    levers and PSAC rows as `kvbackend.scheme.lever_scheme` accepts them)."""
    from kvbackend.scheme import kernel_schemes, lever_scheme

    p, d = layout.page_size, layout.geometry.head_dim
    if p & (p - 1) or d & (d - 1) or p < 16 or d < 16:
        return False
    try:
        schemes = kernel_schemes(codec, layout, levers_read=True)
        lever_scheme(codec, layout)
    except UnsupportedLayout:
        return False
    return all(s.supported_by_kernels() for s in schemes)


def choose(name: str, device: torch.device, codec, layout: PageLayout, unit_encoder=None):
    """The backend called ``name`` ("auto", "torch" or "triton") for pools on ``device``; ``unit_encoder`` goes to
    a Triton backend (`TritonBackend`; a ``chw:`` layer's is `ChwBackend`).

    Raises:
        SpecError: an unknown name, or "triton" where Triton is missing or cannot read the layout.
    """
    if name not in BACKENDS:
        raise SpecError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    readable = chw_kernels_can_serve if _is_chw(codec) else kernels_can_serve  # (imports Triton: not for "torch")
    if name == "auto":
        name = "triton" if device.type == "cuda" and has_triton and readable(codec, layout) else "torch"
    if name == "torch":
        return TorchBackend()
    if not has_triton:
        raise SpecError("backend 'triton' needs the triton package (pip install 'kvbackend[gpu]')")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # (the interpreter runs on the CPU)
        raise SpecError(f"backend 'triton' runs on a CUDA device, not {device.type!r}: use backend='auto' or 'torch' "
                        "(or TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
    if not readable(codec, layout):
        raise SpecError(f"the Triton kernels cannot read codec {codec.spec_string!r} with page_size "
                        f"{layout.page_size} and head_dim {layout.geometry.head_dim}: use backend='auto' or 'torch'")
    return ChwBackend(codec, layout) if _is_chw(codec) else TritonBackend(codec, layout, unit_encoder)
