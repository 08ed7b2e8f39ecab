"""QVG: per-chunk k-means smoothing, progressive residual stages, low-bit group quantization.

Per chunk and head, S stages of k-means (C centroids, warm-started from the previous chunk)
each subtract the assigned centroid; the final residual is quantized per token in groups of B
channels with FP8 scales (and FP8 zeros when asymmetric). Centroids are stored in bf16 and the
residual is taken against the *stored* centroids, so decoding adds back exactly what was removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbackend import fastquant

from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.quant import SCALE_DTYPES, scale_dtype
from kvbackend.spec import Checked, one_of, ranged
from kvbackend.codecs.base import Codec, CodecState, FieldSpecs, from_pages, to_pages
from kvbackend.codecs.groups import (channel_group_fields, decode_channel_groups, decode_token_groups, encode_channel_groups,
                     encode_token_groups, token_group_fields)
from kvbackend.codecs.kmeans import greedy_kmeanspp_init, kmeans, kmeanspp_init, random_init

_INITS = {"kmeans++": kmeanspp_init, "greedy": greedy_kmeanspp_init, "random": random_init}
BATCHED_INITS = {"kmeans++": kmeanspp_init, "greedy": greedy_kmeanspp_init}  # seed U chunks in one batch (``repeat``)
from kvbackend.codecs.rtn import check_bits_group
from kvbackend.codecs.widths import MAX_GROUP, SPLIT_WIDTHS, WIDTHS, SplitWidths, check_split_widths

CENTROID_DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
MAX_STAGES = 16  # residual stages: each stores its assignments per token and its centroids per chunk
MAX_ITERS = 1000  # Lloyd steps per stage


@dataclass(frozen=True)
class QVGSpec(SplitWidths, Checked):
    name: str
    bits: int = one_of(2, WIDTHS)  # residual code width
    group: int = ranged(64, 1, MAX_GROUP)  # B: channels per residual scale (must divide head_dim)
    centroids: int = ranged(16, 1, 256)  # C per stage and head (at most 256: assignments are uint8)
    stages: int = ranged(1, 1, MAX_STAGES)  # S: progressive residual stages
    iters: int = ranged(4, 0, MAX_ITERS)  # Lloyd steps per stage (fewer when assignments stop changing)
    symmetric: bool = False  # ternary absmax codes, or asymmetric min/max with a zero
    scale: str = one_of("fp8", SCALE_DTYPES)  # storage dtype of residual scales and zeros
    seed: int = ranged(0, 0, 2**63 - 1)  # random initialisation of the first chunk's centroids
    init: str = one_of("kmeans++", _INITS)  # first chunk's seeding: "kmeans++", "greedy" (greedy k-means++: the best
    # of 2 + ln C candidates a step) or "random" points
    # 0: key residuals per token like values; N: per channel over N-token groups (KIVI-style; divides page_size)
    kchannel: int = ranged(0, 0, MAX_GROUP)
    clip: bool = False  # residual steps: MSE-optimal Gaussian step instead of min/max (asymmetric only)
    # with clip: the value residuals' clipped step in units of that Gaussian step (1: the step that minimises
    # their own squared error; wider ones clip fewer values, whose shrinkage an attention sum does not average out)
    vstep: float = ranged(1.0, 0.25, 8.0)
    vcluster: bool = True  # false: values without centroids (plain per-token groups; saves assignments and codebook)
    kbits: int = one_of(0, SPLIT_WIDTHS)  # key residual width when it differs from `bits` (0: same)
    vbits: int = one_of(0, SPLIT_WIDTHS)  # value residual width when it differs from `bits` (0: same)
    # storage of the centroids: "bf16", or "fp8" (e4m3 with one fp16 scale per stage and head: half the
    # codebook bytes; residuals are taken against the stored fp8 centroids, so nothing else changes;
    # the kernels apply the scale after their one-hot products)
    cdtype: str = one_of("bf16", CENTROID_DTYPES)


def chosen_rows(cents: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Each point's centroid, ``cents[r, assign[r, n]]`` for ``cents [R, C, D]`` and ``assign [R, N]`` (ids of a
    stage's assignment: every one below C) -> ``[R, N, D]``: the values of ``torch.gather`` over the expanded index,
    through one row selection of the flattened centroids (on one CPU core 0.5 ms against gather's 3.3 for a storage
    batch's 128 rows of 64 points)."""
    r, c, d = cents.shape
    flat = assign + torch.arange(r, device=assign.device).unsqueeze(1) * c
    return cents.reshape(r * c, d).index_select(0, flat.reshape(-1)).view(r, -1, d)


class QVGCodec(Codec):
    name: ClassVar[str] = "qvg"

    @property
    def kernel_encodes(self) -> bool:
        return not self.spec.clip and self.spec.vcluster and self.spec.cdtype == "bf16"

    @property
    def full_scale_fields(self) -> tuple[str, ...]:  # type: ignore[override]
        """fp8 centroids: each stage and head scaled so that its largest magnitude is fp8's 448."""
        return ("k_centroids", "v_centroids") if self.spec.cdtype == "fp8" else ()

    def widen(self, prefix: str) -> float:
        """The factor on ``prefix``'s clipped step (`QVGSpec.vstep` for the values; 1 for the keys)."""
        return self.spec.vstep if prefix == "v" else 1.0

    def _bits(self, prefix: str) -> int:
        return self.spec.key_bits if prefix == "k" else self.spec.value_bits

    def _clustered(self, prefix: str) -> bool:
        return prefix == "k" or self.spec.vcluster

    def validate(self, geometry: Geometry, page_size: int) -> None:
        s = self.spec
        check_bits_group(s, geometry.head_dim)
        if not 1 <= s.centroids <= 256:
            raise SpecError(f"{s.name}: centroids={s.centroids} must be in 1..256 (uint8 assignments)")
        if s.init not in _INITS:
            raise SpecError(f"{s.name}: init={s.init!r}; valid: {', '.join(_INITS)}")
        if s.stages < 1 or s.iters < 0:
            raise SpecError(f"{s.name}: stages must be >= 1 and iters >= 0")
        if s.kchannel and (s.kchannel < 0 or page_size % s.kchannel):
            raise SpecError(f"{s.name}: kchannel={s.kchannel} tokens must divide page_size={page_size}")
        check_split_widths(s)
        if 3 in (s.key_bits, s.value_bits) and (s.group % 8 or s.kchannel % 8):
            raise SpecError(f"{s.name}: 3-bit codes need group and kchannel to be multiples of 8")
        if s.vstep != 1.0 and not (s.clip and not s.symmetric):
            raise SpecError(f"{s.name}: vstep={s.vstep} widens the clipped value step: it needs clip=true (and "
                            "asymmetric codes)")

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        s = self.spec
        h, d = geometry.num_kv_heads, geometry.head_dim
        page: FieldSpecs = []
        book: FieldSpecs = []
        for prefix in ("k", "v"):
            if prefix == "k" and s.kchannel:
                page += channel_group_fields(prefix, page_size, h, d, self._bits(prefix), s.kchannel,
                                             scale_dtype(s.scale))
            else:
                page += token_group_fields(prefix, page_size, h, d, self._bits(prefix), s.group, s.symmetric,
                                           scale_dtype(s.scale))
            if self._clustered(prefix):
                page.append((f"{prefix}_assign", torch.uint8, (s.stages, page_size, h)))
                if s.cdtype == "fp8":
                    book.append((f"{prefix}_centroids", torch.float8_e4m3fn, (s.stages, h, s.centroids, d)))
                    book.append((f"{prefix}_centroid_scales", torch.float16, (s.stages, h)))
                else:
                    book.append((f"{prefix}_centroids", torch.bfloat16, (s.stages, h, s.centroids, d)))
        return page, book

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        self._encode_chunks(k, v, layout, pages, codebook, [state])

    batch_encodes = True  # `_encode_units`: many one-chunk encodes in one pass

    def _encode_units(self, k, v, layout: PageLayout, pages, codebooks, states=None) -> bool:
        kept = states is not None  # fresh chunks' states are nobody's: one shared scratch state, never written
        states = [CodecState()] * codebooks.shape[0] if states is None else list(states)
        if not self._units_encodable(states):
            return False
        self._encode_chunks(k, v, layout, pages, codebooks, states, kept)
        return True

    def _units_encodable(self, states) -> bool:
        """Whether chunks with these states encode in one pass (this codec's and the kernels' encoders ask): alike
        states, and no cold clustered tensor under random seeding (it draws a permutation per row: no shared
        stream)."""
        if not self._states_alike(states):
            return False
        return self.spec.init in BATCHED_INITS or not any(self._clustered(p) and p not in states[0].centroids for p in "kv")

    def _qsac(self, prefix: str, moment: torch.Tensor | None) -> bool:
        """Whether ``prefix``'s assignments are chosen by query sensitivity (QSAC: the reference alone does),
        instead of being k-means' own."""
        return False

    def _cluster_scale(self, prefix: str, moment: torch.Tensor | None) -> torch.Tensor | None:
        """Per k-means row (a head of a chunk) and channel, the factor the points are scaled by before k-means
        ([rows, D] float32: distances weigh channel d by its square), or None for plain Euclidean k-means."""
        return None

    @staticmethod
    def _states_alike(states) -> bool:
        """Whether chunks with these states encode in one pass: all warm-started for the same tensors or none,
        all with query statistics (and mean queries) or none."""
        first = states[0]
        return all(set(s.centroids) == set(first.centroids) and (s.query_moment is None) == (first.query_moment is None)
                   and (s.query_mean is None) == (first.query_mean is None) for s in states)

    @staticmethod
    def _stacked_moments(states, device) -> torch.Tensor | None:
        """The chunks' query moments as one float32 tensor [U, H, D, D] on ``device`` (None without statistics)."""
        if states[0].query_moment is None:
            return None
        return torch.stack([s.query_moment.to(device).float() for s in states])

    def _encode_chunks(self, k, v, layout: PageLayout, pages, codebook, states, kept: bool = True) -> None:
        """`_encode` of ``len(states)`` chunks of equal length at once (K/V ``[U*N, H, D]``, ``pages [U*n, bytes]``,
        ``codebook [U, bytes]`` for U > 1), chunk u from ``states[u]`` (`_states_alike`): each head of each chunk is
        its own k-means problem, warm-started from its own state's centroids, and every cold chunk draws the seeds
        a fresh encode of it alone draws (`kmeanspp_init`'s ``repeat``). ``kept=False``: the states are the
        caller's scratch (one-page chunks a storage backend encodes), left without centroids or iteration counts
        (a copy per chunk cost more than the encode's kernels on a GPU)."""
        s = self.spec
        units = len(states)
        generator = torch.Generator().manual_seed(s.seed)
        h = k.shape[1]
        n = k.shape[0] // units
        moments = self._stacked_moments(states, k.device)
        moment = None if moments is None else moments.flatten(0, 1)  # [U*H, D, D], as the k-means rows
        for prefix, x in (("k", k), ("v", v)):
            if not self._clustered(prefix):
                self._quantize_residual(x, layout, pages, prefix)
                continue
            residual = x.reshape(units, n, h, -1).transpose(1, 2).reshape(units * h, n, -1)  # [U*H, N, D]
            warm = None
            if prefix in states[0].centroids:
                warm = states[0].centroids[prefix] if units == 1 else torch.cat([st.centroids[prefix] for st in states], 1)
            scale = self._cluster_scale(prefix, moment)  # [U*H, D] or None: the space k-means measures in
            scale = None if scale is None else scale.to(residual.device, torch.float32).unsqueeze(1)
            stored, assigns = [], []
            for stage in range(s.stages):
                space = residual if scale is None else residual * scale
                if warm is not None:
                    init = warm[stage].to(residual.device) * (1.0 if scale is None else scale)
                elif units > 1:
                    init = BATCHED_INITS[s.init](space, s.centroids, generator, repeat=units)
                else:
                    init = _INITS[s.init](space, s.centroids, generator)
                result = kmeans(space, init.to(residual.device), s.iters)
                for st in states if kept else ():
                    st.iterations.append(result.iterations)
                centroids = result.centroids if scale is None else result.centroids / scale
                cents = self._store_centroids(centroids)  # as decoding will see them
                assign = self._assign(prefix, residual, cents, result.assign, moment)
                residual = residual - chosen_rows(cents, assign)
                stored.append(cents)
                assigns.append(assign.reshape(units, h, n).transpose(1, 2).reshape(units * n, h))
            every = torch.stack(stored)  # [S, U*H, C, D]
            for u, st in enumerate(states if kept else ()):
                st.centroids[prefix] = every if units == 1 else every[:, u * h : (u + 1) * h].clone()
            by_unit = every.reshape(s.stages, units, h, *stored[0].shape[1:]).transpose(0, 1)
            self._write_centroids(layout, codebook, prefix, by_unit[0] if codebook.dim() == 1 else by_unit)
            assign = torch.stack(assigns)  # [S, T, H]
            view = layout.page.view(pages, f"{prefix}_assign")  # [n, S, P, H]
            view.copy_(to_pages(assign.transpose(0, 1), layout.page_size).transpose(1, 2).to(torch.uint8))
            residual = residual.reshape(units, h, n, -1).transpose(1, 2).reshape(units * n, h, -1)
            self._quantize_residual(residual, layout, pages, prefix)

    def _store_centroids(self, cents: torch.Tensor) -> torch.Tensor:
        """Centroids [H, C, D] rounded as they are stored, in float32."""
        if self.spec.cdtype == "fp8":
            scale = self._centroid_scale(cents)
            return fastquant.fp8_to_float((cents / scale[:, None, None]).to(torch.float8_e4m3fn)) * scale[:, None, None]
        return cents.to(torch.bfloat16).float()

    @staticmethod
    def _centroid_scale(cents: torch.Tensor) -> torch.Tensor:
        """One fp16-representable scale per head (leading dims) mapping the centroids into fp8's range."""
        amax = cents.abs().flatten(-2).amax(-1)
        return (amax / FP8_MAX).clamp(min=2.0**-14).to(torch.float16).float()

    def _write_centroids(self, layout: PageLayout, codebook, prefix: str, cents: torch.Tensor) -> None:
        """Stored centroids [S, H, C, D] (float32, as `_store_centroids` gave them) into the codebook."""
        view = layout.codebook.view(codebook, f"{prefix}_centroids")
        if self.spec.cdtype == "fp8":
            # the scale of rounded centroids is the scale they were rounded with (their largest value
            # is 448 x scale: fp8 times an fp16 scale is exact in float32, and so is the division back)
            scale = self._centroid_scale(cents)
            layout.codebook.view(codebook, f"{prefix}_centroid_scales").copy_(scale.to(torch.float16))
            view.copy_((cents / scale[..., None, None]).to(torch.float8_e4m3fn))
        else:
            view.copy_(cents.to(torch.bfloat16))

    def warm_start(self, layout: PageLayout, codebook) -> dict[str, torch.Tensor]:
        """A chunk's stored centroids [S, H, C, D] as float32, per clustered tensor (``"k"``, ``"v"``)."""
        return {prefix: self._read_centroids(layout, codebook, prefix) for prefix in ("k", "v")
                if f"{prefix}_centroids" in layout.codebook}

    per_page_codebooks = True  # `_decode` takes a slot per page too (`Codec.decode_units`)

    def _read_centroids(self, layout: PageLayout, codebook, prefix: str) -> torch.Tensor:
        """The stored centroids [S, H, C, D] as float32 ([n, S, H, C, D] for a slot per page)."""
        cents = fastquant.fp8_to_float(layout.codebook.view(codebook, f"{prefix}_centroids"))  # (bf16: x.float())
        if self.spec.cdtype == "fp8":
            cents = cents * layout.codebook.view(codebook, f"{prefix}_centroid_scales").float()[..., None, None]
        return cents

    def _gather_centroids(self, layout: PageLayout, codebooks, prefix: str, page, stage: int, heads, ids) -> torch.Tensor:
        """Centroid rows ``[page, stage, heads, ids]`` of per-page slots ``codebooks [n, bytes]`` as float32: the
        stored bytes are gathered first, so only the rows used are converted (the values `_read_centroids` gives)."""
        raw = layout.codebook.view(codebooks, f"{prefix}_centroids")  # [n, S, H, C, D]
        if self.spec.cdtype == "fp8":
            rows = fastquant.fp8_to_float(raw.view(torch.uint8)[page, stage, heads, ids].view(torch.float8_e4m3fn))
            scale = layout.codebook.view(codebooks, f"{prefix}_centroid_scales")[page, stage, heads].float()
            return rows * scale[..., None]
        return raw.view(torch.int16)[page, stage, heads, ids].view(torch.bfloat16).float()

    def _assign(self, prefix: str, residual, cents, nearest, moment: torch.Tensor | None):
        """Centroid index per point of one stage (rows ``[U*H, N, D]``): the k-means (nearest) assignment;
        subclasses may choose otherwise with the rows' query moments ``[U*H, D, D]`` (QuantWM's QSAC)."""
        return nearest

    def _quantize_residual(self, x, layout: PageLayout, pages, prefix: str) -> None:
        s = self.spec
        if prefix == "k" and s.kchannel:
            encode_channel_groups(x, layout, pages, prefix, self._bits(prefix), s.kchannel, clip=s.clip)
        else:
            encode_token_groups(x, layout, pages, prefix, self._bits(prefix), s.group, s.symmetric,
                                clip=s.clip and not s.symmetric, widen=self.widen(prefix))

    def _dequantize_residual(self, layout: PageLayout, pages, prefix: str):
        s = self.spec
        if prefix == "k" and s.kchannel:
            return decode_channel_groups(layout, pages, prefix, self._bits(prefix), s.kchannel)
        return decode_token_groups(layout, pages, prefix, self._bits(prefix), s.group)

    def _decode(self, layout: PageLayout, pages, codebook):
        return self._decode_tensor(layout, pages, codebook, "k"), self._decode_tensor(layout, pages, codebook, "v")

    def _decode_tensor(self, layout: PageLayout, pages, codebook, prefix: str) -> torch.Tensor:
        """One tensor of `_decode` (``"k"`` or ``"v"``), [T, H, D] float32: the encoders that need the keys alone
        (the key outliers, the PSAC rows) skip the values."""
        s = self.spec
        x = self._dequantize_residual(layout, pages, prefix)  # [T, H, D]
        if not self._clustered(prefix):
            return x
        assign = from_pages(layout.page.view(pages, f"{prefix}_assign").transpose(1, 2)).long()  # [T, S, H]
        heads = torch.arange(x.shape[1], device=x.device)
        if codebook.dim() == 2:  # a slot per page: each token reads its page's centroids, gathered as stored
            page = torch.arange(x.shape[0], device=x.device) // layout.page_size
            for stage in reversed(range(s.stages)):
                fused = None
                if s.cdtype == "fp8":  # the fused CPU loop, where it serves: the same values
                    fused = fastquant.plus_fp8_rows(
                        x, layout.codebook.view(codebook, f"{prefix}_centroids").view(torch.uint8)[:, stage],
                        assign[:, stage], page, layout.codebook.view(codebook, f"{prefix}_centroid_scales")[:, stage])
                x = fused if fused is not None else x + self._gather_centroids(
                    layout, codebook, prefix, page[:, None], stage, heads[None, :], assign[:, stage])  # [T, H, D]
            return x
        cents = self._read_centroids(layout, codebook, prefix)  # [S, H, C, D]
        for stage in reversed(range(s.stages)):
            x = x + cents[stage][heads, assign[:, stage]]  # [T, H, D]
        return x
