// Gather-dequant: packed pages (per-token or per-channel groups of 2/3/4/8-bit codes with fp8/fp16/bf16 scales and
// zeros, centroid stages, and the recipe's levers) or plain float pages, and dense pages -> contiguous K/V rows.
//
// One CTA per work page of the plan, all KV heads. The output rows of a page's tokens are one contiguous run of
// valid * H * D elements ([tokens, H, D] output), and the packed codes of the page are one contiguous run in the
// same element order ([P, H, D] codes), so every thread turns runs of 8 elements (one 16-byte store) into output:
// codes, scales and zeros of UNROLL runs are loaded first, then converted and stored. The D / 8 runs of one
// (token, head) row sit in consecutive lanes of one warp, so row-wide steps are warp shuffles: RoPE's partner
// channels (d, d + D/2) are lanes D/16 apart, and the Hadamard rotation of values is three butterfly stages in
// registers and log2(D / 8) across lanes.
//
// Per element, in the order of the Triton kernel (`kernels/gather_dequant.py`):
//   residual (code * scale, then + zero: each rounded to float32, no FMA, as `kvbackend.quant.dequantize`; or
//   (code - qmax) * scale), + centroids of the stages from the last to the first (fp8 ones times their scale),
//   + the key's PSAC correction (float32 coefficients times the bf16 basis, summed over the rows naming the
//   token, as the torch reference), + key outliers, + whole key rows (their codes x scale in float32, summed over the
//   rows naming the token, as the Triton kernel),
//   then keys rotated by R(p0 + t) = R(p0) R(t) (pre-RoPE; one turn by a per-page table in shared memory where it
//   fits, else R(t) then R(p0)) or R(p0) (page-relative), values rotated back by the
//   Hadamard matrix / sqrt(D), and the first page's sink tokens written over; one rounding to the output dtype.
//
// Compile-time options (-D): HEAD_DIM, PAGE, NTHREADS, UNROLL, OUT_KIND / DENSE_KIND (1 fp16, 2 bf16); per tensor
// (K_ and V_): MODE (0 float values, 1 token groups, 2 channel groups), BITS, GROUP, SYM, KIND (element kind of
// scales and zeros, or of float values: 0 fp8 e4m3, 1 fp16, 2 bf16), STAGES, C (centroids per stage), CFP8 (fp8
// centroids with an fp16 scale per stage and head); levers: SINK (tokens), SINK_KIND, ROPE (pre-RoPE keys),
// PAGE_ROPE, VROT, PSAC_R (rank), PSAC_ROWS, PSAC_SPARSE, OUT_N (key outliers per page and head), WHOLE_N (whole key
// rows per page and head); KV_HEADS (the
// launch's KV heads, so that the per-run index arithmetic divides by constants; 0 reads them at run time).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifndef NTHREADS
#define NTHREADS 512
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef K_STAGES
#define K_STAGES 0
#define K_C 1
#define K_CFP8 0
#endif
#ifndef V_STAGES
#define V_STAGES 0
#define V_C 1
#define V_CFP8 0
#endif
#ifndef SINK
#define SINK 0
#define SINK_KIND 2
#endif
#ifndef ROPE
#define ROPE 0
#endif
#ifndef PAGE_ROPE
#define PAGE_ROPE 0
#endif
#ifndef VROT
#define VROT 0
#endif
#ifndef PSAC_R
#define PSAC_R 0
#define PSAC_ROWS 0
#define PSAC_SPARSE 0
#endif
#ifndef OUT_N
#define OUT_N 0
#endif
#ifndef WHOLE_N
#define WHOLE_N 0
#endif
#ifndef KV_HEADS
#define KV_HEADS 0  // KV heads known at compile time (0: the launch's `H`); divisions by it become multiplies
#endif

// Key outliers few enough for a set of their indices per (token, head) row, in the bits below the PSAC bit: a run
// of a row with outliers then tests only that row's outliers, not all of its head's.
#define OUT_SET (OUT_N > 0 && OUT_N <= (WHOLE_N ? 30 : 31))
// Bits of a (token, head) row's mask: 31 a PSAC row names the token, 30 a whole row does (with WHOLE_N), below them
// the outliers' set or run bits.
#define ROW_MASKS (PSAC_R || OUT_N || WHOLE_N)

constexpr int D = HEAD_DIM;
constexpr int P = PAGE;
constexpr int RUNS = D / 8;  // runs of one (token, head) row: consecutive lanes of one warp
static_assert(D % 8 == 0 && 32 % RUNS == 0 && (RUNS & (RUNS - 1)) == 0, "rows of 8-element runs within a warp");
static_assert(!(ROPE || PAGE_ROPE) || RUNS >= 2, "RoPE's partner runs");
constexpr int MAX_HEADS = 32;  // heads whose PSAC rows and outliers a CTA stages in shared memory
// the staged PSAC rows, outliers and row masks (`Staged` below), in bytes
constexpr int STAGED_BYTES = 4 * MAX_HEADS * ((PSAC_R ? PSAC_ROWS * (PSAC_R + 1) : 1) + (OUT_N ? 2 * OUT_N : 2) +
                                              (WHOLE_N ? 2 * WHOLE_N : 2) + (ROW_MASKS ? P : 1));
// pre-RoPE keys turn once, by a per-page table of R(p0 + t), where it fits in static shared memory beside them
constexpr bool ROPE_TABLE = ROPE && STAGED_BYTES + 8 * P * (D / 2) + 32 <= 48 * 1024;

struct Params {
  const uint8_t* pages;  // [num_pages, page_bytes]
  const uint8_t* dense;  // [num_dense, 2, P, H, D] of DENSE_KIND
  const uint8_t* book;   // [num_slots, book_bytes]
  const int* page_ids;   // the plan's int32 arrays [W]
  const int* kinds;
  const int* valid;
  const int* rows;
  const int* slots;
  const int* positions;
  const float* local_cos;  // [P, D/2] R(t), the RoPE's scaling included
  const float* local_sin;
  const float* base_cos;  // [pages, D/2] R(p0) of a request's page j
  const float* base_sin;
  uint8_t* k_out;  // [tokens, H, D] of OUT_KIND
  uint8_t* v_out;
  long long page_bytes;
  long long book_bytes;
  int H;
  int k_codes, k_scales, k_zeros, k_assign, k_book, k_cscale;  // byte offsets in a page or a codebook slot
  int v_codes, v_scales, v_zeros, v_assign, v_book, v_cscale;
  int sink_k, sink_v, psac_codes, psac_scale, psac_token, psac_basis, out_index, out_value;
  int whole_codes, whole_scale, whole_token;
};

__device__ __forceinline__ int heads(const Params& a) { return KV_HEADS > 0 ? KV_HEADS : a.H; }

template <int KIND>
__device__ __forceinline__ float element(uint32_t raw) {  // raw: the element's bits in the low byte(s)
  if (KIND == 0) {
    __nv_fp8_e4m3 x;
    x.__x = static_cast<__nv_fp8_storage_t>(raw & 0xFF);
    return static_cast<float>(x);
  } else if (KIND == 1) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(raw & 0xFFFF)));
  } else {
    return __uint_as_float((raw & 0xFFFF) << 16);
  }
}

__host__ __device__ constexpr int esize(int kind) { return kind == 0 ? 1 : 2; }

// 8 elements of kind KIND starting at p (aligned to 8 elements) as raw words: 8 or 16 bytes.
template <int KIND>
__device__ __forceinline__ uint4 load8(const uint8_t* p) {
  if (esize(KIND) == 1) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    return make_uint4(w.x, w.y, 0u, 0u);
  }
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <int KIND>
__device__ __forceinline__ float element8(const uint4& w, int i) {  // element i of `load8`
  if (esize(KIND) == 1) {
    const uint32_t word = i < 4 ? w.x : w.y;
    return element<KIND>(word >> (8 * (i & 3)));
  }
  const uint32_t word = i < 2 ? w.x : i < 4 ? w.y : i < 6 ? w.z : w.w;
  return element<KIND>(word >> (16 * (i & 1)));
}

// All 8 elements of `load8` as floats; fp8 pairs through one e4m3x2 -> f16x2 conversion each (exact).
template <int KIND>
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8]) {
  if (KIND == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = i < 2 ? w.x : w.y;
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((word >> (16 * (i & 1))) & 0xFFFF), __NV_E4M3);
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = element8<KIND>(w, i);
  }
}

template <int KIND>
__device__ __forceinline__ uint32_t load1(const uint8_t* p, int i) {  // element i's raw bits
  if (esize(KIND) == 1) return p[i];
  return __ldg(reinterpret_cast<const unsigned short*>(p) + i);
}

template <int OUT>
__device__ __forceinline__ uint32_t pack2(float a, float b) {  // a at the lower address
  if (OUT == 1) {
    const __half2 x = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&x);
  }
  const __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&x);
}

// Codes of a run of 8 elements: 8 * BITS bits in element order, each byte's first code in its top bits (3 bits:
// the run's 3 bytes as one 24-bit number, the first code in its top bits).
template <int BITS>
__device__ __forceinline__ uint2 load_codes(const uint8_t* p) {
  if (BITS == 3)
    return make_uint2((static_cast<uint32_t>(__ldg(p)) << 16) | (static_cast<uint32_t>(__ldg(p + 1)) << 8) | __ldg(p + 2),
                      0u);
  if (BITS == 2) return make_uint2(__ldg(reinterpret_cast<const unsigned short*>(p)), 0u);
  if (BITS == 4) return make_uint2(__ldg(reinterpret_cast<const uint32_t*>(p)), 0u);
  return __ldg(reinterpret_cast<const uint2*>(p));
}

template <int BITS>
__device__ __forceinline__ float code_at(const uint2& w, int j) {
  if (BITS == 3) return __uint_as_float(0x4B000000u | ((w.x >> (21 - 3 * j)) & 7u)) - 8388608.0f;
  constexpr int PER_BYTE = 8 / BITS;
  const int byte = j / PER_BYTE;
  const uint32_t word = byte < 4 ? w.x : w.y;
  const int shift = 8 * (byte & 3) + (PER_BYTE - 1 - j % PER_BYTE) * BITS;
  // exact: the code in the mantissa of 2^23, then 2^23 off (no quarter-rate integer conversion)
  return __uint_as_float(0x4B000000u | ((word >> shift) & ((1u << BITS) - 1))) - 8388608.0f;
}

// What a CTA stages per page: each head's PSAC coefficients and tokens, and its key outliers.
struct alignas(16) Staged {
  float coef[PSAC_R ? PSAC_ROWS * MAX_HEADS * PSAC_R : 1];  // codes * scale in float32, as the reference
  int token[PSAC_R ? PSAC_ROWS * MAX_HEADS : 1];            // token of each row (-1: none)
  int out_at[OUT_N ? OUT_N * MAX_HEADS : 1];                // outlier position t * D + d, by head
  float out_value[OUT_N ? OUT_N * MAX_HEADS : 1];
  int whole_token[WHOLE_N ? WHOLE_N * MAX_HEADS : 1];       // token of each whole row (P or more: none), by head
  float whole_scale[WHOLE_N ? WHOLE_N * MAX_HEADS : 1];
  // per (token, head) row: bit k when outlier k falls in the row (OUT_SET; else bit i when an outlier falls in run
  // i), bit 31 when a PSAC row names the token, bit 30 when a whole row does, so a run without any (nearly all)
  // costs one shared-memory read
  uint32_t rowmask[ROW_MASKS ? P * MAX_HEADS : 1];
  // pre-RoPE keys: R(p0) R(t) = R(p0 + t) for the page's tokens, built once per page and read by all its heads
  alignas(16) float rope_cos[ROPE_TABLE ? P * D / 2 : 1];  // read as float4
  alignas(16) float rope_sin[ROPE_TABLE ? P * D / 2 : 1];
};
static_assert(!ROPE_TABLE || sizeof(Staged) <= 48 * 1024, "static shared memory");
static_assert(RUNS <= (WHOLE_N ? 30 : 31), "run bits below the PSAC (and whole-row) bits");
static_assert(WHOLE_N <= 8, "at most 8 whole key rows per page and head");

// Storage of one tensor, as template arguments.
template <int MODE_, int BITS_, int GROUP_, int SYM_, int KIND_, int STAGES_, int C_, int CFP8_>
struct Scheme {
  static constexpr int MODE = MODE_, BITS = BITS_, GROUP = GROUP_, SYM = SYM_, KIND = KIND_, STAGES = STAGES_,
                       C = C_, CFP8 = CFP8_;
};

struct Offsets {
  int codes, scales, zeros, assign, book, cscale, sink;
};

// One tensor (K when IS_K) of one packed page: `n` tokens -> out (elements from the page's first token).
template <class S, bool IS_K, int OUT>
__device__ __forceinline__ void packed_tensor(const Params& a, const uint8_t* page, const uint8_t* slot,
                                              const Offsets& o, int n, long long pos, const Staged& st,
                                              uint8_t* out) {
  const int H = heads(a);
  const int runs = n * H * RUNS;
  const int lane = threadIdx.x & 31;
  // warp-uniform trip counts: a row's runs share a warp, and every lane of a warp joins the shuffles
  for (int first = threadIdx.x; first - lane < runs; first += NTHREADS * UNROLL) {
    constexpr int NS = S::STAGES > 0 ? S::STAGES : 1;
    uint2 code[UNROLL];
    uint4 sraw[UNROLL], zraw[UNROLL], cent[UNROLL][NS];
    float cscale[UNROLL][NS];
    int cid[UNROLL][NS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = first + u * NTHREADS;
      code[u] = make_uint2(0u, 0u);
      sraw[u] = zraw[u] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int stage = 0; stage < NS; ++stage) cid[u][stage] = 0;
      if (r >= runs) continue;
      const int e = 8 * r;  // element (t * H + h) * D + d of the page
      if (S::MODE == 0) {
        sraw[u] = load8<S::KIND>(page + o.codes + static_cast<long long>(e) * esize(S::KIND));
        continue;
      }
      code[u] = load_codes<S::BITS>(page + o.codes + e / 8 * S::BITS);
      const int t = e / (H * D), hd = e - t * (H * D);
#pragma unroll
      for (int stage = 0; stage < S::STAGES; ++stage)  // centroid ids [S, P, H]
        cid[u][stage] = page[o.assign + (stage * P + t) * H + hd / D];  // ids past C add nothing (below)
      if (S::MODE == 1) {  // [P, H, D / GROUP]
        const int g = e / S::GROUP;
        sraw[u].x = load1<S::KIND>(page + o.scales, g);
        if (!S::SYM) zraw[u].x = load1<S::KIND>(page + o.zeros, g);
      } else {  // [P / GROUP, H, D]: 8 channels' scales
        const int g = (t / S::GROUP) * (H * D) + hd;
        sraw[u] = load8<S::KIND>(page + o.scales + g * esize(S::KIND));
        if (!S::SYM) zraw[u] = load8<S::KIND>(page + o.zeros + g * esize(S::KIND));
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // the centroid rows the ids name (a second wave of loads)
      const int r = first + u * NTHREADS;
#pragma unroll
      for (int stage = 0; stage < S::STAGES; ++stage) {
        cent[u][stage] = make_uint4(0u, 0u, 0u, 0u);
        cscale[u][stage] = 0.f;
        if (r >= runs) continue;
        if (cid[u][stage] >= S::C) continue;  // a corrupted id: no read past the stage's centroids
        const int e = 8 * r, h = (e / D) % H, d = e % D;
        const int row = ((stage * H + h) * S::C + cid[u][stage]) * D + d;
        if (S::CFP8) {
          cscale[u][stage] = element<1>(load1<1>(slot + o.cscale, stage * H + h));
          cent[u][stage] = load8<0>(slot + o.book + row);
        } else {
          cent[u][stage] = load8<2>(slot + o.book + 2 * row);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = first + u * NTHREADS;
      if (r - lane >= runs) break;  // warp-uniform: the warp's first run is past the end
      const bool live = r < runs;
      const int rr = live ? r : runs - 1;
      const int e = 8 * rr;
      const int t = e / (H * D), h = (e / D) % H, d = e % D;
      float x[8], sv[8], zv[8];
      if (S::MODE == 0) unpack8<S::KIND>(sraw[u], x);
      if (S::MODE == 2) {
        unpack8<S::KIND>(sraw[u], sv);
        if (!S::SYM) unpack8<S::KIND>(zraw[u], zv);
      }
      const float s1 = S::MODE == 1 ? element<S::KIND>(sraw[u].x) : 0.f;
      const float z1 = S::MODE == 1 && !S::SYM ? element<S::KIND>(zraw[u].x) : 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (S::MODE != 0) {
          const float c = code_at<S::BITS>(code[u], j);
          const float s = S::MODE == 1 ? s1 : sv[j];
          if (S::SYM) {
            x[j] = __fmul_rn(__fsub_rn(c, static_cast<float>((1 << (S::BITS - 1)) - 1)), s);
          } else {
            x[j] = __fadd_rn(__fmul_rn(c, s), S::MODE == 1 ? z1 : zv[j]);
          }
        }
        if (!live) x[j] = 0.f;
      }
#pragma unroll
      for (int stage = S::STAGES - 1; stage >= 0; --stage) {  // + centroids, the last stage first
        if (!live) break;
        float cv[8];
        if (S::CFP8) unpack8<0>(cent[u][stage], cv); else unpack8<2>(cent[u][stage], cv);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          x[j] = S::CFP8 ? __fadd_rn(x[j], __fmul_rn(cv[j], cscale[u][stage])) : __fadd_rn(x[j], cv[j]);
      }
      const uint32_t mask = (IS_K && ROW_MASKS && live) ? st.rowmask[t * MAX_HEADS + h] : 0u;
      if (IS_K && PSAC_R && (mask >> 31)) {  // + the corrections of the rows naming this token (summed, as the reference)
        float fix[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        bool any = false;
        for (int i = 0; i < (PSAC_R ? PSAC_ROWS : 1); ++i) {
          if (st.token[i * MAX_HEADS + h] != t) continue;
          any = true;
          const __nv_bfloat16* basis = reinterpret_cast<const __nv_bfloat16*>(slot + a.psac_basis) + (h * D + d) * PSAC_R;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < (PSAC_R ? PSAC_R : 1); ++k)
              sum = __fadd_rn(sum, __fmul_rn(st.coef[(i * MAX_HEADS + h) * (PSAC_R ? PSAC_R : 1) + k],
                                             __bfloat162float(basis[j * PSAC_R + k])));
            fix[j] = __fadd_rn(fix[j], sum);
          }
        }
        if (any)
#pragma unroll
          for (int j = 0; j < 8; ++j) x[j] = __fadd_rn(x[j], fix[j]);
      }
      if (IS_K && OUT_SET) {  // the row's key outliers, in index order (as the loop below adds them)
        uint32_t set = mask & ((1u << (OUT_SET ? OUT_N : 1)) - 1u);
        while (set) {
          const int i = __ffs(set) - 1;
          set &= set - 1u;
          const int at = st.out_at[i * MAX_HEADS + h] - (t * D + d);
          if (at >= 0 && at < 8) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (j == at) x[j] = __fadd_rn(x[j], st.out_value[i * MAX_HEADS + h]);
          }
        }
      } else if (IS_K && OUT_N && ((mask >> (d / 8)) & 1u)) {  // key outliers of this head falling in the run
#pragma unroll 4
        for (int i = 0; i < (OUT_N ? OUT_N : 1); ++i) {
          const int at = st.out_at[i * MAX_HEADS + h] - (t * D + d);
          if (at >= 0 && at < 8) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (j == at) x[j] = __fadd_rn(x[j], st.out_value[i * MAX_HEADS + h]);
          }
        }
      }
      if (IS_K && WHOLE_N && ((mask >> 30) & 1u)) {  // + the whole rows naming this token, summed from zero
        float fix[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < (WHOLE_N ? WHOLE_N : 1); ++i) {
          if (st.whole_token[i * MAX_HEADS + h] != t) continue;
          const float s = st.whole_scale[i * MAX_HEADS + h];
          const uint2 raw = *reinterpret_cast<const uint2*>(page + a.whole_codes + (i * H + h) * D + d);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int8_t c = static_cast<int8_t>(((j < 4 ? raw.x : raw.y) >> (8 * (j & 3))) & 0xFFu);
            fix[j] = __fadd_rn(fix[j], __fmul_rn(static_cast<float>(c), s));
          }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = __fadd_rn(x[j], fix[j]);
      }
      if (IS_K && (ROPE || PAGE_ROPE)) {  // (lo, hi) -> (lo cos - hi sin, hi cos + lo sin), lo = channels < D / 2
        const bool low = d < D / 2;
        const int half = d % (D / 2);
        const long long jpage = pos / P;
#pragma unroll
        for (int turn = ROPE && !ROPE_TABLE ? 0 : 1; turn < 2; ++turn) {  // R(t), then R(p0); or R(p0 + t) at once
          const float* cs = ROPE_TABLE ? st.rope_cos + t * (D / 2)
                            : turn == 0 ? a.local_cos + t * (D / 2) : a.base_cos + jpage * (D / 2);
          const float* sn = ROPE_TABLE ? st.rope_sin + t * (D / 2)
                            : turn == 0 ? a.local_sin + t * (D / 2) : a.base_sin + jpage * (D / 2);
          float partner[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) partner[j] = __shfl_xor_sync(0xffffffffu, x[j], RUNS / 2);
          if (live) {
            const float4 c0 = *reinterpret_cast<const float4*>(cs + half);  // shared memory, or L1 through __ldg's
            const float4 c1 = *reinterpret_cast<const float4*>(cs + half + 4);  // path (read-only for the kernel)
            const float4 s0 = *reinterpret_cast<const float4*>(sn + half);
            const float4 s1 = *reinterpret_cast<const float4*>(sn + half + 4);
            const float cv[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
            const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
            for (int j = 0; j < 8; ++j)
              x[j] = low ? __fsub_rn(__fmul_rn(x[j], cv[j]), __fmul_rn(partner[j], sv[j]))
                         : __fadd_rn(__fmul_rn(x[j], cv[j]), __fmul_rn(partner[j], sv[j]));
          }
        }
      }
      if (!IS_K && VROT) {  // x @ H / sqrt(D): butterflies over the row's D channels
#pragma unroll
        for (int span = 1; span < 8; span *= 2)
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (!(j & span)) {
              const float lo = x[j], hi = x[j + span];
              x[j] = lo + hi;
              x[j + span] = lo - hi;
            }
#pragma unroll
        for (int lanes = 1; lanes < RUNS; lanes *= 2) {
          const float sign = (lane & lanes) ? -1.f : 1.f;  // upper lanes keep other - x, lower x + other
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float other = __shfl_xor_sync(0xffffffffu, x[j], lanes);
            x[j] = __fmaf_rn(sign, x[j], other);  // the product by +-1 is exact: one rounding, as the add
          }
        }
        const float norm = 1.0f / sqrtf(static_cast<float>(D));
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] *= norm;
      }
      if (!live) continue;
      if (SINK && pos == 0 && t < SINK) {  // the sequence's first tokens: exact, from the slot
        const uint4 w = load8<SINK_KIND>(slot + o.sink + 2 * ((t * H + h) * D + d));
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = element8<SINK_KIND>(w, j);
      }
      const uint4 w = make_uint4(pack2<OUT>(x[0], x[1]), pack2<OUT>(x[2], x[3]), pack2<OUT>(x[4], x[5]),
                                 pack2<OUT>(x[6], x[7]));
      *reinterpret_cast<uint4*>(out + static_cast<long long>(r) * 16) = w;
    }
  }
}

// One tensor of one dense page: `n` tokens copied (converted when the dtypes differ).
template <int DENSE, int OUT>
__device__ __forceinline__ void dense_tensor(const uint8_t* src, int H, int n, uint8_t* out) {
  const int runs = n * H * RUNS;
  for (int r = threadIdx.x; r < runs; r += NTHREADS) {
    uint4 w = __ldg(reinterpret_cast<const uint4*>(src) + r);
    if (DENSE != OUT) {
      float x[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = element8<DENSE>(w, j);
      w = make_uint4(pack2<OUT>(x[0], x[1]), pack2<OUT>(x[2], x[3]), pack2<OUT>(x[4], x[5]), pack2<OUT>(x[6], x[7]));
    }
    reinterpret_cast<uint4*>(out)[r] = w;
  }
}

using KS = Scheme<K_MODE, K_BITS, K_GROUP, K_SYM, K_KIND, K_STAGES, K_C, K_CFP8>;
using VS = Scheme<V_MODE, V_BITS, V_GROUP, V_SYM, V_KIND, V_STAGES, V_C, V_CFP8>;

extern "C" __global__ void __launch_bounds__(NTHREADS) gather_dequant(const Params a) {
  __shared__ Staged st;
  const int w = blockIdx.x;
  const int H = heads(a);
  const long long page = a.page_ids[w];
  const int n = a.valid[w];
  const long long at = static_cast<long long>(a.rows[w]) * H * D * 2;  // bytes: 16-bit outputs
  if (a.kinds[w] != 0) {
    const long long tensor = static_cast<long long>(P) * H * D * 2;
    const uint8_t* src = a.dense + page * 2 * tensor;
    dense_tensor<DENSE_KIND, OUT_KIND>(src, H, n, a.k_out + at);
    dense_tensor<DENSE_KIND, OUT_KIND>(src + tensor, H, n, a.v_out + at);
    return;
  }
  const uint8_t* base = a.pages + page * a.page_bytes;
  const uint8_t* slot = a.book + static_cast<long long>(a.slots[w]) * a.book_bytes;
  const long long pos = a.positions[w];
  if (ROPE_TABLE) {  // cos and sin of (p0 + t) theta: the two rotations' angles add (their scalings multiply)
    const float* bc = a.base_cos + pos / P * (D / 2);
    const float* bs = a.base_sin + pos / P * (D / 2);
    for (int i = threadIdx.x; i < P * D / 2; i += NTHREADS) {
      const int c = i % (D / 2);
      const float lc = __ldg(a.local_cos + i), ls = __ldg(a.local_sin + i), pc = __ldg(bc + c), ps = __ldg(bs + c);
      st.rope_cos[i] = __fsub_rn(__fmul_rn(pc, lc), __fmul_rn(ps, ls));
      st.rope_sin[i] = __fadd_rn(__fmul_rn(ps, lc), __fmul_rn(pc, ls));
    }
    if (!ROW_MASKS) __syncthreads();
  }
  if (ROW_MASKS) {  // the page's PSAC rows, key outliers and whole rows, by head, and which rows and runs they touch
    for (int i = threadIdx.x; i < P * MAX_HEADS; i += NTHREADS) st.rowmask[i] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < (PSAC_R ? PSAC_ROWS : 0) * H; i += NTHREADS) {
      const int row = i / H, h = i % H;
      const float scale = element<1>(load1<1>(base + a.psac_scale, i));
      for (int k = 0; k < (PSAC_R ? PSAC_R : 1); ++k) {
        const float c = static_cast<float>(static_cast<int8_t>(base[a.psac_codes + i * PSAC_R + k]));
        st.coef[(row * MAX_HEADS + h) * (PSAC_R ? PSAC_R : 1) + k] = __fmul_rn(c, scale);
      }
      const int token = PSAC_SPARSE ? static_cast<int>(base[a.psac_token + i]) : row;
      st.token[row * MAX_HEADS + h] = token;
      if (token < P) atomicOr(&st.rowmask[token * MAX_HEADS + h], 1u << 31);
    }
    for (int i = threadIdx.x; i < OUT_N * H; i += NTHREADS) {
      const int k = i / H, h = i % H;
      const int at = static_cast<int>(load1<1>(base + a.out_index, i));
      st.out_at[k * MAX_HEADS + h] = at;
      st.out_value[k * MAX_HEADS + h] = element<1>(load1<1>(base + a.out_value, i));
      if (at < P * D) atomicOr(&st.rowmask[(at / D) * MAX_HEADS + h], OUT_SET ? 1u << k : 1u << ((at % D) / 8));
    }
    for (int i = threadIdx.x; i < WHOLE_N * H; i += NTHREADS) {
      const int row = i / H, h = i % H;
      const int token = static_cast<int>(base[a.whole_token + i]);
      st.whole_token[row * MAX_HEADS + h] = token;
      st.whole_scale[row * MAX_HEADS + h] = element<1>(load1<1>(base + a.whole_scale, i));
      if (token < P) atomicOr(&st.rowmask[token * MAX_HEADS + h], 1u << 30);
    }
    __syncthreads();
  }
  packed_tensor<KS, true, OUT_KIND>(a, base, slot, Offsets{a.k_codes, a.k_scales, a.k_zeros, a.k_assign, a.k_book,
                                                           a.k_cscale, a.sink_k}, n, pos, st, a.k_out + at);
  packed_tensor<VS, false, OUT_KIND>(a, base, slot, Offsets{a.v_codes, a.v_scales, a.v_zeros, a.v_assign, a.v_book,
                                                            a.v_cscale, a.sink_v}, n, pos, st, a.v_out + at);
}
