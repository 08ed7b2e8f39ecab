"""4-bit pre-RoPE keys in the tensor-core decode kernel (`KBITS=4`: two codes a byte, a lane's 16 channels read from
8 bytes of a swizzled 64-byte row and dequantized in place, as 3-bit keys are).

The path is on by default since a GPU ran these tests (`mma_decode.K4`; KVBACKEND_CUDA_K4=0 turns it off); ``k4=True``
asks for it here whatever the switch says. CPU runs check which layouts the kernel claims with and without the switch
and model the read (its variants compile for sm_90 in tests/test_mma_recipe.py, where nvcc is installed); on a GPU
each case is compared with the torch reference and the plain Triton kernel.
"""

import dataclasses

import pytest
import torch

from test_mma_recipe import _inputs, check_mma_case, gpu, recipe_cache

from kvbackend.kernels import mma_decode

RECIPE = ("quantwm:kchannel=64,rank=4,keep=0.0625,centroids=32,clip=true,vcluster=false,sink=4,vrot=hadamard,"
          "prerope=true,cdtype=fp8")
K4_CASES = [  # (codec, head_dim, page size, chunk pages, lengths, KV heads, GQA ratio, target programs)
    # the 4-bit layer of the candidate depth spec (perf/results/s37/p27l18k4b.spec): no outliers, folded PSAC rows
    (f"{RECIPE},outliers=0,iters=8,kmetric=0.5,heavy=4,heavyz=3,vstep=1.15,kbits=4", 128, 64, 2, [700, 150, 64], 2, 4,
     24),
    # outliers and sinks with bf16 centroids on 32-token pages; per-channel keys without centroids (fp16 scales)
    ("quantwm:rank=0,clip=true,vcluster=false,kchannel=32,centroids=5,prerope=true,outliers=5,sink=3,kbits=4", 128, 32,
     3, [150, 40], 2, 2, 64),
    ("kivi:bits=2,group=64,kbits=4,prerope=true", 128, 64, 2, [333, 90], 3, 8, 8),
]
OPT_IN = {"prerope": True, "psac": True, "k4": True}


@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", K4_CASES)
def test_4bit_keys_are_claimed_only_where_turned_on(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio,
                                                    programs):
    cache, ids, _ = recipe_cache(codec, head_dim, page_size, chunk_pages, lengths[:1], heads, ratio)
    (_, _, _, schemes, _), levers = _inputs(cache, ids)
    k = schemes[0]
    assert k.bits == 4 and levers.prerope
    assert mma_decode.supports(*schemes, page_size, head_dim, ratio)
    assert mma_decode.supports_levers(k, levers, page_size, head_dim, **OPT_IN)
    assert not mma_decode.supports_levers(k, levers, page_size, head_dim, prerope=True, psac=True, k4=False)
    assert not mma_decode.supports_levers(k, levers, page_size, 64, **OPT_IN)  # pre-RoPE keys: head_dim 128
    assert not mma_decode.supports_levers(k, dataclasses.replace(levers, prerope=False), page_size, head_dim,
                                          **OPT_IN)  # dequantized in place: on the pre-RoPE path alone
    assert not mma_decode.supports_levers(k, None, page_size, head_dim, **OPT_IN)
    # what `preferred` asks follows the switch (on by default; off, the plain Triton kernel reads 4-bit keys)
    assert mma_decode.supports_levers(k, levers, page_size, head_dim, prerope=True, psac=True) == mma_decode.K4


def test_the_4bit_variant_reserves_its_longer_key_rows():
    """64-byte key rows per token: 16 bytes a token more than 3-bit keys in every stage."""
    three = mma_decode.Config(128, 64, 1, 2, 0, 0, False, False, 2, 2, k_chan=True, centroids=32, sink=4, vrot=True,
                              rope_token=True, k_bits=3)
    four = dataclasses.replace(three, k_bits=4)
    assert four.smem_bytes - three.smem_bytes == 4 * 2 * 64 * 16  # 4 warps x 2 stages x 64 tokens x 16 bytes
    assert "-DKBITS=4" in four.defines()


@gpu
@pytest.mark.parametrize("codec,head_dim,page_size,chunk_pages,lengths,heads,ratio,programs", K4_CASES)
def test_4bit_pre_rope_keys_match_the_reference(codec, head_dim, page_size, chunk_pages, lengths, heads, ratio,
                                                programs):
    from kvbackend.kernels.paged_decode import paged_decode

    case = (codec, head_dim, page_size, chunk_pages, lengths, heads, ratio, programs)
    q, args, levers, rotary, cache, out = check_mma_case(case, seed=11, mma_options=OPT_IN, lse_rtol=1e-3)
    # both codes of each byte are read: the second code of every byte cleared moves the output as the reference says
    codes = cache.layouts[0].page.fields["k_codes"]
    coarse = args[0].clone()
    coarse[:, codes.offset:codes.offset + codes.nbytes] &= 0xF0
    moved, _ = paged_decode(q, coarse, *args[1:], target_programs=programs, levers=levers, rotary=rotary, mma=True,
                            mma_options=OPT_IN)
    moved_plain, _ = paged_decode(q, coarse, *args[1:], target_programs=programs, levers=levers, rotary=rotary,
                                  mma=False, fold=False, planar=False)
    assert float((moved.float() - out.float()).norm() / out.float().norm()) > 1e-3
    assert float((moved.float() - moved_plain.float()).norm() / moved_plain.float().norm()) < 1e-2
    with pytest.raises(ValueError, match="KVBACKEND_CUDA_K4"):  # the switch off: refused where insisted on
        paged_decode(q, *args, target_programs=programs, levers=levers, rotary=rotary, mma=True,
                     mma_options={"prerope": True, "psac": True, "k4": False})


def _byte_perm(x: int, y: int, selector: int) -> int:
    """CUDA's __byte_perm: byte n of the result is byte (selector >> 4 n) & 7 of the 8 bytes y:x."""
    both = (y << 32) | x
    return sum(((both >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _key_chunk_offset(t: int, c: int) -> int:  # mma_decode.cu's at 4 bits (64-byte rows)
    return t * 64 + ((c ^ ((((t >> 1) & 1) << 1) | ((t >> 2) & 1))) << 4)


def test_the_nibble_reads_name_the_channels_of_the_scales_and_spread_over_the_banks():
    """A model of the kernel's 4-bit read (the copy into swizzled stage rows, a lane's two words, `codes4_x`) on rows
    packed as the pages pack them: lane ``tig`` of block ``b`` gets channels 64 b + 16 tig + j and + 8 at position
    ``j``, the channels whose scales and zeros it applies (as at 3 bits), and each half-warp's 8-byte reads (4 rows
    of a fragment: 8-byte loads are served a half-warp at a time) hit every bank exactly once."""
    from kvbackend.bitpack import pack

    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 16, (16, 128), generator=gen)
    packed = pack(rows, 4)
    assert packed.shape == (16, 64)
    stage = bytearray(16 * 64)
    for t in range(16):  # issue_page: chunk c of row t copied to key_chunk_offset(t, c)
        for c in range(4):
            stage[_key_chunk_offset(t, c):_key_chunk_offset(t, c) + 16] = bytes(packed[t, 16 * c:16 * c + 16].tolist())
    for t in range(16):
        for b in range(2):
            for tig in range(4):
                at = _key_chunk_offset(t, 2 * b + (tig >> 1)) + 8 * (tig & 1)
                w0, w1 = (int.from_bytes(stage[at + 4 * i:at + 4 * i + 4], "little") for i in range(2))
                for j in range(8):
                    k = j >> 1
                    x = _byte_perm(w0, w1, k | ((4 + k) << 8))
                    h = ((x if j & 1 else x >> 4) & 0x000F000F) | 0x64006400
                    lo, hi = (h & 0xFFFF) - 0x6400, (h >> 16) - 0x6400  # the halves less 1024, as codes
                    channel = 64 * b + 16 * tig + j
                    assert (lo, hi) == (int(rows[t, channel]), int(rows[t, channel + 8])), (t, b, tig, j)
    for t0 in (0, 4, 8, 12):  # the rows of a half-warp (gid 0-3 or 4-7 of a 16-token tile)
        for b in range(2):
            banks = [0] * 32
            for gid in range(4):
                for tig in range(4):
                    word = _key_chunk_offset(t0 + gid, 2 * b + (tig >> 1)) // 4 + 2 * (tig & 1)
                    banks[word % 32] += 1
                    banks[(word + 1) % 32] += 1
            assert banks == [1] * 32, (t0, b, banks)
