// Gather-dequant for plain layouts: packed pages of per-token or per-channel groups (2/4/8-bit codes, fp8/fp16/bf16
// scales and zeros, no centroids, no levers) or plain float pages, and dense pages -> contiguous K/V rows.
//
// One CTA per work page of the plan, all KV heads. The output rows of a page's tokens are one contiguous run of
// valid * H * D elements ([tokens, H, D] output), and the packed codes of the page are one contiguous run in the
// same element order ([P, H, D] codes), so every thread turns runs of 8 elements into one 16-byte store: codes,
// scales and zeros for UNROLL runs are loaded first, then converted and stored. The arithmetic is the torch
// reference's (`kvbackend.quant.dequantize`): code * scale, then + zero, each rounded to float32 (no FMA), and
// (code - qmax) * scale for symmetric codes; then one round to the output dtype.
//
// Compile-time options (-D): HEAD_DIM, PAGE, NTHREADS, UNROLL, OUT_KIND / DENSE_KIND (1 fp16, 2 bf16), and per
// tensor (K_ and V_): MODE (0 float values, 1 token groups, 2 channel groups), BITS, GROUP, SYM, KIND (element kind
// of scales and zeros, or of the float values: 0 fp8 e4m3, 1 fp16, 2 bf16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifndef NTHREADS
#define NTHREADS 256
#endif
#ifndef UNROLL
#define UNROLL 4
#endif

constexpr int D = HEAD_DIM;
constexpr int P = PAGE;
static_assert(D % 8 == 0, "runs of 8 channels");

struct Params {
  const uint8_t* pages;  // [num_pages, page_bytes]
  const uint8_t* dense;  // [num_dense, 2, P, H, D] of DENSE_KIND
  const int* page_ids;   // the plan's int32 arrays [W]
  const int* kinds;
  const int* valid;
  const int* rows;
  uint8_t* k_out;  // [tokens, H, D] of OUT_KIND
  uint8_t* v_out;
  long long page_bytes;
  int H;
  int k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros;  // byte offsets in a page
};

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

template <int KIND>
__device__ __forceinline__ float load1(const uint8_t* p) {
  if (esize(KIND) == 1) return element<KIND>(*p);
  return element<KIND>(__ldg(reinterpret_cast<const unsigned short*>(p)));
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

// Codes of a run of 8 elements: 8 * BITS bits in element order, each byte's first code in its top bits.
template <int BITS>
__device__ __forceinline__ uint2 load_codes(const uint8_t* p) {
  if (BITS == 2) return make_uint2(__ldg(reinterpret_cast<const unsigned short*>(p)), 0u);
  if (BITS == 4) return make_uint2(__ldg(reinterpret_cast<const uint32_t*>(p)), 0u);
  return __ldg(reinterpret_cast<const uint2*>(p));
}

template <int BITS>
__device__ __forceinline__ float code_at(const uint2& w, int j) {
  constexpr int PER_BYTE = 8 / BITS;
  const int byte = j / PER_BYTE;
  const uint32_t word = byte < 4 ? w.x : w.y;
  const int shift = 8 * (byte & 3) + (PER_BYTE - 1 - j % PER_BYTE) * BITS;
  return static_cast<float>((word >> shift) & ((1u << BITS) - 1));
}

// One tensor (K or V) of one packed page: `n` tokens -> out (elements from the page's first token).
template <int MODE, int BITS, int GROUP, int SYM, int KIND, int OUT>
__device__ __forceinline__ void packed_tensor(const uint8_t* page, int codes, int scales, int zeros, int H, int n,
                                              uint8_t* out) {
  const int runs = n * H * (D / 8);
  for (int first = threadIdx.x; first < runs; first += NTHREADS * UNROLL) {
    uint2 code[UNROLL];
    uint4 sraw[UNROLL], zraw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = first + u * NTHREADS;
      if (r >= runs) break;
      const int e = 8 * r;  // element (t * H + h) * D + d of the page
      if (MODE == 0) {
        const uint8_t* at = page + codes + static_cast<long long>(e) * esize(KIND);
        sraw[u] = load8<KIND>(at);
        continue;
      }
      code[u] = load_codes<BITS>(page + codes + e / 8 * BITS);
      if (MODE == 1) {  // [P, H, D / GROUP]
        const int g = e / GROUP;
        sraw[u].x = esize(KIND) == 1 ? page[scales + g] : __ldg(reinterpret_cast<const unsigned short*>(page + scales) + g);
        if (!SYM)
          zraw[u].x = esize(KIND) == 1 ? page[zeros + g] : __ldg(reinterpret_cast<const unsigned short*>(page + zeros) + g);
      } else {  // [P / GROUP, H, D]: 8 channels' scales
        const int t = e / (H * D), hd = e - t * (H * D);
        const int g = (t / GROUP) * (H * D) + hd;
        sraw[u] = load8<KIND>(page + scales + g * esize(KIND));
        if (!SYM) zraw[u] = load8<KIND>(page + zeros + g * esize(KIND));
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = first + u * NTHREADS;
      if (r >= runs) break;
      float x[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (MODE == 0) {
          x[j] = element8<KIND>(sraw[u], j);
          continue;
        }
        const float c = code_at<BITS>(code[u], j);
        const float s = MODE == 1 ? element<KIND>(sraw[u].x) : element8<KIND>(sraw[u], j);
        if (SYM) {
          x[j] = __fmul_rn(__fsub_rn(c, static_cast<float>((1 << (BITS - 1)) - 1)), s);
        } else {
          const float z = MODE == 1 ? element<KIND>(zraw[u].x) : element8<KIND>(zraw[u], j);
          x[j] = __fadd_rn(__fmul_rn(c, s), z);
        }
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
  const int runs = n * H * (D / 8);
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

extern "C" __global__ void __launch_bounds__(NTHREADS) gather_dequant(const Params a) {
  const int w = blockIdx.x;
  const long long page = a.page_ids[w];
  const int n = a.valid[w];
  const long long at = static_cast<long long>(a.rows[w]) * a.H * D * 2;  // bytes: 16-bit outputs
  if (a.kinds[w] != 0) {
    const long long tensor = static_cast<long long>(P) * a.H * D * 2;
    const uint8_t* src = a.dense + page * 2 * tensor;
    dense_tensor<DENSE_KIND, OUT_KIND>(src, a.H, n, a.k_out + at);
    dense_tensor<DENSE_KIND, OUT_KIND>(src + tensor, a.H, n, a.v_out + at);
    return;
  }
  const uint8_t* base = a.pages + page * a.page_bytes;
  packed_tensor<K_MODE, K_BITS, K_GROUP, K_SYM, K_KIND, OUT_KIND>(base, a.k_codes, a.k_scales, a.k_zeros, a.H, n,
                                                                  a.k_out + at);
  packed_tensor<V_MODE, V_BITS, V_GROUP, V_SYM, V_KIND, OUT_KIND>(base, a.v_codes, a.v_scales, a.v_zeros, a.H, n,
                                                                  a.v_out + at);
}
