"""Decoded pages straight into an engine's host pool (one strided copy per page), and its pages read in place.

SGLang's host pool (`MHATokenToKVPoolHost`) keeps K and V of every layer in one page-locked tensor,
``[2, L, tokens, H, D]`` (``layer_first``) or ``[2, tokens, L, H, D]`` (``page_first``). A page of
``P`` tokens there is ``2 * L`` rows of ``P * H * D`` values (``layer_first``) or 2 rows of
``P * L * H * D`` (``page_first``), each row at the pool's pitch. A batch of decoded pages on a GPU
goes into those rows with one ``cudaMemcpy2DAsync`` per page on the caller's stream (asynchronous
where the pool is page-locked, as SGLang allocates it), instead of a page-locked staging copy
followed by a host copy per page. On the CPU the same rows are one strided copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvbackend.tiers.copy2d import copy_2d


@dataclass(frozen=True)
class PoolWriter:
    """Where the pages of one host pool go: its buffer, its layout and its page geometry."""

    buffer: torch.Tensor  # the pool's kv_buffer, contiguous
    layout: str  # "layer_first" or "page_first"
    page_size: int
    tokens: int  # token slots in the pool
    layers: int
    row_values: int  # H * D: values of one token of one layer

    @classmethod
    def of(cls, pool, layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> Optional["PoolWriter"]:
        """A writer for ``pool``, or None where its buffer is not one contiguous host tensor of the shape its
        layout names (the caller then goes through the pool's own ``set_from_flat_data_page``)."""
        buffer = getattr(pool, "kv_buffer", None)
        layout = getattr(pool, "layout", None)
        tokens = getattr(pool, "size", None)
        page_size = getattr(pool, "page_size", None)
        if (not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or buffer.dtype != dtype
                or not buffer.is_contiguous() or not isinstance(tokens, int) or not isinstance(page_size, int)
                or page_size <= 0 or tokens < page_size):
            return None
        dims = {"layer_first": (2, layers, tokens, heads, head_dim),
                "page_first": (2, tokens, layers, heads, head_dim)}.get(layout)
        if dims is None or tuple(buffer.shape) != dims:
            return None
        return cls(buffer, layout, page_size, tokens, layers, heads * head_dim)

    @property
    def direct(self) -> bool:
        """Whether a device can copy into the pool asynchronously (page-locked memory)."""
        return self.buffer.is_pinned()

    def slot(self, index) -> int:
        """The first token slot of a page at host index ``index``; ValueError outside the pool."""
        start = int(index)
        if start < 0 or start + self.page_size > self.tokens:
            raise ValueError(f"host index {start} is outside the host pool of {self.tokens} tokens "
                             f"(pages of {self.page_size})")
        return start

    def page(self, start: int) -> torch.Tensor:
        """The page at token slot ``start`` (from `slot`) as a view ``[2, L, P, H, D]`` of the pool: read in
        place (a store copies it once, into its codec's staging), never copied out first."""
        p = self.page_size
        if self.layout == "layer_first":  # [2, L, tokens, H, D]
            view = self.buffer[:, :, start : start + p]
        else:  # [2, tokens, L, H, D]
            view = self.buffer[:, start : start + p].transpose(1, 2)
        return view

    def write(self, pages: torch.Tensor, starts: list[int], stream: "torch.cuda.Stream | None" = None) -> None:
        """Pages ``[N, 2, L, P, H, D]`` (on a device or the host) into the pool at token slots ``starts``
        (from `slot`). Asynchronous on ``stream`` (default: the current one) for device pages: the
        caller synchronizes before the pool is read."""
        n, p = pages.shape[0], self.page_size
        if len(starts) != n or tuple(pages.shape[1:4]) != (2, self.layers, p) or pages.shape[4] * pages.shape[5] != self.row_values:
            raise ValueError(f"pages of shape {tuple(pages.shape)} for {len(starts)} slots of this pool")
        pages = pages.to(self.buffer.dtype)
        if self.layout == "page_first":
            pages = pages.transpose(2, 3)  # [N, 2, P, L, H, D]: one row of P * L * H * D values per K and V
        src = pages.contiguous().view(torch.uint8).reshape(-1)
        dst = self.buffer.view(-1).view(torch.uint8)
        e = self.buffer.element_size()
        token = self.row_values * e * (self.layers if self.layout == "page_first" else 1)  # bytes of one token slot
        rows = 2 * self.layers if self.layout == "layer_first" else 2
        width = p * token
        page_bytes = rows * width
        for j, start in enumerate(starts):
            copy_2d(dst, start * token, self.tokens * token, src, j * page_bytes, width, width, rows, stream)

    def read(self, starts: list[int], device: torch.device, stream: "torch.cuda.Stream | None" = None) -> torch.Tensor:
        """The pages at token slots ``starts`` (from `slot`) as ``[2, N, L, P, H, D]`` on ``device`` (K, then V,
        each contiguous), copied straight from a page-locked pool: one strided copy per page and K or V on
        ``stream`` (default: the current one), asynchronous (the caller synchronizes before the pool's slots
        change), and no page-locked staging copy of the pages first."""
        n, p, e = len(starts), self.page_size, self.buffer.element_size()
        src = self.buffer.view(-1).view(torch.uint8)
        token = self.row_values * e  # bytes of one token of one layer
        if self.layout == "layer_first":  # K (or V) of a page: L rows of P tokens at the pool's pitch
            out = torch.empty((2, n, self.layers, p) + self._heads(), dtype=self.buffer.dtype, device=device)
            dst = out.view(-1).view(torch.uint8)
            width, half = p * token, self.layers * self.tokens * token
            for j, start in enumerate(starts):
                for kv in (0, 1):
                    copy_2d(dst, (kv * n + j) * self.layers * width, width, src, kv * half + start * token,
                            self.tokens * token, width, self.layers, stream)
            return out
        # page_first: K (or V) of a page is one row of P * L tokens; [2, N, P, L, H, D], then its layers first
        out = torch.empty((2, n, p, self.layers) + self._heads(), dtype=self.buffer.dtype, device=device)
        dst = out.view(-1).view(torch.uint8)
        width, half = p * self.layers * token, self.tokens * self.layers * token
        for j, start in enumerate(starts):
            for kv in (0, 1):
                copy_2d(dst, (kv * n + j) * width, width, src, kv * half + start * self.layers * token, width, width, 1,
                        stream)
        return out.transpose(2, 3).contiguous()

    def _heads(self) -> tuple[int, ...]:
        """The trailing (heads, head_dim) of the pool's buffer."""
        return tuple(self.buffer.shape[-2:])
