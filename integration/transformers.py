"""Hugging Face transformers integration: a `Cache` whose layers live in kvbackend pages.

    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=32")
    model.generate(input_ids, past_key_values=cache)

Each batch row is one kvbackend request. Keys and values go into the request's dense active chunk;
completed chunks are encoded by the codec; attention reads the reconstruction of the packed
chunks (decoded once per chunk and kept) followed by the active chunk as stored. The first
``sink`` tokens can stay exact, and keys can be stored before RoPE.

A per-layer plan (the one ``kvbackend eval`` prints for ``auto:...``) runs as it is chosen:
``KVBackendCache.from_plan(model.config, plan)`` takes each layer's codec and the plan's sink,
pre-RoPE and value-rotation levers, so nothing is calibrated again.

Query-aware codecs (``quantwm``) also need the queries attention used. ``cache.attach(model)``
installs an attention function that hands each layer's queries to the cache before attending; the
layer then appends its new tokens together with their queries (so a chunk is encoded with the
statistics of its own and earlier queries). Without it such a codec runs on cold statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbackend.errors import SpecError
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.levers import Levers, hadamard
from kvbackend.manager import KVCache
from kvbackend.rope import rotary_from_config
from kvbackend.tools.auto import cache_specs


@dataclass(frozen=True)
class CacheOptions:
    """Options of a `KVBackendCache` shared by all its layers (each layer holds its own levers:
    ``sink``, ``pre_rope``, ``v_rotation``)."""

    codec: str | tuple[str, ...] = "qvg"  # codec spec for completed chunks, or one spec per layer
    page_size: int = 64  # tokens per page
    chunk_pages: int = 32  # pages per chunk (2048 tokens by default)
    max_tokens: int = 4096  # longest sequence per batch row; sizes the pools


class KVBackendLayer(CacheLayerMixin):
    """One attention layer's cache, stored in the shared `KVCache` of its `KVBackendCache`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "KVBackendCache", layer_idx: int, levers: Levers) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.sink, self.pre_rope, self.v_rotation = levers.sink, levers.prerope, levers.vrot
        self.length = 0  # tokens per row seen by this layer (sink included)
        self._sink_k: torch.Tensor | None = None  # [B, H, sink, D], exact
        self._sink_v: torch.Tensor | None = None
        self._packed_k: list[torch.Tensor] = []  # per row: decoded packed pages [H, n, D] (RoPE applied)
        self._packed_v: list[torch.Tensor] = []
        # new tokens waiting for their queries (attach()): (k as stored [B, H, T, D], v, first position)
        self._pending: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.owner._ensure_engine(key_states)
        batch = key_states.shape[0]
        empty = key_states.new_zeros(batch, key_states.shape[1], 0, key_states.shape[3])
        self._sink_k, self._sink_v = empty, empty.clone()
        self._packed_k = [empty[0]] * batch
        self._packed_v = [empty[0]] * batch
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush_pending()  # queries never came (attention ran without the attached function)
        opts, engine = self.owner.options, self.owner.engine
        t = key_states.shape[2]
        to_sink = min(max(self.sink - self.length, 0), t)
        if to_sink:
            self._sink_k = torch.cat([self._sink_k, key_states[:, :, :to_sink]], dim=2)
            self._sink_v = torch.cat([self._sink_v, value_states[:, :, :to_sink]], dim=2)
        k_new, v_new = key_states[:, :, to_sink:], value_states[:, :, to_sink:]
        first = self.length + to_sink - self.sink  # position of k_new[0] among paged tokens
        k_seen, v_seen = k_new, v_new
        if self.pre_rope and k_new.shape[2]:
            k_new = self.owner.rotary.derotate(k_new, self._positions(first, k_new.shape[2]))
        v_new = self.rotate_values(v_new)
        if self.owner.wants_queries and k_new.shape[2]:  # append once attention hands over the queries
            keys, values = self._gather()
            self._pending = (k_new, v_new, first)
            self.length += t
            return torch.cat([keys, k_seen], dim=2), torch.cat([values, v_seen], dim=2)
        for row, rid in enumerate(self.owner.request_ids):
            engine.append(rid, self.layer_idx, k_new[row].transpose(0, 1), v_new[row].transpose(0, 1))
        self.length += t
        return self._gather()

    def observe_queries(self, query: torch.Tensor) -> None:
        """Append the pending tokens with their queries ``[B, Hq, T, D]`` (post-RoPE, as attention saw
        them; de-rotated like the keys when keys are stored before RoPE)."""
        if self._pending is None:
            return
        k_new, v_new, first = self._pending
        n = k_new.shape[2]
        q = query[:, :, -n:]
        if self.pre_rope:  # approximate frame: each query de-rotated by its own position
            q = self.owner.rotary.derotate(q, self._positions(first, n))
        self._pending = None
        for row, rid in enumerate(self.owner.request_ids):
            self.owner.engine.append(rid, self.layer_idx, k_new[row].transpose(0, 1), v_new[row].transpose(0, 1),
                                     queries=q[row].transpose(0, 1))

    def flush_pending(self) -> None:
        if self._pending is None:
            return
        k_new, v_new, _ = self._pending
        self._pending = None
        for row, rid in enumerate(self.owner.request_ids):
            self.owner.engine.append(rid, self.layer_idx, k_new[row].transpose(0, 1), v_new[row].transpose(0, 1))

    def _positions(self, first: int, n: int) -> torch.Tensor:
        # Paged tokens sit after the sink, so their RoPE position is their index plus the sink length.
        return torch.arange(first, first + n) + self.sink

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        engine, opts = self.owner.engine, self.owner.options
        keys, values = [], []
        for row, rid in enumerate(self.owner.request_ids):
            have = self._packed_k[row].shape[1] // opts.page_size
            pk, pv = engine.read_packed(rid, self.layer_idx, first_page=have)
            if pk.shape[0]:
                pk = pk.transpose(0, 1)
                if self.pre_rope:
                    pk = self.owner.rotary.rotate(pk, self._positions(have * opts.page_size, pk.shape[1]))
                self._packed_k[row] = torch.cat([self._packed_k[row], pk], dim=1)
                pv = self.rotate_values(pv.transpose(0, 1), back=True)
                self._packed_v[row] = torch.cat([self._packed_v[row], pv], dim=1)
            dk, dv = engine.read_dense(rid, self.layer_idx)
            dk = dk.transpose(0, 1)
            if self.pre_rope and dk.shape[1]:
                dk = self.owner.rotary.rotate(dk, self._positions(self._packed_k[row].shape[1], dk.shape[1]))
            keys.append(torch.cat([self._packed_k[row], dk], dim=1))
            values.append(torch.cat([self._packed_v[row], self.rotate_values(dv.transpose(0, 1), back=True)], dim=1))
        return torch.cat([self._sink_k, torch.stack(keys)], dim=2), torch.cat([self._sink_v, torch.stack(values)], dim=2)

    def rotate_values(self, v: torch.Tensor, back: bool = False) -> torch.Tensor:
        """Values ``[..., D]`` into the stored frame (or ``back`` out of it): an orthonormal Hadamard
        rotation when this layer's ``v_rotation`` is "hadamard" (computed in float32), else unchanged."""
        if self.v_rotation == "none" or not v.numel():
            return v
        h = hadamard(v.shape[-1]).to(v.device)
        return (v.float() @ (h.T if back else h)).to(v.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._pending = None
        self.length = 0
        self.is_initialized = False
        self._sink_k = self._sink_v = None
        self._packed_k, self._packed_v = [], []

    def stored_bytes(self) -> int:
        """Bytes of the exact sink tokens kept by this layer."""
        return 0 if self._sink_k is None else self._sink_k.nbytes + self._sink_v.nbytes


class KVBackendCache(Cache):
    """A transformers `Cache` backed by kvbackend's paged, compressed storage."""

    def __init__(self, config, codec: str | Sequence[str] = "qvg", *, page_size: int = 64, chunk_pages: int = 32,
                 sink: int = 0, pre_rope: bool = False, max_tokens: int = 4096, v_rotation: str = "none",
                 layer_levers: Sequence[Levers] | None = None) -> None:
        """``sink`` (first tokens of every row kept exact, outside the pages), ``pre_rope`` (keys stored
        before RoPE, rotated again on read) and ``v_rotation`` ("hadamard": values stored rotated,
        rotated back on read) apply to every layer, unless ``layer_levers`` (one `Levers` per layer,
        as `from_plan` passes them) gives each layer its own."""
        codec = codec if isinstance(codec, str) else tuple(codec)
        self.options = CacheOptions(codec, page_size, chunk_pages, max_tokens)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = text_config.num_hidden_layers
        if isinstance(codec, tuple) and len(codec) != layers:
            raise SpecError(f"a per-layer plan of {len(codec)} specs for a model of {layers} layers")
        levers = list(layer_levers) if layer_levers is not None else [Levers(sink, pre_rope, v_rotation)] * layers
        if len(levers) != layers:
            raise SpecError(f"layer_levers has {len(levers)} entries for a model of {layers} layers")
        if len({lever.sink for lever in levers}) > 1:  # the engine's requests hold one token count in all layers
            raise SpecError(f"every layer of one cache keeps the same sink; the plan asks for "
                            f"{sorted({lever.sink for lever in levers})}")
        if any(lever.psac for lever in levers):
            raise SpecError("the psac= lever is applied by `kvbackend eval` only; use quantwm:rank=R")
        self.model_config = text_config
        self.rotary = rotary_from_config(text_config) if any(lever.prerope for lever in levers) else None
        self.engine: KVCache | None = None
        self.request_ids: list[int] = []
        self.wants_queries = False  # set by attach() when the codec reads query statistics
        super().__init__(layers=[KVBackendLayer(self, i, lever) for i, lever in enumerate(levers)])

    @classmethod
    def from_plan(cls, config, plan: Sequence[str], **options) -> "KVBackendCache":
        """A cache that runs a per-layer plan as chosen (e.g. ``kvbackend eval --json``'s ``plan`` for
        an ``auto:...`` codec): each layer's codec and its own ``sink``, ``prerope`` and ``vrot``
        levers. Other keyword options as for the class.

        Raises:
            SpecError: ``plan`` is not a non-empty list of codec spec strings (an eval row of a codec
                other than ``auto:`` has ``plan`` None: give its spec as ``codec=`` instead), or a spec
                or lever the cache cannot take.
        """
        if plan is None:
            raise SpecError("this row has no plan (plan is None: only auto:... codecs choose per-layer specs); "
                            "for one codec in every layer use KVBackendCache(config, codec=SPEC)")
        if isinstance(plan, str):
            raise SpecError(f"a plan is a list of per-layer codec specs, not one string ({plan!r}); "
                            f"for one codec in every layer use KVBackendCache(config, codec={plan!r})")
        if not isinstance(plan, Sequence):
            raise SpecError(f"a plan is a list of per-layer codec specs, got {type(plan).__name__}")
        if not plan:
            raise SpecError("the plan is empty; it needs one codec spec per layer")
        for i, spec in enumerate(plan):
            if not isinstance(spec, str):
                raise SpecError(f"plan[{i}]={spec!r} is not a codec spec string")
        specs, levers = cache_specs(plan)
        return cls(config, specs, layer_levers=levers, **options)

    def attach(self, model) -> str:
        """Route ``model``'s attention through a function that hands queries to this cache first
        (needed by query-aware codecs such as ``quantwm``; harmless for others). Returns the name it
        registered; ``detach(model)`` restores the previous implementation."""
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def attention(module, query, key, value, attention_mask, **kwargs):
            layer = self.layers[module.layer_idx]
            layer.observe_queries(query)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        name = f"kvbackend_{id(self):x}"
        AttentionInterface.register(name, attention)
        self._previous_attn = model.config._attn_implementation
        model.set_attn_implementation(name)
        from kvbackend.codecs import get as get_codec

        specs = [self.options.codec] if isinstance(self.options.codec, str) else self.options.codec
        self.wants_queries = any(get_codec(spec).uses_queries for spec in specs)
        return name

    def detach(self, model) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.flush_pending()
        self.wants_queries = False
        model.set_attn_implementation(getattr(self, "_previous_attn", "sdpa"))

    def _ensure_engine(self, key_states: torch.Tensor) -> None:
        if self.engine is not None:
            return
        cfg, opts = self.model_config, self.options
        batch, heads, _, head_dim = key_states.shape
        pages_per_row = -(-opts.max_tokens // opts.page_size) + 1
        geometry = Geometry(cfg.num_hidden_layers, heads, head_dim, key_states.dtype)
        which = {"codec": opts.codec} if isinstance(opts.codec, str) else {"layer_codecs": opts.codec}
        config = CacheConfig(**which, page_size=opts.page_size, chunk_pages=opts.chunk_pages,
                             dense_pages=batch * pages_per_row, packed_pages=batch * pages_per_row,
                             device=str(key_states.device))
        self.engine = KVCache(geometry, config)
        self.request_ids = [self.engine.add_request()[0] for _ in range(batch)]

    # -- batch reshuffles (beam search and friends) ---------------------------------------------
    def _reselect(self, rows: list[int]) -> None:
        """Make batch row i a copy of old row ``rows[i]``: packed pages are shared, active chunks copied."""
        if self.engine is None:
            return
        for layer in self.layers:
            if layer.is_initialized:
                layer.flush_pending()
        old = self.request_ids
        self.request_ids = [self.engine.fork(old[r]) for r in rows]
        for rid in old:
            self.engine.free(rid)
        for layer in self.layers:
            if layer.is_initialized:
                index = torch.tensor(rows, device=layer._sink_k.device)
                layer._sink_k, layer._sink_v = layer._sink_k[index], layer._sink_v[index]
                layer._packed_k = [layer._packed_k[r] for r in rows]
                layer._packed_v = [layer._packed_v[r] for r in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reselect([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reselect([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reselect([row for row in range(len(self.request_ids)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a KVBackendCache cannot drop tokens (packed chunks are immutable); "
                         "assisted or speculative decoding that rolls back the cache is not supported")

    def kv_bytes(self) -> dict[str, int]:
        """Bytes held: ``stored`` (packed pages + codebooks + dense active pages + exact sinks), and
        ``exact`` (the same tokens as uncompressed tensors of the model's dtype)."""
        if self.engine is None:
            return {"stored": 0, "exact": 0, "packed": 0, "dense": 0, "sink": 0}
        for layer in self.layers:
            if layer.is_initialized:
                layer.flush_pending()
        stats = self.engine.stats()
        g = self.engine.geometry
        sink = sum(layer.stored_bytes() for layer in self.layers)
        element = torch.empty((), dtype=g.dtype).element_size()
        tokens = sum(layer.length for layer in self.layers) * len(self.request_ids)
        dense_used = sum(self.engine.page_table(rid).dense_tokens(0) for rid in self.request_ids)
        dense = dense_used * g.num_layers * g.values_per_token * element  # tokens, not whole pages
        return {"stored": stats.packed_bytes + dense + sink, "exact": tokens * g.values_per_token * element,
                "packed": stats.packed_bytes, "dense": dense, "sink": sink}
