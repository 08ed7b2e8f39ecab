"""Range checks of the index fields of packed pages that come from outside the process.

A page group read from the file tier, a storage directory or a caller of `KVCache.install_pages` may carry
bytes that pass their checksum yet were never written by this library: whoever can write the directory
can recompute a crc32c. Codes, scales and centroids decode to some value whatever they hold, but a few
fields are indices, and an index out of its range is not a value:

- ``{k,v}_assign`` (uint8 ``[S, P, H]``): centroid ids, below the ``C`` centroids of ``{k,v}_centroids``;
- ``k_psac_token`` (uint8 ``[rows, H]``): the token a sparse PSAC row corrects, below ``P``;
- ``k_whole_token`` (uint8 ``[W, H]``): the token a whole key row belongs to, below ``P``;
- ``k_out_index`` (int16 ``[n, H]``): a key outlier's position ``t * D + d`` in the page, in ``[0, P * D)``.

The torch reference raises on such an index (IndexError on the CPU; on a GPU PyTorch's indexing kernels assert
on the device instead), the Triton kernels and the CUDA gather drop its term (the page decodes to other
values), and the tensor-core decode (`mma_decode.cu`) addresses its centroid tables with the id unchecked. So
pages are checked once, where they enter, and a page that fails is refused as a miss, like one that fails its
checksum. `PageCheck` reads each kind of index
field of every layer as one strided view of the page group and compares it with its bound.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbackend.codecs.heads import HeadsCodec
from kvbackend.layout import PageLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexField:
    """One index field of a packed page: where its elements are and what they must stay below."""

    name: str  # the field's name, with the head's prefix inside a per-head codec ("h1.k_assign")
    offset: int  # byte offset from the start of the page
    count: int  # elements
    width: int  # bytes per element: 1 (uint8) or 2 (int16, read as unsigned, so a negative one is refused too)
    limit: int  # every element must be below this


def index_fields(codec, layout: PageLayout) -> list[IndexField]:
    """The index fields of one packed page of ``codec`` on ``layout`` (none for most codecs)."""
    if isinstance(codec, HeadsCodec):  # each head's page is a field of the layer's page
        out = []
        for i, (head, sub) in enumerate(zip(codec.heads, codec._head_layouts(layout.geometry, layout.page_size))):
            at = layout.page.fields[f"h{i}"].offset
            out += [IndexField(f"h{i}.{f.name}", at + f.offset, f.count, f.width, f.limit)
                    for f in index_fields(head, sub)]
        return out
    page, book = layout.page.fields, layout.codebook.fields
    out = []
    for prefix in ("k", "v"):
        assign = page.get(f"{prefix}_assign")
        if assign is not None:
            centroids = book[f"{prefix}_centroids"].shape[2]
            out.append(IndexField(assign.name, assign.offset, assign.nbytes, 1, centroids))
    for name in ("k_psac_token", "k_whole_token"):
        token = page.get(name)
        if token is not None:
            out.append(IndexField(token.name, token.offset, token.nbytes, 1, layout.page_size))
    outliers = page.get("k_out_index")
    if outliers is not None:
        out.append(IndexField(outliers.name, outliers.offset, outliers.nbytes // 2, 2,
                              layout.page_size * layout.geometry.head_dim))
    return out


@dataclass(frozen=True)
class _Block:
    """Index fields of one kind (elements, width, bound) at evenly spaced offsets of a blob, such as one field of
    every layer of a uniform cache: read as one strided view ``[len(names), count * width]`` of the blob."""

    start: int  # byte offset of the first field in the blob
    stride: int  # bytes from one field to the next
    count: int
    width: int
    limit: int
    names: tuple[str, ...]  # "layer 3 k_assign", one per field


class PageCheck:
    """The index fields of every packed page inside a blob (a page group, or a storage adapter's blob), checked
    together. Build it with `PageCheck.of`, which gives None where the blob holds no index field.

    One field of every layer is read as one strided view of the blob (no gather): on Llama-8B's geometry (32
    layers, 8 KV heads, head_dim 128, 64-token pages) a page group of qvg (3.3 MB) checks in 61 us and one of
    quantwm with sparse PSAC rows and 16 key outliers (3.9 MB) in 110 us, against 122 and 143 us for crc32c over
    it (one CPU core)."""

    def __init__(self, pages: Sequence[tuple[str, int, list[IndexField]]]) -> None:
        """``pages``: (name of the page, e.g. ``"layer 3"``; its byte offset in the blob; its index fields)."""
        kinds: dict[tuple[str, int, int, int], list[tuple[int, str]]] = {}
        for where, base, fields in pages:
            for f in fields:
                kinds.setdefault((f.name, f.count, f.width, f.limit), []).append((base + f.offset, f"{where} {f.name}"))
        self.blocks: list[_Block] = []
        for (_, count, width, limit), found in kinds.items():
            found.sort()
            run = [found[0]]
            for item in found[1:] + [None]:  # evenly spaced runs of one kind become one block each
                if item is not None and (len(run) == 1 or item[0] - run[-1][0] == run[1][0] - run[0][0]):
                    run.append(item)
                    continue
                stride = run[1][0] - run[0][0] if len(run) > 1 else count * width
                self.blocks.append(_Block(run[0][0], stride, count, width, limit, tuple(n for _, n in run)))
                run = [item]
        self.span = max((b.start + (len(b.names) - 1) * b.stride + b.count * b.width for b in self.blocks), default=0)

    @classmethod
    def of(cls, pages: Sequence[tuple[str, int, object, PageLayout]]) -> "PageCheck | None":
        """A check of the pages ``(name, byte offset in the blob, codec, layout)``; None where none of them has an
        index field (nothing to check)."""
        found = [(name, at, index_fields(codec, layout)) for name, at, codec, layout in pages]
        return cls(found) if any(fields for _, _, fields in found) else None

    def _out_of_range(self, blobs: torch.Tensor) -> list[torch.Tensor]:
        """Per block, ``[n, fields]``: True where a field of a row of ``blobs`` [n, >= span] holds an index past its
        bound. Host blobs are read by numpy, on the calling thread: torch's reductions over these strided views
        split across its intra-op threads, which on a busy host wait on each other (32 blobs of the recipe's page
        codec on Llama-8B's geometry: 1.5 ms on one thread, 30-72 ms on two on a 2-core machine, about 7.5 ms on a
        16-core one beside the tier's reader threads; 0.8 ms by numpy)."""
        if blobs.dtype != torch.uint8 or blobs.dim() != 2 or blobs.shape[1] < self.span:
            raise ValueError(f"expected uint8 blobs [n, >= {self.span}], got {blobs.dtype} {tuple(blobs.shape)}")
        if blobs.stride(1) != 1:  # the views below step through a row byte by byte
            blobs = blobs.contiguous()
        if blobs.device.type == "cpu":
            return self._out_of_range_numpy(blobs)
        return self._out_of_range_torch(blobs)

    def _out_of_range_numpy(self, blobs: torch.Tensor) -> list[torch.Tensor]:
        rows = blobs.numpy()
        out = []
        for b in self.blocks:
            view = np.lib.stride_tricks.as_strided(rows[:, b.start :], (rows.shape[0], len(b.names), b.count * b.width),
                                                   (rows.strides[0], b.stride, 1), writeable=False)
            if b.width == 1:
                bad = view.max(axis=2, initial=0) >= b.limit if b.limit < 256 else np.zeros(view.shape[:2], bool)
            else:  # little-endian 16-bit elements, read unsigned: a negative int16 is past any bound below 32768
                bad = ((view[..., 0::2].astype(np.int32) | (view[..., 1::2].astype(np.int32) << 8)) >= b.limit).any(2)
            out.append(torch.from_numpy(np.ascontiguousarray(bad)))
        return out

    def _out_of_range_torch(self, blobs: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for b in self.blocks:
            view = blobs.as_strided((blobs.shape[0], len(b.names), b.count * b.width), (blobs.stride(0), b.stride, 1),
                                    blobs.storage_offset() + b.start)
            if b.width == 1:
                bad = view >= b.limit if b.limit < 256 else torch.zeros_like(view, dtype=torch.bool)
            else:  # little-endian 16-bit elements, read unsigned: a negative int16 is past any bound below 32768
                bad = (view[..., 0::2].int() | (view[..., 1::2].int() << 8)) >= b.limit
            out.append(bad.any(-1))
        return out

    def bad_rows(self, blobs: torch.Tensor) -> list[bool]:
        """Per row of ``blobs`` [n, >= span] (uint8, any device): whether an index field of it is out of range. One
        transfer of n booleans to the host."""
        bad = torch.zeros(blobs.shape[0], dtype=torch.bool, device=blobs.device)
        for fields in self._out_of_range(blobs):
            bad |= fields.any(1)
        return bad.tolist()

    def reason(self, blob: torch.Tensor) -> str | None:
        """Why the page group ``blob`` (1-D uint8) is refused (its first field out of range), or None when it
        passes."""
        if blob.numel() < self.span:
            return f"{blob.numel()} bytes, short of the {self.span} its index fields reach"
        flags = torch.cat([fields[0] for fields in self._out_of_range(blob.reshape(1, -1))]).tolist()
        names = [name for b in self.blocks for name in b.names]
        return next((f"{name} holds an index out of range" for name, bad in zip(names, flags) if bad), None)


def refuse_crafted(check: PageCheck | None, tier, blobs: torch.Tensor, rows: Sequence[int],
                   keys: Sequence[int]) -> list[int]:
    """The ``rows`` of ``blobs`` [n, >= span] (blobs the file ``tier`` delivered as hits for ``keys``, one per
    row) whose index fields are in range, checked together (one pass per kind of field over the whole batch, where
    checking blob by blob inside the tier's reader threads serialized them on the interpreter lock); each other row's
    blob is refused in the tier (`FileTier.refuse`: a miss and a failure, its file removed with its last blob). A check
    that fails (it should not) serves none of the rows: they miss, nothing is dropped."""
    rows = list(rows)
    if check is None or not rows:
        return rows
    picked = blobs if rows == list(range(blobs.shape[0])) else blobs[rows]
    try:
        bad = check.bad_rows(picked)
    except Exception as exc:  # noqa: BLE001 - unchecked rows are never served: all of them miss, none is dropped
        log.error("kvbackend: checking the index fields of %d blobs failed, all of them miss: %r", len(rows), exc)
        return []
    for j, refused in zip(rows, bad):
        if refused:
            tier.refuse(keys[j], blobs[j], check.reason(blobs[j]) or "an index out of range")
    return [j for j, refused in zip(rows, bad) if not refused]
