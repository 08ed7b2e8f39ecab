"""Each layer's codec, page layout and backend, from a cache's configuration, and the fingerprint that
names them all.

``CacheConfig.layer_codecs`` gives every layer its own codec spec (a per-layer plan, such as the one
`kvbackend eval` prints for ``auto:...``); otherwise ``CacheConfig.codec`` serves every layer. Layers of
one spec share their codec, layout and backend objects.
"""

from __future__ import annotations

import hashlib

import torch

from kvbackend import backends, codecs
from kvbackend.errors import SpecError
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.layout import PageLayout
from kvbackend.page_group import VERSION as PAGE_GROUP_VERSION
from kvbackend.spec import SpecKind, spec_kind


def build_layers(geometry: Geometry, config: CacheConfig) -> tuple[list, list[PageLayout], list]:
    """(codecs, layouts, backends), one entry per layer.

    Raises:
        SpecError: a spec count other than the layer count, an ``auto:`` plan (chosen on a prompt,
            not here) or levers that act on whole sequences.
    """
    specs = config.layer_codecs or (config.codec,) * geometry.num_layers
    if len(specs) != geometry.num_layers:
        raise SpecError(f"layer_codecs has {len(specs)} specs for {geometry.num_layers} layers")
    built: dict[str, tuple] = {}  # spec -> (codec, layout, backend), shared by layers of one spec
    for spec in specs:
        if spec in built:
            continue
        if spec_kind(spec) is SpecKind.AUTO:
            raise SpecError(f"{spec!r}: an auto plan is chosen on a prompt by `kvbackend eval` (or "
                            "kvbackend.tools.auto.plan_widths); pass its per-layer specs as CacheConfig(layer_codecs=...)")
        codec = codecs.get(spec)
        if codec.levers.active:
            raise SpecError(f"{spec!r}: sink/prerope/vrot act on whole sequences; they are applied by "
                            "`kvbackend eval` and by KVBackendCache(sink=..., pre_rope=...), not by a KVCache "
                            "(kvbackend.tools.auto.cache_specs strips them from a plan)")
        layout = codec.layout(geometry, config.page_size)
        built[spec] = (codec, layout, backends.choose(config.backend, torch.device(config.device),
                                                      codec, layout))
    return ([built[spec][0] for spec in specs], [built[spec][1] for spec in specs],
            [built[spec][2] for spec in specs])


def cache_fingerprint(geometry: Geometry, config: CacheConfig, layouts: list[PageLayout]) -> str:
    """16 hex characters naming everything that shapes an exported page group's bytes: the page-group
    format version, layers, heads, head size, dtype, page size, chunk pages and every layer's layout
    (the per-layer plan). Tiers keyed by it never serve one cache's pages to another."""
    g = geometry
    text = "|".join([f"pagegroup-v{PAGE_GROUP_VERSION}", f"L{g.num_layers}H{g.num_kv_heads}D{g.head_dim}",
                     str(g.dtype), f"P{config.page_size}C{config.chunk_pages}", *(lay.fingerprint for lay in layouts)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
