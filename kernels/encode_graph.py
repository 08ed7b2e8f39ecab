"""Warm chunk encodes replayed from CUDA graphs.

A warm one-pass encode (`kvbackend.kernels.unit_encoder.encode_units`: k-means from the last chunk's centroids,
the encode kernels, QuantWM's outliers and PSAC rows) launches 300-400 small kernels, and on the H200 the host
takes 2-4x longer to launch them than the device takes to run them (`perf/NOTES.md`, session 29). A chunk of the
same layers, shape, codec and layout comes back every `chunk_tokens` tokens with the same kinds of state, so
`GraphedEncoder` captures the pass once and replays it:

- the first warm pass of a key runs eagerly (it compiles and loads every kernel, which a capture must not do);
- the second is captured into a CUDA graph over static buffers (K, V, each chunk's warm centroids and query
  moment in; pages, codebooks and the new centroids out), then replayed; later ones copy their inputs in, replay
  and copy the outputs out, so no output ever aliases graph memory;
- the static pages and codebooks are zeroed inside the graph before the encode writes them: no byte of an earlier
  chunk can survive into a later one, whatever the encode writes;
- cold passes (no centroids yet), CPU tensors and passes inside another capture are the eager encoder's.

Inside a capture nothing may read the device, so two steps differ from an eager pass (`kvbackend.psac`): the PSAC
basis comes from a short subspace iteration on the Ritz matrix instead of eigh (at least 99.99% of the exact
subspace's query energy), and a moment whose factorization fails keeps unit directions instead of the host's
LAPACK fallback. k-means runs every step on CUDA either way. The bytes therefore match an eager pass except the
PSAC basis and the rows made from it.

The graphs of one `GraphedEncoder` share one memory pool, which stays reserved while the encoder lives: about the
peak of one eager pass of its largest key (`reserved_bytes`).
"""

from __future__ import annotations

import gc
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvbackend.codecs.base import CodecState
from kvbackend.layout import PageLayout

from kvbackend.kernels import unit_encoder

UnitEncoder = Callable[..., bool]


@dataclass
class _Captured:
    """One captured pass and its static buffers."""

    graph: torch.cuda.CUDAGraph
    k: torch.Tensor
    v: torch.Tensor
    outs: list[torch.Tensor]  # pages and codebooks, of each part for a mixed pass
    centroids_in: list[dict[str, torch.Tensor]]
    moments_in: list[torch.Tensor | None]
    means_in: list[torch.Tensor | None]  # the chunks' mean queries (`quantwm:heavy`)
    centroids_out: list[dict[str, torch.Tensor]]
    iterations: list[list[int]]  # what the pass appends to each state's `iterations`


@dataclass
class GraphedEncoder:
    """A `Codec.encode_units` encoder (the ``encoder=`` contract: fill ``pages`` and ``codebooks`` and update
    ``states``, or return False before writing anything) that replays warm passes from CUDA graphs; `mixed` does
    the same for `kvbackend.kernels.unit_encoder.encode_mixed` (a ``depth:`` spec's layers in one pass).

    ``encoder``: the eager one-pass encoder (None: `kvbackend.kernels.unit_encoder.encode_units`, looked up at each
    call). ``max_graphs``: keys (codecs, layouts, shapes, dtypes, device, state kinds) captured at most; passes of
    further keys run eagerly."""

    encoder: UnitEncoder | None = None
    max_graphs: int = 16
    reserved_bytes: int = 0  # what the captures added to the device's reserved memory
    replays: int = 0
    _graphs: dict = field(default_factory=dict, repr=False)
    _seen: set = field(default_factory=set, repr=False)
    _failed: set = field(default_factory=set, repr=False)
    _pool: object = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, codec, k: torch.Tensor, v: torch.Tensor, layout: PageLayout, pages: torch.Tensor,
                 codebooks: torch.Tensor, states: Sequence[CodecState] | None = None) -> bool:
        eager = self.encoder or unit_encoder.encode_units
        key = self._key(("units", codec.spec_string, layout.fingerprint), k, v, [pages, codebooks], states)
        if key is None or not unit_encoder.supports(codec, layout, states):
            return eager(codec, k, v, layout, pages, codebooks, states)
        return self._run(key, lambda sk, sv, outs, static: eager(codec, sk, sv, layout, *outs, static),
                         lambda: eager(codec, k, v, layout, pages, codebooks, states), k, v, [pages, codebooks],
                         states)

    def mixed(self, parts: Sequence[unit_encoder.Part], k: torch.Tensor, v: torch.Tensor,
              states: Sequence[CodecState]) -> bool:
        """`unit_encoder.encode_mixed` (same contract), warm passes of a key seen before replayed from a graph."""
        outs = [t for part in parts for t in (part.pages, part.codebooks)]
        names = ("mixed",) + tuple((part.codec.spec_string, part.layout.fingerprint, tuple(part.index))
                                   for part in parts)
        key = self._key(names, k, v, outs, states)
        eager = lambda: unit_encoder.encode_mixed(parts, k, v, states)  # noqa: E731
        consecutive = all(part.index == list(range(part.index[0], part.index[0] + len(part.index))) for part in parts)
        if key is None or not consecutive:  # other orders index the units by a tensor from host data: eager
            return eager()

        def capture(sk, sv, souts, static):
            static_parts = [unit_encoder.Part(part.codec, part.layout, souts[2 * i], souts[2 * i + 1], part.index)
                            for i, part in enumerate(parts)]
            return unit_encoder.encode_mixed(static_parts, sk, sv, static)

        return self._run(key, capture, eager, k, v, outs, states)

    def _run(self, key, capture, eager, k, v, outs, states) -> bool:
        with self._lock:  # one capture or replay at a time: the static buffers are shared
            captured = self._graphs.get(key)
            if captured is None:
                if key not in self._seen or key in self._failed or len(self._graphs) >= self.max_graphs:
                    self._seen.add(key)
                    return eager()
                captured = self._capture(key, capture, k, v, outs, states)
                if captured is None:
                    return eager()
            self._replay(captured, k, v, outs, states)
            return True

    @staticmethod
    def _key(names: tuple, k, v, outs, states) -> tuple | None:
        """What a captured pass is specific to, or None where a pass is never captured."""
        if states is None or not k.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        if not states[0].centroids:  # cold chunks: k-means++ seeds from the host's generator
            return None
        kinds = set()
        for st in states:
            moment, mean = st.query_moment, st.query_mean
            if any(t is not None and not t.is_cuda for t in (moment, mean)) or \
                    not all(t.is_cuda for t in st.centroids.values()):
                return None
            kinds.add((tuple((p, tuple(t.shape), t.dtype, t.device) for p, t in sorted(st.centroids.items())),
                       None if moment is None else (tuple(moment.shape), moment.dtype),
                       None if mean is None else (tuple(mean.shape), mean.dtype)))
        if len(kinds) != 1:
            return None
        return (names, tuple(k.shape), k.dtype, tuple(v.shape), v.dtype, tuple(tuple(t.shape) for t in outs),
                k.device, len(states), kinds.pop())

    def _capture(self, key, capture, k, v, outs, states) -> _Captured | None:
        static = [CodecState({p: t.clone() for p, t in st.centroids.items()}, [],
                             None if st.query_moment is None else st.query_moment.clone(),
                             query_mean=None if st.query_mean is None else st.query_mean.clone()) for st in states]
        centroids_in = [dict(st.centroids) for st in static]
        moments_in = [st.query_moment for st in static]
        means_in = [st.query_mean for st in static]
        sk, sv = k.clone(), v.clone()
        souts = [torch.empty_like(t) for t in outs]
        torch.cuda.synchronize(k.device)
        # `torch.cuda.graph` collects garbage and empties the allocator's cache before it captures: do both first,
        # so that what it gives back is not counted against the capture (`reserved_bytes` read negative otherwise;
        # the collection too, since a cycle it frees holds cached blocks). Once per captured key.
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(k.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: another thread's CUDA work (a tier's copies) neither breaks nor joins the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                for t in souts:  # nothing of an earlier chunk survives in bytes the encode leaves alone
                    t.zero_()
                ok = capture(sk, sv, souts, static)
        except Exception as exc:  # an operation that cannot be captured: this key runs eagerly from now on
            self._failed.add(key)
            warnings.warn(f"kvbackend: a warm chunk encode could not be captured in a CUDA graph ({exc}); "
                          "it runs eagerly", RuntimeWarning, stacklevel=4)
            return None
        if not ok:
            self._failed.add(key)
            return None
        self._pool = graph.pool() if self._pool is None else self._pool
        self.reserved_bytes += torch.cuda.memory_reserved(k.device) - before
        captured = _Captured(graph, sk, sv, souts, centroids_in, moments_in, means_in,
                             [dict(st.centroids) for st in static], [list(st.iterations) for st in static])
        self._graphs[key] = captured
        return captured

    def _replay(self, c: _Captured, k, v, outs, states) -> None:
        c.k.copy_(k)
        c.v.copy_(v)
        for st, cents, moment, mean in zip(states, c.centroids_in, c.moments_in, c.means_in):
            for prefix, buffer in cents.items():
                buffer.copy_(st.centroids[prefix])
            if moment is not None:
                moment.copy_(st.query_moment)
            if mean is not None:
                mean.copy_(st.query_mean)
        c.graph.replay()
        self.replays += 1
        for out, static in zip(outs, c.outs):
            out.copy_(static)
        for st, cents, steps in zip(states, c.centroids_out, c.iterations):
            for prefix, out in cents.items():
                st.centroids[prefix] = out.clone()
            st.iterations.extend(steps)
