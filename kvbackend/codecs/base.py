"""The codec interface: encode one chunk of K/V into packed pages plus a codebook slot, and back."""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from kvbackend import fastquant
from kvbackend.errors import InvalidKV
from kvbackend.geometry import Geometry
from kvbackend.layout import FieldSet, PageLayout
from kvbackend.levers import Levers
from kvbackend.saturation import refuse_saturated
from kvbackend.spec import format_spec
from kvbackend.step_state import stream_key

# A one-pass encode of U chunks with `Codec._encode_units`' contract: (codec, K, V, layout, pages, codebooks,
# states) -> whether it encoded them (False before writing or updating anything)
UnitEncoder = Callable[..., bool]

FieldSpecs = list[tuple[str, torch.dtype, tuple[int, ...]]]
# `Codec.encode_units` on the CPU encodes at most this many K values per pass: the k-means temporaries of larger
# batches fall out of the caches and cost more than the per-call overhead they save
CPU_UNIT_VALUES = 1 << 20
# key values `Codec.encode_units` encodes in one pass on a GPU (float32 K and V and the encoder's temporaries: a few
# GiB at most; 32 layers of a 2048-token chunk of Llama-8B geometry fit in one)
DEVICE_UNIT_VALUES = 1 << 26


@dataclass
class CodecState:
    """What persists between the chunks of one request and layer."""

    centroids: dict[str, torch.Tensor] = field(default_factory=dict)  # "k"/"v" -> [S, H, C, D] warm start
    iterations: list[int] = field(default_factory=list)  # k-means iterations run, per encode (diagnostics)
    # per KV head, mean q q^T of the queries attention saw up to the chunk being encoded [H, D, D]
    # (set by the caller; read by query-aware codecs such as quantwm; None = no statistics yet)
    query_moment: torch.Tensor | None = None
    # running sums behind query_moment in a paged cache: chunk index -> (sum of q q^T [H, D, D], count);
    # chunks not yet encoded keep their own part, so a chunk never sees queries of later tokens
    query_parts: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # per KV head, the mean query [H, D] over the same queries as query_moment (None: not known; `quantwm:heavy`)
    query_mean: torch.Tensor | None = None
    # the sums of q [H, D] behind query_mean, by chunk as query_parts (a chunk whose queries came without them
    # has none, and the mean is then not known)
    query_sums: dict[int, torch.Tensor] = field(default_factory=dict)

    def clone(self) -> "CodecState":
        moment = self.query_moment.clone() if self.query_moment is not None else None
        parts = {c: (s.clone(), n) for c, (s, n) in self.query_parts.items()}
        mean = self.query_mean.clone() if self.query_mean is not None else None
        return CodecState({k: t.clone() for k, t in self.centroids.items()}, list(self.iterations), moment, parts,
                          mean, {c: s.clone() for c, s in self.query_sums.items()})

    def add_queries(self, chunk: int, queries: torch.Tensor, kv_heads: int) -> None:
        """Add queries [T, Hq, D] of tokens of chunk ``chunk`` (GQA groups pooled per KV head)."""
        t, hq, d = queries.shape
        q = queries.float().transpose(0, 1).reshape(kv_heads, (hq // kv_heads) * t, d)
        self.add_moment(chunk, q.transpose(1, 2) @ q, q.shape[1], q.sum(1))

    def add_moment(self, chunk: int, moment: torch.Tensor, count: int, total_q: torch.Tensor | None = None) -> None:
        """Add a sum of q q^T [H, D, D] over ``count`` queries of chunk ``chunk`` (see `query_moments`), and their
        sum of q [H, D] where known (``total_q``)."""
        total, seen = self.query_parts.get(chunk, (None, 0))
        # kept as a copy: ``moment`` may be a view of a whole decode batch's moments, which must not stay alive
        self.query_parts[chunk] = (moment.clone() if total is None else total + moment, seen + count)
        if total_q is not None and (total is None or chunk in self.query_sums):
            summed = self.query_sums.get(chunk)
            self.query_sums[chunk] = total_q.float().clone() if summed is None else summed + total_q.float()
        else:  # some of this chunk's queries came without their sum: its mean (and every later one) is not known
            self.query_sums.pop(chunk, None)

    def close_chunk(self, chunk: int) -> list[int]:
        """Set query_moment (and query_mean) from the queries of chunks <= ``chunk`` and fold them into one part.

        Returns the chunks whose statistics were dropped: parts that hold NaN or Inf (queries appended unchecked,
        `CacheConfig.check_finite` off) are left out, the finite ones kept; where none is left (or their sum
        overflows) the state has no statistics and the chunk encodes as without queries."""
        done = [c for c in self.query_parts if c <= chunk]
        if not done:
            return []
        parts = {c: self.query_parts.pop(c) for c in done}
        sums = {c: self.query_sums.pop(c, None) for c in done}
        dropped: list[int] = []
        while done:
            total = sum(parts[c][0] for c in done)
            count = sum(parts[c][1] for c in done)
            known = all(sums[c] is not None for c in done)
            summed = sum(sums[c] for c in done) if known else None
            if all_finite_many(total, *([summed] if known else [])):
                break
            bad = [c for c in done if not all_finite_many(parts[c][0], *([sums[c]] if sums[c] is not None else []))]
            bad = bad or done  # finite parts whose sum overflows: none can be kept
            dropped += bad
            done = [c for c in done if c not in bad]
        if not done:
            self.query_moment = self.query_mean = None
            return dropped
        self.query_parts[chunk] = (total, count)
        self.query_moment = total / max(count, 1)
        if not known:
            self.query_mean = None
            return dropped
        self.query_sums[chunk] = summed
        self.query_mean = summed / max(count, 1)
        return dropped


def _owned(total: torch.Tensor | None, row: torch.Tensor) -> bool:
    """Whether a part ``total`` can take ``row`` in place: a tensor of the row's kind that views nothing else, needs
    no gradient and is not an inference tensor outside inference mode (parts a caller set may be any of these)."""
    return (total is not None and total.shape == row.shape and total.dtype == row.dtype and total.device == row.device
            and total._base is None and not total.requires_grad
            and not (total.is_inference() and not torch.is_inference_mode_enabled()))


def add_step_moments(states: Sequence[CodecState], chunks: Sequence[int], moments: torch.Tensor, count: int,
                     sums: torch.Tensor, rows: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
                     memo: dict | None = None) -> None:
    """`CodecState.add_moment` of row i of ``moments`` [B, H, D, D] and ``sums`` [B, H, D] (`query_moments` of one
    decode step) to chunk ``chunks[i]`` of ``states[i]``, for every row, with the same float32 sums: parts the states
    hold take their rows in place, all of them in one multi-tensor add (one state at a time, a step of 46 requests
    cost 450 tensor operations per layer, the step's largest host cost); a part the step opens, one a caller set (a
    view, an inference tensor), or a state named twice goes through `add_moment`, after the in-place adds. Nothing
    is booked before the adds succeed.

    ``rows``: ``moments`` and ``sums`` split into their rows, where the caller keeps them (`MomentBuffers`: a split
    per call is 2B tensor operations). ``memo``: a dict the caller keeps for these states (one per layer): a call
    whose every part went in place leaves its states, chunks and parts there (as weak references), and the next
    call that finds the same states naming the same chunks with the same part tensors, in the same inference mode,
    adds in place without checking each part again."""
    if not (len(states) == len(chunks) == moments.shape[0] == sums.shape[0]):
        raise ValueError(f"one chunk and one row of moments per state: {len(states)} states, {len(chunks)} chunks, "
                         f"{moments.shape[0]} and {sums.shape[0]} rows")
    if moments.dtype != torch.float32 or sums.dtype != torch.float32:
        raise ValueError(f"moments and sums are float32 (query_moments), got {moments.dtype} and {sums.dtype}")
    if rows is None:
        rows = moments.unbind(0), sums.unbind(0)
    row_moments, row_sums = rows
    if not len(row_moments) == len(row_sums) == len(states):
        raise ValueError(f"one row of moments and sums per state: {len(states)} states, {len(row_moments)} and "
                         f"{len(row_sums)} rows given")
    totals = [state.query_parts.get(chunk, (None, 0))[0] for state, chunk in zip(states, chunks)]
    summed = [state.query_sums.get(chunk) for state, chunk in zip(states, chunks)]
    inference = torch.is_inference_mode_enabled()
    last = memo.get("step") if memo is not None else None
    if last is not None and last.matches(states, chunks, totals, summed, inference):
        in_place, one_by_one = range(len(states)), []
    else:
        in_place, one_by_one, seen = [], [], set()
        for i, state in enumerate(states):
            if (id(state) in seen or not _owned(totals[i], row_moments[i])
                    or not (summed[i] is None or _owned(summed[i], row_sums[i]))):
                one_by_one.append(i)
            else:
                in_place.append(i)
            seen.add(id(state))
    # a chunk's sum of q grows only while all of its queries came with theirs (else the mean stays unknown)
    with_sums = [i for i in in_place if summed[i] is not None]
    if in_place:
        torch._foreach_add_([totals[i] for i in in_place], [row_moments[i] for i in in_place])
    if with_sums:
        torch._foreach_add_([summed[i] for i in with_sums], [row_sums[i] for i in with_sums])
    for i in in_place:
        state, chunk = states[i], chunks[i]
        state.query_parts[chunk] = (totals[i], state.query_parts[chunk][1] + count)
    for i in one_by_one:
        states[i].add_moment(chunks[i], row_moments[i], count, row_sums[i])
    if memo is not None:
        memo["step"] = None if one_by_one else _StepParts.of(states, chunks, totals, summed, inference)


def step_parts(states: Sequence[CodecState], chunks: Sequence[int], memo: dict | None, kv_heads: int, head_dim: int,
               device: torch.device) -> torch.Tensor | None:
    """The addresses of the parts a step's query statistics add to, where `add_step_moments`' last call with this
    ``memo`` took every part of these states and chunks in place: int64 ``[2, B]`` on ``device`` (row 0 each
    chunk's moment part, row 1 its sum part or 0), for a kernel that adds into them
    (`kvbackend.kernels.query_moments.step_query_moments`' ``parts``); then `book_step_moments`. None where that
    call did not (a chunk opened or changed, another state or inference mode) or a part is not a contiguous float32
    ``[H, D, D]`` (``[H, D]``) on ``device``: add through `add_step_moments`.

    The table is made once per partition and kept in the memo; each call checks that the parts still sit at its
    addresses with their shapes (a part's storage swapped or reshaped in place is caught, not written through a
    stale address)."""
    last = memo.get("step") if memo is not None else None
    if last is None:
        return None
    if device.type == "cuda" and device.index is None:  # ("cuda": the current device, as tensors name it)
        device = torch.device("cuda", torch.cuda.current_device())
    totals = [state.query_parts.get(chunk, (None, 0))[0] for state, chunk in zip(states, chunks)]
    summed = [state.query_sums.get(chunk) for state, chunk in zip(states, chunks)]
    if not last.matches(states, chunks, totals, summed, torch.is_inference_mode_enabled()):
        return None
    shape = (kv_heads, head_dim, head_dim)  # (each call: a part restrided, retyped or reshaped where it sits)
    if not (all(t.shape == shape and t.dtype is torch.float32 and t.is_contiguous() for t in totals)
            and all(s is None or (s.shape == shape[:2] and s.dtype is torch.float32 and s.is_contiguous())
                    for s in summed)):
        return None
    addresses = ([t.data_ptr() for t in totals], [0 if s is None else s.data_ptr() for s in summed],
                 stream_key(device))  # (the table's copy is queued on the stream that made it: another would not wait)
    if last.pointers is None or last.addresses != addresses:  # (the stream key names the device)
        def fits(part):
            return (part.device == device
                    and part.storage_offset() + part.numel() <= part.untyped_storage().nbytes() // 4)
        if not (all(fits(t) for t in totals) and all(s is None or fits(s) for s in summed)):
            return None
        table = torch.tensor(addresses[:2], dtype=torch.int64)
        # (from pinned memory, queued: a copy from pageable memory would make the host wait for the device)
        last.pointers = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
        last.addresses = addresses
    return last.pointers


def book_step_moments(states: Sequence[CodecState], chunks: Sequence[int], count: int) -> None:
    """Count ``count`` more queries in each chunk's parts, once a kernel added a step's statistics to them in place
    (`step_parts`), and mark the parts changed in place for autograd (as the multi-tensor add does: a graph that
    saved one raises on backward instead of using the new values)."""
    changed = []
    for state, chunk in zip(states, chunks):
        total, seen = state.query_parts[chunk]
        state.query_parts[chunk] = (total, seen + count)
        changed.append(total)
        summed = state.query_sums.get(chunk)
        if summed is not None:
            changed.append(summed)
    torch.autograd.graph.increment_version(changed)


@dataclass
class _StepParts:
    """The states, chunks and part tensors of a call of `add_step_moments` whose parts all went in place, held
    weakly (a freed part's id may come back on another tensor; its weak reference does not); with the parts'
    addresses on the device once `step_parts` made them."""

    states: list
    chunks: tuple
    totals: list
    summed: list
    inference: bool
    pointers: torch.Tensor | None = None
    addresses: tuple | None = None

    def __reduce__(self):
        """A copy or a pickle of a cache holds no memo (weak references are not pickled): its next step checks."""
        return _no_step, ()

    @staticmethod
    def of(states, chunks, totals, summed, inference) -> "_StepParts":
        return _StepParts([weakref.ref(s) for s in states], tuple(chunks), [weakref.ref(t) for t in totals],
                          [None if s is None else weakref.ref(s) for s in summed], inference)

    def matches(self, states, chunks, totals, summed, inference) -> bool:
        """Whether a call on these parts may add in place without `_owned`'s checks: the same states, chunks and
        part tensors (a dead reference matches nothing, not even a part gone missing), none of them needing a
        gradient since, in the same inference mode."""
        if self.inference != inference or len(self.states) != len(states) or self.chunks != tuple(chunks):
            return False
        return (all(ref() is state for ref, state in zip(self.states, states))
                and all(total is not None and ref() is total and not total.requires_grad
                        for ref, total in zip(self.totals, totals))
                and all((s is None) if ref is None else (s is not None and ref() is s and not s.requires_grad)
                        for ref, s in zip(self.summed, summed)))


def _no_step() -> None:
    return None


def query_moments(queries: torch.Tensor, kv_heads: int,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``queries`` [B, Hq, D] (one token each), the sums of q q^T and of q over its GQA group per KV
    head: ([B, H, D, D], [B, H, D]), each row what `CodecState.add_queries` adds for that token, in one batched
    product (into ``out``, contiguous float32 tensors of those shapes, where given)."""
    b, hq, d = queries.shape
    q = queries.float().reshape(b * kv_heads, hq // kv_heads, d)
    if out is None:
        return (q.transpose(1, 2) @ q).view(b, kv_heads, d, d), q.sum(1).view(b, kv_heads, d)
    moments, sums = out
    torch.bmm(q.transpose(1, 2), q, out=moments.view(b * kv_heads, d, d))
    torch.sum(q, 1, out=sums.view(b * kv_heads, d))
    return moments, sums


@dataclass
class EncodedChunk:
    """One encoded chunk of one layer: packed pages and the chunk's codebook slot."""

    layout: PageLayout  # how to read the bytes
    pages: torch.Tensor  # uint8 [num_pages, page_bytes]
    codebook: torch.Tensor  # uint8 [codebook_bytes] (empty when the codec has none)
    num_tokens: int  # tokens represented; the last page may be padded

    @property
    def nbytes(self) -> int:
        """Bytes actually stored for this chunk."""
        return self.pages.nbytes + self.codebook.nbytes

    @property
    def num_values(self) -> int:
        """K and V values represented."""
        g = self.layout.geometry
        return self.num_tokens * g.values_per_token

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / self.num_values


class Codec(ABC):
    """Base of every codec. Subclasses declare their fields and fill/read them."""

    name: ClassVar[str]

    uses_queries: ClassVar[bool] = False  # reads CodecState.query_moment (set it per chunk, causally)
    # True when every page's bytes depend on that page's tokens alone and there is no codebook: encoding
    # M whole pages in one call gives the bytes of M one-page encodes, so storage adapters batch every
    # layer of every page they move into one call (tests/test_codecs_page_local.py holds it to that)
    page_local: ClassVar[bool] = False
    # True when `_encode` takes K/V in their own float dtype (it converts what it needs itself), so `encode`
    # makes no float32 copy of the whole chunk first
    any_float_input: ClassVar[bool] = False

    @property
    def kernel_encodes(self) -> bool:
        """True when the GPU encode kernel produces exactly this codec's bytes (min/max steps, nearest
        centroids); options it does not implement send encoding to the torch reference."""
        return True

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.levers = Levers()  # sequence-level options; set by kvbackend.codecs.get
        self._layouts: dict[tuple[Geometry, int], PageLayout] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec_string})"

    @property
    def spec_string(self) -> str:
        text, levers = format_spec(self.spec), self.levers.suffix()
        if not levers:
            return text
        return f"{text}{',' if ':' in text else ':'}{levers}"

    # -- declared by subclasses -------------------------------------------------------------
    @abstractmethod
    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        """(page fields, codebook fields) as (name, dtype, per-page shape) triples."""

    @abstractmethod
    def _encode(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout, pages: torch.Tensor,
                codebook: torch.Tensor, state: CodecState) -> None:
        """Fill ``pages [n, page_bytes]`` and ``codebook`` from float32 K/V ``[n*P, H, D]``."""

    @abstractmethod
    def _decode(self, layout: PageLayout, pages: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 K/V ``[n*P, H, D]`` from ``pages [n, page_bytes]`` and the chunk's codebook."""

    # float fields scaled so that their largest value is their dtype's by design (`kvbackend.saturation`)
    full_scale_fields: tuple[str, ...] = ()

    def saturation_parts(self, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor) -> list[tuple]:
        """(name prefix, layout, pages, codebooks, full-scale fields) of each part whose float fields
        `kvbackend.saturation` reads: the codec's own layout by default."""
        return [("", layout, pages, codebooks, self.full_scale_fields)]

    def stored_max_abs(self, geometry: Geometry) -> tuple[float, float]:
        """(keys, values): a magnitude of values that this codec cannot store whatever the rest of the chunk holds
        (the fp8/fp16/bf16 codecs' values), refused at `KVCache.append` before anything is written; ``inf`` where
        what saturates depends on the chunk (a group's scale or zero, a residual), which `kvbackend.saturation`
        checks once the chunk is encoded."""
        return math.inf, math.inf

    def max_abs(self, geometry: Geometry) -> tuple[float, float]:
        """`stored_max_abs` of K/V as appended, through the levers' frames: a key before RoPE (or turned to its
        page's frame) is a rotation of channel pairs, at most sqrt(2) times the largest key channel; a
        Hadamard-rotated value at most sqrt(head_dim) times the largest value channel. `KVCache` refuses K/V
        beyond it (a bound that always holds, so it can refuse values that would have fitted)."""
        k, v = self.stored_max_abs(geometry)
        if self.levers.rope:
            k /= math.sqrt(2.0)
        if self.levers.vrot != "none":
            v /= math.sqrt(geometry.head_dim)
        return k, v

    def validate(self, geometry: Geometry, page_size: int) -> None:
        """Raise SpecError if the spec cannot serve this geometry (called once per layout)."""

    def warm_start(self, layout: PageLayout, codebook: torch.Tensor) -> dict[str, torch.Tensor]:
        """The `CodecState.centroids` entries a chunk's stored codebook slot gives the next chunk, for a
        request that continues a cached prefix (k-means codecs: their centroids); nothing by default."""
        return {}

    # -- shared machinery -------------------------------------------------------------------
    def layout(self, geometry: Geometry, page_size: int) -> PageLayout:
        key = (geometry, page_size)
        if key not in self._layouts:
            self.validate(geometry, page_size)
            page, codebook = self.fields(geometry, page_size)
            self._layouts[key] = PageLayout(self.spec_string, geometry, page_size, FieldSet(page), FieldSet(codebook))
        return self._layouts[key]

    def encode(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout, state: CodecState | None = None) -> EncodedChunk:
        """Encode one chunk of one layer, ``k`` and ``v`` of shape ``[N, H, D]``.

        The last page is padded by repeating the last token, so padding never widens a group's range.

        Raises:
            InvalidKV: wrong shape or dtype, K/V mismatch, or non-finite values.
        """
        check_kv(k, v, layout.geometry)
        _check_values(k, v)
        chunk = self._encode_checked(k, v, layout, state)
        refuse_saturated(self, layout, chunk.pages, chunk.codebook)
        return chunk

    def _encode_checked(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout,
                        state: CodecState | None) -> EncodedChunk:
        """`encode` of K/V already checked, before the saturation read (its callers read the fields)."""
        kf, vf, num_pages = self._padded(k, v, layout.page_size)
        pages = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=k.device)
        codebook = torch.zeros(layout.codebook_bytes, dtype=torch.uint8, device=k.device)
        self._encode(kf, vf, layout, pages, codebook, state if state is not None else CodecState())
        return EncodedChunk(layout, pages, codebook, k.shape[0])

    def _padded(self, k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K/V ``[..., N, H, D]`` as the codec takes them (float32 unless `any_float_input`), each chunk's last page
        padded by repeating its last token (so padding never widens a group's range), and the pages per chunk."""
        n = k.shape[-3]
        num_pages = -(-n // page_size)
        pad = num_pages * page_size - n
        kf, vf = (k, v) if self.any_float_input else (k.float(), v.float())
        if pad:
            tail = (*k.shape[:-3], pad, *k.shape[-2:])
            kf = torch.cat([kf, kf[..., -1:, :, :].expand(tail)], -3)
            vf = torch.cat([vf, vf[..., -1:, :, :].expand(tail)], -3)
        return kf, vf, num_pages

    # Whether `_encode_units` encodes many independent chunks in one pass (else `encode_units` loops).
    batch_encodes = False

    def _encode_units(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout, pages: torch.Tensor,
                      codebooks: torch.Tensor, states: Sequence[CodecState] | None = None) -> bool:
        """Fill ``pages [U*n, page_bytes]`` and ``codebooks [U, codebook_bytes]`` from float32 K/V ``[U*n*P, H,
        D]`` (U chunks of n whole pages, each encoded from a fresh state, or from ``states[u]``, which it updates
        as `encode` does), or return False where this spec cannot, before writing or updating anything."""
        return False

    def encode_units(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout,
                     states: Sequence[CodecState] | None = None,
                     encoder: UnitEncoder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode U independent chunks of one length, ``k`` and ``v`` of shape ``[U, N, H, D]``: one-page chunks,
        as a storage backend keeps them, or one chunk of each of several layers. Each chunk starts from a fresh
        `CodecState` (no warm start, no query statistics), or from ``states[u]`` (a request's layers: their warm
        starts and query statistics), which is updated as `encode` updates it. Returns ``(pages [U, n,
        page_bytes], codebooks [U, codebook_bytes])``, the bytes `encode` gives chunk by chunk. One pass where the
        codec can (`batch_encodes`, and states alike: all warm or all cold, all with query statistics or none; on
        the CPU in slices of at most `CPU_UNIT_VALUES` key values, on a device `DEVICE_UNIT_VALUES`), else a loop.
        ``encoder``: a faster one-pass encode with `_encode_units`' contract (the GPU kernels' for this codec,
        `kvbackend.kernels.unit_encoder.encode_units`), tried first wherever a pass is taken.

        Raises:
            InvalidKV: wrong shapes or dtypes, or non-finite values in any chunk (nothing is returned).
            ValueError: ``states`` not one per chunk.
        """
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] == 0:
            raise InvalidKV(f"encode_units needs k and v of shape [units, tokens, heads, head_dim], got "
                            f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}")
        units, n = k.shape[:2]
        if states is not None and len(states) != units:
            raise ValueError(f"encode_units: {len(states)} states for {units} chunks")
        check_kv(k.reshape(units * n, *k.shape[2:]), v.reshape(units * v.shape[1], *v.shape[2:]), layout.geometry)
        _check_values(k, v)
        budget = CPU_UNIT_VALUES if k.device.type == "cpu" else DEVICE_UNIT_VALUES
        step = max(1, budget // k[0].numel())
        parts = [self._encoded_units(k[at : at + step], v[at : at + step], layout,
                                     None if states is None else states[at : at + step], encoder)
                 for at in range(0, units, step)]
        pages, codebooks = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        refuse_saturated(self, layout, pages, codebooks)  # (the kernels' encode too)
        return pages, codebooks

    def _encoded_units(self, k: torch.Tensor, v: torch.Tensor, layout: PageLayout,
                       states: Sequence[CodecState] | None,
                       encoder: UnitEncoder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode_units` of checked K/V, in one pass where the codec can."""
        units = k.shape[0]
        if self.batch_encodes and (units > 1 or encoder is not None):
            kf, vf, num_pages = self._padded(k, v, layout.page_size)
            pages = torch.zeros(units * num_pages, layout.page_bytes, dtype=torch.uint8, device=k.device)
            codebooks = torch.zeros(units, layout.codebook_bytes, dtype=torch.uint8, device=k.device)
            flat = (units * num_pages * layout.page_size, *k.shape[2:])
            kf, vf = kf.reshape(flat), vf.reshape(flat)
            if encoder is not None and encoder(self, kf, vf, layout, pages, codebooks, states):
                return pages.view(units, num_pages, -1), codebooks
            if units > 1 and self._encode_units(kf, vf, layout, pages, codebooks, states):
                return pages.view(units, num_pages, -1), codebooks
        # chunk by chunk: checked once for all (`encode_units`), the fields read once for all after
        chunks = [self._encode_checked(k[u], v[u], layout, None if states is None else states[u])
                  for u in range(units)]
        return torch.stack([c.pages for c in chunks]), torch.stack([c.codebook for c in chunks])

    def decode(self, chunk: EncodedChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference reconstruction of a whole chunk, in the geometry's dtype."""
        k, v = self.decode_pages(chunk.layout, chunk.pages, chunk.codebook)
        return k[: chunk.num_tokens], v[: chunk.num_tokens]

    def decode_pages(self, layout: PageLayout, pages: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruct any subset of one chunk's pages: ``[len(pages) * P, H, D]`` each."""
        k, v = self._decode(layout, pages, codebook)
        dtype = layout.geometry.dtype
        return k.to(dtype), v.to(dtype)

    # Whether `_decode` also takes one codebook slot per page (``[len(pages), codebook_bytes]``) in one pass.
    per_page_codebooks = False

    def decode_units(self, layout: PageLayout, pages: torch.Tensor, codebooks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruct pages that each have their own codebook slot (``codebooks[i]`` for ``pages[i]``: one-page
        chunks, as a storage backend keeps them, or one page of each of several layers): ``[len(pages) * P, H, D]``
        each, the values `decode_pages` gives page by page. One pass where the codec can
        (`per_page_codebooks`), else a loop.

        Raises:
            ValueError: ``pages`` and ``codebooks`` disagree in count or size.
        """
        if pages.dim() != 2 or codebooks.dim() != 2 or pages.shape[0] != codebooks.shape[0] \
                or pages.shape[1] != layout.page_bytes or codebooks.shape[1] != layout.codebook_bytes:
            raise ValueError(f"decode_units needs pages [n, {layout.page_bytes}] and codebooks [n, "
                             f"{layout.codebook_bytes}], got {tuple(pages.shape)} and {tuple(codebooks.shape)}")
        if not layout.codebook_bytes or pages.shape[0] <= 1:  # no slot to tell apart
            return self.decode_pages(layout, pages, codebooks[0] if codebooks.shape[0] else codebooks.reshape(-1))
        if self.per_page_codebooks:
            k, v = self._decode(layout, pages, codebooks)
            dtype = layout.geometry.dtype
            return k.to(dtype), v.to(dtype)
        parts = [self.decode_pages(layout, pages[i : i + 1], codebooks[i]) for i in range(pages.shape[0])]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _check_values(k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise InvalidKV for chunks of no tokens or with non-finite values (shapes already checked). Values past what
    a float field stores are not refused here: the encode clamps them at the field's largest value, which
    `kvbackend.saturation` refuses once the chunk is encoded, on every encode path alike."""
    if k.shape[-3] == 0:
        raise InvalidKV("cannot encode an empty chunk (0 tokens)")
    if not all_finite_many(k, v):
        raise InvalidKV("K/V contain NaN or Inf; kvbackend refuses to encode non-finite values")


def all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` holds no NaN or Inf. Its largest and smallest values carry both (max and min
    propagate NaN), at a fraction of the cost of an elementwise `isfinite` on the CPU."""
    return all_finite_many(x)


def all_finite_many(*xs: torch.Tensor) -> bool:
    """`all_finite` of every tensor in ``xs``, with one device-to-host read for all of them (a decode step checks
    keys, values and queries in every layer: a read each stalls the host's launches three times). bf16 on the CPU
    goes through the fused loop; the rest through one `aminmax` each (NaN propagates, Inf shows at an end)."""
    rest = []
    for x in xs:
        if not x.numel():
            continue
        fused = fastquant.all_finite(x) if x.device.type == "cpu" else None
        if fused is False:
            return False
        if fused is None:
            rest.append(x)
    if not rest:
        return True
    dtype = rest[0].dtype if all(x.dtype == rest[0].dtype for x in rest) else torch.float32
    ends = torch.cat([torch.stack(torch.aminmax(x.reshape(-1))).to(rest[0].device, dtype) for x in rest])
    return bool(torch.isfinite(ends).all())


def check_kv(k: torch.Tensor, v: torch.Tensor, geometry: Geometry) -> None:
    """Raise InvalidKV unless ``k`` and ``v`` are matching float ``[N, H, D]`` tensors for ``geometry``."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise InvalidKV(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[1:] != (geometry.num_kv_heads, geometry.head_dim):
            raise InvalidKV(
                f"{name} must have shape [tokens, {geometry.num_kv_heads}, {geometry.head_dim}], got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidKV(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    if k.shape != v.shape:
        raise InvalidKV(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.device != v.device:
        raise InvalidKV(f"k and v are on different devices: {k.device} vs {v.device}")


def prepare_kv(k: torch.Tensor, v: torch.Tensor, queries: torch.Tensor | None, geometry: Geometry,
               device: torch.device, check_finite: bool, limits: tuple[float, float] | None = None,
               why: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K/V (and queries) ready to store: checked, detached from any autograd graph and in the cache's dtype.

    Raises:
        InvalidKV: wrong shapes, dtypes or device; with ``check_finite``, NaN or Inf in K/V after the cast
            to the cache's dtype (a finite float32 value beyond fp16's range counts) or in queries;
            with ``check_finite``, a key or value beyond ``limits`` (keys, values: the largest magnitude the cache
            stores and reads without saturating, `KVCache.kv_limits`; ``why`` names what sets them).
    """
    check_kv(k, v, geometry)
    if k.device != device:
        raise InvalidKV(f"k/v on {k.device}, cache on {device}")
    if queries is not None:
        g = geometry
        if (not isinstance(queries, torch.Tensor) or queries.dim() != 3 or queries.shape[0] != k.shape[0]
                or queries.shape[2] != g.head_dim or queries.shape[1] % g.num_kv_heads
                or not queries.dtype.is_floating_point or queries.device != device):
            raise InvalidKV(f"queries must be float [{k.shape[0]}, Hq, {g.head_dim}] on {device} with Hq a multiple "
                            f"of {g.num_kv_heads}, got {getattr(queries, 'shape', queries)!r}")
        queries = queries.detach()
    k, v = k.detach().to(geometry.dtype), v.detach().to(geometry.dtype)
    if check_finite and limits is not None and (math.isfinite(limits[0]) or math.isfinite(limits[1])):
        largest = largest_abs(k, v, *([] if queries is None else [queries]))  # one read for all (NaN propagates)
        if queries is not None and not math.isfinite(largest.pop()):
            raise InvalidKV("queries contain NaN or Inf; nothing was written")
        if not all(math.isfinite(x) for x in largest):
            raise InvalidKV(f"K/V contain NaN or Inf (in {geometry.dtype}); nothing was written")
        for name, big, limit in (("K", largest[0], limits[0]), ("V", largest[1], limits[1])):
            if big > limit:
                raise InvalidKV(f"{name} holds values up to {big:.6g} in magnitude, beyond the {limit:.6g} this cache "
                                f"stores and reads without saturating ({why or 'its codec'}); nothing was written")
        return k, v, queries
    # queries too only with ``check_finite``: the read waits for the device, once per layer of a decode step (the
    # step's largest stall on a GPU); unchecked, a chunk's statistics are checked once when it closes
    # (`CodecState.close_chunk`), where non-finite ones are dropped
    checked = [queries, k, v] if check_finite and queries is not None else [k, v] if check_finite else []
    if checked and not all_finite_many(*checked):  # one read for all; which one failed only on failure
        if queries is not None and not all_finite(queries):
            raise InvalidKV("queries contain NaN or Inf; nothing was written")
        raise InvalidKV(f"K/V contain NaN or Inf (in {geometry.dtype}); nothing was written")
    return k, v, queries


def largest_abs(*xs: torch.Tensor) -> list[float]:
    """The largest magnitude in each of ``xs`` (NaN where one holds a NaN, inf for an Inf; 0 for an empty one),
    with one device-to-host read for all: bf16 on the CPU through the fused loop, the rest through one `aminmax`
    each (NaN propagates, Inf shows at an end)."""
    out: list[float | None] = [0.0 if not x.numel() else fastquant.largest_abs(x) if x.device.type == "cpu" else None
                               for x in xs]
    rest = [i for i, found in enumerate(out) if found is None]
    if rest:
        ends = torch.stack([torch.stack(torch.aminmax(xs[i].reshape(-1))).float().abs().max() for i in rest])
        for i, found in zip(rest, ends.tolist()):  # (max() propagates NaN)
            out[i] = found
    return out  # type: ignore[return-value]


def to_pages(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[n*P, ...]`` -> ``[n, P, ...]``."""
    return x.reshape(-1, page_size, *x.shape[1:])


def from_pages(x: torch.Tensor) -> torch.Tensor:
    """``[n, P, ...]`` -> ``[n*P, ...]``."""
    return x.reshape(-1, *x.shape[2:])
