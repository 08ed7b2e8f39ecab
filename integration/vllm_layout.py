"""The token structure of a vLLM primary-tier chunk, for codecs that quantize over groups of tokens.

vLLM (0.33) lays a CPU-tier chunk out as one slot per worker (one slot when the layout is replicated),
then padding. A worker's slot holds, for each of its attention layers in turn, ``blocks_per_chunk``
blocks of one page each; a page is ``[kv_heads, tokens_per_block, 2, head_dim]`` (``LBHNC``, "HND")
or ``[tokens_per_block, kv_heads, 2, head_dim]`` (``LBNHC``, "NHD"), K and V side by side in every
(head, token) cell. `BlockLayout` checks that the engine's description matches those sizes exactly
and views a chunk as ``[workers, layers, blocks, ...]`` so K and V of one layer come out as
``[tokens, kv_heads, head_dim]``.

Refused, with the reason: block-major layouts (``BL*``), several KV-cache groups, decode- or
prefill-context parallelism (token shards interleaved across workers), and any chunk whose page
size is not the plain K/V product (MLA latents, packed or quantized KV formats, padded pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_MAJOR, TOKEN_MAJOR = "HND", "NHD"
_LAYOUT_NAMES = {"LBHNC": HEAD_MAJOR, "HND": HEAD_MAJOR, "LBNHC": TOKEN_MAJOR, "NHD": TOKEN_MAJOR}


@dataclass(frozen=True)
class BlockLayout:
    """One chunk's token structure: ``workers`` slots of ``layers`` x ``blocks`` pages."""

    workers: int
    layers: int
    blocks: int  # blocks per chunk
    tokens_per_block: int
    kv_heads: int  # per worker
    head_dim: int
    itemsize: int
    order: str  # HEAD_MAJOR or TOKEN_MAJOR

    @property
    def tokens(self) -> int:
        return self.blocks * self.tokens_per_block

    @property
    def page_bytes(self) -> int:
        return self.kv_heads * self.tokens_per_block * 2 * self.head_dim * self.itemsize

    @property
    def used_bytes(self) -> int:
        """Bytes of a chunk that hold K/V (the rest is padding, carried raw)."""
        return self.workers * self.layers * self.blocks * self.page_bytes

    def facts(self) -> dict:
        return dict(workers=self.workers, layers=self.layers, blocks=self.blocks, tokens_per_block=self.tokens_per_block,
                    kv_heads=self.kv_heads, head_dim=self.head_dim, itemsize=self.itemsize, order=self.order)

    def kv(self, chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A strided view ``[workers, layers, 2, blocks, tokens_per_block, kv_heads, head_dim]`` of ``chunk``'s
        K/V bytes (``.flatten(3, 4)`` of one layer's K or V gives ``[tokens, kv_heads, head_dim]``)."""
        x = chunk[: self.used_bytes].view(dtype)
        if self.order == HEAD_MAJOR:
            x = x.view(self.workers, self.layers, self.blocks, self.kv_heads, self.tokens_per_block, 2, self.head_dim)
            x = x.permute(0, 1, 5, 2, 4, 3, 6)  # [W, L, 2, blocks, tokens/block, heads, D]
        else:
            x = x.view(self.workers, self.layers, self.blocks, self.tokens_per_block, self.kv_heads, 2, self.head_dim)
            x = x.permute(0, 1, 5, 2, 3, 4, 6)
        return x


def block_layout(spec, head_dim: int, kv_heads: int | None, itemsize: int, chunk_bytes: int) -> BlockLayout:
    """The token structure of the chunks ``spec`` (vLLM's offloading spec, with its ``config``) describes.

    Raises:
        ValueError: the spec says too little, or describes chunks whose bytes are not plain K/V pages.
    """
    config = getattr(spec, "config", None)
    if config is None:
        raise ValueError("codecs over groups of tokens need the engine's offloading config (vLLM's spec had none); "
                         "use a per-row codec")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"set kv_heads (KV heads per worker) in the tier config for codecs over groups of tokens, "
                         f"got {kv_heads!r}")
    name = getattr(config, "kv_cache_layout", None)
    order = _LAYOUT_NAMES.get(str(name).upper() if name else None)
    if order is None:
        raise ValueError(f"kv_cache_layout {name!r}: codecs over groups of tokens read LBHNC/HND or LBNHC/NHD "
                         "chunks only; use a per-row codec")
    groups = tuple(getattr(config, "groups", None) or ())
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV-cache groups: codecs over groups of tokens read single-group models only")
    parallel = getattr(config, "parallel", None)
    for field in ("dcp_size", "pcp_size"):
        if (getattr(parallel, field, 1) or 1) > 1:
            raise ValueError(f"{field} > 1 interleaves tokens across workers; use a per-row codec")
    replicated = bool(getattr(spec, "replicated_layout", getattr(config, "replicated_layout", False)))
    workers = 1 if replicated else int(getattr(parallel, "world_size", 1) or 1)
    tokens_per_block = int(groups[0].tokens_per_block)
    blocks = int(getattr(getattr(config, "cache", None), "blocks_per_chunk", 0) or 0)
    per_block = int(getattr(config, "worker_kv_bytes_per_block", 0) or 0)
    page = kv_heads * tokens_per_block * 2 * head_dim * itemsize
    if blocks < 1 or per_block < 1 or per_block % page:
        raise ValueError(f"worker_kv_bytes_per_block={per_block} is not a whole number of K/V pages of {page} bytes "
                         f"({kv_heads} heads x {tokens_per_block} tokens x 2 x {head_dim} x {itemsize} bytes): MLA, "
                         "packed or padded pages, or a wrong kv_heads; use a per-row codec")
    layers = per_block // page
    names = tuple(getattr(groups[0], "layer_names", None) or ())
    if names and len(names) != layers:
        raise ValueError(f"the pages hold {layers} layers but the group names {len(names)}: not plain K/V pages")
    layout = BlockLayout(workers, layers, blocks, tokens_per_block, kv_heads, head_dim, itemsize, order)
    if layout.used_bytes > chunk_bytes:
        raise ValueError(f"the engine describes {layout.used_bytes} bytes of K/V per chunk, more than the "
                         f"{chunk_bytes} bytes of a primary-tier chunk")
    return layout
