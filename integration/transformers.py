"""Hugging Face transformers integration: a `Cache` whose layers live in kvbackend pages.

    cache = KVBackendCache(model.config, codec="kivi:bits=2,group=32")
    model.generate(input_ids, past_key_values=cache)

Each batch row is one kvbackend request. Keys and values go into the request's dense active chunk;
completed chunks are encoded by the codec into packed pages and their dense pages are freed. The
cache holds nothing else: every forward call, each layer's attention reads its K/V from the paged
`KVCache` (`KVCache.read`: packed pages decoded by the torch reference, then the active chunk as
stored), and that reconstruction is dropped once attention has used it.

Levers are options of each layer's codec spec, served by the paged cache itself: ``sink=S`` (the
first S tokens kept at 16 bits in the first chunk's codebook slot; S <= page_size), ``prerope=true``
(keys encoded before RoPE, rotated again on read) and ``vrot=hadamard`` (values encoded after a
Hadamard rotation, rotated back on read). The ``sink``, ``pre_rope`` and ``v_rotation`` arguments
append them to every layer's spec that does not name them already.

A per-layer plan (the one ``kvbackend eval`` prints for ``auto:...``) runs as it is chosen:
``KVBackendCache.from_plan(model.config, plan)`` takes each layer's spec, levers included, so
nothing is calibrated again.

Query-aware codecs (``quantwm``) also need the queries attention used. ``cache.attach(model)``
installs an attention function that hands each layer's queries to the cache before attending; the
layer then appends its new tokens together with their queries (so a chunk is encoded with the
statistics of its own and earlier queries). Without it such a codec runs on cold statistics.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbackend import codecs
from kvbackend.backends import BACKENDS
from kvbackend.codecs.base import prepare_kv
from kvbackend.errors import CacheFull, InvalidKV, SpecError
from kvbackend.frames import LeverFrame
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.levers import Levers
from kvbackend.manager import KVCache
from kvbackend.rope import Rotary, rope_not_undoable, rotary_from_config
from kvbackend.depth import layer_specs as depth_layer_specs
from kvbackend.spec import RECOMMENDED_SPEC, split_spec


@dataclass(frozen=True)
class CacheOptions:
    """Options of a `KVBackendCache` shared by all its layers."""

    codec: str | tuple[str, ...] = RECOMMENDED_SPEC  # codec spec as given, or one spec per layer
    page_size: int = 64  # tokens per page
    chunk_pages: int = 32  # pages per chunk (2048 tokens by default)
    max_tokens: int = 4096  # tokens each row of the first call's batch is sure to hold; sizes the shared pools
    dense_tokens: int | None = None  # tokens per row the dense pool holds; None: max_tokens (any prompt at once)
    backend: str = "auto"  # the paged cache's backend: "auto" (Triton kernels on CUDA), "torch" or "triton"


def lever_options(levers: Levers) -> dict[str, str]:
    """The spec options that turn ``levers`` on (levers left at their defaults are omitted)."""
    options = {}
    if levers.sink:
        options["sink"] = str(levers.sink)
    if levers.prerope:
        options["prerope"] = "true"
    if levers.pagerope:
        options["pagerope"] = "true"
    if levers.vrot != "none":
        options["vrot"] = levers.vrot
    return options


def with_levers(spec: str, levers: Levers) -> str:
    """``spec`` with the lever options of ``levers`` appended, except those the spec names itself."""
    _, named = split_spec(spec)  # raises SpecError for a malformed spec
    extra = [f"{key}={value}" for key, value in lever_options(levers).items() if key not in named]
    if not extra:
        return spec
    text = spec.strip()
    joiner = ":" if ":" not in text else ("" if text.endswith((":", ",")) else ",")
    return f"{text}{joiner}{','.join(extra)}"


def layer_specs(codec: str | tuple[str, ...], layers: int, levers: Levers,
                layer_levers: Sequence[Levers] | None = None) -> tuple[list[str], list[codecs.Codec]]:
    """Every layer's codec spec with its levers, and the parsed codecs.

    ``levers`` fill in the lever options a spec does not name; ``layer_levers`` (one per layer) must
    agree with any lever option the layer's spec names.

    Raises:
        SpecError: a spec count other than ``layers``, a bad spec, a ``layer_levers`` entry that
            contradicts its spec, differing sinks, or the ``psac=`` lever.
    """
    specs = depth_layer_specs(codec, layers)  # a depth: spec expands to its layers' specs
    if len(specs) != layers:
        raise SpecError(f"a per-layer plan of {len(specs)} specs for a model of {layers} layers")
    if layer_levers is not None:
        per_layer = list(layer_levers)
        if len(per_layer) != layers:
            raise SpecError(f"layer_levers has {len(per_layer)} entries for a model of {layers} layers")
        specs = [with_levers(spec, lever) for spec, lever in zip(specs, per_layer)]
        parsed = [codecs.get(spec) for spec in specs]
        for i, (codec_i, lever) in enumerate(zip(parsed, per_layer)):
            if codec_i.levers != lever:
                raise SpecError(f"layer {i}: spec {specs[i]!r} names levers {codec_i.levers} but layer_levers "
                                f"gives {lever}")
    else:
        specs = [with_levers(spec, levers) for spec in specs]
        parsed = [codecs.get(spec) for spec in specs]
    if any(c.levers.psac for c in parsed):
        raise SpecError("the psac= lever is applied by `kvbackend eval` only; use quantwm:rank=R")
    sinks = sorted({c.levers.sink for c in parsed})
    if len(sinks) > 1:
        raise SpecError(f"every layer of one cache keeps the same sink; the plan asks for {sinks}")
    return specs, parsed


def layers_without_own_kv(config) -> list[tuple[int, str]]:
    """The layers of ``config`` (a text config) that hold no K/V of their own, with their type as
    transformers reads it: ``dummy`` (a layer reusing an earlier layer's K/V, or one without attention)
    and linear-attention, hybrid or indexed layers. Empty where transformers cannot say."""
    try:
        from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer, DynamicSlidingWindowLayer,
                                              get_layer_types_and_kwargs)

        types, _ = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    plain = (DynamicLayer, DynamicSlidingWindowLayer)
    return [(i, kind) for i, kind in enumerate(types)
            if DYNAMIC_LAYER_TYPE_MAPPING.get(kind) not in (None, *plain)]


def previous_attention(module, implementation: str | None):
    """The attention function ``module`` runs under ``implementation`` (the model's before `attach`): a
    registered one (``sdpa``, flash, flex), else the eager attention of the module's own modeling file,
    which knows the model's extras (gpt-oss sinks, Gemma 2 soft-capping); SDPA where neither exists."""
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation and implementation != "eager" and implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    if implementation == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager
    return sdpa_attention_forward


def previous_mask(implementation: str | None):
    """The mask function transformers uses for ``implementation`` (SDPA's where it has none of its own)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if implementation and implementation in ALL_MASK_ATTENTION_FUNCTIONS:
        return ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    return sdpa_mask


class KVBackendLayer(CacheLayerMixin):
    """One attention layer's cache, stored in the shared `KVCache` of its `KVBackendCache`.

    It holds no K/V of its own: `update` appends the new tokens to the paged cache and returns what
    `read` decodes from it for this forward call only.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "KVBackendCache", layer_idx: int, levers: Levers) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.levers = levers  # served by the paged cache (they are part of this layer's codec spec)
        self.length = 0  # tokens per row seen by this layer
        # This forward call's new tokens, waiting for their queries (attach()): (k [B, H, T, D], v).
        # Set in `update` and appended by `observe_queries` within the same forward call.
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # A one-token step whose attention the attached function runs on the pages (`attend_paged`):
        # `update` returned only the new token, nothing was decoded to dense K/V.
        self._paged_step = False
        # The attached attention function has run for this layer: the model's attention goes through
        # transformers' AttentionInterface (models that compute attention themselves never call it,
        # and must get every token's K/V from `update`).
        self.attention_seen = False

    @property
    def sink(self) -> int:
        return self.levers.sink

    @property
    def pre_rope(self) -> bool:
        return self.levers.prerope

    @property
    def page_rope(self) -> bool:
        return self.levers.pagerope

    @property
    def v_rotation(self) -> str:
        return self.levers.vrot

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.owner._ensure_engine(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``[B, H, T, D]`` new keys and values; return every token's K/V of this layer
        ``[B, H, length, D]`` (a temporary of this forward call)."""
        if key_states.dim() != 4 or value_states.shape != key_states.shape:
            raise InvalidKV(f"layer {self.layer_idx}: keys and values must be [batch, kv_heads, tokens, head_dim] "
                            f"tensors of one shape, got {tuple(key_states.shape)} and {tuple(value_states.shape)}; "
                            "nothing was written")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush_pending()  # queries never came (attention ran without the attached function)
        owner = self.owner
        if self.layer_idx == 0 and len({layer.length for layer in owner.layers}) > 1:
            raise RuntimeError("the layers hold different lengths: an earlier forward call failed after some layers "
                               "had stored its tokens, or the cache was built for a model with more layers than the "
                               "one calling it. Call cache.reset() and run the sequence again")
        if key_states.shape[0] != len(owner.request_ids):
            raise ValueError(f"layer {self.layer_idx}: a batch of {key_states.shape[0]} rows for a cache of "
                             f"{len(owner.request_ids)} rows")
        t = key_states.shape[2]
        if owner.query_aware and not owner.wants_queries and not owner.warned:
            owner.warned = True
            warnings.warn("this cache's codec reads the queries attention used (quantwm); call cache.attach(model) "
                          "before generating, or chunks are encoded without query statistics (lower quality)",
                          UserWarning, stacklevel=2)
        # A decode step of an attached cache whose pages the kernels read, on a model whose attention
        # calls the attached function: attention runs on the pages (`attend_paged`), so no dense K/V of
        # the sequence is ever made.
        # (another model calling with this cache, or this one after `set_attn_implementation`, attends to what
        # `update` returns: it must get every token, so the step is paged only inside a forward of an attached
        # model whose attention is still the attached function)
        paged = (t == 1 and owner.attached and owner.forwarding and self.attention_seen
                 and owner.engine.backends[self.layer_idx].name == "triton")
        # This call's tokens are attended as given (in every layer alike, whether or not a chunk completes
        # with them); the cache serves them from its pages in later calls.
        keys, values = (None, None) if paged else self.read()
        if t:
            self._check(key_states, value_states)  # raises before anything is stored or counted
            if owner.wants_queries or paged:
                self._pending = (key_states, value_states)  # appended once attention has run
            else:
                self._append(key_states, value_states, checked=True)
            self.length += t
        self._paged_step = paged
        if paged:
            return key_states, value_states
        return torch.cat([keys, key_states], dim=2), torch.cat([values, value_states], dim=2)

    def attend_paged(self, module, query: torch.Tensor, attention_mask, fallback, **kwargs) -> torch.Tensor:
        """Attention output ``[B, 1, Hq, D]`` of a one-token step that `update` left on the pages.

        As on the read path, the tokens stored before this call are attended as stored and the new
        token as given: the paged decode kernel attends to the stored tokens, the new token joins
        through the log-sum-exp, and only then is it stored (with its query). So a step whose token
        completes a chunk attends that chunk as the other layers do. A mask that hides any token
        (padding), dropout, soft-capping, attention sinks (``s_aux``) or a sliding window go through
        ``fallback`` (the attention the model ran before `attach`) on K/V read from the pages instead."""
        self._paged_step = False
        k_new, v_new = self._pending
        try:
            out = self._attend_stored_and_new(module, query, k_new, v_new, attention_mask, fallback, **kwargs)
        except BaseException:
            self._pending = None  # counted in update, never stored
            self.length -= k_new.shape[2]
            raise
        if self.owner.wants_queries:
            self.observe_queries(query)
        else:
            self.flush_pending(checked=True)  # `update` checked these K/V and their room in this call
        return out

    def _attend_stored_and_new(self, module, query, k_new, v_new, attention_mask, fallback, **kwargs):
        engine, rows = self.owner.engine, self.owner.request_ids
        plain = (kwargs.get("dropout", 0.0) == 0.0 and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
                 and kwargs.get("sliding_window") is None and query.shape[2] == 1)
        if plain and attention_mask is not None:
            # nothing hidden: a boolean mask (SDPA's) all True, an additive one (eager's) all zero
            plain = bool(attention_mask.all()) if attention_mask.dtype == torch.bool else bool((attention_mask == 0).all())
        if not plain:
            keys, values = self.read()
            return fallback(module, query, torch.cat([keys, k_new], dim=2), torch.cat([values, v_new], dim=2),
                            attention_mask, **kwargs)[0]
        b, hq, _, d = query.shape
        h = k_new.shape[1]
        scale = kwargs.get("scaling") or d ** -0.5
        # the new token's score and value per query head (query head i reads KV head i // group), broadcast
        s_new = (query[:, :, 0].float().reshape(b, h, hq // h, d) * k_new.float()).sum(-1).reshape(b, hq) * scale
        v1 = v_new.float().expand(b, h, hq // h, d).reshape(b, hq, d)
        if self.length == 1:  # nothing stored before this token
            return v1.to(query.dtype).unsqueeze(1)
        out, lse = engine.decode(engine.plan(rows, self.layer_idx), self.layer_idx, query[:, :, 0].contiguous(),
                                 scale=scale)
        m = torch.maximum(lse, s_new)
        w_old, w_new = (lse - m).exp(), (s_new - m).exp()
        merged = (out.float() * w_old[..., None] + v1 * w_new[..., None]) / (w_old + w_new)[..., None]
        return merged.to(query.dtype).unsqueeze(1)

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor,
               queries: torch.Tensor | None = None) -> None:
        """Raise before any row is written: K/V (and queries) of every row valid, dense room for every row."""
        engine, options = self.owner.engine, self.owner.options
        b, h, n, d = key_states.shape
        flat = lambda x: x.transpose(1, 2).reshape(b * n, x.shape[1], d)  # noqa: E731 - [B*T, H, D]
        limits = engine.kv_limits[self.layer_idx]
        prepare_kv(flat(key_states), flat(value_states), None if queries is None else flat(queries),
                   engine.geometry, engine.dense.data.device, engine.config.check_finite, limits[:2], limits[2])
        p = engine.config.page_size
        tables = [engine.page_table(rid) for rid in self.owner.request_ids]
        needed = sum(max(-(-(t.dense_tokens(self.layer_idx) + n) // p) - len(t.dense), 0) for t in tables)
        if needed > engine.dense.allocator.num_free:
            if self.length + n > options.max_tokens:
                hint = (f"the rows would hold {self.length + n} tokens, over max_tokens={options.max_tokens}: "
                        f"build the cache with a larger max_tokens")
            else:
                hint = (f"{n} new tokens per row do not fit the dense pool (dense_tokens={options.dense_tokens}); "
                        f"feed long prompts through KVBackendCache.prefill or raise dense_tokens")
            raise CacheFull("dense", needed, engine.dense.allocator.num_free, hint=hint)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor,
                queries: torch.Tensor | None = None, checked: bool = False) -> None:
        if not checked:  # every row first: no row is left ahead of another
            self._check(key_states, value_states, queries)
        engine, rows = self.owner.engine, self.owner.request_ids
        if key_states.shape[2] == 1 and len(rows) > 1:  # a decode step: one batched append for every row
            engine.append_step(rows, self.layer_idx, key_states[:, :, 0], value_states[:, :, 0],
                               queries=None if queries is None else queries[:, :, 0])
            return
        for row, rid in enumerate(rows):
            q = None if queries is None else queries[row].transpose(0, 1)
            engine.append(rid, self.layer_idx, key_states[row].transpose(0, 1), value_states[row].transpose(0, 1),
                          queries=q)

    def observe_queries(self, query: torch.Tensor) -> None:
        """Append the pending tokens with their queries ``[B, Hq, T, D]`` (post-RoPE, as attention saw
        them; the paged cache brings them into the keys' stored frame)."""
        if self._pending is None:
            return
        k_new, v_new = self._pending
        self._pending = None
        try:
            self._append(k_new, v_new, queries=query[:, :, -k_new.shape[2]:])
        except Exception:
            self.length -= k_new.shape[2]  # counted in update, never stored
            raise

    def flush_pending(self, checked: bool = False) -> None:
        """Append pending tokens without queries (attention never handed them over, or the codec reads
        none). ``checked``: `update` validated them and the room for them in this call."""
        if self._pending is None:
            return
        k_new, v_new = self._pending
        self._pending = None
        try:
            self._append(k_new, v_new, checked=checked)
        except Exception:
            self.length -= k_new.shape[2]
            raise

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V of every row ``[B, H, tokens, D]``, read from the paged cache now (packed
        pages decoded, levers undone, then the active chunk as stored; with the Triton backend in one
        `gather_dequant` launch for all rows). Nothing of it is kept."""
        engine, rows = self.owner.engine, self.owner.request_ids
        if engine.backends[self.layer_idx].name == "triton" and self.length_stored():
            k, v = engine.gather(engine.plan(rows, self.layer_idx), self.layer_idx)  # [B * T, H, D], rows in order
            shape = (len(rows), -1, *k.shape[1:])
            return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        keys, values = [], []
        for rid in self.owner.request_ids:
            k, v = engine.read(rid, self.layer_idx)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return torch.stack(keys), torch.stack(values)

    def length_stored(self) -> int:
        """Tokens per row the paged cache holds for this layer (every row holds the same)."""
        rows = self.owner.request_ids
        return self.owner.engine.page_table(rows[0]).lengths[self.layer_idx] if rows else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._pending = None
        self._paged_step = False
        self.length = 0
        self.is_initialized = False


class KVBackendCache(Cache):
    """A transformers `Cache` backed by kvbackend's paged, compressed storage."""

    def __init__(self, config, codec: str | Sequence[str] = RECOMMENDED_SPEC, *, page_size: int = 64, chunk_pages: int = 32,
                 sink: int = 0, pre_rope: bool = False, max_tokens: int = 4096, v_rotation: str = "none",
                 layer_levers: Sequence[Levers] | None = None, dense_tokens: int | None = None,
                 backend: str = "auto") -> None:
        """``sink`` (first tokens of every row kept at 16 bits; at most ``page_size``), ``pre_rope``
        (keys stored before RoPE, rotated again on read) and ``v_rotation`` ("hadamard": values stored
        rotated, rotated back on read) are appended to every layer's codec spec that does not name
        them, unless ``layer_levers`` (one `Levers` per layer) gives each layer its own.

        Memory: the packed pool holds ``max_tokens`` per row, compressed. The dense pool holds
        ``dense_tokens`` per row at the model's dtype (default ``max_tokens``, so a prompt of any
        length can be passed in one forward call: a chunk is packed only once every layer has it).
        Both are sized for the batch of the first forward call and shared by its rows: ``max_tokens``
        is what each row is sure to get, not a cap (rows that beam search drops leave their room to
        the others); a call the pools cannot hold raises `CacheFull` before any row is written.
        For the codec's saving, give ``dense_tokens`` of two chunks and feed long prompts through
        `prefill`, which runs them chunk by chunk.

        Attention: with `attach` and the Triton kernels (``backend`` "auto" on CUDA, or "triton"),
        one-token decode steps attend on the pages through the fused paged decode kernel; other
        calls (prompts, masks that hide tokens) read the pages into temporary K/V for the model's
        attention.

        Raises:
            SpecError: a bad spec or lever, a codec that is neither a spec string nor a list of them, a
                per-layer plan of the wrong length, differing sinks, a sink longer than a page, ``psac=``, or
                ``prerope=``/``pagerope=`` on a model whose RoPE one full-width rotation cannot undo.
            ValueError: a bad size or backend, or a model with layers that hold no K/V of their own
                (layers sharing an earlier layer's K/V, linear-attention layers).
        """
        if not isinstance(codec, str) and not (isinstance(codec, Sequence)
                                               and all(isinstance(spec, str) for spec in codec)):
            raise SpecError(f"codec must be a codec spec string (or one per layer), got {codec!r}")
        codec = codec if isinstance(codec, str) else tuple(codec)
        for name, value in (("page_size", page_size), ("chunk_pages", chunk_pages), ("max_tokens", max_tokens),
                            ("dense_tokens", 1 if dense_tokens is None else dense_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dense_tokens is not None and dense_tokens < page_size * chunk_pages:
            raise ValueError(f"dense_tokens={dense_tokens} is below one chunk ({page_size * chunk_pages} tokens): the "
                             f"dense pool must hold a row's active chunk until it is packed")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.options = CacheOptions(codec, page_size, chunk_pages, max_tokens, dense_tokens, backend)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = text_config.num_hidden_layers
        others = layers_without_own_kv(text_config)
        if others:
            raise ValueError(f"layers {', '.join(str(i) for i, _ in others)} of this model hold no K/V of their own "
                             f"({', '.join(sorted({kind for _, kind in others}))}: they share an earlier layer's K/V, "
                             "have no attention or keep a recurrent state); KVBackendCache serves models whose every "
                             "layer stores its own keys and values")
        levers = Levers(sink, pre_rope, v_rotation)  # raises SpecError for a bad lever value
        self.layer_specs, parsed = layer_specs(codec, layers, levers, layer_levers)
        self.model_config = text_config
        needs_rope = any(c.levers.rope for c in parsed)
        unfit = rope_not_undoable(text_config) if needs_rope else None
        if unfit:
            raise SpecError(f"prerope/pagerope undo the model's RoPE with one full-width rotation, and this model's "
                            f"RoPE is not one: {unfit}; use a spec without prerope= and pagerope=")
        self.rotary: Rotary | None = rotary_from_config(text_config) if needs_rope else None
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        shape = Geometry(layers, heads, head_dim, torch.float32)
        for i, c in enumerate(parsed):  # what the paged cache would refuse, refused now
            LeverFrame(c.levers, self.rotary, page_size).check(page_size, f"layer {i} ({self.layer_specs[i]})", head_dim)
            c.layout(shape, page_size)  # SpecError: a group or channel option that does not fit the pages
        self.engine: KVCache | None = None
        self.request_ids: list[int] = []
        self.wants_queries = False  # set by attach() when the codec reads query statistics
        self.attached = False  # attach() routes attention through this cache (paged decode steps)
        # inside a forward call of an attached model whose attention is still this cache's (set by the hooks
        # `attach` puts on the model): a decode step goes on the pages only then
        self.forwarding = False
        self._models: set[int] = set()  # ids of the models whose attention is attached to this cache
        self.query_aware = any(c.uses_queries for c in parsed)
        self.warned = False  # the missing attach() is reported once per cache
        self.warned_padding = False  # sinks of left-padded rows are reported once per cache
        self.rows_sized = 0  # the batch the pools were sized for (at the first forward call)
        super().__init__(layers=[KVBackendLayer(self, i, c.levers) for i, c in enumerate(parsed)])

    @classmethod
    def from_plan(cls, config, plan: Sequence[str], **options) -> "KVBackendCache":
        """A cache that runs a per-layer plan as chosen (e.g. ``kvbackend eval --json``'s ``plan`` for
        an ``auto:...`` codec): each layer's codec with its own ``sink``, ``prerope`` and ``vrot``
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
        return cls(config, tuple(plan), **options)

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **model_kwargs):
        """Run ``model`` over ``input_ids [B, T]`` chunk by chunk (pieces that end on this cache's chunk
        boundaries), so every chunk is packed before the next is read and the dense pool needs only
        one chunk per row (``dense_tokens``). Returns the model's output for the last piece
        (its logits cover that piece's tokens only). ``attention_mask`` covers every token of the
        cache, earlier ones included, as in one call; ``position_ids``, if given, the prompt's tokens.

        Raises:
            ValueError: ``input_ids`` is not a non-empty [B, T] tensor of token ids; inputs_embeds or cache_position.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError("input_ids must be a [batch, tokens] tensor with at least one token")
        for name in ("inputs_embeds", "cache_position"):
            if name in model_kwargs:
                raise ValueError(f"prefill takes input_ids (and position_ids) only, not {name}")
        positions = model_kwargs.pop("position_ids", None)
        if attention_mask is not None and attention_mask.dim() == 2 and self.get_seq_length() == 0:
            self._check_sinks(attention_mask)
        chunk = self.options.page_size * self.options.chunk_pages
        keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        start, total, output = 0, input_ids.shape[1], None
        while start < total:
            end = min(start + chunk - self.get_seq_length() % chunk, total)
            kwargs = dict(model_kwargs, use_cache=True, **{keyword: self})
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, : self.get_seq_length() + end - start]
            if positions is not None:
                kwargs["position_ids"] = positions[..., start:end]
            output = model(input_ids[:, start:end], **kwargs)
            start = end
        return output

    def attach(self, model) -> str:
        """Route ``model``'s attention through a function that hands queries to this cache first
        (needed by query-aware codecs such as ``quantwm``; harmless for others), then runs the
        attention the model ran before (its eager attention, SDPA, ...: sinks and soft-capping
        included) with that implementation's mask. Returns the name it registered; ``detach(model)``
        restores the previous implementation."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        attached = getattr(model, "_kvbackend_cache", None)
        if attached is not None and attached is not self:
            raise ValueError("another KVBackendCache is attached to this model (its attention hands queries to that "
                             "cache alone): detach it first")
        # kept on the model: a cache attached to two models restores each to its own
        previous = model.config._attn_implementation if attached is None else model._kvbackend_previous_attn

        def attention(module, query, key, value, attention_mask, **kwargs):
            inner = previous_attention(module, previous)
            index = getattr(module, "layer_idx", None)
            if not (isinstance(index, int) and 0 <= index < len(self.layers) and getattr(module, "is_causal", True)):
                # not one of the cached decoder layers (a vision tower's encoder attention): attention as before
                return inner(module, query, key, value, attention_mask, **kwargs)
            layer = self.layers[index]
            layer.attention_seen = True
            if (attention_mask is not None and attention_mask.dim() == 4 and kwargs.get("sliding_window") is None
                    and layer.sink and not self.warned_padding):  # (a window hides the first positions anyway)
                last = attention_mask[:, 0, -1]  # what the call's last query may attend: [B, K]
                # a boolean mask (SDPA's) or an additive one (eager's: the dtype's minimum where hidden)
                self._check_sinks(last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2)
            if layer._paged_step:
                return layer.attend_paged(module, query, attention_mask, inner, **kwargs), None
            layer.observe_queries(query)
            return inner(module, query, key, value, attention_mask, **kwargs)

        name = f"kvbackend_{id(self):x}_{id(model):x}"
        AttentionInterface.register(name, attention)
        # and the previous implementation's mask under the same name: without one, transformers builds no
        # mask at all (no padding mask, and a multi-token call after cached tokens would be causal from the
        # wrong corner)
        AttentionMaskInterface.register(name, previous_mask(previous))
        model.set_attn_implementation(name)
        model._kvbackend_cache = self
        model._kvbackend_previous_attn = previous
        for handle in getattr(model, "_kvbackend_hooks", ()):  # attached again: one pair of hooks
            handle.remove()

        def entered(module, args):
            self.forwarding = getattr(model.config, "_attn_implementation", None) == name

        def left(module, args, output):
            self.forwarding = False

        model._kvbackend_hooks = (model.register_forward_pre_hook(entered),
                                  model.register_forward_hook(left, always_call=True))
        self._models.add(id(model))
        self.wants_queries = any(codecs.get(spec).uses_queries for spec in self.layer_specs)
        self.attached = True
        for layer in self.layers:  # decode steps go on the pages once this model's attention is seen to call it
            layer.attention_seen = False
        return name

    def detach(self, model) -> None:
        """Restore the attention ``model`` had before `attach` (pending tokens are stored first). A cache
        attached to another model too stays attached to that one (its queries and paged steps go on)."""
        if getattr(model, "_kvbackend_cache", None) is not self:
            raise ValueError("this KVBackendCache is not attached to this model")
        self._flush()
        self._models.discard(id(model))
        if not self._models:
            self.wants_queries = False
            self.attached = False
        model.set_attn_implementation(getattr(model, "_kvbackend_previous_attn", None) or "sdpa")
        for handle in getattr(model, "_kvbackend_hooks", ()):
            handle.remove()
        self.forwarding = False
        del model._kvbackend_cache
        del model._kvbackend_previous_attn
        model.__dict__.pop("_kvbackend_hooks", None)

    def _flush(self) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.flush_pending()

    def _check_sinks(self, visible: torch.Tensor) -> None:
        """Warn once where a row's first positions are padding (``visible`` [B, K], True where a token may be
        attended): ``sink=S`` keeps each stored row's first S positions exact, so there it keeps padding."""
        sink = self.layers[0].sink
        if sink and not self.warned_padding and not bool(visible[:, :sink].bool().all()):
            self.warned_padding = True
            warnings.warn(f"sink={sink} keeps each row's first {sink} positions at 16 bits; in a left-padded batch "
                          "those are padding, and the row's first real tokens are compressed like the rest (lower "
                          "quality for the padded rows). Batch prompts of equal length, or pad on the right, to keep "
                          "the sinks", UserWarning, stacklevel=3)

    def _ensure_engine(self, key_states: torch.Tensor) -> None:
        if self.engine is not None:
            return
        opts = self.options
        batch, heads, _, head_dim = key_states.shape
        pages_per_row = -(-opts.max_tokens // opts.page_size) + 1
        dense_per_row = pages_per_row if opts.dense_tokens is None else -(-opts.dense_tokens // opts.page_size) + 1
        geometry = Geometry(self.model_config.num_hidden_layers, heads, head_dim, key_states.dtype)
        specs = self.layer_specs
        which = {"codec": specs[0]} if len(set(specs)) == 1 else {"layer_codecs": tuple(specs)}
        config = CacheConfig(**which, page_size=opts.page_size, chunk_pages=opts.chunk_pages,
                             dense_pages=batch * dense_per_row, packed_pages=batch * pages_per_row,
                             device=str(key_states.device), backend=opts.backend)
        self.engine = KVCache(geometry, config, rotary=self.rotary)
        self.request_ids = [self.engine.add_request()[0] for _ in range(batch)]
        self.rows_sized = batch

    def __deepcopy__(self, memo: dict) -> "KVBackendCache":
        """An independent copy holding the same tokens (transformers' way to reuse a prompt's cache for
        several continuations), attached to no model: a model's attention hands queries and paged decode
        steps to the cache that `attach` registered, never to a copy, so the copy reads every token itself.
        Call ``attach`` on it (after detaching the original) for query statistics or paged steps."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            setattr(clone, key, copy.deepcopy(value, memo))
        clone.attached = clone.wants_queries = clone.forwarding = False
        clone._models = set()
        for layer in clone.layers:
            layer.attention_seen = False
            layer._paged_step = False
        return clone

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not (isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers)):  # (transformers: an IndexError)
            raise ValueError(f"this cache holds {len(self.layers)} layers and layer {layer_idx} called it: a cache is "
                             "built for one model's config (num_hidden_layers); build one for this model")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        """Forget every token: the rows' requests are freed and the next forward call starts afresh."""
        if self.engine is not None:
            for rid in self.request_ids:
                self.engine.free(rid)
        self.engine, self.request_ids = None, []
        super().reset()

    # -- batch reshuffles (beam search and friends) ---------------------------------------------
    def _reselect(self, rows: list[int]) -> None:
        """Make batch row i a copy of old row ``rows[i]``: packed pages are shared, active chunks copied."""
        if self.engine is None:
            return
        if len(rows) > self.rows_sized:  # the packed pool holds compressed chunks for rows_sized rows only
            raise ValueError(f"this cache's pools were sized for a batch of {self.rows_sized} rows at its first "
                             f"forward call; a batch of {len(rows)} needs a cache built (or reset) at that batch "
                             "(generate expands beams and return sequences before its first call)")
        self._flush()
        old, engine = self.request_ids, self.engine
        first = {}  # old row -> the new row that takes its request as it is; later copies fork it
        for i, r in enumerate(rows):
            first.setdefault(r, i)
        copies = [r for i, r in enumerate(rows) if first[r] != i]
        dropped = [old[r] for r in range(len(old)) if r not in first]
        # Every row holds as many dense pages (same tokens, chunks packed together), and a dropped row's
        # pages come back before any copy is made: checked whole, so nothing changes when it fails.
        pages = max((len(engine.page_table(rid).dense) for rid in old), default=0)
        free = engine.dense.allocator.num_free + pages * len(dropped)
        if pages * len(copies) > free:
            raise CacheFull("dense", pages * len(copies), free,
                            hint=f"{len(copies)} copies of rows' active chunks for a batch of {len(rows)}; build "
                                 f"the cache with a larger dense_tokens (or max_tokens) for this batch")
        for rid in dropped:
            engine.free(rid)
        self.request_ids = [old[r] if first[r] == i else engine.fork(old[r]) for i, r in enumerate(rows)]

    def _row_numbers(self, indices) -> list[int]:
        """``indices`` as row numbers in ``0..rows-1``, read as torch indexes a batch: a 1-D tensor (or
        sequence) of integers, negative ones counting from the end, or a boolean mask over the rows.

        Raises:
            ValueError: no rows, a tensor that is not 1-D, floats, or a mask of another length.
            IndexError: a row number outside the batch.
        """
        rows = len(self.request_ids)
        picked = torch.as_tensor(indices).detach().cpu()
        if picked.dim() != 1:
            raise ValueError(f"row indices must be a 1-D tensor, got shape {tuple(picked.shape)}")
        if picked.dtype == torch.bool:
            if picked.numel() != rows:
                raise ValueError(f"a boolean row mask of {picked.numel()} entries for a cache of {rows} rows")
            picked = picked.nonzero().flatten()
        elif picked.is_floating_point() or picked.is_complex():
            raise ValueError(f"row indices must be integers or a boolean mask, got {picked.dtype}")
        numbers = [int(i) for i in picked.tolist()]
        if not numbers:
            raise ValueError("the selection keeps no row; a cache holds at least one row (reset() it instead)")
        outside = [i for i in numbers if not -rows <= i < rows]
        if outside:
            raise IndexError(f"row indices {outside} are outside a cache of {rows} rows")
        return [i % rows for i in numbers]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.engine is not None:
            self._reselect(self._row_numbers(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.engine is not None:
            self._reselect(self._row_numbers(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive integer (each row kept that many times), got {repeats!r}")
        self._reselect([row for row in range(len(self.request_ids)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a KVBackendCache cannot drop tokens (packed chunks are immutable); "
                         "assisted or speculative decoding that rolls back the cache is not supported")

    def kv_bytes(self) -> dict[str, int]:
        """Bytes held, measured from the paged cache: ``stored`` = ``packed`` (packed pages and codebook
        slots in use, sink fields included) + ``dense`` (the tokens held in dense pages: active chunks
        and chunks waiting for packed room, at the model's dtype); ``exact`` = what a `DynamicCache`
        holds for the same tokens. ``dense_pages``: the dense pages in use, whole (a page is the
        dense pool's unit of allocation, so ``dense <= dense_pages``)."""
        if self.engine is None:
            return {"stored": 0, "exact": 0, "packed": 0, "dense": 0, "dense_pages": 0}
        self._flush()
        stats = self.engine.stats()
        g = self.engine.geometry
        element = torch.empty((), dtype=g.dtype).element_size()
        per_token = g.values_per_token * element  # one layer's K and V of one token
        exact = sum(layer.length for layer in self.layers) * len(self.request_ids) * per_token
        dense_tokens = sum(self.engine.page_table(rid).dense_tokens(layer)
                           for rid in self.request_ids for layer in range(g.num_layers))
        dense = dense_tokens * per_token
        return {"stored": stats.packed_bytes + dense, "exact": exact, "packed": stats.packed_bytes,
                "dense": dense, "dense_pages": stats.dense_bytes}
