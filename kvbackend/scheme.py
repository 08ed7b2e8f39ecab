"""What a kernel needs to know to read (or write) one of K or V in a packed page.

`kernel_schemes(codec, layout)` turns a codec's layout into two `TensorScheme`s of plain ints,
which kernels take as compile-time constants. Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbackend.errors import UnsupportedLayout
from kvbackend.layout import PageLayout

FLOAT, TOKEN_GROUPS, CHANNEL_GROUPS = 0, 1, 2  # storage modes
FP8_E4M3, FP16, BF16, FP32 = 0, 1, 2, 3  # element kinds of scales, zeros and float values
_KINDS = {torch.float8_e4m3fn: FP8_E4M3, torch.float16: FP16, torch.bfloat16: BF16, torch.float32: FP32}
NONE = -1  # offset of an absent field


@dataclass(frozen=True)
class TensorScheme:
    """How K (or V) of one token block is stored in a page; all offsets in bytes."""

    mode: int  # FLOAT, TOKEN_GROUPS (per token, groups of channels) or CHANNEL_GROUPS (per channel, groups of tokens)
    bits: int  # code width (2, 3, 4, 8); 0 in FLOAT mode
    group: int  # channels (TOKEN_GROUPS) or tokens (CHANNEL_GROUPS) per scale; 0 in FLOAT mode
    symmetric: bool  # codes centred on 2**(bits-1) - 1 and no zeros
    kind: int  # element kind of scales/zeros, or of the values themselves in FLOAT mode
    codes: int  # offset of codes (or float values)
    scales: int = NONE
    zeros: int = NONE
    assign: int = NONE  # uint8 [S, P, H] centroid ids
    stages: int = 0  # S
    centroids: int = 0  # C
    codebook: int = NONE  # offset of the centroids [S, H, C, D] in the codebook slot (bf16, or fp8 with scales)
    centroid_scales: int = NONE  # offset of fp16 scales [S, H] of fp8 centroids (NONE: bf16 centroids)

    def supported_by_kernels(self) -> bool:
        return self.mode == FLOAT or self.bits in (2, 3, 4, 8)  # 3 bits: the plain Triton kernels, the encode kernels,
        # the CUDA gather and (pre-RoPE keys) the tensor-core decode kernel; each kernel's own `supports` decides


def kind_of(dtype: torch.dtype) -> int:
    return _KINDS[dtype]


@dataclass(frozen=True)
class LeverScheme:
    """What a kernel needs of a layer's levers (`kvbackend.levers`) and PSAC rows; offsets in bytes.

    Sinks live in the codebook slot of the chunk that starts a sequence (``[sink, H, D]`` in the
    cache's 16-bit dtype, the original frame); PSAC rows in the page (``[rows, H, rank]`` int8 codes,
    ``[rows, H]`` fp16 scales and, for sparse rows, ``[rows, H]`` uint8 token indices) and the basis in
    the codebook slot (``[H, D, rank]`` bf16)."""

    sink: int = 0  # exact first tokens of a sequence (0 = none)
    sink_k: int = NONE
    sink_v: int = NONE
    sink_kind: int = FP16  # FP16 or BF16
    prerope: bool = False  # keys of packed pages are stored before RoPE
    pagerope: bool = False  # keys of packed pages are stored de-rotated by their page's first position
    vrot: bool = False  # values of packed pages are stored Hadamard-rotated
    psac_rank: int = 0  # 0 = no PSAC rows
    psac_rows: int = 0  # rows per page and head (= page_size for dense rows)
    psac_codes: int = NONE
    psac_scale: int = NONE
    psac_token: int = NONE  # NONE: row i corrects token i
    psac_basis: int = NONE
    outliers: int = 0  # key outliers per page and head (0 = none): int16 positions t * D + d, fp16 errors
    out_index: int = NONE
    out_value: int = NONE
    whole: int = 0  # whole key rows per page and head (0 = none): int8 [W, H, D] codes, fp16 [W, H] scales,
    whole_codes: int = NONE  # uint8 [W, H] tokens; a row adds codes * scale to its token's key
    whole_scale: int = NONE
    whole_token: int = NONE

    @property
    def active(self) -> bool:
        return self != LeverScheme()


# Every field some kernel reads; a layout with any other field is refused by `kernel_schemes`.
PAGE_FIELDS_READ = frozenset({"k", "v", "k_psac", "k_psac_scale", "k_psac_token", "k_out_index", "k_out_value",
                              "k_whole", "k_whole_scale", "k_whole_token"}
                             | {f"{x}_{n}" for x in "kv" for n in ("codes", "scales", "zeros", "assign")})
BOOK_FIELDS_READ = frozenset({"k_centroids", "v_centroids", "k_centroid_scales", "v_centroid_scales", "k_psac_basis",
                              "sink_k", "sink_v"})
MAX_KERNEL_PSAC_RANK = 16  # the kernels pad the rank to one 16-wide tensor-core operand
MAX_KERNEL_OUTLIERS = 64  # key outliers per page and head the kernels hold as one [page, outliers] one-hot
MAX_KERNEL_WHOLE = 8  # whole key rows per page and head the Triton kernels add, one row at a time


def lever_scheme(codec, layout: PageLayout) -> LeverScheme:
    """The levers and PSAC fields of ``codec`` on ``layout`` (a `kvbackend.frames.lever_layout`).

    Raises:
        UnsupportedLayout: for a lever no kernel reads (the sequence-level ``psac=`` lever, a PSAC rank
            above `MAX_KERNEL_PSAC_RANK`, more key outliers than `MAX_KERNEL_OUTLIERS`, more whole key rows
            than `MAX_KERNEL_WHOLE`, or a rotation other than Hadamard).
    """
    levers, page, book = codec.levers, layout.page.fields, layout.codebook.fields
    if levers.psac:
        raise UnsupportedLayout("the sequence-level psac= lever is applied by `kvbackend eval` only")
    if levers.vrot not in ("none", "hadamard"):
        raise UnsupportedLayout(f"no kernel undoes the value rotation {levers.vrot!r}")
    fields = {}
    if levers.sink:
        if "sink_k" not in book or "sink_v" not in book:
            raise UnsupportedLayout(f"{codec.spec_string!r}: the layout has no sink fields (build it with "
                                    "kvbackend.frames.lever_layout)")
        sink_k = book["sink_k"]
        fields.update(sink=levers.sink, sink_k=sink_k.offset, sink_v=book["sink_v"].offset, sink_kind=kind_of(sink_k.dtype))
    if "k_psac" in page:
        rows, _, rank = page["k_psac"].shape
        if rank > MAX_KERNEL_PSAC_RANK:
            raise UnsupportedLayout(f"the kernels add PSAC rows of rank <= {MAX_KERNEL_PSAC_RANK}, got {rank}")
        token = page.get("k_psac_token")
        fields.update(psac_rank=rank, psac_rows=rows, psac_codes=page["k_psac"].offset,
                      psac_scale=page["k_psac_scale"].offset, psac_token=token.offset if token is not None else NONE,
                      psac_basis=book["k_psac_basis"].offset)
    if "k_out_index" in page:
        if page["k_out_index"].shape[0] > MAX_KERNEL_OUTLIERS:
            raise UnsupportedLayout(f"the kernels add at most {MAX_KERNEL_OUTLIERS} key outliers per page and head, "
                                    f"got {page['k_out_index'].shape[0]}")
        fields.update(outliers=page["k_out_index"].shape[0], out_index=page["k_out_index"].offset,
                      out_value=page["k_out_value"].offset)
    if "k_whole" in page:
        if page["k_whole"].shape[0] > MAX_KERNEL_WHOLE:
            raise UnsupportedLayout(f"the kernels add at most {MAX_KERNEL_WHOLE} whole key rows per page and head, "
                                    f"got {page['k_whole'].shape[0]}")
        fields.update(whole=page["k_whole"].shape[0], whole_codes=page["k_whole"].offset,
                      whole_scale=page["k_whole_scale"].offset, whole_token=page["k_whole_token"].offset)
    return LeverScheme(prerope=levers.prerope, pagerope=levers.pagerope, vrot=levers.vrot == "hadamard", **fields)


def kernel_schemes(codec, layout: PageLayout, levers_read: bool = False) -> tuple[TensorScheme, TensorScheme]:
    """(K scheme, V scheme) for ``codec`` on ``layout``.

    ``levers_read``: the caller passes `lever_scheme` to the kernels too. Without it a layout with
    levers or PSAC rows is refused, so no caller can read such pages while ignoring what they carry.

    Raises:
        UnsupportedLayout: for a codec whose fields no kernel reads (the torch reference still works).
    """
    spec = codec.spec
    page, book = layout.page.fields, layout.codebook.fields
    unread = sorted(set(page) - PAGE_FIELDS_READ) + sorted(set(book) - BOOK_FIELDS_READ)
    if unread:  # a field no kernel reads would be ignored, and its pages served wrong
        raise UnsupportedLayout(f"no kernel reads the fields {', '.join(unread)} of {codec.spec_string!r}; "
                                "the torch reference serves it")
    if not levers_read and ("k_psac" in page or "k_out_index" in page or "k_whole" in page or codec.levers.active):
        raise UnsupportedLayout(f"{codec.spec_string!r} has levers, PSAC rows, key outliers or whole key rows: pass "
                                "levers_read=True and the kernels `levers=lever_scheme(codec, layout)`")
    out = []
    for prefix in ("k", "v"):
        if prefix in page:  # identity / fp16 / bf16 / fp8: plain values
            out.append(TensorScheme(FLOAT, 0, 0, False, kind_of(page[prefix].dtype), page[prefix].offset))
            continue
        if f"{prefix}_codes" not in page:
            raise UnsupportedLayout(f"no kernel reads the fields of codec {codec.spec_string!r}")
        scales = page[f"{prefix}_scales"]
        channel = scales.shape[0] != layout.page_size  # KIVI keys: [P / G, H, D]
        zeros = page.get(f"{prefix}_zeros")
        assign = page.get(f"{prefix}_assign")
        cents = book.get(f"{prefix}_centroids")
        cent_scales = book.get(f"{prefix}_centroid_scales")
        out.append(TensorScheme(
            mode=CHANNEL_GROUPS if channel else TOKEN_GROUPS,
            bits=getattr(spec, "key_bits" if prefix == "k" else "value_bits", spec.bits),
            group=layout.page_size // scales.shape[0] if channel else layout.geometry.head_dim // scales.shape[-1],
            symmetric=zeros is None,
            kind=kind_of(scales.dtype),
            codes=page[f"{prefix}_codes"].offset,
            scales=scales.offset,
            zeros=zeros.offset if zeros is not None else NONE,
            assign=assign.offset if assign is not None else NONE,
            stages=assign.shape[0] if assign is not None else 0,
            centroids=cents.shape[2] if cents is not None else 0,
            codebook=cents.offset if cents is not None else NONE,
            centroid_scales=cent_scales.offset if cent_scales is not None else NONE,
        ))
    return out[0], out[1]
