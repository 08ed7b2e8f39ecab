"""Each layer's codec, page layout and backend, from a cache's configuration, and the fingerprint that
names them all.

``CacheConfig.layer_codecs`` gives every layer its own codec spec (a per-layer plan, such as the one
`kvbackend eval` prints for ``auto:...``); otherwise ``CacheConfig.codec`` serves every layer (a ``depth:``
spec, `kvbackend.depth`, expands to one spec per layer). Layers of one spec share their codec, layout and
backend objects.
"""

from __future__ import annotations

import hashlib

import torch

from kvbackend import backends, codecs
from kvbackend.depth import layer_specs
from kvbackend.errors import SpecError
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.frames import lever_layout
from kvbackend.layout import PageLayout
from kvbackend.page_group import VERSION as PAGE_GROUP_VERSION
from kvbackend.rope import Rotary
from kvbackend.spec import SpecKind, spec_kind


def build_layers(geometry: Geometry, config: CacheConfig) -> tuple[list, list[PageLayout], list]:
    """(codecs, layouts, backends), one entry per layer.

    Raises:
        SpecError: a spec count other than the layer count, or an ``auto:`` plan (chosen on a prompt,
            not here).
    """
    specs = layer_specs(config.layer_codecs or config.codec, geometry.num_layers)
    if len(specs) != geometry.num_layers:
        raise SpecError(f"layer_codecs has {len(specs)} specs for {geometry.num_layers} layers")
    built: dict[str, tuple] = {}  # spec -> (codec, layout, backend), shared by layers of one spec
    device = torch.device(config.device)
    graphs = None  # warm chunk encodes replayed from CUDA graphs, one memory pool for all the layers' graphs
    if config.encode_graphs and device.type == "cuda":
        from kvbackend.kernels.encode_graph import GraphedEncoder

        graphs = GraphedEncoder()
    for spec in specs:
        if spec in built:
            continue
        if spec_kind(spec) is SpecKind.AUTO:
            raise SpecError(f"{spec!r}: an auto plan is chosen on a prompt by `kvbackend eval` (or "
                            "kvbackend.tools.auto.plan_widths); pass its per-layer specs as CacheConfig(layer_codecs=...)")
        codec = codecs.get(spec)
        layout = lever_layout(codec.layout(geometry, config.page_size), codec.levers)
        built[spec] = (codec, layout, backends.choose(config.backend, device, codec, layout, graphs))
    return ([built[spec][0] for spec in specs], [built[spec][1] for spec in specs],
            [built[spec][2] for spec in specs])


def cache_fingerprint(geometry: Geometry, config: CacheConfig, layouts: list[PageLayout],
                      rotary: Rotary | None = None) -> str:
    """16 hex characters naming everything that shapes an exported page group's bytes: the page-group
    format version, layers, heads, head size, dtype, page size, chunk pages, every layer's layout (the
    per-layer plan, levers included: they are part of its codec spec) and, for keys stored before
    RoPE, the RoPE they were de-rotated with. Tiers keyed by it never serve one cache's pages to another."""
    g = geometry
    parts = [f"pagegroup-v{PAGE_GROUP_VERSION}", f"L{g.num_layers}H{g.num_kv_heads}D{g.head_dim}", str(g.dtype),
             f"P{config.page_size}C{config.chunk_pages}", *(lay.fingerprint for lay in layouts)]
    if rotary is not None:
        freqs = rotary.inv_freq.float().cpu().numpy().tobytes()
        parts.append(f"rope:{hashlib.sha256(freqs).hexdigest()[:16]}x{rotary.scaling!r}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
