// Experiment (not a kernel of the package): the query-key pass of a decode over keys stored at a width per
// channel (`chw:` keys after RoPE), on tensor cores, to measure what the width per channel costs against uniform
// 2-bit codes in the same kernel and against BF16 SDPA. `perf/experiments/chw_mma_scores.py` builds the pages,
// checks the scores against a torch reference and times it.
//
// Layout of one page (the experiment's own): per KV head a block of 32-bit words holding P rows of S_h bits (token
// after token, each row the head's coded channels in "lane order": for each 16-channel tile kt and each thread
// column tig, the channels 16kt + 2tig, +1, +8, +9, each at its width, the first at the lowest bit), padded so
// that one word past the last row can be read; after the blocks, an fp16 absmax per head and channel [H, D].
// A key is mean + (code + 0.5) * step - amax with step = 2 amax / 2^w (w > 0), its mean where w = 0.
//
// Scores S^T[token, q] = K[token, :] . q[:, q] ("swap-AB": tokens are the MMA's M, the GQA group its N). The
// per-channel step folds into the query fragment once per page, the rest of the key into one term per page and
// query row. A thread's four channels of a tile lie in one 32-bit window of its token's row (at most 4 x 8 bits),
// read with one funnel shift from two words; each pair of codes becomes one half2 through the mantissa of 1024.
//
// -D: HEAD_DIM 128 only, PAGE 64, NWARPS, BLOCK (bytes staged per head block, a multiple of 16), WRITE_SCORES
// (1: every score to `out` [B, Hq, L]; 0: each warp's largest score to `out` [grid, warps], for timing), MINB.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef PAGE
#define PAGE 64
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef BLOCK
#define BLOCK 4096
#endif
#ifndef MINB
#define MINB 1  // CTAs per SM the registers must allow
#endif
#ifndef WRITE_SCORES
#define WRITE_SCORES 1
#endif

constexpr int D = 128;
constexpr int P = PAGE;
constexpr int KT = D / 16;  // channel tiles
constexpr int MT = P / 16;  // token tiles
constexpr int STAGE = BLOCK + 2 * D;  // the head's block, then its absmax row
static_assert(BLOCK % 16 == 0 && P % 16 == 0, "16-byte copies");

struct Params {
  const uint8_t* pages;
  long long page_bytes;
  const int* page_table;   // [B, pages_per_req]
  int pages_per_req;
  int pages_per_split;
  int H;
  int group;
  const __nv_bfloat16* q;  // [B, H * group, D]
  const uint32_t* consts;  // [H, KT, 4]: bit offset in the row | w0 << 12 | w1 << 16 | w2 << 20 | w3 << 24
  const int* head_first;   // [H] byte offset of the head's block in the page (a multiple of 16)
  const int* head_bytes;   // [H] its bytes (a multiple of 16, at most BLOCK; one word past its last row included)
  const int* row_bits;     // [H]
  int amax_offset;         // byte offset of the fp16 absmax [H, D]
  const __half* mean;      // [H, D]
  float* out;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int n>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(n)); }

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 x = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&x);
}

// Two codes (lo at bit 0 under mask m_lo, hi at bit `p_hi` under mask m_hi) as half2 (lo, hi), exact in fp16.
__device__ __forceinline__ uint32_t code_pair(uint32_t win, uint32_t m_lo, int p_hi, uint32_t m_hi16) {
  const uint32_t lo = (win & m_lo) | 0x64006400u;
  const uint32_t hi = (win << (16 - p_hi)) & m_hi16;  // the hi code moved to bit 16
  uint32_t x = lo | hi;
  __half2 h = __hsub2(*reinterpret_cast<__half2*>(&x), __halves2half2(__float2half(1024.f), __float2half(1024.f)));
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void issue(uint8_t* stage, const Params& a, int page, int h, int lane) {
  const uint8_t* base = a.pages + static_cast<int64_t>(page) * a.page_bytes;
  const int first = a.head_first[h], chunks = a.head_bytes[h] / 16;
  for (int i = lane; i < chunks; i += 32) cp_async16(stage + 16 * i, base + first + 16 * i);
  for (int i = lane; i < 2 * D / 16; i += 32) cp_async16(stage + BLOCK + 16 * i, base + a.amax_offset + h * 2 * D + 16 * i);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MINB) chw_scores(Params a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tig = lane & 3;
  uint8_t* ring = smem + warp * 2 * STAGE;
  const int S = a.row_bits[h];

  // per thread: its query row gid at its 4 channels of each tile (0 past the group), the tiles' constants, and its
  // part of the query row's product with the channel means (the same on every page)
  float qv[KT][4];
  uint32_t cst[KT];
  float qmu = 0.f;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    const int c0 = 16 * kt + 2 * tig;
    const int ch[4] = {c0, c0 + 1, c0 + 8, c0 + 9};
    cst[kt] = a.consts[(h * KT + kt) * 4 + tig];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      qv[kt][i] = gid < a.group
                      ? __bfloat162float(a.q[(static_cast<int64_t>(b) * a.H * a.group + h * a.group + gid) * D + ch[i]])
                      : 0.f;
      qmu += qv[kt][i] * __half2float(a.mean[h * D + ch[i]]);
    }
  }

  const int first = split * a.pages_per_split;
  const int last = min(first + a.pages_per_split, a.pages_per_req);
  const int* table = a.page_table + static_cast<int64_t>(b) * a.pages_per_req;
  float best = -INFINITY;
  int j = first + warp;
  if (j < last) issue(ring, a, table[j], h, lane);
  cp_async_commit();
  for (int n = 0; j < last; j += NWARPS, ++n) {
    uint8_t* stage = ring + (n & 1) * STAGE;
    if (j + NWARPS < last) issue(ring + ((n + 1) & 1) * STAGE, a, table[j + NWARPS], h, lane);
    cp_async_commit();
    cp_async_wait<1>();
    __syncwarp();
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(stage);
    const __half* amax = reinterpret_cast<const __half*>(stage + BLOCK);
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    float zpart = qmu;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t c = cst[kt];
      const int off = c & 0xfff;
      const int w0 = (c >> 12) & 15, w1 = (c >> 16) & 15, w2 = (c >> 20) & 15, w3 = (c >> 24) & 15;
      const int c0 = 16 * kt + 2 * tig;
      const __half2 am01 = *reinterpret_cast<const __half2*>(amax + c0);
      const __half2 am23 = *reinterpret_cast<const __half2*>(amax + c0 + 8);
      const float am[4] = {__low2float(am01), __high2float(am01), __low2float(am23), __high2float(am23)};
      const int w[4] = {w0, w1, w2, w3};
      float qs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float step = w[i] ? am[i] * __int_as_float((128 - w[i]) << 23) : 0.f;  // 2 amax / 2^w
        qs[i] = qv[kt][i] * step;
        zpart += w[i] ? qv[kt][i] * (0.5f * step - am[i]) : 0.f;
      }
      const uint32_t b0 = pack_half2(qs[0], qs[1]), b1 = pack_half2(qs[2], qs[3]);
      const uint32_t m0 = (1u << w0) - 1u, m1 = ((1u << w1) - 1u) << 16;
      const uint32_t m2 = (1u << w2) - 1u, m3 = ((1u << w3) - 1u) << 16;
      const int p2 = w0 + w1;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t r[2][2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = 16 * mt + gid + 8 * half;
          const int bit = t * S + off;
          const uint32_t win = __funnelshift_r(kw[bit >> 5], kw[(bit >> 5) + 1], bit & 31);
          r[half][0] = code_pair(win, m0, w0, m1);
          r[half][1] = code_pair(win >> p2, m2, w2, m3);
        }
        mma16816(acc[mt], r[0][0], r[1][0], r[0][1], r[1][1], b0, b1);
      }
    }
    __syncwarp();
    // the page's key term for query row gid: summed over the 4 threads of the row, then read where it is needed
    zpart += __shfl_xor_sync(0xffffffffu, zpart, 1);
    zpart += __shfl_xor_sync(0xffffffffu, zpart, 2);
    const float z0 = __shfl_sync(0xffffffffu, zpart, 8 * tig), z1 = __shfl_sync(0xffffffffu, zpart, 8 * tig + 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float s[4] = {acc[mt][0] + z0, acc[mt][1] + z1, acc[mt][2] + z0, acc[mt][3] + z1};
#if WRITE_SCORES
      const int64_t L = static_cast<int64_t>(a.pages_per_req) * P;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qrow = 2 * tig + (e & 1), t = j * P + 16 * mt + gid + 8 * (e >> 1);
        if (qrow < a.group) a.out[(static_cast<int64_t>(b) * a.H * a.group + h * a.group + qrow) * L + t] = s[e];
      }
#else
#pragma unroll
      for (int e = 0; e < 4; ++e) best = (2 * tig + (e & 1)) < a.group ? fmaxf(best, s[e]) : best;
#endif
    }
  }
  cp_async_wait<0>();
#if !WRITE_SCORES
  for (int o = 16; o; o >>= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (lane == 0) {
    const int64_t cta = (static_cast<int64_t>(b) * gridDim.y + h) * gridDim.z + split;
    a.out[cta * NWARPS + warp] = best;
  }
#endif
}
