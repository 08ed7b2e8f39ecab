"""The frame packed pages are stored in when a codec's levers are on (`kvbackend.levers`).

- ``prerope=true``: keys are encoded before RoPE (de-rotated at their positions) and rotated again on
  read, so the codec never sees the rotation's spread of each channel pair;
- ``pagerope=true``: keys are encoded de-rotated by the first position of their page only (a key at
  ``p0 + t`` is stored as ``R(t) k`` before RoPE): a channel turns by at most a page's worth of its
  frequency, so slow channels keep their pre-RoPE statistics, and readers rotate the query by
  ``R(p0)`` once per page instead of rotating every key;
- ``vrot=hadamard``: values are encoded after an orthonormal Hadamard rotation (outliers spread over
  every channel) and rotated back on read;
- ``sink=S``: the first S tokens of a sequence are kept at 16 bits (the cache's own dtype for bf16 and
  fp16 caches, so exactly; fp16 for a float32 cache), in two fields of every chunk's codebook slot
  (``sink_k``, ``sink_v``, counted in the stored bytes like any field; only the chunk that starts a
  sequence fills them), and replace the decoded ones on read; the codec encodes copies of the next
  token in their place (`without_sinks`), so the sinks set none of the page's statistics.

The dense active chunk is stored exactly as appended; only encoding and decoding cross the frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.codecs.base import query_moments
from kvbackend.errors import SpecError
from kvbackend.layout import FieldSet, PageLayout
from kvbackend.levers import Levers, rotate_values
from kvbackend.rope import Rotary
from kvbackend.switches import switched_off

SINK_FIELDS = ("sink_k", "sink_v")


def rope_positions(levers: Levers, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The positions keys at ``positions`` are de-rotated by: their own (``prerope``) or their page's
    first (``pagerope``)."""
    if levers.pagerope:
        if page_size <= 0:
            raise ValueError("pagerope=true needs the page size")
        return positions - positions % page_size
    return positions


def without_sinks(k: torch.Tensor, v: torch.Tensor, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first chunk ``[T, H, D]`` (or ``[L, T, H, D]``, several layers) for its codec, the ``sink``
    first tokens (kept exact elsewhere, and written over the decoded rows on read) replaced by copies of the next
    token, so their often huge values set no scale, centroid or correction of the tokens that are decoded."""
    sink = min(sink, k.shape[-3] - 1)
    if sink <= 0:
        return k, v
    k, v = k.clone(), v.clone()
    k[..., :sink, :, :] = k[..., sink : sink + 1, :, :]
    v[..., :sink, :, :] = v[..., sink : sink + 1, :, :]
    return k, v


def lever_layout(layout: PageLayout, levers: Levers) -> PageLayout:
    """``layout`` with the sink fields appended to its codebook slot (the codec's own fields keep their
    offsets, so the codec reads and writes the slot as before)."""
    if not levers.sink:
        return layout
    g = layout.geometry
    specs = [(f.name, f.dtype, f.shape) for f in layout.codebook.fields.values()]
    dtype = g.dtype if g.dtype in (torch.bfloat16, torch.float16) else torch.float16
    specs += [(name, dtype, (levers.sink, g.num_kv_heads, g.head_dim)) for name in SINK_FIELDS]
    return PageLayout(layout.codec, g, layout.page_size, layout.page, FieldSet(specs))


@dataclass(frozen=True)
class LeverFrame:
    """One layer's levers with what they need: the model's RoPE for pre-RoPE keys."""

    levers: Levers
    rotary: Rotary | None = None
    page_size: int = 0  # tokens per page (needed by pagerope=true)

    def check(self, page_size: int, where: str, head_dim: int | None = None) -> None:
        """Raise SpecError for levers the paged cache cannot serve as given (with ``head_dim``, a Hadamard
        rotation of values over a head size that is not a power of two, which every chunk's encoding would
        refuse, leaving every chunk dense)."""
        if head_dim is not None and self.levers.vrot == "hadamard" and head_dim & (head_dim - 1):
            raise SpecError(f"{where}: vrot=hadamard needs a power-of-two head_dim, and the model's is {head_dim}")
        if self.levers.rope and self.rotary is None:
            name = "prerope" if self.levers.prerope else "pagerope"
            raise SpecError(f"{where}: {name}=true stores keys before RoPE and needs the model's RoPE: pass "
                            "KVCache(..., rotary=kvbackend.rope.rotary_from_config(model.config))")
        if self.levers.rope and head_dim is not None and self.rotary.inv_freq.numel() * 2 != head_dim:
            raise SpecError(f"{where}: the RoPE given (rotary=) has {self.rotary.inv_freq.numel()} frequencies, for a "
                            f"head_dim of {self.rotary.inv_freq.numel() * 2}; the model's head_dim is {head_dim}")
        if self.levers.psac:
            raise SpecError(f"{where}: the psac= lever is applied by `kvbackend eval` only; in the paged cache use "
                            "quantwm, whose rank= option stores the same correction in its pages")
        if self.levers.sink > page_size:
            raise SpecError(f"{where}: sink={self.levers.sink} exceeds the page size {page_size}; the exact sink "
                            "tokens live in the first page's chunk")

    def _positions(self, first: int, n: int, device: torch.device) -> torch.Tensor:
        """The positions keys of tokens ``first..first+n-1`` are de-rotated by in the stored frame."""
        return rope_positions(self.levers, torch.arange(first, first + n, device=device), self.page_size)

    def to_stored(self, k: torch.Tensor, v: torch.Tensor, first: int,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keys_as_given: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[T, H, D]`` of positions ``first..`` into the stored frame (float32). Leading dims
        are batches of the same positions (``[L, T, H, D]``: one chunk of several layers with these levers):
        every element as `to_stored` of its own ``[T, H, D]`` gives it, bit for bit. ``out``: float32 buffers of
        ``k``'s and ``v``'s shapes (not overlapping them) the results may be written into, so that a caller that
        reuses them across batches touches no fresh memory; the results are the same bits either way.
        ``keys_as_given``: without a RoPE lever the keys are returned as given, not widened (for a codec whose
        field writers read bf16 themselves, `Codec.any_float_input`: the same values, so the same bytes)."""
        if self.levers.rope or not keys_as_given:
            if out is not None and not self.levers.rope and k.dtype != torch.float32:
                k = out[0].copy_(k)  # the float32 widening into the caller's buffer (RoPE's turn makes its own)
            k = k.float()
        if self.levers.rope:
            t = k.shape[-3]
            k = self.rotary.derotate(k.transpose(-3, -2), self._positions(first, t, k.device)).transpose(-3, -2)
        # rotated values are widened to float32 inside the rotation (no float32 copy of the batch first)
        if self.levers.vrot == "hadamard":
            v = rotate_values(v, None if out is None else out[1])  # `out` is written only by the fused CPU loop
        elif out is not None and v.dtype != torch.float32:
            v = out[1].copy_(v)
        else:
            v = v.float()
        return k.contiguous(), v.contiguous()

    def from_stored(self, k: torch.Tensor, v: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `to_stored`, in ``k``'s dtype."""
        dtype = k.dtype
        if self.levers.rope:
            k = self.rotary.rotate(k.float().transpose(0, 1),
                                   self._positions(first, k.shape[0], k.device)).transpose(0, 1)
        if self.levers.vrot == "hadamard":
            v = rotate_values(v)  # its own inverse
        return k.to(dtype), v.to(dtype)

    def step_queries_to_stored(self, q: torch.Tensor, positions: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
        """One query per row ``[B, Hq, D]`` at ``positions [B]`` (each row its own request's position) in
        the keys' stored frame: `queries_to_stored` of every row at once. ``memo``: a dict kept for these
        positions (`StepInts.rope`): the RoPE tables are made once there for every frame that turns alike."""
        if not self.levers.rope:
            return q
        tables = self._step_tables(positions, q.device, memo)
        return self.rotary.derotate(q.transpose(0, 1), None, cos_sin=tables).transpose(0, 1)

    def step_query_moments(self, q: torch.Tensor, positions: torch.Tensor, memo: dict | None, kv_heads: int,
                           out: tuple[torch.Tensor, torch.Tensor], kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`query_moments` of `step_queries_to_stored` (``q [B, Hq, D]`` at ``positions [B]``) into ``out``
        (contiguous float32 ``[B, H, D, D]`` and ``[B, H, D]``). ``kernel``: in one Triton kernel
        (`kvbackend.kernels.query_moments`: the same queries rounded to their dtype after the turn, sums in another
        order), for a layer the Triton backend serves, unless ``KVBACKEND_STEP_KERNEL`` is ``0`` (to compare);
        else in torch."""
        if kernel and self._step_kernel(q, positions, memo, kv_heads, out=out):
            return out
        return query_moments(self.step_queries_to_stored(q, positions, memo), kv_heads, out=out)

    def add_step_query_moments(self, q: torch.Tensor, positions: torch.Tensor, memo: dict | None, kv_heads: int,
                               parts: torch.Tensor) -> bool:
        """`step_query_moments` through the Triton kernel, added in place to each request's parts at the addresses
        ``parts`` (int64 ``[2, B]``, `kvbackend.codecs.base.step_parts`) instead of written to buffers; False (and
        nothing added) where the kernel does not take these queries or ``KVBACKEND_STEP_KERNEL`` is ``0``."""
        return self._step_kernel(q, positions, memo, kv_heads, parts=parts)

    def step_kernel_takes(self, q: torch.Tensor) -> bool:
        """Whether the step statistics kernel takes the queries ``q`` (``[B, Hq, D]``): not where
        ``KVBACKEND_STEP_KERNEL`` is ``0`` or the kernel does not read their shape or dtype."""
        if switched_off("KVBACKEND_STEP_KERNEL"):
            return False
        from kvbackend.kernels import query_moments as kernels  # (Triton is imported by Triton layers only)
        return kernels.supports(q)

    def _step_kernel(self, q: torch.Tensor, positions: torch.Tensor, memo: dict | None, kv_heads: int,
                     **into) -> bool:
        """The step statistics kernel on ``q`` (its RoPE tables from ``memo``) into ``out`` or ``parts``; False
        where it is switched off or does not take these queries."""
        if not self.step_kernel_takes(q):
            return False
        from kvbackend.kernels import query_moments as kernels
        tables = self._step_tables(positions, q.device, memo) if self.levers.rope else None
        kernels.step_query_moments(q, kv_heads, tables, self.rotary.scaling if self.levers.rope else 1.0, **into)
        return True

    def _step_tables(self, positions: torch.Tensor, device: torch.device,
                     memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables ``[B, D]`` that turn a step's queries into the stored frame, kept in ``memo``."""
        key = (id(self.rotary), self.levers.pagerope, self.page_size, device)
        tables = memo.get(key) if memo is not None else None
        if tables is None:
            tables = self.rotary.cos_sin(rope_positions(self.levers, positions, self.page_size), device)
            if memo is not None:
                memo[key] = tables
        return tables

    def queries_to_stored(self, q: torch.Tensor, first: int) -> torch.Tensor:
        """Queries ``[T, Hq, D]`` of positions ``first..`` in the keys' stored frame (de-rotated as a key at their
        own position would be; exact for the query-key product only within that page, as `kvbackend eval` does it)."""
        if not self.levers.rope:
            return q
        return self.step_queries_to_stored(q, torch.arange(first, first + q.shape[0], device=q.device))
