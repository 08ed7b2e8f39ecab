"""Whole key rows (`quantwm:whole=W`) in the tensor-core decode kernel (`WHOLE_N` in `kernels/mma_decode.cu`).

Each whole row joins the kernel's centroid-value table as one more row (its token's centroid, or folded PSAC row,
plus the row's INT8 codes times its scale), and its token reads that row. The path is on by default
since a GPU ran these tests (`mma_decode.WHOLE`; KVBACKEND_CUDA_WHOLE=0 turns it off); ``whole=True`` asks for it here.

CPU runs check which layouts claim the path and compile its variants for sm_90 (where nvcc is installed; the
launcher's shared-memory count is checked against the kernel's by a static_assert). On a GPU each case is compared
with the torch reference and the plain Triton kernel, and crafted rows (64x louder; token indices past the page or
two rows naming one token) decode as the Triton kernel decodes them.
"""

import dataclasses

import pytest
import torch

from kvbackend.kernels import mma_decode
from kvbackend.scheme import MAX_KERNEL_WHOLE
from kernel_cases import DEVICE
from test_mma_recipe import _inputs, check_mma_case, gpu, recipe_cache

RECIPE = "quantwm:kchannel=64,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,cdtype=fp8"
CASES = [  # (codec, head_dim, page size, chunk pages, lengths, KV heads, GQA ratio, target programs)
    # the quality spec's whole-row layers: no PSAC rows, no outliers, 3-bit keys (layers 7, 8, 18, 20) or 2-bit
    (f"{RECIPE},rank=0,whole=1,kbits=3", 128, 64, 2, [700, 150, 64], 2, 4, 24),
    (f"{RECIPE},rank=0,whole=1", 128, 64, 2, [333, 90], 3, 3, 8),
    # beside PSAC rows folded into the table (4 rows: token map in registers) and outliers
    (f"{RECIPE},rank=4,keep=0.0625,outliers=16,whole=2", 128, 64, 2, [333, 90], 3, 8, 8),
    # 16 folded PSAC rows (a token -> row map in shared memory), 8 whole rows, bf16 centroids, 32-token pages
    ("quantwm:kchannel=32,centroids=4,clip=true,vcluster=false,prerope=true,rank=4,keep=0.5,whole=8", 128, 32, 3,
     [200, 33], 2, 2, 16),
]
OPT_IN = {"prerope": True, "psac": True, "whole": True}


def _config(**extra):
    return mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, vrot=True,
                             rope_token=True, **extra)


@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", CASES)
def test_whole_rows_are_claimed_only_when_asked_with_pre_rope_keys_and_centroids(codec, head_dim, page_size,
                                                                                chunk_pages, lengths, heads, ratio,
                                                                                programs):
    cache, ids, _ = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths[:1], heads, ratio)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    k = schemes[0]
    assert levers.whole >= 1 and levers.prerope and k.stages
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    assert mma_decode.supports_levers(k, levers, page_size, head_dim, **OPT_IN)
    assert not mma_decode.supports_levers(k, levers, page_size, head_dim, prerope=True, psac=True, whole=False)
    assert not mma_decode.supports_levers(k, levers, page_size, 64, **OPT_IN)  # pre-RoPE keys: head_dim 128
    assert not mma_decode.supports_levers(k, dataclasses.replace(levers, whole=MAX_KERNEL_WHOLE + 1), page_size,
                                          head_dim, **OPT_IN)
    assert not mma_decode.supports_levers(dataclasses.replace(k, stages=0), levers, page_size, head_dim, **OPT_IN)
    # the default follows the switch (on; off, the plain Triton kernel reads whole rows)
    assert mma_decode.supports_levers(k, levers, page_size, head_dim, prerope=True, psac=True) == mma_decode.WHOLE
    config = mma_decode.config_for(*schemes, page_size, head_dim, torch.bfloat16, torch.bfloat16, 2, 4, None, levers)
    assert config.whole == levers.whole
    assert f"-DWHOLE_N={levers.whole}" in config.defines()


def test_whole_rows_cost_their_staged_bytes_and_table_rows():
    """Per warp: a stage holds the rows' codes and a scale and token word each (16-byte rounded), and the
    centroid-value table one fp16 row of D channels per whole row."""
    for whole in (1, 2, 8):
        extra = -(-(whole * 128 + 8 * whole) // 16) * 16
        for stages in (1, 2):
            base, more = _config(stages=stages), _config(stages=stages, whole=whole)
            assert more.smem_bytes - base.smem_bytes == 4 * (stages * extra + whole * 128 * 2), (whole, stages)


@pytest.mark.skipif(mma_decode.nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("config", [
    _config(whole=1, k_bits=3),  # the quality spec's 3-bit whole-row layers
    _config(whole=1),
    _config(whole=2, outliers=16, psac_rank=4, psac_rows=4, psac_sparse=True, psac_fold=True),
    _config(whole=3, psac_rank=4, psac_rows=4, psac_sparse=True, k_bits=3, stages=1),  # PSAC rows read per key
    mma_decode.Config(128, 32, 1, 2, 1, 1, False, False, 2, 2, k_chan=True, centroids=4, c_kind=2, rope_token=True,
                      psac_rank=4, psac_rows=16, psac_sparse=True, psac_fold=True, whole=8),
])
def test_whole_row_variants_compile_for_hopper(config, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBACKEND_CACHE_DIR", str(tmp_path))
    assert mma_decode.compile_cubin(config, "sm_90")[:4] == b"\x7fELF"


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", CASES)
def test_whole_rows_match_the_reference_and_are_read(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio,
                                                    programs):
    check_mma_case((codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs), seed=13,
                   mma_options=OPT_IN)


@gpu
@pytest.mark.parametrize("case", [0, 2, 3])
@pytest.mark.parametrize("craft", ["loud", "tokens"])
def test_crafted_whole_rows_decode_as_the_triton_kernel(case, craft):
    """Crafted whole rows in every packed page decode as the plain Triton kernel decodes them: rows 64x louder (their
    scales; a row read at the wrong token or channels would show) and token indices past the page (ignored) or
    naming another row's token (both add). Each craft moves the output: the rows are read."""
    from kvbackend.batch import PACKED
    from kvbackend.kernels.paged_decode import paged_decode

    codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs = CASES[case]
    cache, ids, rotary = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, seed=17)
    args, levers = _inputs(cache, ids)
    q = torch.randn(len(ids), heads * ratio, head_dim, device=DEVICE).bfloat16()
    intact, _ = paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                             mma_options=OPT_IN)
    pages, plan = args[0], args[4]
    tokens, scales = (cache.layouts[0].page.fields[name] for name in ("k_whole_token", "k_whole_scale"))
    W, H = tokens.shape
    used = sorted({int(p) for p, kind in zip(plan.page_ids.tolist(), plan.kinds.tolist()) if kind == PACKED})
    assert used
    crafted = pages.clone()
    for p in used:
        if craft == "loud":
            view = crafted[p, scales.offset:scales.offset + 2 * W * H].view(torch.float16).view(W, H)
            view.mul_(64)
        else:
            view = crafted[p, tokens.offset:tokens.offset + W * H].view(W, H)
            view[0, 0] = 255  # head 0's first row names no token
            if W > 1:
                view[1, 1 % H] = view[0, 1 % H]  # head 1's second row names its first row's token
    bad = (crafted, *args[1:])
    out, lse = paged_decode(q, *bad, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                            mma_options=OPT_IN)
    want, want_lse = paged_decode(q, *bad, target_programs=programs, levers=levers, rotary=rotary, mma=False,
                                  fold=False, planar=False)
    assert torch.isfinite(out.float()).all()
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2
    # rtol: loud rows (scales x64) put log-sum-exps near 90, where the two kernels' fp16 key operands differ by
    # a few 1e-4 relative (H100, session 38: 80.58 against 80.60)
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)
    moved = float((out.float() - intact.float()).norm() / intact.float().norm())
    assert moved > (1e-2 if craft == "loud" else 1e-4), moved
