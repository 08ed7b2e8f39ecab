"""QuantWM: QVG with query-sensitivity-aware centroid choice (QSAC) and principal-subspace attention
compensation (PSAC) of the keys.

Query statistics come from ``CodecState.query_moment`` (per KV head, M = mean q q^T over the queries
of its group that attention saw up to this chunk's last token; set by the caller). Without them the
codec is QVG with an empty PSAC (cold start: uniform channel weights, no correction).

- QSAC (keys; per-token residual groups only, since with ``kchannel`` a key's step depends on its
  token group): channel weights w = diag(M) (mean 1 per head). The top ``candidates`` centroids by
  weighted distance are tried and the one minimising sum_g (sum_{c in g} w_c) * R_g^2, with R_g the
  range of the residual in channel group g (the quantization step grows with it), is kept.
- PSAC (keys): the top ``rank`` eigenvectors U_r of M are stored per chunk (bf16, codebook); each
  token's key error E = K - K^ is projected, C = E U_r, and stored INT8 with one fp16 scale per
  (token, head). A row is kept only if it lowers the query-weighted error e^T M e; dropped rows store
  scale 0. Decoding adds C U_r^T. Values are coded as in QVG.
- Sparse PSAC (``keep=F`` < 1): each page holds rows for only n = ceil(F * page_size) tokens per head,
  the n whose row lowers e^T M e the most, with a uint8 token index per row (the page layout is fixed
  in size, so the budget is a fraction of the page, not a per-chunk choice). At rank 8 and head_dim
  64 a dense row costs 1.25 bpv; keep=0.25 costs 0.34.
- Sparse key outliers (``outliers=N``): per page and head, the N key entries whose error after the
  quantizer is largest, weighted by the query channel weights diag(M) when the chunk has them, store
  that error as fp16 with an int16 position in the page (4 bytes each: N=16 on 64-token pages of
  head_dim 64 costs 0.0625 bpv). With clipped steps (``clip=true``) these are the entries the clip
  cut, so the pair acts as a dense-and-sparse quantizer. PSAC rows then fit what is left. The gather
  kernel and the plain decode kernel add them to their key tiles; the folded decode kernel adds them as
  a score term (q at each outlier's channel times its value), or to keys it rebuilds for pre-RoPE
  rotation.
- Whole keys (``whole=W``): per page and head, W keys store everything the other fields leave of them, as
  INT8 with one fp16 scale and a uint8 token index (head_dim + 3 bytes each): the `heavy` keys first (the few
  tokens attention gathers on), then the largest query-weighted errors left. They are written after the
  outliers (which take a clipped key's largest errors, so the rows' steps stay fine) and before the PSAC rows
  (which then fit the rows' rounding along the query directions). Decoding adds them with the PSAC correction
  (`key_fix`). The Triton decode and gather kernels add them (`lever_scheme`); the CUDA kernels decline such
  layouts (the Triton ones serve them), and the encode kernels leave them to this reference encoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbackend.errors import SpecError
from kvbackend.geometry import Geometry
from kvbackend.layout import PageLayout
from kvbackend.psac import principal_directions
from kvbackend.quant import round_to
from kvbackend.rope import pair_mean
from kvbackend.spec import ranged
from kvbackend.codecs.base import CodecState, FieldSpecs, from_pages, to_pages
from kvbackend.codecs.qvg import QVGCodec, QVGSpec


@dataclass(frozen=True)
class QuantWMSpec(QVGSpec):
    candidates: int = ranged(4, 1, 256)  # QSAC: centroids tried per key, by query-weighted distance
    # PSAC rank r, at most head_dim (0 = off; the `psac=` lever is the post-hoc, sequence-level variant)
    rank: int = ranged(8, 0, 1024)
    # fraction of a page's tokens that get a PSAC row (1 = every token, no index)
    keep: float = ranged(1.0, 0.0, 1.0, open_lo=True)
    # sparse key outliers: per page and head, the key entries with the largest query-weighted error get
    # their error stored exactly (fp16 value, int16 position in the page): 4 bytes each (0 = off)
    outliers: int = ranged(0, 0, 4096)
    # keys' k-means under the chunk's query channel weights w (diag of its query second moment, mean 1): distances
    # weigh channel d by w_d ** kmetric (0 = plain Euclidean; 1 = the query-weighted error of the logits). Needs
    # query statistics; the stored bytes keep their layout (centroids are stored unweighted)
    kmetric: float = ranged(0.0, 0.0, 1.0)
    # per chunk and KV head, the `heavy` keys with the largest logit under the chunk's mean query (the tokens
    # attention gathers on beyond the sinks: a few take most of its mass in some layers) take their page's outlier
    # slots and PSAC rows before any other key. Needs the mean query (`CodecState.query_mean`); no byte changes
    # layout (0 = off)
    heavy: int = ranged(0, 0, 1 << 20)
    # a heavy key's logit must also stand this many standard deviations above the mean of its chunk and head's
    # logits (0 = the `heavy` largest, whatever they are)
    heavyz: float = ranged(0.0, 0.0, 1e3)
    # per page and head, this many keys stored whole: what the quantizer and the outliers leave of them, as INT8
    # with one fp16 scale and a uint8 token index (head_dim + 3 bytes each); the `heavy` keys first, then the
    # largest query-weighted errors left (0 = off)
    whole: int = ranged(0, 0, 256)

    def psac_rows(self, page_size: int) -> int:
        """PSAC rows per page and head."""
        return page_size if self.keep >= 1 else max(1, math.ceil(self.keep * page_size))

    @property
    def sparse(self) -> bool:
        return self.keep < 1


def channel_weights(moment: torch.Tensor) -> torch.Tensor:
    """diag(M) per head, scaled to mean 1: [H, D]."""
    w = torch.diagonal(moment, dim1=-2, dim2=-1).clamp_min(0)
    return w / w.mean(-1, keepdim=True).clamp_min(1e-12)


def qsac_assign(x: torch.Tensor, cents: torch.Tensor, weights: torch.Tensor, candidates: int, group: int) -> torch.Tensor:
    """QSAC choice per point: x [H, T, D], cents [H, C, D], weights [H, D] -> index [H, T]."""
    h, t, d = x.shape
    m = min(candidates, cents.shape[1])
    dist = ((x.unsqueeze(2) - cents.unsqueeze(1)) ** 2 * weights[:, None, None, :]).sum(-1)  # [H, T, C]
    cand = dist.topk(m, dim=-1, largest=False).indices  # [H, T, M]
    chosen = torch.gather(cents.unsqueeze(1).expand(h, t, -1, d), 2, cand.unsqueeze(-1).expand(-1, -1, -1, d))
    residual = (x.unsqueeze(2) - chosen).reshape(h, t, m, d // group, group)
    ranges = residual.amax(-1) - residual.amin(-1)  # [H, T, M, G]
    group_w = weights.reshape(h, 1, 1, d // group, group).sum(-1)  # [H, 1, 1, G]
    score = (group_w * ranges**2).sum(-1)  # [H, T, M]
    return torch.gather(cand, 2, score.argmin(-1, keepdim=True)).squeeze(-1)


def top_positions(score: torch.Tensor, n: int, segment: int) -> torch.Tensor:
    """``score.topk(n, dim=-1).indices`` (largest first) found through the ``n`` segments of ``segment`` entries with
    the largest maxima: every one of the n largest entries lies in one of them, so the result is the same (up to
    the order of equal scores), and the full-width top-k, a sort-like pass over every entry, runs on n * segment."""
    width = score.shape[-1]
    if width % segment or width // segment <= n:
        return score.topk(n, dim=-1).indices
    seg = score.unflatten(-1, (width // segment, segment))  # [..., S, segment]
    best = seg.amax(-1).topk(n, dim=-1).indices  # [..., n]
    cand = torch.gather(seg, -2, best.unsqueeze(-1).expand(*best.shape, segment)).flatten(-2)  # [..., n * segment]
    pick = cand.topk(n, dim=-1).indices
    return torch.gather(best, -1, pick // segment) * segment + pick % segment


def trailing_copies(last: torch.Tensor) -> torch.Tensor:
    """How many rows of each unit's last page ``last [U, P, H, D]`` repeat the row before them at its end (the
    trailing run of rows equal to the last one, less its first), int64 [U]. On a device, one comparison of every
    row (no read back to the host); on the CPU only the units whose last two rows are equal compare the rest."""
    def run(x):
        same = (x == x[:, -1:]).flatten(2).all(2).flip(1).cumprod(1)  # [U, P]: the trailing run, from the end
        return same.sum(1) - 1
    if last.device.type != "cpu" or last.shape[1] < 2:
        return run(last)
    maybe = (last[:, -2] == last[:, -1]).flatten(1).all(1).nonzero().flatten()
    out = torch.zeros(last.shape[0], dtype=torch.int64)
    if maybe.numel():
        out[maybe] = run(last[maybe])
    return out


def qsac_score(x: torch.Tensor, cents: torch.Tensor, assign: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
    """QSAC's objective of given assignments, per point [H, T] (for tests and diagnostics)."""
    h, t, d = x.shape
    chosen = torch.gather(cents, 1, assign.unsqueeze(-1).expand(-1, -1, d))
    r = (x - chosen).reshape(h, t, d // group, group)
    return (weights.reshape(h, 1, d // group, group).sum(-1) * (r.amax(-1) - r.amin(-1)) ** 2).sum(-1)


# what a heavy key's outlier score and PSAC gain are scaled by (`heavy`): a power of two, so their order among
# themselves is exact, far above other keys' scores, and inside float32 for key errors below 2^41
HEAVY_RANK = 2.0**40


def psac_products(error: torch.Tensor, basis: tuple[torch.Tensor, torch.Tensor], units: int) -> torch.Tensor:
    """What `QuantWMCodec._encode_psac` takes as ``both``: the keys' error [pages, H, P, D] of ``units`` chunks times
    each chunk's ``[U, MU]`` (`QuantWMCodec.psac_basis`), as [U, H, T, 2r]."""
    count, h, p, d = error.shape
    both = torch.cat([basis[0].float(), basis[1]], -1)  # [U, H, D, 2r]
    # [U, pages of a chunk, H, P, D] x [U, 1, H, D, 2r]: batched over pages and heads, no transpose of the error
    both = error.view(units, count // units, h, p, d) @ both.unsqueeze(1)
    return both.transpose(1, 2).reshape(units, h, (count // units) * p, -1)  # [U, H, T, 2r]


def _by_head(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys ``[N*P, H, D]`` as ``[N, H, P*D]``: each page and head flat, position ``t * D + d`` (as stored)."""
    _, h, d = x.shape
    return to_pages(x, page_size).permute(0, 2, 1, 3).reshape(-1, h, page_size * d)


class QuantWMCodec(QVGCodec):
    name: ClassVar[str] = "quantwm"
    uses_queries: ClassVar[bool] = True

    @property
    def kernel_encodes(self) -> bool:
        return False  # QSAC and PSAC run in the reference encoder

    def validate(self, geometry: Geometry, page_size: int) -> None:
        super().validate(geometry, page_size)
        s = self.spec
        if s.candidates < 1 or not 0 <= s.rank <= geometry.head_dim:
            raise SpecError(f"quantwm: candidates={s.candidates} must be >= 1 and rank={s.rank} in 0..head_dim")
        if not 0 < s.keep <= 1:
            raise SpecError(f"quantwm: keep={s.keep} must be a fraction in (0, 1]")
        if s.sparse and page_size > 256:
            raise SpecError(f"quantwm: keep < 1 stores uint8 token indices, so page_size={page_size} must be <= 256")
        if s.heavy and not (s.outliers or (s.rank and s.sparse) or s.whole):
            raise SpecError(f"quantwm: heavy={s.heavy} gives heavy keys the outlier slots, PSAC rows or whole rows "
                            "first; it needs outliers > 0, rank > 0 with keep < 1, or whole > 0")
        if s.whole and (s.whole > page_size or page_size > 256):
            raise SpecError(f"quantwm: whole={s.whole} stores uint8 token indices: it must be at most page_size "
                            f"({page_size}), which must be at most 256")
        if s.outliers and (s.outliers > page_size * geometry.head_dim or page_size * geometry.head_dim > 1 << 15):
            raise SpecError(f"quantwm: outliers={s.outliers} must be at most page_size * head_dim "
                            f"({page_size * geometry.head_dim}), which must be at most 32768 (int16 positions)")

    def fields(self, geometry: Geometry, page_size: int) -> tuple[FieldSpecs, FieldSpecs]:
        page, book = super().fields(geometry, page_size)
        r, h, d = self.spec.rank, geometry.num_kv_heads, geometry.head_dim
        if r:
            n = self.spec.psac_rows(page_size)
            page += [("k_psac", torch.int8, (n, h, r)), ("k_psac_scale", torch.float16, (n, h))]
            if self.spec.sparse:
                page += [("k_psac_token", torch.uint8, (n, h))]
            book += [("k_psac_basis", torch.bfloat16, (h, d, r))]
        if self.spec.outliers:
            n = self.spec.outliers
            page += [("k_out_index", torch.int16, (n, h)), ("k_out_value", torch.float16, (n, h))]
        if self.spec.whole:
            n = self.spec.whole
            page += [("k_whole", torch.int8, (n, h, d)), ("k_whole_scale", torch.float16, (n, h)),
                     ("k_whole_token", torch.uint8, (n, h))]
        return page, book

    def _qsac(self, prefix: str, moment: torch.Tensor | None) -> bool:
        s = self.spec  # QSAC: keys with query statistics choose among the nearest candidates by query sensitivity
        return prefix == "k" and moment is not None and s.candidates >= 2 and not s.kchannel

    def _weighted(self, prefix: str, moment: torch.Tensor | None) -> bool:
        """Whether ``prefix``'s k-means measures distances under the query channel weights (`kmetric`)."""
        return prefix == "k" and moment is not None and self.spec.kmetric > 0

    def _cluster_scale(self, prefix: str, moment: torch.Tensor | None) -> torch.Tensor | None:
        if not self._weighted(prefix, moment):
            return None
        w = channel_weights(moment)
        if self.levers.rope:  # keys in a RoPE-free frame: both channels of a RoPE pair weigh the pair's mean
            w = pair_mean(w)
        return w.clamp_min(1e-4) ** (self.spec.kmetric / 2)

    def _assign(self, prefix: str, residual, cents, nearest, moment: torch.Tensor | None):
        if not self._qsac(prefix, moment):
            return nearest
        return qsac_assign(residual, cents, channel_weights(moment), self.spec.candidates, self.spec.group)

    def _encode(self, k, v, layout: PageLayout, pages, codebook, state: CodecState) -> None:
        super()._encode(k, v, layout, pages, codebook, state)
        self._encode_keys(k, layout, pages, codebook, [state])

    def _encode_units(self, k, v, layout: PageLayout, pages, codebooks, states=None) -> bool:
        """Chunks from fresh states have no query statistics: no QSAC, and PSAC rows stay empty (as in `_encode`
        without them); outliers are chosen per page as there."""
        if not super()._encode_units(k, v, layout, pages, codebooks, states):
            return False
        self._encode_keys(k, layout, pages, codebooks,
                          [CodecState()] * codebooks.shape[0] if states is None else list(states))
        return True

    def _encode_keys(self, k, layout: PageLayout, pages, codebook, states) -> None:
        """The key outliers and PSAC rows of ``len(states)`` chunks encoded by QVG (``codebook`` [bytes] for one
        chunk, [U, bytes] for U), each with its own chunk's query statistics."""
        moments = self._stacked_moments(states, k.device)  # [U, H, D, D] or None
        units = len(states)
        heavy = self.heavy_rows(k, self._stacked_means(states, k.device), units)
        per_page = codebook if codebook.dim() == 1 else codebook.repeat_interleave(pages.shape[0] // units, 0)
        if self.spec.whole:  # one error, carried from field to field as the kernels' encoder carries it
            self._encode_key_error(k, layout, pages, codebook, per_page, moments, units, heavy)
            return
        if self.spec.outliers:
            self._encode_outliers(k, layout, pages, per_page, moments, units, heavy)
        if self.spec.rank and moments is not None:
            self._encode_psac(k, layout, pages, codebook, moments, heavy=heavy)

    def _encode_key_error(self, k, layout: PageLayout, pages, codebook, per_page, moments: torch.Tensor | None,
                          units: int, heavy: torch.Tensor | None) -> None:
        """The key outliers, whole rows and PSAC rows from one error, what the quantizer leaves of the keys as
        [pages, H, P, D] (the layout the encode kernel returns it in), each field's share taken out of it before the
        next is chosen: the outliers (a clipped key's largest errors, so the rows' steps stay fine), then the whole
        rows, then the PSAC rows (their rounding along the query directions)."""
        p = layout.page_size
        approx = self._decode_tensor(layout, pages, per_page, "k")  # QVG's keys: no values decoded
        error = to_pages(k - approx, p).permute(0, 2, 1, 3).contiguous()  # [N, H, P, D]
        self.key_fields(layout, pages, codebook, k, error, moments, units, heavy)

    def key_fields(self, layout: PageLayout, pages, codebook, k, error: torch.Tensor, moments: torch.Tensor | None,
                   units: int, heavy: torch.Tensor | None, basis=None) -> None:
        """The key outliers, whole rows (`whole`) and PSAC rows of ``units`` chunks from what the codes leave of their
        keys, ``error`` [pages, H, P, D] (updated in place as each field takes its share). ``basis``:
        `psac_basis`, where the caller already has it."""
        count, h, p, d = error.shape
        if self.spec.outliers:
            flat = error.view(count, h, p * d)
            index, value = self.write_outliers(layout, pages, flat, *self.outlier_inputs(k, p, moments, units),
                                               heavy=heavy)
            flat.scatter_add_(2, index, -value.float())  # what is left once the outliers are added back
        if self.spec.whole:
            self.write_whole(layout, pages, error, k, moments, units, heavy)
        if self.spec.rank and moments is not None:
            basis = self.psac_basis(moments) if basis is None else basis
            self._encode_psac(k, layout, pages, codebook, moments, basis=basis, both=psac_products(error, basis, units),
                              heavy=heavy)

    @staticmethod
    def _stacked_means(states, device) -> torch.Tensor | None:
        """The chunks' mean queries as one float32 tensor [U, H, D] on ``device`` (None where a chunk has none)."""
        if any(st.query_mean is None for st in states):
            return None
        return torch.stack([st.query_mean.to(device).float() for st in states])

    def heavy_rows(self, k, means: torch.Tensor | None, units: int) -> torch.Tensor | None:
        """Which rows of ``k`` [U*n, H, D] (``units`` chunks) are heavy keys (`heavy`): per chunk and head, the
        ``heavy`` largest logits under the chunk's mean query ``means`` [U, H, D], as bool [U*n, H]; None when off
        or without means. A row equal to the next one (the copies standing in for sink tokens, the padding of a
        partial last page) is never chosen: the run's last row is. With `heavyz`, only those whose logit is that many
        standard deviations above the mean of the chunk and head's logits."""
        if not self.spec.heavy or means is None:
            return None
        n, h, d = k.shape[0] // units, k.shape[1], k.shape[2]
        x = k.float().reshape(units, n, h, d)
        logit = torch.einsum("unhd,uhd->unh", x, means.float())
        copy = torch.zeros(units, n, h, dtype=torch.bool, device=k.device)
        copy[:, :-1] = (x[:, :-1] == x[:, 1:]).all(-1)
        kept = ~copy
        if self.spec.heavyz:  # only logits far above the chunk's own (a chunk need not hold any heavy key)
            weight = kept.float()
            count = weight.sum(1, keepdim=True).clamp_min(1)
            mean = (logit * weight).sum(1, keepdim=True) / count
            std = (((logit - mean) ** 2 * weight).sum(1, keepdim=True) / count).sqrt()
            kept = kept & (logit > mean + self.spec.heavyz * std)
        top = logit.masked_fill(copy, float("-inf")).topk(min(self.spec.heavy, n), dim=1).indices  # [U, N, H]
        rows = torch.zeros(units, n, h, dtype=torch.bool, device=k.device).scatter_(1, top, True) & kept
        return rows.view(units * n, h)

    def outlier_inputs(self, k, page_size: int, moments: torch.Tensor | None, units: int):
        """What the outlier choice weighs by: (channel weights [U, H, D] float32, ones without query statistics;
        the trailing rows of each chunk's last page that repeat the row before them [U] int64). `Codec.encode`
        pads a partial last page with copies of the last token: they share its errors, so only the first of a
        trailing run of identical rows may take outlier slots."""
        p, (_, h, d) = page_size, k.shape
        n = k.shape[0] // units
        if moments is None:
            weights = torch.ones(units, h, d, device=k.device)
        else:
            weights = channel_weights(moments)
        return weights, trailing_copies(k.reshape(units, n, h, d)[:, -p:])

    def _encode_outliers(self, k, layout: PageLayout, pages, codebook, moments: torch.Tensor | None,
                         units: int = 1, heavy: torch.Tensor | None = None) -> None:
        """Per page and head, the ``outliers`` key entries of largest error (weighted by the query
        channel weights of the page's chunk when it has query statistics, ``moments`` [U, H, D, D]; the rows
        ``heavy`` marks first) store their error exactly (fp16). ``k`` holds ``units`` chunks of equal length
        (``codebook`` then has a slot per page)."""
        approx = self._decode_tensor(layout, pages, codebook, "k")  # QVG's keys: no values decoded
        error = _by_head(k - approx, layout.page_size)  # [N, H, P*D]
        self.write_outliers(layout, pages, error, *self.outlier_inputs(k, layout.page_size, moments, units),
                            heavy=heavy)

    def write_outliers(self, layout: PageLayout, pages, error: torch.Tensor, weights: torch.Tensor,
                       copies: torch.Tensor, heavy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The outlier fields of ``pages`` from what the other fields leave of the keys, ``error`` [N, H, P*D]
        (each page and head flat, position ``t * D + d``), with `outlier_inputs`' weights [U, H, D] and copies [U],
        and `heavy_rows`' rows [N*P, H] (or None), whose entries rank above all others of their page and head.
        Returns the positions [N, H, n] (int64) and the values stored (fp16)."""
        p, units = layout.page_size, weights.shape[0]
        h, d = weights.shape[1], weights.shape[2]
        pages_per_unit = error.shape[0] // units
        score = error.reshape(-1, h, p, d) ** 2
        if score.is_cuda or not bool((weights == 1).all()):  # (a product by ones changes no bit: a CPU pass saved)
            score = score * weights.repeat_interleave(pages_per_unit, 0)[:, :, None, :]
        if heavy is not None:  # scaled by 2^40 (exact: the order among them stays), above any other error's score
            score = torch.where(to_pages(heavy, p).transpose(1, 2)[..., None], score * HEAVY_RANK, score)
        if score.is_cuda or bool(copies.any()):  # (on the CPU, only where a page ends in copies: a pass saved)
            after_first = torch.arange(p, device=error.device) >= p - copies[:, None]  # [U, P], each chunk's last page
            last_pages = score.view(units, pages_per_unit, h, p, d)[:, -1]  # [U, H, P, D], a view of score
            last_pages.masked_fill_(after_first[:, None, :, None], -1.0)
        score = score.reshape(-1, h, p * d)
        if score.is_cuda:  # one token's channels per segment (the full-width top-k was 0.76 of 5.8 ms of a chunk's encode)
            index = top_positions(score, self.spec.outliers, d)  # [N, H, n]
        else:  # on the CPU the full-width top-k is the faster of the two
            index = score.topk(self.spec.outliers, dim=-1).indices
        value = torch.gather(error, 2, index).clamp(-65504.0, 65504.0).to(torch.float16)
        layout.page.view(pages, "k_out_index").copy_(index.transpose(1, 2).to(torch.int16))
        layout.page.view(pages, "k_out_value").copy_(value.transpose(1, 2))
        return index, value

    def _decode_base(self, layout: PageLayout, pages, codebook):
        """QVG's reconstruction plus the key outliers (everything but the PSAC rows)."""
        return self._decode_base_keys(layout, pages, codebook), self._decode_tensor(layout, pages, codebook, "v")

    def _decode_base_keys(self, layout: PageLayout, pages, codebook) -> torch.Tensor:
        """The keys of `_decode_base` alone (the PSAC encoder reads no values)."""
        k = self._decode_tensor(layout, pages, codebook, "k")
        if not self.spec.outliers:
            return k
        p, (_, h, d) = layout.page_size, k.shape
        index = layout.page.view(pages, "k_out_index").long().transpose(1, 2)  # [N, H, n]
        value = layout.page.view(pages, "k_out_value").float().transpose(1, 2)
        flat = _by_head(k, p).scatter_add(2, index, value)
        return from_pages(flat.reshape(-1, h, p, d).permute(0, 2, 1, 3))

    def psac_basis(self, moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stored bases [U, H, D, r] in bf16, ``moments`` [U, H, D, D] times them [U, H, D, r] in float32):
        the product with ``[U, MU]`` gives both PSAC's coefficients and its gain (`_encode_psac`)."""
        units, h, d = moments.shape[0], moments.shape[1], moments.shape[-1]
        r = self.spec.rank
        basis = principal_directions(moments.reshape(units * h, d, d), r).view(units, h, d, r).to(torch.bfloat16)
        return basis, moments @ basis.float()

    def _encode_psac(self, k, layout: PageLayout, pages, codebook, moments: torch.Tensor,
                     basis: tuple[torch.Tensor, torch.Tensor] | None = None,
                     both: torch.Tensor | None = None, heavy: torch.Tensor | None = None) -> None:
        """PSAC rows of ``U = len(moments)`` chunks (``moments`` [U, H, D, D]; ``codebook`` [bytes] for one chunk,
        [U, bytes] for U), each with the basis of its own chunk's queries. ``basis`` (`psac_basis`) and ``both``
        (what the fields before the PSAC rows leave of the keys, [U, H, T, D], times ``[U, MU]``: [U, H, T, 2r]),
        where the encoder already has them; else they are computed here (the error decoded from the pages).
        With ``keep`` < 1, the rows ``heavy`` marks ([U*T, H], `heavy_rows`) are kept first where they gain."""
        r, p = self.spec.rank, layout.page_size
        units, h, d = moments.shape[0], moments.shape[1], moments.shape[-1]
        t = k.shape[0] // units
        basis, mu = self.psac_basis(moments) if basis is None else basis
        u = basis.float()  # [U, H, D, r] as stored
        # The query-weighted error e^T M e of a row falls by gain = 2 f^T M e - f^T M f once its correction
        # f = U c is added (M symmetric): with c the stored coefficients, f^T M e = c . (e M U) and
        # f^T M f = c^T (U^T M U) c, so one [T, D] x [D, 2r] product gives the coefficients and the gain, and
        # no [T, D] correction or quadratic form over D is formed.
        if both is None:
            per_page = codebook if codebook.dim() == 1 else codebook.repeat_interleave(pages.shape[0] // units, 0)
            approx = self._decode_base_keys(layout, pages, per_page)  # keys without the correction
            error = (k - approx).view(units, t, h, d).transpose(1, 2)  # [U, H, T, D]
            both = error @ torch.cat([u, mu], -1)  # [U, H, T, 2r]
        coeff, projected = both[..., :r], both[..., r:]
        scale = round_to((coeff.abs().amax(-1) / 127).clamp_min(2**-24), torch.float16, "up")
        codes = torch.round(coeff / scale.unsqueeze(-1)).clamp(-127, 127)
        c = codes * scale.float().unsqueeze(-1)  # [U, H, T, r], the correction's coefficients as decoded
        gain = 2 * (c * projected).sum(-1) - ((c @ (u.transpose(-1, -2) @ mu)) * c).sum(-1)  # [U, H, T]
        keep = gain > 0  # rows that lower the query-weighted error
        scale = torch.where(keep, scale.float(), torch.zeros_like(scale.float())).to(torch.float16)
        codes = torch.where(keep.unsqueeze(-1), codes, torch.zeros_like(codes)).to(torch.int8)
        layout.codebook.view(codebook, "k_psac_basis").copy_(basis[0] if codebook.dim() == 1 else basis)

        def by_token(x):  # [U, H, T, ...] -> pages [U*T/P, P, H, ...]
            return to_pages(x.transpose(1, 2).reshape(units * t, h, *x.shape[3:]), p)

        codes, scale = by_token(codes), by_token(scale)
        if self.spec.sparse:  # per page and head, the rows that lower the error most
            gain = by_token(gain.clamp_min(0))  # [N, P, H]
            if heavy is not None:
                gain = torch.where(to_pages(heavy, p), gain * HEAVY_RANK, gain)
            token = gain.topk(self.spec.psac_rows(p), dim=1).indices  # [N, n, H]
            codes = torch.gather(codes, 1, token.unsqueeze(-1).expand(-1, -1, -1, r))
            scale = torch.gather(scale, 1, token)
            layout.page.view(pages, "k_psac_token").copy_(token.to(torch.uint8))
        layout.page.view(pages, "k_psac").copy_(codes)
        layout.page.view(pages, "k_psac_scale").copy_(scale)

    def write_whole(self, layout: PageLayout, pages, error: torch.Tensor, k, moments: torch.Tensor | None,
                    units: int, heavy: torch.Tensor | None) -> None:
        """The whole-row fields of ``pages`` (`whole`) from what the other fields leave of the keys ``k``, ``error``
        [pages, H, P, D], which each row's decoded value is then taken out of (in place). Per page and head, the
        ``heavy`` rows first, then the largest errors weighted by the chunks' query channel weights (``moments`` [U,
        H, D, D], or plain), store their error as INT8 codes with one fp16 scale per row (rounded up, so no code
        clips). A row that only stands in for another is never chosen: one equal to the next row (the copies
        written over sink tokens, which are kept exact elsewhere), or a chunk's padding (its trailing run of equal
        rows but the first, the real last token)."""
        count, h, p, d = error.shape
        n = count * p // units
        weights, copies = self.outlier_inputs(k, p, moments, units)
        score = (error**2 * weights.repeat_interleave(count // units, 0)[:, :, None, :]).sum(-1)  # [N, H, P]
        score = score.transpose(1, 2).reshape(units, n, h)
        if heavy is not None:  # above every other row, whatever their errors
            score = torch.where(heavy.view(units, n, h), score * HEAVY_RANK + HEAVY_RANK, score)
        x = k.view(units, n, h, d)
        stand_in = torch.zeros(units, n, h, dtype=torch.bool, device=k.device)
        stand_in[:, :-1] = (x[:, :-1] == x[:, 1:]).all(-1)
        pos = torch.arange(n, device=k.device)
        first = (n - 1 - copies)[:, None]  # [U, 1]: the trailing run's first row
        stand_in = (stand_in & (pos != first)[..., None]) | (pos > first)[..., None]
        score = to_pages(score.masked_fill(stand_in, -1.0).view(units * n, h), p)  # [N, P, H]
        token = score.topk(self.spec.whole, dim=1).indices.transpose(1, 2)  # [N, H, W]
        at = token.unsqueeze(-1).expand(-1, -1, -1, d)
        rows = torch.gather(error, 2, at)  # [N, H, W, D]
        scale = round_to((rows.abs().amax(-1) / 127).clamp_min(2**-24), torch.float16, "up")  # [N, H, W]
        codes = torch.round(rows / scale.float().unsqueeze(-1)).clamp(-127, 127)
        error.scatter_add_(2, at, -(codes * scale.float().unsqueeze(-1)))  # what decoding adds back (`whole_fix`)
        layout.page.view(pages, "k_whole").copy_(codes.transpose(1, 2).to(torch.int8))
        layout.page.view(pages, "k_whole_scale").copy_(scale.transpose(1, 2))
        layout.page.view(pages, "k_whole_token").copy_(token.transpose(1, 2).to(torch.uint8))

    def whole_fix(self, layout: PageLayout, pages) -> torch.Tensor:
        """What the whole keys add, float32 ``[len(pages) * P, H, D]`` (``whole`` > 0)."""
        rows = layout.page.view(pages, "k_whole").float() * layout.page.view(pages, "k_whole_scale").float().unsqueeze(-1)
        token = layout.page.view(pages, "k_whole_token").long()  # [N, W, H]
        dense = torch.zeros(rows.shape[0], layout.page_size, *rows.shape[2:], dtype=rows.dtype, device=rows.device)
        return from_pages(dense.scatter_add_(1, token.unsqueeze(-1).expand_as(rows), rows))

    def key_fix(self, layout: PageLayout, pages, codebook) -> torch.Tensor | None:
        """The one correction decoding adds to the keys once the outliers are in, float32 ``[len(pages) * P, H, D]``:
        the PSAC rows plus the whole keys (None when the spec has neither)."""
        fix = self.psac_fix(layout, pages, codebook) if self.spec.rank else None
        if self.spec.whole:
            whole = self.whole_fix(layout, pages)
            fix = whole if fix is None else fix + whole
        return fix

    def _decode(self, layout: PageLayout, pages, codebook):
        k, v = self._decode_base(layout, pages, codebook)
        fix = self.key_fix(layout, pages, codebook)
        if fix is not None:
            k = k + fix
        return k, v

    def psac_is_zero(self, layout: PageLayout, pages, codebook) -> bool:
        """Whether every stored PSAC code, scale and basis entry is +0 (pages of chunks without query statistics):
        then `psac_fix` is +0 everywhere, whatever order its sums take."""
        fields = [layout.page.view(pages, "k_psac").view(torch.uint8),
                  layout.page.view(pages, "k_psac_scale").view(torch.int16),
                  layout.codebook.view(codebook, "k_psac_basis").view(torch.int16)]
        return not any(bool(x.any()) for x in fields)

    def psac_fix(self, layout: PageLayout, pages, codebook) -> torch.Tensor:
        """The PSAC correction decoding adds to the keys, float32 ``[len(pages) * P, H, D]`` (``rank`` > 0)."""
        codes = layout.page.view(pages, "k_psac").float()  # [N, n, H, r]
        scale = layout.page.view(pages, "k_psac_scale").float()  # [N, n, H]
        u = layout.codebook.view(codebook, "k_psac_basis").float()  # [H, D, r], or [N, H, D, r] (a slot per page)
        equation = "pthr,phdr->pthd" if codebook.dim() == 2 else "pthr,hdr->pthd"
        fix = torch.einsum(equation, codes * scale.unsqueeze(-1), u)  # [N, n, H, D]
        if self.spec.sparse:  # unused rows have scale 0, so adding them anywhere changes nothing
            token = layout.page.view(pages, "k_psac_token").long()  # [N, n, H]
            dense = torch.zeros(fix.shape[0], layout.page_size, *fix.shape[2:], dtype=fix.dtype, device=fix.device)
            fix = dense.scatter_add_(1, token.unsqueeze(-1).expand_as(fix), fix)
        return from_pages(fix)
