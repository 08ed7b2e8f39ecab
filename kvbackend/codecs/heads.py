"""Per-head widths: one base codec whose key/value widths, residual stages or key outliers differ from
one KV head to the next (``heads:base=quantwm:kchannel=64;clip=true,kbits=3-2-2,vbits=2-2-3``).

A layer's heads are not equally sensitive: a head that retrieves far tokens loses more from 2-bit keys
than one that attends locally. `auto:...,perhead=true` plans widths per (layer, head) and writes such a
spec wherever a layer's heads differ; mixing 2- and 3-bit heads is also how a layer takes a width
between 2 and 3 bits.

Each head is encoded by its own codec on a one-head geometry and its page bytes and codebook slot are
stored as one opaque field per head (``h0``, ``h1``, ...), so every head keeps the base's own layout
and reference decode. The kernels read no such field (`kvbackend.scheme.kernel_schemes` refuses it by
name), so these layers are served by the torch reference. The base's options are separated by ``;``;
levers (``sink``, ``prerope``, ``vrot``) are options of this spec itself, shared by every head, as the
paged cache applies them per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.levers import Levers, split_levers
from kvbackend.spec import Checked, split_spec
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs

PER_HEAD = ("kbits", "vbits", "stages", "outliers")  # base options a heads: spec may set per head


@dataclass(frozen=True)
class HeadsSpec(Checked):
    name: str
    base: str = "kivi:group=64"  # the codec of every head, its options separated by ';', without levers
    kbits: str = ""  # key widths per KV head, dash-separated (e.g. 3-2-2); "": the base's for every head
    vbits: str = ""  # value widths per KV head
    stages: str = ""  # residual stages per KV head (qvg-family bases)
    outliers: str = ""  # key outliers per page and KV head (quantwm bases)


def head_specs(spec: HeadsSpec) -> list[str]:
    """The codec spec of each KV head: the base with that head's options.

    Raises:
        SpecError: levers inside the base, a nested heads: base, lists of different lengths, or a
            per-head value that is not an integer.
    """
    name, options = split_spec(spec.base.replace(";", ","))
    if name == "heads":
        raise SpecError("heads: the base cannot itself be a heads: spec")
    _, levers = split_levers(options, name)
    if levers.active:
        raise SpecError(f"heads: levers ({levers.suffix()}) go on the heads: spec itself, shared by every head, "
                        f"not inside base={spec.base!r}")
    lists: dict[str, list[str]] = {}
    for key in PER_HEAD:
        text = getattr(spec, key)
        if not text:
            continue
        parts = text.split("-")
        if not all(part.isdecimal() for part in parts):  # (int() reads every decimal digit, not every digit)
            raise SpecError(f"heads: {key}={text!r} must be dash-separated integers, one per KV head (e.g. 3-2-2)")
        lists[key] = parts
    if not lists:
        raise SpecError(f"heads: give at least one of {', '.join(PER_HEAD)} per KV head (dash-separated)")
    for key in lists:  # never silently overridden
        if key in options:
            raise SpecError(f"heads: {key} is given per head ({key}={getattr(spec, key)}) and in base={spec.base!r}; "
                            "give it once")
    counts = {len(parts) for parts in lists.values()}
    if len(counts) > 1:
        raise SpecError(f"heads: the per-head lists differ in length: "
                        + ", ".join(f"{k}={getattr(spec, k)}" for k in lists))
    heads = counts.pop()
    return [f"{name}:" + ",".join(f"{k}={v}" for k, v in {**options, **{k: p[i] for k, p in lists.items()}}.items())
            for i in range(heads)]


class HeadsCodec(Codec):
    name: ClassVar[str] = "heads"

    def __init__(self, spec: HeadsSpec, make: Callable[[str], Codec]) -> None:
        """``make``: the registry's codec factory (`kvbackend.codecs.get`), for each head's codec."""
        texts = head_specs(spec)
        # the base in its canonical spelling (without the options given per head), so spellings of one codec share
        # one spec string and one layout fingerprint
        name, options = split_spec(make(spec.base.replace(";", ",")).spec_string)
        listed = {key for key in PER_HEAD if getattr(spec, key)}
        # the per-head lists as numbers write them (03-2 and fullwidth digits are 3-2: one fingerprint)
        lists = {key: "-".join(str(int(part)) for part in getattr(spec, key).split("-")) for key in listed}
        spec = dataclasses.replace(spec, base=f"{name}:" + ";".join(f"{k}={v}" for k, v in options.items()
                                                                     if k not in listed), **lists)
        super().__init__(spec)
        self.heads = []
        for i, text in enumerate(texts):
            try:
                self.heads.append(make(text))
            except SpecError as exc:
                raise SpecError(f"heads: head {i} ({text}): {exc}") from None
        self.uses_queries = any(codec.uses_queries for codec in self.heads)  # type: ignore[misc]
        self.page_local = all(codec.page_local for codec in self.heads)  # type: ignore[misc]

    @property
    def levers(self) -> Levers:
        return self._levers

    @levers.setter
    def levers(self, levers: Levers) -> None:
        """The spec's levers (set once built, `kvbackend.codecs.get`); each head's codec learns the keys' frame from
        them (quantwm's `kmetric` pairs the channel weights of a RoPE pair for keys stored before RoPE), as a codec
        given the levers itself would. Sinks and value rotations stay the layer's: no head stores them."""
        self._levers = levers
        for codec in getattr(self, "heads", ()):
            codec.levers = Levers(prerope=levers.prerope, pagerope=levers.pagerope)

    @property
    def kernel_encodes(self) -> bool:
        return False  # no kernel reads the per-head fields: the reference encodes and decodes

    def stored_max_abs(self, geometry: Geometry) -> tuple[float, float]:
        bounds = [codec.stored_max_abs(geometry) for codec in self.heads]
        return min(k for k, _ in bounds), min(v for _, v in bounds)

    def saturation_parts(self, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor) -> list[tuple]:
        """Each head's own fields (its page bytes and codebook slot are opaque here), named ``h{i}.field``."""
        parts = []
        for i, (codec, sub) in enumerate(zip(self.heads, self._head_layouts(layout.geometry, layout.page_size))):
            books = (layout.codebook.view(codebooks, f"h{i}") if sub.codebook_bytes
                     else codebooks.new_zeros(*codebooks.shape[:-1], 0))
            parts.append((f"h{i}.", sub, layout.page.view(pages, f"h{i}"), books, codec.full_scale_fields))
        return parts

    def _head_layouts(self, geometry: Geometry, page_size: int) -> list[PageLayout]:
        one = dataclasses.replace(geometry, num_kv_heads=1)
        return [codec.layout(one, page_size) for codec in self.heads]

    def validate(self, geometry: Geometry, page_size: int) -> None:
        if len(self.heads) != geometry.num_kv_heads:
            raise SpecError(f"heads: the spec gives {len(self.heads)} heads' options, the model has "
                            f"{geometry.num_kv_heads} KV heads")
        self._head_layouts(geometry, page_size)  # each head's codec validates its own options

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        layouts = self._head_layouts(geometry, page_size)
        page = [(f"h{i}", torch.uint8, (lay.page_bytes,)) for i, lay in enumerate(layouts)]
        book = [(f"h{i}", torch.uint8, (lay.codebook_bytes,)) for i, lay in enumerate(layouts) if lay.codebook_bytes]
        return page, book

    @staticmethod
    def _head_state(state: CodecState, head: int) -> CodecState:
        """Head ``head``'s view of the layer's state: its warm-start centroids and its query moment and mean."""
        tag = f"h{head}:"
        moment = state.query_moment[head : head + 1] if state.query_moment is not None else None
        mean = state.query_mean[head : head + 1] if state.query_mean is not None else None
        return CodecState({k[len(tag):]: t for k, t in state.centroids.items() if k.startswith(tag)}, [], moment,
                          query_mean=mean)

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        moment = state.query_moment
        if moment is not None and tuple(moment.shape) != (len(self.heads), k.shape[2], k.shape[2]):
            raise ValueError(f"heads: query_moment must be [KV heads, D, D] = [{len(self.heads)}, {k.shape[2]}, "
                             f"{k.shape[2]}] (pooled per KV head), got {tuple(moment.shape)}")
        for i, (codec, sub) in enumerate(zip(self.heads, self._head_layouts(layout.geometry, layout.page_size))):
            head_pages = torch.zeros(pages.shape[0], sub.page_bytes, dtype=torch.uint8, device=pages.device)
            head_book = torch.zeros(sub.codebook_bytes, dtype=torch.uint8, device=pages.device)
            head_state = self._head_state(state, i)
            codec._encode(k[:, i : i + 1].contiguous(), v[:, i : i + 1].contiguous(), sub, head_pages, head_book,
                          head_state)
            layout.page.view(pages, f"h{i}").copy_(head_pages)
            if sub.codebook_bytes:
                layout.codebook.view(codebook, f"h{i}").copy_(head_book)
            state.centroids.update({f"h{i}:{name}": t for name, t in head_state.centroids.items()})
            state.iterations.extend(head_state.iterations)

    def warm_start(self, layout: PageLayout, codebook) -> dict[str, torch.Tensor]:
        """Each head's warm start from its part of the slot, under the names `_encode` keeps them."""
        out = {}
        for i, (codec, sub) in enumerate(zip(self.heads, self._head_layouts(layout.geometry, layout.page_size))):
            if sub.codebook_bytes:
                book = layout.codebook.view(codebook, f"h{i}").contiguous()
                out.update({f"h{i}:{name}": t for name, t in codec.warm_start(sub, book).items()})
        return out

    def _decode(self, layout: PageLayout, pages, codebook):
        keys, values = [], []
        for i, (codec, sub) in enumerate(zip(self.heads, self._head_layouts(layout.geometry, layout.page_size))):
            head_book = (layout.codebook.view(codebook, f"h{i}").contiguous() if sub.codebook_bytes
                         else torch.zeros(0, dtype=torch.uint8, device=pages.device))
            k, v = codec._decode(sub, layout.page.view(pages, f"h{i}").contiguous(), head_book)
            keys.append(k)
            values.append(v)
        return torch.cat(keys, 1), torch.cat(values, 1)
