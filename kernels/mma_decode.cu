// Paged decode attention over 2-bit per-token-group pages on tensor cores (mma.sync m16n8k16).
//
// One CTA per (request, KV head, split); each warp walks its own pages (no CTA barrier per page) and
// keeps its own online softmax; the warps merge once at the end. Per page a warp:
//   1. copies the head's packed key and value rows and their scale words into a warp-private
//      shared-memory ring (cp.async, NSTAGE pages in flight);
//   2. keys, "swap-AB": S^T[token, q] = K[token, :] . q[:, q]: tokens are the MMA's M (16 per tile), the
//      GQA group (<= 8 query heads) its N. The channel order inside the K dimension is free, so each
//      thread unpacks the 32-bit code words it loaded as they lie: a half2 register holds the codes at
//      positions p and p + 8 of one word, masked in place and or-ed into the mantissa of 1024.0, which
//      gives 1024 + code * 4^(p % 4); one subtraction leaves code * 4^(p % 4), exact in fp16, and the
//      query fragment carries 4^-(p % 4) and the matching channel (loop-invariant, built once);
//   3. scales per token and channel group are applied to the fp32 accumulators (one per group), zeros
//      through the query's channel sums;
//   4. values, swap-AB again: O^T[channel, q] += V^T[channel, token] . P'^T[token, q], with P' = p * the
//      token's value scale, staged through shared memory (ldmatrix.trans) because the score
//      accumulator's layout is the transpose of the operand the value product needs. A value register
//      pairs two tokens' codes of one channel (prmt of two code words); output rows carry 4^(p % 4),
//      taken off once at the end.
// Dense pages (the active tail, bf16/fp16) take a slower path through the same accumulators.
//
// The recommended recipe's layout (kvbackend's quantwm keys) adds, each behind a compile-time switch:
//   - K_CHAN: keys with one scale and zero per channel and page (KIVI-style token groups of one page). The
//     scales fold into the query fragment once per page (normalized by the page's largest scale, a power of
//     two taken off the fp32 accumulator), the zeros into one score term per page and query row;
//   - K_CENT: one stage of K_CENT (<= 32) key centroids per chunk: a table q . centroid[j] per query row,
//     built on tensor cores when the chunk's codebook slot changes (every page with page-relative keys), and
//     one lookup by the token's assignment byte;
//   - OUT_N: sparse key outliers per page and head (a score term q[d] * value, on tensor cores: a one-hot A of
//     the outliers' values by token, the query at their channels as B). OUT_FOLD (pre-RoPE keys with key centroids,
//     at most 32 outliers): each token with outliers reads its own row of the centroid-value table instead, a copy of
//     the row it reads otherwise plus its outliers' values, so a key pays nothing for them and no score term follows;
//   - SINK: a request's first SINK tokens masked (the merge kernel attends to the exact sinks);
//   - VROT: Hadamard-rotated values: each warp keeps its packed pages' output apart from the dense pages',
//     and rotates it back once (a fast Walsh-Hadamard transform in shared memory) before the merge;
//   - PAGE_ROPE: keys stored de-rotated by their page's first position: the query turns by R(p0)^T once
//     per page, before the scales fold in;
//   - ROPE_TOKEN: keys stored before RoPE (head_dim 128). Nothing folds: each key is dequantized into the
//     fp16 operand (code x scale + zero + its centroid), and turned by R(t) for its position t in the page,
//     the RoPE partner of a thread's channel c being channel c + 64 of the same thread; the query turns by
//     R(p0)^T once per page. R(t) is a table in shared memory, filled once per CTA;
//   - PSAC_R (with ROPE_TOKEN): PSAC rows of rank PSAC_R (a multiple of 4), PSAC_ROWS per page and head
//     (PSAC_SPARSE: each names its token; else row i is token i): each row's correction basis x codes x scale
//     joins its token's key before RoPE, from fp16 pairs built once per page (the basis kept per slot).
//     PSAC_FOLD (sparse rows with key centroids): each row's correction plus its token's centroid is an extra
//     row (32 + row) of the centroid-value table, and the token reads that row instead of its centroid: the
//     correction costs nothing per key value (no per-token row test, no second add).
//   - K_CHW: keys at a width of their own per channel (`chw:...,order=lane`, keys after RoPE): per page and head one
//     block of CHW_BLOCK bytes at most, each token a row of the head's coded channels in lane order (per 16-channel
//     tile kt and thread column tig: channels 16 kt + 2 tig, +1, +8, +9, at widths 0-8, most significant bit first),
//     so the four codes a thread feeds the MMA lie in one 32-bit window (two byte-swapped words, one funnel shift);
//     a key is mean + (code + 0.5) step - amax, step = 2 amax / 2^w (the channel's mean where w = 0): the steps fold
//     into the query fragment once per page (as K_CHAN's scales), the rest into one score term per page and query
//     row (the means' part once per codebook slot). Per-head and per-tile constants come from `chw_heads` and
//     `chw_tiles` (`mma_decode.chw_tables`);
//   - WHOLE_N (with ROPE_TOKEN and K_CENT): whole key rows, WHOLE_N per page and head, each naming its token: the
//     row's INT8 codes x its fp16 scale plus what the token reads otherwise (its centroid, or its folded PSAC row) is
//     an extra row of the centroid-value table, after the folded PSAC rows, and the token reads that row instead.
//
// Compile-time configuration (-D): HEAD_DIM (64 or 128), PAGE (multiple of 16), KBITS (key codes: 2, or 3 or 4 with
// ROPE_TOKEN, read 16 codes of a lane at a time from 6 or 8 bytes and dequantized in place), KG / VG (scale groups per
// head: 1 or HEAD_DIM / 64), K_KIND / V_KIND (0 fp8 e4m3, 1 fp16, 2 bf16), K_SYM / V_SYM (symmetric: zero = -scale,
// -3 x scale for 3-bit keys, -7 x scale for 4-bit ones), Q_KIND / DENSE_KIND (1 fp16, 2 bf16; Q_KIND 3 fp32), NSTAGE,
// NWARPS, MINB.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef PAGE
#define PAGE 64
#endif
#ifndef KG
#define KG 2
#endif
#ifndef VG
#define VG 2
#endif
#ifndef K_KIND
#define K_KIND 1
#endif
#ifndef V_KIND
#define V_KIND 1
#endif
#ifndef K_SYM
#define K_SYM 0
#endif
#ifndef V_SYM
#define V_SYM 0
#endif
#ifndef Q_KIND
#define Q_KIND 2
#endif
#ifndef DENSE_KIND
#define DENSE_KIND 2
#endif
#ifndef NSTAGE
#define NSTAGE 2
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef K_CHAN
#define K_CHAN 0  // key scales and zeros per channel and page
#endif
#ifndef K_CENT
#define K_CENT 0  // key centroids of the chunk (one stage; 0 = none)
#endif
#ifndef C_KIND
#define C_KIND 0  // centroids: 0 fp8 e4m3 with an fp16 scale per stage and head, 2 bf16
#endif
#ifndef SINK
#define SINK 0
#endif
#ifndef OUT_N
#define OUT_N 0
#endif
#ifndef VROT
#define VROT 0
#endif
#ifndef PAGE_ROPE
#define PAGE_ROPE 0
#endif
#ifndef ROPE_TOKEN
#define ROPE_TOKEN 0
#endif
#ifndef PSAC_R
#define PSAC_R 0
#endif
#ifndef PSAC_ROWS
#define PSAC_ROWS 0
#endif
#ifndef PSAC_SPARSE
#define PSAC_SPARSE 0
#endif
#ifndef PSAC_FOLD
#define PSAC_FOLD 0
#endif
#ifndef WHOLE_N
#define WHOLE_N 0
#endif
#ifndef OUT_FOLD
#define OUT_FOLD 0
#endif
#ifndef K_CHW
#define K_CHW 0  // keys at a width per channel in lane order (`chw:...,order=lane`)
#endif
#ifndef CHW_BLOCK
#define CHW_BLOCK 0  // K_CHW: bytes of the largest head block of key codes (a multiple of 16)
#endif
#ifndef CHW_SFOLD
#define CHW_SFOLD 0  // K_CHW: each lane folds the steps of one tile column's four channels into a shared row per page
#endif                // (0: every lane folds its own 32 channels, 8 lanes alike each; the launcher's default is 1)
#ifndef CHW_QSMEM
#define CHW_QSMEM 0  // K_CHW: the query's fp16 pairs and the page's folded fragments in shared memory, not registers
#endif                // (an H100 timed it 6% slower, session 60)
#ifndef CHW_SWAP
#define CHW_SWAP 0  // K_CHW: the block's words byte-swapped in place once per page (not in every window; an H100
#endif               // timed it 10% slower, session 60)
#ifndef CHW_PREF
#define CHW_PREF 0  // K_CHW: the next channel tile's constants and query fragments loaded while this tile is read (the
#endif               // loop's loads off its dependence chain)
#ifndef CHW_SUBN
#define CHW_SUBN 0  // K_CHW: code pairs as fp16 subnormals (code x 2^-24, exact; no magic-number or, no subtraction),
#endif               // the 2^24 taken off with the scales' normalization after the product (the launcher's default)
#ifndef V_SUBN
#define V_SUBN 0  // packed pages' value codes as fp16 subnormals (code x 4^p x 2^-24, exact: one and, no magic-number or,
#endif             // no subtraction), the 2^24 put back on the packed part of the output once after the pages
#ifndef CHW_TAB
#define CHW_TAB 0  // K_CHW with CHW_SUBN: a tile's shifts and masks loaded from `chw_tab` (two 16-byte loads a tile)
#endif              // instead of decoded from its packed widths in the key loop
#ifndef CHW_W32
#define CHW_W32 0  // K_CHW: every head's token rows are whole 32-bit words (the launcher checks): a row's words from
#endif              // its own base, one shift a tile for all rows (no per-row bit address)
#ifndef CHW_PROBE
#define CHW_PROBE 0  // K_CHW timing probe, WRONG SCORES (the launcher refuses it outside benches): the key rows read
#endif                // are token 5 r mod P (1) or token 0 (2) instead of r, to time shared-memory bank conflicts
#ifndef CHW_UNROLL
#define CHW_UNROLL 0  // K_CHW: unroll the key loop over channel tiles (more registers: ptxas spills at 255)
#endif
#ifndef KBITS
#define KBITS 2  // key code width: 2, or 3 or 4 with pre-RoPE keys (ROPE_TOKEN; 8 codes in 3 bytes or 2 in a byte, the
                 // first in the top bits)
#endif
// folded rows, few of them: each lane keeps the rows' tokens in registers and compares (no token -> row map)
#define PSAC_REGMAP (PSAC_FOLD && PSAC_ROWS <= 8)
#ifndef MINB
#define MINB 0  // CTAs per SM the register allocation must allow (__launch_bounds__); 0: the compiler's choice
#endif
#if MINB > 0
#define KERNEL_BOUNDS __launch_bounds__(NWARPS * 32, MINB)
#else
#define KERNEL_BOUNDS __launch_bounds__(NWARPS * 32)
#endif

constexpr int D = HEAD_DIM;
constexpr int P = PAGE;
constexpr int ROWB = D / 4;        // bytes of one token's 2-bit codes for one head
constexpr int NCH = ROWB / 16;     // 16-byte chunks per row (1 or 2)
constexpr int KROWB = D * KBITS / 8;  // bytes of one token's key codes for one head (ROWB, 48 at 3 bits, 64 at 4)
constexpr int KNCH = KROWB / 16;
constexpr float KSYM_ZERO = static_cast<float>((1 << (KBITS - 1)) - 1);  // symmetric keys: zero = -this x scale
constexpr int NB = D / 64;         // 64-channel blocks
constexpr int MT = P / 16;         // token tiles per page
constexpr int N = 8;               // query rows per MMA (the GQA group, padded)
constexpr int KES = K_KIND == 0 ? 1 : 2;  // bytes of a key scale element
constexpr int VES = V_KIND == 0 ? 1 : 2;
constexpr int KCH_BYTES = K_CHAN ? 2 * D * KES : K_CHW ? 2 * D + 16 : 0;  // per-channel key scales, then zeros;
                                                                       // K_CHW: the head's fp16 absmaxes (+ alignment)
constexpr int KC_BYTES = K_CHW ? CHW_BLOCK + 16 : P * KROWB;  // the stage's key codes (K_CHW: the head's block and one
                                                              // spare word for the last window)
constexpr int OUT_BYTES = OUT_N ? (8 * OUT_N + 15) / 16 * 16 : 0;   // outlier index words, value words
constexpr int ROPE_BYTES = (PAGE_ROPE || ROPE_TOKEN) ? 4 * D : 0;   // R(p0): cos [D/2], sin [D/2] floats
constexpr int PS_BYTES = PSAC_R ? (PSAC_ROWS * PSAC_R + 8 * PSAC_ROWS + 15) / 16 * 16 : 0;  // PSAC codes, scale and
                                                                                          // token words per row
constexpr int WH_BYTES = WHOLE_N ? (WHOLE_N * D + 8 * WHOLE_N + 15) / 16 * 16 : 0;  // whole rows: codes [rows][D],
                                                                                   // scale and token words per row
// key codes, value codes, 4 words per token (k scale or centroid id, k zero, v scale, v zero), then the above
constexpr int STAGE_BYTES = KC_BYTES + P * ROWB + 4 * P * 4 + KCH_BYTES + OUT_BYTES + ROPE_BYTES + PS_BYTES + WH_BYTES;
constexpr int SP_BYTES = VG * P * N * 2;                             // P'^T per value scale group, fp16 [token][q]
constexpr int CT_BYTES = (K_CENT && !ROPE_TOKEN) ? 32 * N * 4 + 2 * (D / 64) * 4 * 4 * 32 * 4 : 0;  // centroid
                                                    // table [32][N] f32, then its A fragments (2 NB 16 words x 32 lanes)
constexpr int WROW0 = 32 + (PSAC_FOLD ? PSAC_ROWS : 0);  // centroid values, then the page's folded PSAC rows,
constexpr int OROW0 = WROW0 + WHOLE_N;                   // then its whole rows,
constexpr int CV_ROWS = OROW0 + (OUT_FOLD ? OUT_N : 0);  // then one row per outlier lane (OUT_FOLD)
// The row a centroid id past K_CENT (a corrupted page) reads: zero, so it adds nothing, as in the gather kernels.
// Rows K_CENT..31 are zero where K_CENT < 32; with 32 centroids one more zero row follows the folded rows.
constexpr int CV_ZERO = K_CENT < 32 ? 31 : CV_ROWS;
constexpr int CV_BYTES = (K_CENT && ROPE_TOKEN) ? (CV_ROWS + (K_CENT < 32 ? 0 : 1)) * D * 2 : 0;  // pre-RoPE keys:
                                                                                    // centroid values, fp16 pairs
// PSAC rows: the slot's basis [D][R] bf16, the page's corrections [rows][D / 2] fp16 pairs, token -> row map [P]
constexpr int PB_BYTES = PSAC_R ? D * PSAC_R * 2 + (PSAC_FOLD ? 0 : PSAC_ROWS * D * 2) + (P + 15) / 16 * 16 : 0;
constexpr int CF_BYTES = (K_CHW && CHW_SFOLD) ? 2 * D * 4 : 0;  // K_CHW: the page's folded steps and zero terms [2][D]
constexpr int QS_BYTES = (K_CHW && CHW_QSMEM) ? 2 * (D / 16) * 2 * 32 * 4 : 0;  // K_CHW: [query | page][tile][2][lane]
constexpr int WARP_BYTES = NSTAGE * STAGE_BYTES + SP_BYTES + CT_BYTES + CV_BYTES + PB_BYTES + CF_BYTES + QS_BYTES;
constexpr int RING_BYTES = NWARPS * WARP_BYTES;
constexpr int ROT_BYTES = ROPE_TOKEN ? 2 * P * D : 0;  // R(t): cos and sin [P][D / 4] fp16 pairs (c, c + 8)
// Rotated values: each warp's packed output [N][D] f32 waits, while the other warps still stream pages, in the
// warp's own stage buffers where they hold it (free once its last page is read), else in an area of its own
constexpr bool VROT_IN_RING = VROT && NSTAGE * STAGE_BYTES >= N * D * 4;
constexpr int MERGE_OFF = (VROT && !VROT_IN_RING) ? RING_BYTES + ROT_BYTES : 0;
constexpr int MERGE_BYTES = NWARPS * N * D * 4 + 2 * NWARPS * N * 4;
constexpr int SMEM_BYTES = (VROT && !VROT_IN_RING)
                               ? MERGE_OFF + MERGE_BYTES
                               : (RING_BYTES + ROT_BYTES > MERGE_BYTES ? RING_BYTES + ROT_BYTES : MERGE_BYTES);
#ifdef SMEM_EXPECTED  // the launcher's count of the dynamic shared memory (mma_decode.Config.smem_bytes)
static_assert(SMEM_EXPECTED == SMEM_BYTES, "the launcher's shared-memory size differs from the kernel's");
#endif

static_assert(D == 64 || D == 128, "head_dim 64 or 128");
static_assert(P % 16 == 0 && P >= 16 && P <= 256, "page size a multiple of 16");
static_assert(KG == 1 || KG == NB, "key scale groups: one per head or one per 64 channels");
static_assert(!CHW_TAB || (K_CHW && CHW_SUBN && !CHW_PREF), "the tile tables hold the subnormal pairs' shifts");
static_assert(!CHW_W32 || (K_CHW && !CHW_PROBE), "whole-word rows: the chw keys, no timing probe");
static_assert(!K_CHW || (KG == 1 && !K_CHAN && !K_CENT && !OUT_N && !PAGE_ROPE && !ROPE_TOKEN && !PSAC_R && !WHOLE_N
                         && KBITS == 2 && CHW_BLOCK > 0 && CHW_BLOCK % 16 == 0),
              "keys at a width per channel: keys after RoPE, no centroids, outliers, PSAC or whole rows");
static_assert(VG == 1 || VG == NB, "value scale groups: one per head or one per 64 channels");
static_assert(!K_CHAN || KG == 1, "per-channel key scales fold into the query: one accumulator");
static_assert(!PAGE_ROPE || K_CHAN, "page-relative keys are read with per-channel key scales");
static_assert(!ROPE_TOKEN || (K_CHAN && D == 128 && !PAGE_ROPE), "pre-RoPE keys: per-channel scales, head_dim 128");
static_assert(!PSAC_R || (ROPE_TOKEN && PSAC_R % 4 == 0 && PSAC_R <= 16 && PSAC_ROWS >= 1 && PSAC_ROWS <= P
                          && (PSAC_SPARSE ? PSAC_ROWS <= 127 : PSAC_ROWS == P)),
              "PSAC rows: with pre-RoPE keys, rank 4/8/12/16, sparse rows <= 127 (the token -> row map is signed bytes)");
static_assert(KBITS == 2 || ((KBITS == 3 || KBITS == 4) && ROPE_TOKEN),
              "3- and 4-bit keys: pre-RoPE keys only (dequantized per key value)");
static_assert(!K_CENT || (K_CHAN && K_CENT <= 32), "up to 32 centroids, with per-channel key scales");
static_assert(OUT_N <= 64 && SINK <= P, "at most 64 outliers per page; sinks within the first page");
static_assert(!OUT_FOLD || (ROPE_TOKEN && K_CENT && OUT_N >= 1 && OUT_N <= 32),
              "outliers folded into the centroid-value table: pre-RoPE keys with key centroids, 1 to 32 per page");
static_assert(!WHOLE_N || (ROPE_TOKEN && K_CENT && WHOLE_N <= 8 && P <= 256),
              "whole key rows: with pre-RoPE keys and key centroids, at most 8 per page and head");
static_assert(!PSAC_FOLD || (PSAC_R && PSAC_SPARSE && K_CENT && ROPE_TOKEN && PSAC_ROWS <= 32),
              "folded PSAC rows: sparse rows (at most 32) with key centroids and pre-RoPE keys");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(smem_u32(p)));
}

// Codes at positions p and p + 8 of a code word (bits 2p and 16 + 2p; p < 4 after the caller's shift by 8
// for positions 4..7) as half2 (code * 4^p): masked in place into the mantissa of 1024, then 1024 taken off.
template <int p>
__device__ __forceinline__ uint32_t codes_x4p(uint32_t w) {
  uint32_t h;  // (w & mask) | magic as one lop3 (the compiler otherwise emits an and and an or)
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(h) : "r"(w), "n"(0x00030003u << (2 * p)), "r"(0x64006400u));
  __half2 x = *reinterpret_cast<__half2*>(&h);
  x = __hsub2(x, __floats2half2_rn(1024.f, 1024.f));
  return *reinterpret_cast<uint32_t*>(&x);
}

// codes_x4p<p> as fp16 subnormals (code * 4^p * 2^-24, exact): the bits masked in place (V_SUBN).
template <int p>
__device__ __forceinline__ uint32_t codes_x4s(uint32_t w) { return w & (0x00030003u << (2 * p)); }

// codes_x4p<q> for a q known once loops are unrolled.
__device__ __forceinline__ uint32_t codes_at(uint32_t w, int q) {
  switch (q) {
    case 0: return codes_x4p<0>(w);
    case 1: return codes_x4p<1>(w);
    case 2: return codes_x4p<2>(w);
    default: return codes_x4p<3>(w);
  }
}

// 3-bit codes i (0..3) of the two 12-bit halves of w (the first code in the top bits) as half2, exact.
template <int i>
__device__ __forceinline__ uint32_t codes3_x(uint32_t w) {
  uint32_t h;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(h) : "r"(w >> (9 - 3 * i)), "n"(0x00070007u), "r"(0x64006400u));
  __half2 x = *reinterpret_cast<__half2*>(&h);
  x = __hsub2(x, __floats2half2_rn(1024.f, 1024.f));
  return *reinterpret_cast<uint32_t*>(&x);
}

__device__ __forceinline__ uint32_t codes3_at(uint32_t w, int i) {
  switch (i) {
    case 0: return codes3_x<0>(w);
    case 1: return codes3_x<1>(w);
    case 2: return codes3_x<2>(w);
    default: return codes3_x<3>(w);
  }
}

// 4-bit codes of channels j and j + 8 (0 <= j < 8) of a lane's 16 (w0: the bytes of channels 0..7, w1: 8..15, two
// codes a byte, the first in the top bits) as half2, exact: byte j / 2 of each word into bytes 0 and 2, the nibble
// masked into the mantissa of 1024, then 1024 taken off.
template <int j>
__device__ __forceinline__ uint32_t codes4_x(uint32_t w0, uint32_t w1) {
  constexpr uint32_t k = j >> 1;
  const uint32_t x = __byte_perm(w0, w1, k | ((4 + k) << 8));
  uint32_t h;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(h) : "r"((j & 1) ? x : x >> 4), "n"(0x000F000Fu), "r"(0x64006400u));
  __half2 y = *reinterpret_cast<__half2*>(&h);
  y = __hsub2(y, __floats2half2_rn(1024.f, 1024.f));
  return *reinterpret_cast<uint32_t*>(&y);
}

__device__ __forceinline__ uint32_t codes4_at(uint32_t w0, uint32_t w1, int j) {
  switch (j) {
    case 0: return codes4_x<0>(w0, w1);
    case 1: return codes4_x<1>(w0, w1);
    case 2: return codes4_x<2>(w0, w1);
    case 3: return codes4_x<3>(w0, w1);
    case 4: return codes4_x<4>(w0, w1);
    case 5: return codes4_x<5>(w0, w1);
    case 6: return codes4_x<6>(w0, w1);
    default: return codes4_x<7>(w0, w1);
  }
}

__device__ __forceinline__ __half2 as_half2(uint32_t x) { return *reinterpret_cast<__half2*>(&x); }
__device__ __forceinline__ uint32_t as_u32(__half2 x) { return *reinterpret_cast<uint32_t*>(&x); }

// K_CHW: two codes (lo at bit 0 under mask m_lo, hi at bit p_hi under mask m_hi16 once moved to bit 16) as the half2
// (lo, hi), exact in fp16 (the codes or-ed into the mantissa of 1024, then 1024 taken off).
__device__ __forceinline__ uint32_t chw_pair(uint32_t x, uint32_t m_lo, int p_hi, uint32_t m_hi16) {
  const uint32_t v = (x & m_lo) | ((x << (16 - p_hi)) & m_hi16) | 0x64006400u;
  __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&v), __float2half2_rn(1024.f));
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 x = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&x);
}

template <int KIND>
__device__ __forceinline__ float element(uint32_t word, int byte) {  // a float of kind KIND at byte `byte` of word
  if (KIND == 0) {
    __nv_fp8_e4m3 x;
    x.__x = static_cast<__nv_fp8_storage_t>((word >> (8 * byte)) & 0xFF);
    return static_cast<float>(x);
  } else if (KIND == 1) {
    uint16_t b = static_cast<uint16_t>(word >> (8 * byte));
    return __half2float(*reinterpret_cast<__half*>(&b));
  } else {
    uint16_t b = static_cast<uint16_t>(word >> (8 * byte));
    return __bfloat162float(*reinterpret_cast<__nv_bfloat16*>(&b));
  }
}

template <int KIND>
__device__ __forceinline__ float load_float(const void* base, int64_t index) {
  if (KIND == 1) return __half2float(reinterpret_cast<const __half*>(base)[index]);
  if (KIND == 2) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[index]);
  return reinterpret_cast<const float*>(base)[index];
}

// Two dense-page elements (one 32-bit word of bf16 or fp16) as an fp16x2 operand; one element as float.
__device__ __forceinline__ uint32_t dense_half2(uint32_t w) {
  if (DENSE_KIND == 1) return w;
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  return pack_half2(f.x, f.y);
}

__device__ __forceinline__ float dense_element(uint32_t w, int high) {
  const uint16_t b = static_cast<uint16_t>(high ? w >> 16 : w);
  if (DENSE_KIND == 1) return __half2float(*reinterpret_cast<const __half*>(&b));
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&b));
}

// Channel of position p (0..15) in 32-bit code word `word` of a token's row: bytes hold their first code in
// the top bits, a little-endian word bytes 0..3 in bits 0..31.
__device__ __forceinline__ int word_channel(int word, int p) { return 16 * word + 4 * (p >> 2) + 3 - (p & 3); }

// Byte offset in the stage buffer of 16-byte chunk c of token t's row (chunks swizzled so the fragment
// reads below are free of bank conflicts).
__device__ __forceinline__ int chunk_offset(int t, int c) {
  return t * ROWB + ((NCH == 2 ? (c ^ ((t >> 2) & 1)) : c) << 4);
}

// Byte offset of 16-byte chunk c of token t's key row: as `chunk_offset` at 2 bits, in order at 3 bits; at 4 bits
// (64-byte rows, head_dim 128) chunk c of row t sits at c ^ (2 (bit 1 of t) + bit 2 of t): rows t and t + 2 start on
// the same bank, so each half-warp's 8-byte reads (4 rows, a lane's 8 bytes at chunk 2 b + tig / 2) then cover all 32
// banks once.
__device__ __forceinline__ int key_swizzle(int t) { return (((t >> 1) & 1) << 1) | ((t >> 2) & 1); }
__device__ __forceinline__ int key_chunk_offset(int t, int c) {
  return KBITS == 2 ? chunk_offset(t, c) : KBITS == 4 ? t * KROWB + ((c ^ key_swizzle(t)) << 4) : t * KROWB + (c << 4);
}

// Output channel of value-accumulator row (tile J, row gid + 8 e) and its power-of-four factor's exponent.
__device__ __forceinline__ int value_channel(int J, int gid, int e) {
  int b = J >> 2, k = 2 * (J & 3) + e;
  return 64 * b + 8 * gid + 4 * (k >> 2) + 3 - (k & 3);
}

struct Params {
  const void* q;
  float* o_part;
  float* m_part;
  float* l_part;
  const uint8_t* pages;
  const void* dense;
  const int* page_ids;
  const int* valid;
  const int* req_start;
  const int* req_pages;
  const int* req_packed;
  float scale_log2;
  int pages_per_split;
  int num_splits;
  int H;
  int group;
  long long page_bytes;
  int k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros;
  // the recipe's fields (read where the switches above say so)
  const uint8_t* book;     // the layer's codebook slots
  const int* slots;        // codebook slot of each work page
  const float* base_cos;   // [pages, D/2] R(p0) of a request's page j (page-relative keys)
  const float* base_sin;
  long long book_bytes;
  int k_assign, k_book, k_cscale, out_index, out_value;
  const float* local_cos;  // [P, D/2] R(t) within a page, RoPE's scaling included (pre-RoPE keys)
  const float* local_sin;
  int psac_codes, psac_scale, psac_token, psac_basis;  // PSAC rows: page fields, and the basis in the slot
  int whole_codes, whole_scale, whole_token;           // whole key rows: page fields
  const int* chw_heads;       // K_CHW: [H][8] block's first byte, its bytes, a token's bits, first absmax, absmaxes
  const uint32_t* chw_tiles;  // K_CHW: [H][D / 16][4][2] per tile and thread column: bit offset in the row | widths
                              // << 12 (4 bits each), and the four channels' absmax indices (8 bits each, 255 none)
  int k_mean;                 // K_CHW: the chunk's channel means [H, D] fp16 in the codebook slot
  const uint4* chw_tab;       // K_CHW && CHW_TAB: [H][D / 16][4][2] per tile and thread column: bit offset, s01,
                              // 32 - s01, 32 - w2 - w3 | 16 - w1, 16 - w3, the two pairs' masks
};

// K_CHW: one head's constants (per CTA)
struct ChwHead {
  int first, bytes, bits, amax_lo, amax_hi;  // block [first, first + bytes) in the key field; absmax words' bytes
  int amax_off;                              // the head's first absmax within the copied words (0 or 2 bytes)
};

__device__ __forceinline__ void issue_page(uint8_t* stage, const Params& a, int page, int j, int h, int lane,
                                           const ChwHead& ch = ChwHead{}) {
  const uint8_t* base = a.pages + static_cast<int64_t>(page) * a.page_bytes;
  uint8_t* kc = stage;
  uint8_t* vc = stage + KC_BYTES;
  uint32_t* words = reinterpret_cast<uint32_t*>(stage + KC_BYTES + P * ROWB);  // [4][P]: k scale, k zero, v scale,
                                                                               // v zero
  uint8_t* extra = stage + KC_BYTES + P * ROWB + 4 * P * 4;  // per-channel key scales, outliers, R(p0)
  if (K_CHW) {  // the head's block of key codes, its absmaxes (whole words), then the value codes
    for (int i = lane; i < ch.bytes / 16; i += 32) cp_async16(kc + 16 * i, base + a.k_codes + ch.first + 16 * i);
    for (int i = lane; ch.amax_lo + 4 * i < ch.amax_hi; i += 32) cp_async4(extra + 4 * i, base + ch.amax_lo + 4 * i);
#pragma unroll
    for (int i = lane; i < P * NCH; i += 32) {
      int t = i / NCH, c = i % NCH;
      cp_async16(vc + chunk_offset(t, c), base + a.v_codes + static_cast<int64_t>(t * a.H + h) * ROWB + 16 * c);
    }
  } else if (KBITS == 2) {
#pragma unroll
    for (int i = lane; i < P * NCH; i += 32) {
      int t = i / NCH, c = i % NCH;
      int64_t row = static_cast<int64_t>(t * a.H + h) * ROWB + 16 * c;
      cp_async16(kc + chunk_offset(t, c), base + a.k_codes + row);
      cp_async16(vc + chunk_offset(t, c), base + a.v_codes + row);
    }
  } else {
#pragma unroll
    for (int i = lane; i < P * KNCH; i += 32) {
      int t = i / KNCH, c = i % KNCH;
      cp_async16(kc + key_chunk_offset(t, c), base + a.k_codes + static_cast<int64_t>(t * a.H + h) * KROWB + 16 * c);
    }
#pragma unroll
    for (int i = lane; i < P * NCH; i += 32) {
      int t = i / NCH, c = i % NCH;
      cp_async16(vc + chunk_offset(t, c), base + a.v_codes + static_cast<int64_t>(t * a.H + h) * ROWB + 16 * c);
    }
  }
#pragma unroll
  for (int t = lane; t < P; t += 32) {
    int ko = (t * a.H + h) * KG * KES, vo = (t * a.H + h) * VG * VES;
    if (K_CHW) {
    } else if (!K_CHAN) {
      cp_async4(words + t, base + a.k_scales + (ko & ~3));
      if (!K_SYM) cp_async4(words + P + t, base + a.k_zeros + (ko & ~3));
    } else if (K_CENT) {  // the word holding the token's centroid id (assignments [1, P, H] bytes)
      cp_async4(words + t, base + a.k_assign + ((t * a.H + h) & ~3));
    }
    cp_async4(words + 2 * P + t, base + a.v_scales + (vo & ~3));
    if (!V_SYM) cp_async4(words + 3 * P + t, base + a.v_zeros + (vo & ~3));
  }
  if (K_CHAN) {  // scales and zeros [1, H, D] of the page: D * KES bytes each, contiguous per head
    constexpr int CH = D * KES / 16;
    for (int i = lane; i < 2 * CH; i += 32) {
      if (i >= CH && K_SYM) break;
      const int field = i < CH ? a.k_scales : a.k_zeros;
      cp_async16(extra + 16 * i, base + field + h * D * KES + 16 * (i % CH));
    }
  }
  if (OUT_N) {  // the 32-bit words holding outlier i's int16 position and fp16 value ([OUT_N, H] each)
    uint32_t* out = reinterpret_cast<uint32_t*>(extra + KCH_BYTES);
    for (int i = lane; i < OUT_N; i += 32) {
      const int at = ((i * a.H + h) * 2) & ~3;
      cp_async4(out + i, base + a.out_index + at);
      cp_async4(out + OUT_N + i, base + a.out_value + at);
    }
  }
  if (PSAC_R) {  // per row: its R codes (R / 4 words), the word holding its fp16 scale, and its token's byte
    uint32_t* ps = reinterpret_cast<uint32_t*>(extra + KCH_BYTES + OUT_BYTES + ROPE_BYTES);
    for (int i = lane; i < PSAC_ROWS * (PSAC_R / 4 + 2); i += 32) {
      const int row = i / (PSAC_R / 4 + 2), part = i % (PSAC_R / 4 + 2);
      if (part < PSAC_R / 4) {
        cp_async4(ps + row * (PSAC_R / 4) + part, base + a.psac_codes + (row * a.H + h) * PSAC_R + 4 * part);
      } else if (part == PSAC_R / 4) {
        cp_async4(ps + PSAC_ROWS * PSAC_R / 4 + row, base + a.psac_scale + (((row * a.H + h) * 2) & ~3));
      } else if (PSAC_SPARSE) {
        cp_async4(ps + PSAC_ROWS * (PSAC_R / 4 + 1) + row, base + a.psac_token + ((row * a.H + h) & ~3));
      }
    }
  }
  if (WHOLE_N) {  // per row: its D int8 codes (16-byte chunks), the word holding its fp16 scale and its token's byte
    uint8_t* wh = extra + KCH_BYTES + OUT_BYTES + ROPE_BYTES + PS_BYTES;
    uint32_t* ww = reinterpret_cast<uint32_t*>(wh + WHOLE_N * D);
    constexpr int WCH = D / 16;
    for (int i = lane; i < WHOLE_N * (WCH + 2); i += 32) {
      const int row = i / (WCH + 2), part = i % (WCH + 2);
      if (part < WCH) {
        cp_async16(wh + row * D + 16 * part, base + a.whole_codes + static_cast<int64_t>(row * a.H + h) * D + 16 * part);
      } else if (part == WCH) {
        cp_async4(ww + row, base + a.whole_scale + (((row * a.H + h) * 2) & ~3));
      } else {
        cp_async4(ww + WHOLE_N + row, base + a.whole_token + ((row * a.H + h) & ~3));
      }
    }
  }
  if (PAGE_ROPE || ROPE_TOKEN) {  // cos and sin of R(p0) for the request's page j: D / 2 floats each
    constexpr int CH = D / 2 * 4 / 16;
    uint8_t* rope = extra + KCH_BYTES + OUT_BYTES;
    for (int i = lane; i < 2 * CH; i += 32) {
      const float* table = i < CH ? a.base_cos : a.base_sin;
      cp_async16(rope + 16 * i, table + static_cast<int64_t>(j) * (D / 2) + 4 * (i % CH));
    }
  }
}

// Key scale or zero (field 0 or 1) of channel ch, from the stage's per-channel region.
__device__ __forceinline__ float kchan_element(const uint8_t* kch, int field, int ch) {
  const uint8_t* at = kch + field * D * KES + ch * KES;
  if (K_KIND == 0) {
    __nv_fp8_e4m3 x;
    x.__x = static_cast<__nv_fp8_storage_t>(*at);
    return static_cast<float>(x);
  } else if (K_KIND == 1) {
    return __half2float(*reinterpret_cast<const __half*>(at));
  }
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at));
}

// Centroid value j (0..15) of a row block of 16 channels loaded as raw words (fp8: 4 words, bf16: 8).
__device__ __forceinline__ float centroid_value(const uint32_t* r, int j) {
  if (C_KIND == 0) return element<0>(r[j >> 2], j & 3);
  return element<2>(r[j >> 1], 2 * (j & 1));
}

// Key centroids as the A operand of the table product q . centroid (M = 32 rows in two tiles, K = channels
// in the query fragments' order, each value times 4^(p % 4) / 64 to undo the fragment's 4^-(p % 4) without
// leaving fp16's range: a bf16 centroid of 1024 times 64 would be inf), built once per codebook slot into this
// warp's shared memory (CF words per lane, interleaved by lane); rows >= K_CENT are zero. Returns the factor
// the table takes on: 64 times the fp16 scale of fp8 centroids (64 for bf16).
__device__ __noinline__ float centroid_fragments(uint32_t* cf, const Params& a, int64_t slot, int h, int gid,
                                                 int tig, int lane) {
  constexpr int CES = C_KIND == 0 ? 1 : 2;  // bytes per centroid value
  constexpr int RW = 4 * CES;               // words per 16 channels
  const uint8_t* book = a.book + slot * a.book_bytes;
  const float cs = C_KIND == 0 ? __half2float(*reinterpret_cast<const __half*>(book + a.k_cscale + 2 * h)) : 1.f;
  const uint8_t* cents = book + a.k_book + static_cast<int64_t>(h) * K_CENT * D * CES;  // stage 0: [H, C, D]
#pragma unroll
  for (int m2 = 0; m2 < 2; ++m2) {
    const int j0 = 16 * m2 + gid, j1 = j0 + 8;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int w = 4 * b + tig;
      uint32_t r0[RW], r1[RW];
#pragma unroll
      for (int x = 0; x < RW / 4; ++x) {
        uint4 u0 = make_uint4(0u, 0u, 0u, 0u), u1 = make_uint4(0u, 0u, 0u, 0u);
        if (j0 < K_CENT) u0 = *reinterpret_cast<const uint4*>(cents + (j0 * D + 16 * w) * CES + 16 * x);
        if (j1 < K_CENT) u1 = *reinterpret_cast<const uint4*>(cents + (j1 * D + 16 * w) * CES + 16 * x);
        r0[4 * x] = u0.x; r0[4 * x + 1] = u0.y; r0[4 * x + 2] = u0.z; r0[4 * x + 3] = u0.w;
        r1[4 * x] = u1.x; r1[4 * x + 1] = u1.y; r1[4 * x + 2] = u1.z; r1[4 * x + 3] = u1.w;
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // a0/a1: positions (2 ks, 2 ks + 8) of rows j0/j1; a2/a3: (2 ks + 1, 2 ks + 9)
          const int p = 2 * ks + e;
          const int jl = 4 * (p >> 2) + 3 - (p & 3);
          const float f = static_cast<float>(1 << (2 * (p & 3))) * (1.f / 64.f);
          const int at = ((m2 * NB + b) * 4 + ks) * 4 + 2 * e;
          cf[at * 32 + lane] = pack_half2(centroid_value(r0, jl) * f, centroid_value(r0, jl + 8) * f);
          cf[(at + 1) * 32 + lane] = pack_half2(centroid_value(r1, jl) * f, centroid_value(r1, jl + 8) * f);
        }
    }
  }
  return cs * 64.f;
}

// Shared-memory swizzle of R(t) (rows of 32 words), read as 8-byte pairs of words (2 m, 2 m + 1): pair m of row
// ``row`` lies at m ^ (row & 3), so the 4 tokens of a half-warp's 8-byte load phase spread over 4 bank pairs.
__device__ __forceinline__ int swz(int k, int row) { return k ^ ((row & 3) << 1); }

// The two words (2 m, 2 m + 1) of ``row`` in a swizzled table with rows of ``width`` words.
__device__ __forceinline__ uint2 pair_at(const uint32_t* table, int width, int row, int k) {
  return *reinterpret_cast<const uint2*>(table + row * width + swz(k, row));
}

// Shared-memory swizzle of the centroid values (rows of 64 words), read as 16-byte quads of words (4 q .. 4 q + 3):
// within each 8-word group, quad q of row ``row`` lies at q ^ (row & 1), so the 2 tokens of a quarter-warp's 16-byte
// load phase read different banks when their rows differ in the last bit (4-way choices of the 8-byte pairs gave
// about 2x the ideal wavefronts for rows that are random centroid ids).
__device__ __forceinline__ int swzc(int k, int row) { return k ^ ((row & 1) << 2); }

// The four words 4 q .. 4 q + 3 (k = 4 q) of ``row`` in the centroid-value table.
__device__ __forceinline__ uint4 quad_at(const uint32_t* table, int width, int row, int k) {
  return *reinterpret_cast<const uint4*>(table + row * width + swzc(k, row));
}

// PSAC basis in shared memory: fp16 pairs (U[c][r], U[c + 8][r]) at word i * R + r for pair i, c = 16 (i / 8) + i % 8
// (the key operand's channel pairs), so one 16-byte load gives a pair's four ranks and one HFMA2 per rank builds its
// correction; lanes read consecutive 16-byte rows (no bank conflict).

// Pre-RoPE keys: the slot's centroids times their scale as fp16 pairs (channels c, c + 8), c = 16 w + jl:
// cv[a * D / 2 + swzc(8 w + jl, a)] for centroid a, w in 0..D/16-1, jl in 0..7; rows a >= K_CENT are zero.

// A lane loads whole 16-channel blocks of centroid rows (16 or 32 bytes each), CV_LOADS blocks at a time with every
// load issued before the first use: a slot change costs a few memory round trips, not one per value (one byte load
// per value cost about 20 us a slot, 25-40% of the recipe's decode, session 46).
constexpr int CV_BLOCKS = 32 * (D / 16);  // (row, 16-channel block) pairs of the table
constexpr int CV_LOADS = 4;               // blocks in flight per lane

__device__ __noinline__ void centroid_values(uint32_t* cv, const Params& a, int64_t slot, int h, int lane) {
  constexpr int CES = C_KIND == 0 ? 1 : 2;
  constexpr int RW = 4 * CES;  // words per 16 channels
  const uint8_t* book = a.book + slot * a.book_bytes;
  const float cs = C_KIND == 0 ? __half2float(*reinterpret_cast<const __half*>(book + a.k_cscale + 2 * h)) : 1.f;
  const uint8_t* cents = book + a.k_book + static_cast<int64_t>(h) * K_CENT * D * CES;
#pragma unroll 1
  for (int j0 = 0; j0 < CV_BLOCKS; j0 += 32 * CV_LOADS) {
    uint32_t r[CV_LOADS][RW];
#pragma unroll
    for (int n = 0; n < CV_LOADS; ++n) {
      const int j = j0 + lane + 32 * n, row = j / (D / 16), w = j % (D / 16);
#pragma unroll
      for (int x = 0; x < RW / 4; ++x) {
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (j < CV_BLOCKS && row < K_CENT) u = *reinterpret_cast<const uint4*>(cents + (row * D + 16 * w) * CES + 16 * x);
        r[n][4 * x] = u.x; r[n][4 * x + 1] = u.y; r[n][4 * x + 2] = u.z; r[n][4 * x + 3] = u.w;
      }
    }
#pragma unroll
    for (int n = 0; n < CV_LOADS; ++n) {
      const int j = j0 + lane + 32 * n, row = j / (D / 16), w = j % (D / 16);
      if (j < CV_BLOCKS) {
#pragma unroll
        for (int jl = 0; jl < 8; ++jl)  // channels c = 16 w + jl and c + 8 of centroid ``row``
          cv[row * (D / 2) + swzc(8 * w + jl, row)] =
              pack_half2(centroid_value(r[n], jl) * cs, centroid_value(r[n], jl + 8) * cs);
      }
    }
  }
  if (CV_ZERO >= 32)
    for (int i = lane; i < D / 2; i += 32) cv[CV_ZERO * (D / 2) + swzc(i, CV_ZERO)] = 0u;
}

// A PSAC row of a page's extra block ``ps`` (codes [ROWS][R] int8, scales [ROWS] fp16, token bytes [ROWS]; ``rh``
// = row * H + head picks a head's scale and token): the token it corrects (>= P: none), its coefficients (codes x
// scale, fp16 pairs, as the Triton path), and its correction of channels (c, c + 8) at pair index i, summed in fp16.
__device__ __forceinline__ int psac_token(const uint32_t* ps, int row, int rh) {
  return (ps[PSAC_ROWS * (PSAC_R / 4 + 1) + row] >> (8 * (rh & 3))) & 0xFF;
}
__device__ __forceinline__ void psac_coefs(const uint32_t* ps, int row, int rh, __half2 (&coef)[PSAC_R > 0 ? PSAC_R : 1]) {
  const uint16_t sb = static_cast<uint16_t>(ps[PSAC_ROWS * PSAC_R / 4 + row] >> (16 * (rh & 1)));
  const float scale = __half2float(*reinterpret_cast<const __half*>(&sb));
  const signed char* codes = reinterpret_cast<const signed char*>(ps + row * (PSAC_R / 4));
#pragma unroll
  for (int rr = 0; rr < PSAC_R; ++rr) coef[rr] = __float2half2_rn(static_cast<float>(codes[rr]) * scale);
}
__device__ __forceinline__ __half2 psac_fix(const uint4* pbasis, int i, const __half2 (&coef)[PSAC_R > 0 ? PSAC_R : 1]) {
  __half2 fix = __float2half2_rn(0.f);
#pragma unroll
  for (int q = 0; q < PSAC_R / 4; ++q) {
    const uint4 u = pbasis[i * (PSAC_R / 4) + q];
    fix = __hfma2(coef[4 * q], as_half2(u.x), fix);
    fix = __hfma2(coef[4 * q + 1], as_half2(u.y), fix);
    fix = __hfma2(coef[4 * q + 2], as_half2(u.z), fix);
    fix = __hfma2(coef[4 * q + 3], as_half2(u.w), fix);
  }
  return fix;
}
// The centroid whose values a folded PSAC row adds: its token's id, checked (a corrupted id, or no token, adds none).
__device__ __forceinline__ int psac_centroid(const uint32_t* words, int tok, int H, int h) {
  int cid = tok < P ? (words[tok] >> (8 * ((tok * H + h) & 3))) & 0xFF : 0;
  return cid < K_CENT ? cid : CV_ZERO;
}

// The centroid-value row token t reads before its whole rows: its centroid (a corrupted id: the zero row), or the
// last folded PSAC row naming it (``ptok``: the rows' tokens in registers; else the token -> row map ``pmap``).
template <int N_>
__device__ __forceinline__ int token_row(const uint32_t* words, const int (&ptok)[N_], const signed char* pmap, int t,
                                         int H, int h) {
  const int id = (words[t] >> (8 * ((t * H + h) & 3))) & 0xFF;
  int r = id < K_CENT ? id : CV_ZERO;
  if (PSAC_REGMAP) {
#pragma unroll
    for (int row = 0; row < N_; ++row)
      if (ptok[row] == t) r = 32 + row;
  } else if (PSAC_FOLD) {
    const int pr = static_cast<int>(pmap[t]);
    if (pr >= 0) r = 32 + pr;
  }
  return r;
}

// The centroid table ct[c][n] = centroid c . query row n (log2 units) times ``cs``, from the fragments above.
__device__ __forceinline__ void centroid_table(float* ct, const uint32_t* cf, float cs, int gid, int tig, int lane,
                                               const uint32_t (&qb)[NB][4][2]) {
#pragma unroll
  for (int m2 = 0; m2 < 2; ++m2) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int at = ((m2 * NB + b) * 4 + ks) * 4;
        mma16816(acc, cf[at * 32 + lane], cf[(at + 1) * 32 + lane], cf[(at + 2) * 32 + lane], cf[(at + 3) * 32 + lane],
                 qb[b][ks][0], qb[b][ks][1]);
      }
#pragma unroll
    for (int i = 0; i < 4; ++i) ct[(16 * m2 + gid + 8 * (i >> 1)) * N + 2 * tig + (i & 1)] = acc[i] * cs;
  }
}

extern "C" __global__ void KERNEL_BOUNDS mma_decode(const __grid_constant__ Params a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int r = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const int start = a.req_start[r], count = a.req_pages[r], packed = a.req_packed[r];
  const int first = s * a.pages_per_split;
  const int last = min(first + a.pages_per_split, count);
  const int Hq = a.H * a.group;
  uint8_t* wbuf = smem + warp * WARP_BYTES;
  __half* sp = reinterpret_cast<__half*>(wbuf + NSTAGE * STAGE_BYTES);  // [VG][P][N]
  float* ct = reinterpret_cast<float*>(wbuf + NSTAGE * STAGE_BYTES + SP_BYTES);  // centroid table [32][N]
  uint32_t* cf = reinterpret_cast<uint32_t*>(ct + 32 * N);                       // its A fragments
  int ct_slot = -1;
  float ct_scale = 1.f;
  uint32_t* cvt = reinterpret_cast<uint32_t*>(wbuf + NSTAGE * STAGE_BYTES + SP_BYTES + CT_BYTES);  // pre-RoPE: centroids
  uint8_t* pbase = wbuf + NSTAGE * STAGE_BYTES + SP_BYTES + CT_BYTES + CV_BYTES;
  float* cfold = reinterpret_cast<float*>(pbase + PB_BYTES);  // K_CHW && CHW_SFOLD: [2][D]
  uint32_t* qsm = reinterpret_cast<uint32_t*>(pbase + PB_BYTES + CF_BYTES);  // K_CHW && CHW_QSMEM
  const uint4* pbasis = reinterpret_cast<const uint4*>(pbase);  // the slot's basis: [D / 2][R] fp16 pairs
  uint32_t* pv = reinterpret_cast<uint32_t*>(pbase + D * PSAC_R * 2);                 // [rows][D / 2] pairs
  signed char* pmap = reinterpret_cast<signed char*>(pbase + D * PSAC_R * 2 + (PSAC_FOLD ? 0 : PSAC_ROWS * D * 2));
                                                                                   // token -> row
  // R(t): [P][D / 4] pairs, pair k of token t at t * D / 4 + swz(k, t): the tokens of a load phase read different
  // banks for the same k (unswizzled, every row is 32 words long: an 8-way bank conflict)
  const uint32_t* rot_words = reinterpret_cast<const uint32_t*>(smem + RING_BYTES);  // cos rows, then sin rows
  if (ROPE_TOKEN) {  // the page's R(t) table, once per CTA: pairs (c, c + 8), c = 16 w + jl < D / 2
    __half2* fill = reinterpret_cast<__half2*>(smem + RING_BYTES);
    for (int i = threadIdx.x; i < P * D / 4; i += NWARPS * 32) {
      const int t = i / (D / 4), k = i % (D / 4), c = 16 * (k / 8) + k % 8;
      fill[t * (D / 4) + swz(k, t)] = __floats2half2_rn(a.local_cos[t * (D / 2) + c], a.local_cos[t * (D / 2) + c + 8]);
      fill[P * D / 4 + t * (D / 4) + swz(k, t)] = __floats2half2_rn(a.local_sin[t * (D / 2) + c],
                                                                    a.local_sin[t * (D / 2) + c + 8]);
    }
    __syncthreads();
  }

  // Query fragments (B operand, k = channel slot, n = query row gid): slot pair (2 tig, 2 tig + 1) of
  // k-step (b, ks) holds positions (2 ks, 2 ks + 8) of word 4 b + tig, and (2 tig + 8, 2 tig + 9) positions
  // (2 ks + 1, 2 ks + 9); each scaled by 4^-(p % 4) to undo the codes' in-place factor.
  const bool live_row = gid < a.group;
  const int64_t q_row = static_cast<int64_t>(r) * Hq + h * a.group + gid;
  uint32_t qf[NB][4][2];
  float qsum_k[KG][2];  // per key scale group, query columns 2 tig and 2 tig + 1 (fp16-rounded q, as used)
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int p = 2 * ks + e;
        float f = 1.f / static_cast<float>(1 << (2 * (p & 3)));
        float lo = 0.f, hi = 0.f;
        if (live_row) {
          lo = load_float<Q_KIND>(a.q, q_row * D + word_channel(4 * b + tig, p)) * a.scale_log2;
          hi = load_float<Q_KIND>(a.q, q_row * D + word_channel(4 * b + tig, p + 8)) * a.scale_log2;
        }
        qf[b][ks][e] = pack_half2(__half2float(__float2half_rn(lo)) * f, __half2float(__float2half_rn(hi)) * f);
      }
#pragma unroll
  for (int g = 0; g < KG; ++g)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float sum = 0.f;
      int col = 2 * tig + c;
      if (col < a.group) {
        const int64_t row = static_cast<int64_t>(r) * Hq + h * a.group + col;
        for (int ch = g * (D / KG); ch < (g + 1) * (D / KG); ++ch)
          sum += __half2float(__float2half_rn(load_float<Q_KIND>(a.q, row * D + ch) * a.scale_log2));
      }
      qsum_k[g][c] = sum;
    }

  // Headroom of the per-page query fragments (per-channel key scales): 2^qhead lifts q * scale / max scale
  // toward fp16's top (|q| 2^qhead < 2^14, room for RoPE's sqrt(2)), so channels with small scales stay out of
  // fp16's subnormals; the accumulators take it off with the scales' normalization.
  int qhead = 0;
  if (K_CHAN) {
    float qmx = 0.f;
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&qf[b][ks][e]));
          qmx = fmaxf(qmx, fmaxf(fabsf(x.x), fabsf(x.y)));
        }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) qmx = fmaxf(qmx, __shfl_xor_sync(0xffffffffu, qmx, o));
    int qe = 0;
    frexpf(qmx, &qe);  // qmx < 2^qe
    qhead = qmx > 0.f ? min(max(14 - qe, 0), 40) : 0;
  }

  // K_CHW: this head's constants, the query row gid at this thread's four channels of each 16-channel tile (fp16
  // pairs in the order the codes' windows give them: (c + 1, c) and (c + 9, c + 8), c = 16 kt + 2 tig), each tile's
  // bit offset and widths, and the headroom of the per-page fragments (as K_CHAN's)
  constexpr int KT = D / 16;
  ChwHead chw{};
  uint32_t qh[K_CHW && !CHW_QSMEM ? KT : 1][2];  // (set below where K_CHW reads it: nvcc's warning 549 is spurious)
  // the query's pair e of tile kt, and the page's folded fragment (registers, or this lane's column of shared memory)
  auto qh_at = [&](int kt, int e) -> uint32_t { return CHW_QSMEM ? qsm[(kt * 2 + e) * 32 + lane] : qh[kt][e]; };
  uint32_t cst[K_CHW ? KT : 1];
  float qmean = 0.f;  // this thread's part of q . mean for the codebook slot mean_slot
  int mean_slot = -1;
  uint32_t cw[2] = {0u, 0u};  // CHW_SFOLD: the constants of this lane's tile column (tile lane / 4, column lane % 4)
  if (K_CHW) {
    const int* hc = a.chw_heads + 8 * h;
    chw.first = hc[0];
    chw.bytes = hc[1];
    chw.bits = hc[2];
    chw.amax_lo = (a.k_scales + 2 * hc[3]) & ~3;
    chw.amax_hi = a.k_scales + 2 * (hc[3] + hc[4]);
    chw.amax_off = (a.k_scales + 2 * hc[3]) & 3;
    if (CHW_SFOLD && (lane >> 2) < KT) {
      cw[0] = a.chw_tiles[((h * KT + (lane >> 2)) * 4 + (lane & 3)) * 2];
      cw[1] = a.chw_tiles[((h * KT + (lane >> 2)) * 4 + (lane & 3)) * 2 + 1];
    }
    float qmx = 0.f;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const int c = 16 * kt + 2 * tig;
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      if (live_row) {
        const int chan[4] = {c + 1, c, c + 9, c + 8};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          x[i] = __half2float(__float2half_rn(load_float<Q_KIND>(a.q, q_row * D + chan[i]) * a.scale_log2));
      }
      if (CHW_QSMEM) {
        qsm[(kt * 2) * 32 + lane] = pack_half2(x[0], x[1]);
        qsm[(kt * 2 + 1) * 32 + lane] = pack_half2(x[2], x[3]);
      } else {
        qh[kt][0] = pack_half2(x[0], x[1]);
        qh[kt][1] = pack_half2(x[2], x[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) qmx = fmaxf(qmx, fabsf(x[i]));
      cst[kt] = a.chw_tiles[((h * KT + kt) * 4 + tig) * 2];
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) qmx = fmaxf(qmx, __shfl_xor_sync(0xffffffffu, qmx, o));
    int qe = 0;
    frexpf(qmx, &qe);
    qhead = qmx > 0.f ? min(max(14 - qe, 0), 40) : 0;
  }

  float acc_o[4 * NB][4];  // O^T tiles: 16 channels x 8 query rows each
#pragma unroll
  for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[J][i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};   // this thread's share, summed across the warp at the end
  float z_run[VG][2] = {};       // probabilities times value zeros, this thread's share
  int e_run = 0;                 // acc_o holds its sums times 2^e_run (see softmax_stage)

  // Online softmax over one page's scores (log2 units) S[mt][i]: i = (token gid | gid + 8) x (col 2 tig | +1).
  // Rescales the running state and stages P' = p * value scale * 2^E into sp, with E chosen per page so the
  // page's largest value scale times 2^E lies in [0.5, 1): p * scale alone underflows fp16 for small value
  // scales over long contexts (scale 0.004 and p 1e-5 is below fp16's subnormal range). acc_o follows E
  // through the same rescale as the softmax's alpha (powers of two: exact).
  auto softmax_stage = [&](float (&S)[MT][4], auto value_scale_zero) {
    float vmax = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int g = 0; g < VG; ++g) {
          float vs, vz;
          value_scale_zero(16 * mt + gid + 8 * e, g, vs, vz);
          vmax = fmaxf(vmax, fabsf(vs));
        }
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
    int e_page;
    frexpf(vmax, &e_page);  // vmax = m * 2^e_page, m in [0.5, 1); 0 for vmax = 0
    e_page = min(max(-e_page, -60), 60);
    const float p_factor = ldexpf(1.f, e_page);
    const float o_factor = ldexpf(1.f, e_page - e_run);
    e_run = e_page;
    float mloc[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) mloc[i & 1] = fmaxf(mloc[i & 1], S[mt][i]);
    float alpha[2], m_use[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      mloc[c] = fmaxf(mloc[c], __shfl_xor_sync(0xffffffffu, mloc[c], 4));
      mloc[c] = fmaxf(mloc[c], __shfl_xor_sync(0xffffffffu, mloc[c], 8));
      mloc[c] = fmaxf(mloc[c], __shfl_xor_sync(0xffffffffu, mloc[c], 16));
      float m_new = fmaxf(m_run[c], mloc[c]);
      m_use[c] = m_new == -INFINITY ? 0.f : m_new;
      alpha[c] = exp2f(m_run[c] - m_use[c]);
      m_run[c] = m_new;
      l_run[c] *= alpha[c];
#pragma unroll
      for (int g = 0; g < VG; ++g) z_run[g][c] *= alpha[c];
    }
#pragma unroll
    for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[J][i] *= alpha[i & 1] * o_factor;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int t = 16 * mt + gid + 8 * e;
        float p0 = exp2f(S[mt][2 * e] - m_use[0]);
        float p1 = exp2f(S[mt][2 * e + 1] - m_use[1]);
        l_run[0] += p0;
        l_run[1] += p1;
#pragma unroll
        for (int g = 0; g < VG; ++g) {
          float vs, vz;
          value_scale_zero(t, g, vs, vz);
          z_run[g][0] += p0 * vz;
          z_run[g][1] += p1 * vz;
          const float f = vs * p_factor;
          *reinterpret_cast<uint32_t*>(sp + (g * P + t) * N + 2 * tig) = pack_half2(p0 * f, p1 * f);
        }
      }
    __syncwarp();
  };

  // P'^T fragments for token tile kt and scale group g (B operand: k = token, n = query row).
  auto p_fragment = [&](int kt, int g, uint32_t& b0, uint32_t& b1) {
    const __half* row = sp + (g * P + 16 * kt + (lane & 15)) * N;
    ldmatrix_x2_trans(b0, b1, row);
  };

  // ---------------------------------------------------------------- packed pages
  // Each warp takes a contiguous run of the split's packed pages (not every NWARPS-th page): a run meets one or two
  // codebook slots (chunks are whole runs of pages), so a warp builds its centroid table once or twice instead of
  // once per chunk of the split; the longest run is as long as the longest strided share.
  int packed_end = min(last, packed);
  const int per_warp = packed_end > first ? (packed_end - first + NWARPS - 1) / NWARPS : 0;
  int my_first = first + warp * per_warp;
  int n_mine = max(0, min(per_warp, packed_end - my_first));
#pragma unroll
  for (int i = 0; i < NSTAGE - 1; ++i) {
    if (i < n_mine)
      issue_page(wbuf + i * STAGE_BYTES, a, a.page_ids[start + my_first + i], my_first + i, h, lane, chw);
    cp_async_commit();
  }
  // The page ids and chunk slots come from global memory one page ahead of their use: a load in the page's own
  // iteration put a global round trip in front of its copies (and of the centroid table's slot test).
  int next_id = NSTAGE - 1 < n_mine ? a.page_ids[start + my_first + NSTAGE - 1] : 0;
  int next_slot = (K_CENT || PSAC_R || K_CHW) && n_mine > 0 ? a.slots[start + my_first] : 0;
  for (int i = 0; i < n_mine; ++i) {
    int ahead = i + NSTAGE - 1;
    const int page_id = next_id;
    if (ahead + 1 < n_mine) next_id = a.page_ids[start + my_first + ahead + 1];
    const int slot_now = next_slot;
    if ((K_CENT || PSAC_R || K_CHW) && i + 1 < n_mine) next_slot = a.slots[start + my_first + i + 1];
    if (ahead < n_mine) issue_page(wbuf + (ahead % NSTAGE) * STAGE_BYTES, a, page_id, my_first + ahead, h, lane, chw);
    cp_async_commit();
    cp_async_wait<NSTAGE - 1>();
    __syncwarp();
    if (K_CHW && CHW_SWAP) {  // the codes' bytes in the order of the words' significance, once per page
      uint32_t* words = reinterpret_cast<uint32_t*>(wbuf + (i % NSTAGE) * STAGE_BYTES);
      for (int w = lane; w < chw.bytes / 4; w += 32) words[w] = __byte_perm(words[w], 0u, 0x0123);
      __syncwarp();
    }
    const uint8_t* stage = wbuf + (i % NSTAGE) * STAGE_BYTES;
    const uint8_t* kc = stage;
    const uint8_t* vc = stage + KC_BYTES;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(stage + KC_BYTES + P * ROWB);
    const uint8_t* extra = stage + KC_BYTES + P * ROWB + 4 * P * 4;
    const int jpage = my_first + i;  // the page's index in the request
    int ptok[PSAC_REGMAP ? PSAC_ROWS : 1];  // PSAC_REGMAP: each folded row's token (-1: none)
    int wtok[WHOLE_N > 0 ? WHOLE_N : 1];    // WHOLE_N: each whole row's token (-1: none), the same in every lane

    // Per-channel key scales: this page's query fragments qk (scales folded in, normalized by 2^-kexp),
    // and the zeros' score term zc per query column (2 tig, 2 tig + 1).
    uint32_t qk[NB][4][2];
    float zc[2] = {0.f, 0.f};
    float kback = 1.f;  // 2^kexp: the scales' normalization, taken off the accumulators
    // pre-RoPE keys: the scale and zero pairs (channels c, c + 8) of this lane's operand slots at (b * 4 + ks) * 2 + e,
    // in registers for the page
    uint32_t szr[2][ROPE_TOKEN ? 8 * NB : 1];
    if (ROPE_TOKEN) {  // pre-RoPE keys: qk is R(p0)^T q (no scales fold in); scale and zero pairs to this lane's slots
      const float* rope = reinterpret_cast<const float*>(extra + KCH_BYTES + OUT_BYTES);
      // R(p0)'s cos and sin of this lane's channels 16 tig + 0..15 (and their partners 64 on): 16-byte loads
      float rc[16], rs[16];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float4 c4 = *reinterpret_cast<const float4*>(rope + 16 * tig + 4 * u);
        const float4 s4 = *reinterpret_cast<const float4*>(rope + D / 2 + 16 * tig + 4 * u);
        rc[4 * u] = c4.x, rc[4 * u + 1] = c4.y, rc[4 * u + 2] = c4.z, rc[4 * u + 3] = c4.w;
        rs[4 * u] = s4.x, rs[4 * u + 1] = s4.y, rs[4 * u + 2] = s4.z, rs[4 * u + 3] = s4.w;
      }
      // the raw scale and zero words of this lane's channels 16 (4 b + tig) + 0..15: 16-byte loads
      uint32_t kw[NB][2][4 * KES];
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int f = 0; f < (K_SYM ? 1 : 2); ++f)
#pragma unroll
          for (int u = 0; u < KES; ++u) {
            const uint4 r = *reinterpret_cast<const uint4*>(extra + (f * D + 16 * (4 * b + tig)) * KES + 16 * u);
            kw[b][f][4 * u] = r.x;
            kw[b][f][4 * u + 1] = r.y;
            kw[b][f][4 * u + 2] = r.z;
            kw[b][f][4 * u + 3] = r.w;
          }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int p = 2 * ks + e;
          const int jl = 4 * (p >> 2) + 3 - (p & 3);
          const float f = static_cast<float>(1 << (2 * (p & 3)));
          float2 x[NB];
#pragma unroll
          for (int b = 0; b < NB; ++b) x[b] = __half22float2(*reinterpret_cast<const __half2*>(&qf[b][ks][e]));
          const float2 lo = x[0], hi = x[NB - 1];  // channels c, c + 8 and c + 64, c + 72 (c = 16 tig + jl)
          x[0].x = lo.x * rc[jl] + hi.x * rs[jl];
          x[0].y = lo.y * rc[jl + 8] + hi.y * rs[jl + 8];
          x[NB - 1].x = hi.x * rc[jl] - lo.x * rs[jl];
          x[NB - 1].y = hi.y * rc[jl + 8] - lo.y * rs[jl + 8];
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            const int at = (b * 4 + ks) * 2 + e;
            qk[b][ks][e] = pack_half2(x[b].x * f, x[b].y * f);
            const float fk = KBITS == 2 ? f : 1.f;  // 2-bit codes arrive times 4^(p % 4), 3- and 4-bit ones as they are
            if (K_KIND == 0) {
              // fp8 pairs: channels jl and jl + 8 sit at byte jl % 4 of words jl / 4 and jl / 4 + 2; one permute and
              // one fp8x2 conversion per pair. fp8 -> fp16 is exact, and so are the products below (1 / fk is a power
              // of two that keeps fp8's smallest subnormal inside fp16's range; KSYM_ZERO x an fp8 value needs at most
              // 7 significant bits): the same halves as converting each byte to float first.
              const uint32_t sel = (jl & 3) | ((4 + (jl & 3)) << 4);
              const __half2_raw sraw = __nv_cvt_fp8x2_to_halfraw2(
                  static_cast<__nv_fp8x2_storage_t>(__byte_perm(kw[b][0][jl >> 2], kw[b][0][(jl >> 2) + 2], sel)),
                  __NV_E4M3);
              const __half2 sp = *reinterpret_cast<const __half2*>(&sraw);
              szr[0][at] = as_u32(__hmul2(sp, __float2half2_rn(1.f / fk)));
              if (K_SYM) {
                szr[1][at] = as_u32(__hmul2(sp, __float2half2_rn(-KSYM_ZERO)));
              } else {
                const __half2_raw zraw = __nv_cvt_fp8x2_to_halfraw2(
                    static_cast<__nv_fp8x2_storage_t>(
                        __byte_perm(kw[b][K_SYM ? 0 : 1][jl >> 2], kw[b][K_SYM ? 0 : 1][(jl >> 2) + 2], sel)),
                    __NV_E4M3);
                szr[1][at] = *reinterpret_cast<const uint32_t*>(&zraw);
              }
              continue;
            }
            // channels 16 (4 b + tig) + jl and + 8 of the words above
            const float s0 = element<K_KIND>(kw[b][0][(jl * KES) >> 2], (jl * KES) & 3);
            const float s1 = element<K_KIND>(kw[b][0][((jl + 8) * KES) >> 2], ((jl + 8) * KES) & 3);
            const float z0 = K_SYM ? -KSYM_ZERO * s0 : element<K_KIND>(kw[b][K_SYM ? 0 : 1][(jl * KES) >> 2], (jl * KES) & 3);
            const float z1 = K_SYM ? -KSYM_ZERO * s1
                                   : element<K_KIND>(kw[b][K_SYM ? 0 : 1][((jl + 8) * KES) >> 2], ((jl + 8) * KES) & 3);
            szr[0][at] = pack_half2(s0 / fk, s1 / fk);
            szr[1][at] = pack_half2(z0, z1);
          }
        }
      if (K_CENT || PSAC_R) {
        const int slot = slot_now;
        if (slot != ct_slot) {
          __syncwarp();
          if (K_CENT) centroid_values(cvt, a, slot, h, lane);
          if (PSAC_R) {  // the slot's basis for this head: [D][R] bf16, contiguous, to [D / 2][R] fp16 pairs
            constexpr int QUADS = PSAC_R > 0 ? PSAC_R / 4 : 1;  // 4 ranks (8 bytes of bf16) per load
            const uint2* from = reinterpret_cast<const uint2*>(a.book + slot * a.book_bytes + a.psac_basis
                                                               + static_cast<int64_t>(h) * D * PSAC_R * 2);
            uint4* to = reinterpret_cast<uint4*>(pbase);
            constexpr int PB = (D / 2) * QUADS, PB_LANE = (PB + 31) / 32;  // every load before the first store
            uint2 bl[PB_LANE], bh[PB_LANE];
#pragma unroll
            for (int n = 0; n < PB_LANE; ++n) {
              const int j = lane + 32 * n, i = j / QUADS, q = j % QUADS, c = 16 * (i / 8) + i % 8;
              bl[n] = bh[n] = make_uint2(0u, 0u);
              if (j < PB) {
                bl[n] = from[c * QUADS + q];
                bh[n] = from[(c + 8) * QUADS + q];
              }
            }
#pragma unroll
            for (int n = 0; n < PB_LANE; ++n) {
              const int j = lane + 32 * n;
              if (j >= PB) continue;
              const uint32_t wl[2] = {bl[n].x, bl[n].y}, wh[2] = {bh[n].x, bh[n].y};
              uint32_t pair[4];
#pragma unroll
              for (int k = 0; k < 4; ++k) {  // rank 4 q + k: the low (even k) or high half of word k / 2
                const uint32_t sh = (k & 1) ? 0u : 16u;
                pair[k] = pack_half2(__uint_as_float((wl[k >> 1] << sh) & 0xFFFF0000u),
                                     __uint_as_float((wh[k >> 1] << sh) & 0xFFFF0000u));
              }
              to[j] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
            }
          }
          __syncwarp();
          ct_slot = slot;
        }
      }
      if (PSAC_R) {  // this page's corrections: basis x codes x scale, per row, as fp16 pairs (c, c + 8)
        const uint32_t* ps = reinterpret_cast<const uint32_t*>(extra + KCH_BYTES + OUT_BYTES + ROPE_BYTES);
        if (PSAC_REGMAP) {
#pragma unroll
          for (int row = 0; row < (PSAC_REGMAP ? PSAC_ROWS : 1); ++row) {
            const int tok = psac_token(ps, row, row * a.H + h);
            ptok[row] = tok < P ? tok : -1;
          }
        } else if (PSAC_SPARSE) {
          for (int t = lane; t < P; t += 32) pmap[t] = -1;
          __syncwarp();
          for (int row = lane; row < PSAC_ROWS; row += 32) {
            const int tok = psac_token(ps, row, row * a.H + h);
            if (tok < P) pmap[tok] = static_cast<signed char>(row);
          }
        }
        if (PSAC_REGMAP) {  // folded rows, few: every row's loads and products first, then the stores (a store to
                            // the table between them would keep each row's loads behind the previous row's store)
          constexpr int RR = PSAC_REGMAP ? PSAC_ROWS : 1;
          __half2 folded[RR][D / 64];
#pragma unroll
          for (int row = 0; row < RR; ++row) {
            const int cid = psac_centroid(words, psac_token(ps, row, row * a.H + h), a.H, h);
            __half2 coef[PSAC_R > 0 ? PSAC_R : 1];
            psac_coefs(ps, row, row * a.H + h, coef);
#pragma unroll
            for (int ii = 0; ii < D / 64; ++ii) {
              const int i = lane + 32 * ii;
              folded[row][ii] = __hadd2(as_half2(cvt[cid * (D / 2) + swzc(i, cid)]), psac_fix(pbasis, i, coef));
            }
          }
#pragma unroll
          for (int row = 0; row < RR; ++row)
#pragma unroll
            for (int ii = 0; ii < D / 64; ++ii)
              cvt[(32 + row) * (D / 2) + swzc(lane + 32 * ii, 32 + row)] = as_u32(folded[row][ii]);
        }
#pragma unroll 1
        for (int row = 0; row < (PSAC_REGMAP ? 0 : PSAC_ROWS); ++row) {
          // PSAC_FOLD: the centroid of the row's token, whose values the folded row adds
          const int cid = PSAC_FOLD ? psac_centroid(words, psac_token(ps, row, row * a.H + h), a.H, h) : 0;
          __half2 coef[PSAC_R > 0 ? PSAC_R : 1];
          psac_coefs(ps, row, row * a.H + h, coef);
          for (int i = lane; i < D / 2; i += 32) {
            const __half2 fix = psac_fix(pbasis, i, coef);
            if (PSAC_FOLD)  // the token's centroid (as the table holds it) plus the correction
              cvt[(32 + row) * (D / 2) + swzc(i, 32 + row)] = as_u32(__hadd2(as_half2(cvt[cid * (D / 2) + swzc(i, cid)]), fix));
            else
              pv[row * (D / 2) + i] = as_u32(fix);
          }
        }
        __syncwarp();
      }
      if (WHOLE_N) {  // whole rows: row WROW0 + w of the table is what its token reads otherwise (its centroid, its
                      // folded PSAC row, or an earlier whole row naming the same token: rows add) plus codes x scale
        const uint8_t* wh = extra + KCH_BYTES + OUT_BYTES + ROPE_BYTES + PS_BYTES;
        const uint32_t* ww = reinterpret_cast<const uint32_t*>(wh + WHOLE_N * D);
#pragma unroll
        for (int row = 0; row < (WHOLE_N > 0 ? WHOLE_N : 1); ++row) {
          const int rh = row * a.H + h;
          const int tok = (ww[WHOLE_N + row] >> (8 * (rh & 3))) & 0xFF;
          wtok[row] = tok < P ? tok : -1;
          if (tok >= P) continue;  // no token (a corrupted index): the row is never read
          int src = token_row(words, ptok, pmap, tok, a.H, h);
#pragma unroll
          for (int w = 0; w < row; ++w)
            if (wtok[w] == tok) src = WROW0 + w;
          const uint16_t sb = static_cast<uint16_t>(ww[row] >> (16 * (rh & 1)));
          const float scale = __half2float(*reinterpret_cast<const __half*>(&sb));
          const signed char* codes = reinterpret_cast<const signed char*>(wh + row * D);
          for (int i = lane; i < D / 2; i += 32) {
            const int c = 16 * (i / 8) + i % 8;
            const __half2 fix = __floats2half2_rn(static_cast<float>(codes[c]) * scale,
                                                  static_cast<float>(codes[c + 8]) * scale);
            cvt[(WROW0 + row) * (D / 2) + swzc(i, WROW0 + row)] =
                as_u32(__hadd2(as_half2(cvt[src * (D / 2) + swzc(i, src)]), fix));
          }
          __syncwarp();  // a later row naming the same token reads this one
        }
      }
      if (K_CENT) {  // each token's centroid-value row over its assignment word, as the key loop reads it: the id
                     // checked (a corrupted one reads the zero row, inside the table) and, with folded PSAC rows,
                     // the last row naming the token (the reads of the ids above are behind the __syncwarp)
        uint32_t* row_of = const_cast<uint32_t*>(words);
        for (int t = lane; t < P; t += 32) {
          int r = token_row(words, ptok, pmap, t, a.H, h);
#pragma unroll
          for (int w = 0; w < (WHOLE_N > 0 ? WHOLE_N : 0); ++w)  // the last row naming the token holds them all
            if (wtok[w] == t) r = WROW0 + w;
          row_of[t] = static_cast<uint32_t>(r);
        }
        __syncwarp();
        if (OUT_FOLD) {  // key outliers, pre-RoPE key terms like the rest of a key: each token with outliers reads a
                         // copy of its row (above) plus its outliers' values, row OROW0 + l for the highest lane l
                         // holding one of them, so the key loop pays nothing for them (no score term after it)
          const uint32_t* out = reinterpret_cast<const uint32_t*>(extra + KCH_BYTES);
          const int oc = lane < OUT_N ? lane : 0;
          const int pos = (out[oc] >> (((oc * a.H + h) & 1) * 16)) & 0xFFFF;  // t * D + d
          const int t = pos / D, d = pos % D;
          const bool ok = lane < OUT_N && t < P;  // (a position past the page: a corrupted index, skipped)
          const unsigned same_tok = __match_any_sync(0xffffffffu, ok ? t : -1 - lane);
          const unsigned same_pos = __match_any_sync(0xffffffffu, ok ? pos : -1 - lane);
          const int leader = 31 - __clz(same_tok);
          const unsigned leaders = __ballot_sync(0xffffffffu, ok && leader == lane);
          const int src = ok ? static_cast<int>(row_of[t]) : 0;
          constexpr int QR = D / 8;  // 16-byte quads per row; a row's quad q lies at q ^ (row & 1) (`swzc`)
#pragma unroll
          for (int k = 0; k < (OUT_N * QR + 31) / 32; ++k) {  // the leaders' rows copied by the whole warp
            const int idx = lane + 32 * k, x = idx / QR, q = idx % QR;
            const int from = __shfl_sync(0xffffffffu, src, x < OUT_N ? x : 0);
            if (x < OUT_N && ((leaders >> x) & 1u)) {
              const int to = OROW0 + x;
              reinterpret_cast<uint4*>(cvt + to * (D / 2))[q ^ (to & 1)] =
                  reinterpret_cast<const uint4*>(cvt + from * (D / 2))[q ^ (from & 1)];
            }
          }
          __syncwarp();
          if (ok && lane == 31 - __clz(same_pos)) {  // one write per position: its outliers summed in lane order
            float sum = 0.f;
            for (unsigned m = same_pos; m; m &= m - 1) {
              const int b = __ffs(m) - 1;
              const uint16_t vb = static_cast<uint16_t>(out[OUT_N + b] >> (((b * a.H + h) & 1) * 16));
              sum += __half2float(*reinterpret_cast<const __half*>(&vb));
            }
            const int to = OROW0 + leader;  // channel d is half (d % 16 >= 8) of pair 8 (d / 16) + d % 8
            __half* cell = reinterpret_cast<__half*>(cvt + to * (D / 2) + swzc(8 * (d / 16) + d % 8, to)) + ((d >> 3) & 1);
            *cell = __float2half_rn(__half2float(*cell) + sum);
          }
          if (ok && lane == leader) row_of[t] = static_cast<uint32_t>(OROW0 + lane);
          __syncwarp();
        }
      }
    }
    if (K_CHAN && !ROPE_TOKEN) {
      const float* rope = reinterpret_cast<const float*>(extra + KCH_BYTES + OUT_BYTES);
      float smax = 0.f;
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) smax = fmaxf(smax, fabsf(kchan_element(extra, 0, 16 * (4 * b + tig) + jj)));
      smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 1));
      smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 2));
      int kexp;
      frexpf(smax, &kexp);  // smax = m * 2^kexp, m in [0.5, 1): folded scales stay below 2^qhead
      kexp = min(max(kexp, -60), 60);
      const float nrm = ldexpf(1.f, qhead - kexp);
      kback = ldexpf(1.f, kexp - qhead);
      float zpart = 0.f;
      uint32_t qf_page[NB][4][2];  // R(p0)^T q without the scales (the centroid table's operand)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int p = 2 * ks + e;
          const int jl = 4 * (p >> 2) + 3 - (p & 3);
          const float f = static_cast<float>(1 << (2 * (p & 3)));
          float2 x[NB];
#pragma unroll
          for (int b = 0; b < NB; ++b) x[b] = __half22float2(*reinterpret_cast<const __half2*>(&qf[b][ks][e]));
          if (PAGE_ROPE) {  // R(p0)^T q: (lo, hi) -> (lo cos + hi sin, hi cos - lo sin) per RoPE pair
            float2 partner[NB];
            if (NB == 2) {
              partner[0] = x[NB - 1];
              partner[NB - 1] = x[0];
            } else {  // head_dim 64: the partner channel (+-32) is in lane tig ^ 2
              partner[0].x = __shfl_xor_sync(0xffffffffu, x[0].x, 2);
              partner[0].y = __shfl_xor_sync(0xffffffffu, x[0].y, 2);
            }
#pragma unroll
            for (int b = 0; b < NB; ++b) {
              const int ch = 16 * (4 * b + tig) + jl;
              const int idx = ch % (D / 2);
              const float sgn = ch < D / 2 ? 1.f : -1.f;
              const float2 y = x[b];
              x[b].x = y.x * rope[idx] + sgn * partner[b].x * rope[D / 2 + idx];
              x[b].y = y.y * rope[idx + 8] + sgn * partner[b].y * rope[D / 2 + idx + 8];
            }
          }
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            const int ch = 16 * (4 * b + tig) + jl;
            const float s0 = kchan_element(extra, 0, ch), s1 = kchan_element(extra, 0, ch + 8);
            const float z0 = K_SYM ? -s0 : kchan_element(extra, 1, ch);
            const float z1 = K_SYM ? -s1 : kchan_element(extra, 1, ch + 8);
            zpart += (x[b].x * z0 + x[b].y * z1) * f;
            qk[b][ks][e] = pack_half2(x[b].x * (s0 * nrm), x[b].y * (s1 * nrm));
            if (K_CENT && PAGE_ROPE) qf_page[b][ks][e] = pack_half2(x[b].x, x[b].y);
          }
        }
      zpart += __shfl_xor_sync(0xffffffffu, zpart, 1);
      zpart += __shfl_xor_sync(0xffffffffu, zpart, 2);  // query row gid, all channels
#pragma unroll
      for (int c = 0; c < 2; ++c) zc[c] = __shfl_sync(0xffffffffu, zpart, 4 * (2 * tig + c));
      if (K_CENT) {  // the centroid table: per chunk, or per page where the query turns with the page
        const int slot = slot_now;
        if (PAGE_ROPE || slot != ct_slot) {
          __syncwarp();
          if (slot != ct_slot) {
            ct_scale = centroid_fragments(cf, a, slot, h, gid, tig, lane);
            ct_slot = slot;
          }
          centroid_table(ct, cf, ct_scale, gid, tig, lane, PAGE_ROPE ? qf_page : qf);
          __syncwarp();
        }
      }
    }

    uint32_t qc[K_CHW && !CHW_QSMEM ? KT : 1][2];  // K_CHW: this page's query fragments, the steps folded in
    auto qc_set = [&](int kt, int e, uint32_t x) {
      if (CHW_QSMEM) qsm[((KT + kt) * 2 + e) * 32 + lane] = x; else qc[kt][e] = x;
    };
    auto qc_at = [&](int kt, int e) -> uint32_t { return CHW_QSMEM ? qsm[((KT + kt) * 2 + e) * 32 + lane] : qc[kt][e]; };
    if (K_CHW) {
      if (slot_now != mean_slot) {  // q . mean, this thread's channels: once per codebook slot
        const __half* mean = reinterpret_cast<const __half*>(a.book + static_cast<int64_t>(slot_now) * a.book_bytes
                                                             + a.k_mean) + h * D;
        qmean = 0.f;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          const int c = 16 * kt + 2 * tig;
          const float2 m01 = __half22float2(*reinterpret_cast<const __half2*>(mean + c));
          const float2 m89 = __half22float2(*reinterpret_cast<const __half2*>(mean + c + 8));
          const float2 x0 = __half22float2(as_half2(qh_at(kt, 0))), x1 = __half22float2(as_half2(qh_at(kt, 1)));
          qmean += x0.x * m01.y + x0.y * m01.x + x1.x * m89.y + x1.y * m89.x;
        }
        mean_slot = slot_now;
      }
      const __half* amx = reinterpret_cast<const __half*>(extra + chw.amax_off);
      float zpart = qmean;
      if (CHW_SFOLD) {
        // each lane: the steps (2 amax / 2^w; 0 where w = 0) of its tile column's four channels; the warp's largest
        // sets the normalization; the lane writes step x nrm and 0.5 step - amax to the shared row, every lane
        // then reads its own 32 channels' pairs
        float st4[4] = {0.f, 0.f, 0.f, 0.f}, am4[4] = {0.f, 0.f, 0.f, 0.f};
        float smax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int w = (cw[0] >> (12 + 4 * i)) & 15;
          am4[i] = w ? __half2float(amx[(cw[1] >> (8 * i)) & 255]) : 0.f;
          st4[i] = w ? am4[i] * __int_as_float((128 - w) << 23) : 0.f;
          smax = fmaxf(smax, st4[i]);
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
        int kexp;
        frexpf(smax, &kexp);  // folded steps stay below 2^qhead
        kexp = min(max(kexp, -60), 60);
        const float nrm = ldexpf(1.f, qhead - kexp);
        kback = ldexpf(1.f, kexp - qhead);
        if ((lane >> 2) < KT) {
          const int c0 = 16 * (lane >> 2) + 2 * (lane & 3);
          *reinterpret_cast<float2*>(cfold + c0) = make_float2(st4[0] * nrm, st4[1] * nrm);
          *reinterpret_cast<float2*>(cfold + c0 + 8) = make_float2(st4[2] * nrm, st4[3] * nrm);
          *reinterpret_cast<float2*>(cfold + D + c0) = make_float2(0.5f * st4[0] - am4[0], 0.5f * st4[1] - am4[1]);
          *reinterpret_cast<float2*>(cfold + D + c0 + 8) = make_float2(0.5f * st4[2] - am4[2], 0.5f * st4[3] - am4[3]);
        }
        __syncwarp();
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          const int c = 16 * kt + 2 * tig;
          const float2 x0 = __half22float2(as_half2(qh_at(kt, 0))), x1 = __half22float2(as_half2(qh_at(kt, 1)));
          const float2 s01 = *reinterpret_cast<const float2*>(cfold + c);
          const float2 s89 = *reinterpret_cast<const float2*>(cfold + c + 8);
          const float2 z01 = *reinterpret_cast<const float2*>(cfold + D + c);
          const float2 z89 = *reinterpret_cast<const float2*>(cfold + D + c + 8);
          qc_set(kt, 0, pack_half2(x0.x * s01.y, x0.y * s01.x));  // (c + 1, c)
          qc_set(kt, 1, pack_half2(x1.x * s89.y, x1.y * s89.x));  // (c + 9, c + 8)
          zpart += x0.y * z01.x + x0.x * z01.y + x1.y * z89.x + x1.x * z89.y;
        }
      } else {
        // the step of channel i of tile kt (2 amax / 2^w; 0 where w = 0) and its absmax
        auto step_of = [&](int kt, int i, float& am) {
          const uint32_t c = cst[kt], idx = a.chw_tiles[((h * KT + kt) * 4 + tig) * 2 + 1];
          const int w = (c >> (12 + 4 * i)) & 15;
          am = w ? __half2float(amx[(idx >> (8 * i)) & 255]) : 0.f;
          return w ? am * __int_as_float((128 - w) << 23) : 0.f;
        };
        float smax = 0.f;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float am;
            smax = fmaxf(smax, step_of(kt, i, am));
          }
        smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 1));
        smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 2));
        int kexp;
        frexpf(smax, &kexp);  // folded steps stay below 2^qhead
        kexp = min(max(kexp, -60), 60);
        const float nrm = ldexpf(1.f, qhead - kexp);
        kback = ldexpf(1.f, kexp - qhead);
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          const float2 x0 = __half22float2(as_half2(qh_at(kt, 0))), x1 = __half22float2(as_half2(qh_at(kt, 1)));
          const float x[4] = {x0.y, x0.x, x1.y, x1.x};  // channels c, c + 1, c + 8, c + 9
          float st[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float am;
            st[i] = step_of(kt, i, am);
            zpart += x[i] * (0.5f * st[i] - am);
          }
          qc_set(kt, 0, pack_half2(x[1] * (st[1] * nrm), x[0] * (st[0] * nrm)));
          qc_set(kt, 1, pack_half2(x[3] * (st[3] * nrm), x[2] * (st[2] * nrm)));
        }
      }
      zpart += __shfl_xor_sync(0xffffffffu, zpart, 1);
      zpart += __shfl_xor_sync(0xffffffffu, zpart, 2);  // query row gid, all channels
#pragma unroll
      for (int c = 0; c < 2; ++c) zc[c] = __shfl_sync(0xffffffffu, zpart, 4 * (2 * tig + c));
    }

    // Keys: accumulators per scale group.
    float S[MT][4];
    if (K_CHW) {  // each thread's four codes of a tile from one 32-bit window of its token's row
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(kc);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) S[mt][0] = S[mt][1] = S[mt][2] = S[mt][3] = 0.f;  // the accumulators
      const uint32_t* tile_c = a.chw_tiles + (h * KT * 4 + tig) * 2;  // this column's constants, 8 words a tile
      uint32_t c_next = CHW_PREF ? tile_c[0] : 0u, b0_next = CHW_PREF ? qc_at(0, 0) : 0u;
      uint32_t b1_next = CHW_PREF ? qc_at(0, 1) : 0u;
#if CHW_UNROLL
#pragma unroll
#else
#pragma unroll 1
#endif
      for (int kt = 0; kt < KT; ++kt) {  // (not unrolled: the tiles' constants from L1, the fragments from the stack)
        const uint32_t c = CHW_TAB      ? 0u  // (the table below instead)
                           : CHW_UNROLL ? cst[kt]
                           : CHW_PREF   ? c_next
                                        : a.chw_tiles[((h * KT + kt) * 4 + tig) * 2];
        const uint32_t b0 = CHW_PREF ? b0_next : qc_at(kt, 0), b1 = CHW_PREF ? b1_next : qc_at(kt, 1);
        if (CHW_PREF && kt + 1 < KT) {
          c_next = tile_c[(kt + 1) * 8];
          b0_next = qc_at(kt + 1, 0);
          b1_next = qc_at(kt + 1, 1);
        }
#if CHW_TAB
        const uint4 t0 = a.chw_tab[((h * KT + kt) * 4 + tig) * 2], t1 = a.chw_tab[((h * KT + kt) * 4 + tig) * 2 + 1];
        const int off = t0.x, s01 = t0.y, up01 = t0.z, s23u = t0.w, k1 = t1.x, k3 = t1.y;
        const uint32_t m01 = t1.z, m23 = t1.w;
#else
        const int off = c & 0xfff;
        const int w0 = (c >> 12) & 15, w1 = (c >> 16) & 15, w2 = (c >> 20) & 15, w3 = (c >> 24) & 15;
        const int s01 = 32 - w0 - w1, s23 = s01 - w2 - w3;  // the pairs' shifts down from the window's top
        const uint32_t m1 = (1u << w1) - 1u, m0 = ((1u << w0) - 1u) << 16;
        const uint32_t m3 = (1u << w3) - 1u, m2 = ((1u << w2) - 1u) << 16;
#if CHW_SUBN
        const int up01 = 32 - s01, s23u = s23 + 32 - s01, k1 = 16 - w1, k3 = 16 - w3;
        const uint32_t m01 = m1 | m0, m23 = m3 | m2;
#endif
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t r[2][2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = 16 * mt + gid + 8 * half;
            const int bit = CHW_W32 ? off : (CHW_PROBE == 1 ? (5 * row) % P : CHW_PROBE == 2 ? 0 : row) * chw.bits + off;
            const uint32_t* rw = CHW_W32 ? kw + row * (chw.bits >> 5) + (off >> 5) : kw + (bit >> 5);  // the window's words
            const uint32_t hi = CHW_SWAP ? rw[0] : __byte_perm(rw[0], 0u, 0x0123);
            const uint32_t lo = CHW_SWAP ? rw[1] : __byte_perm(rw[1], 0u, 0x0123);
            // the row's bits from `bit` on, first at the top (`CHW_TAB`: the intrinsic's own shift mod 32, no `and`)
            const uint32_t win = __funnelshift_l(lo, hi, CHW_TAB ? bit : bit & 31);
#if CHW_SUBN
            {  // widths <= 8: each pair alone in the low half (the second pair from the window moved
              //               up past the first), its high code moved up lands on bits no mask keeps in the low half
              //               (16 - w >= 8 >= w)
              const uint32_t x01 = __funnelshift_rc(win, 0u, s01);
              const uint32_t x23 = __funnelshift_rc(win << up01, 0u, s23u);
              r[half][0] = (x01 | (x01 << k1)) & m01;
              r[half][1] = (x23 | (x23 << k3)) & m23;
            }
#else
            {
              r[half][0] = chw_pair(__funnelshift_rc(win, 0u, s01), m1, w1, m0);
              r[half][1] = chw_pair(__funnelshift_rc(win, 0u, s23), m3, w3, m2);
            }
#endif
          }
          mma16816(S[mt], r[0][0], r[1][0], r[0][1], r[1][1], b0, b1);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
#if CHW_SUBN
        for (int x = 0; x < 4; ++x) S[mt][x] = S[mt][x] * (kback * 16777216.f) + zc[x & 1];
#else
        for (int x = 0; x < 4; ++x) S[mt][x] = S[mt][x] * kback + zc[x & 1];
#endif
    }
#pragma unroll
    for (int mt = 0; mt < (K_CHW ? 0 : MT); ++mt) {
      float acc[KG][4];
#pragma unroll
      for (int g = 0; g < KG; ++g)
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[g][x] = 0.f;
      const int t0 = 16 * mt + gid, t1 = t0 + 8;
      if (ROPE_TOKEN) {  // keys dequantized into the operand and turned by R(t): a0..a3 per k-step and block
        uint32_t wv[NB][2];   // 2 bits: the lane's code word of channels 16 (4 b + tig) + 0..15 per row
        uint32_t wh[NB][2];   // 3 bits: wv holds those channels' codes 0..3 of each 8 (12 bits per 16-bit half: the
                              // first eight channels low, the next eight high) and wh codes 4..7; 4 bits: wv the
                              // bytes of the first eight channels, wh of the next eight
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
          for (int r2 = 0; r2 < 2; ++r2) {
            const int t = t0 + 8 * r2;
            if (KBITS == 2) {
              wv[b][r2] = *reinterpret_cast<const uint32_t*>(kc + chunk_offset(t, b) + 4 * tig);
              wh[b][r2] = 0;
            } else if (KBITS == 4) {  // 16 codes in 8 bytes at byte 32 b + 8 tig of the row: chunk 2 b + tig / 2
              const uint2 w = *reinterpret_cast<const uint2*>(kc + key_chunk_offset(t, 2 * b + (tig >> 1))
                                                              + 8 * (tig & 1));
              wv[b][r2] = w.x;
              wh[b][r2] = w.y;
            } else {  // 16 codes in 6 bytes at byte 24 b + 6 tig of the row (2-byte aligned): two aligned words
              const int off = t * KROWB + 24 * b + 6 * tig;
              const uint32_t* w = reinterpret_cast<const uint32_t*>(kc + (off & ~3));
              const uint32_t lo = w[0], hi = w[1], sh = 8 * (off & 3);
              const uint32_t x0 = __funnelshift_r(lo, hi, sh);  // bytes B0..B3
              const uint32_t x1 = (hi >> sh) & 0xFFFFu;         // bytes B4, B5
              const uint32_t v0 = __byte_perm(x0, 0u, 0x4012);  // B0 B1 B2 as one 24-bit number: codes 0..7
              const uint32_t v1 = __byte_perm(x0, x1, 0x6345);  // B3 B4 B5: codes 8..15
              wv[b][r2] = (v0 >> 12) | ((v1 << 4) & 0x0FFF0000u);
              wh[b][r2] = (v0 & 0xFFFu) | ((v1 & 0xFFFu) << 16);
            }
          }
        int ids[2] = {0, 0};
        int prow[2] = {-1, -1};  // PSAC row of each token, -1 for none
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2) {
          const int t = t0 + 8 * r2;
          // the row the page pass wrote: the centroid (zero for a corrupted id), or the folded PSAC row
          if (K_CENT) ids[r2] = static_cast<int>(words[t]);
          if (PSAC_R && !PSAC_FOLD) prow[r2] = PSAC_SPARSE ? static_cast<int>(pmap[t]) : t;
        }
        uint4 cq[2][NB];  // [row t0 | t1][block]: a k-step pair's 16-byte quads of centroid values
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t ar[NB][2][2];  // [block][e][row t0 | t1]
          // the k-step's two positions jl = 2 m + 1 - e (m = 2 (ks >> 1) + 1 - (ks & 1)) sit in words 2 m, 2 m + 1
          // of each table row: one 8-byte load of R(t)'s rows; k-steps 2 kp and 2 kp + 1 share words 4 kp .. 4 kp + 3
          // of the centroid values, one 16-byte load at the even step (words 4 kp + 2, + 3 serve it, 4 kp, + 1 the
          // odd one)
          const int m = 2 * (ks >> 1) + 1 - (ks & 1);
          if (K_CENT && (ks & 1) == 0) {
#pragma unroll
            for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
              for (int b = 0; b < NB; ++b) cq[r2][b] = quad_at(cvt, D / 2, ids[r2], 8 * (4 * b + tig) + 2 * ks);
          }
          uint2 cen[2][NB], rcos[2], rsin[2];
#pragma unroll
          for (int r2 = 0; r2 < 2; ++r2) {
            const int t = t0 + 8 * r2;
            rcos[r2] = pair_at(rot_words, D / 4, t, 8 * tig + 2 * m);
            rsin[r2] = pair_at(rot_words + P * D / 4, D / 4, t, 8 * tig + 2 * m);
#pragma unroll
            for (int b = 0; b < NB; ++b)
              if (K_CENT) cen[r2][b] = (ks & 1) ? make_uint2(cq[r2][b].x, cq[r2][b].y) : make_uint2(cq[r2][b].z, cq[r2][b].w);
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = 2 * ks + e;
            const int jl = 4 * (p >> 2) + 3 - (p & 3);
#pragma unroll
            for (int r2 = 0; r2 < 2; ++r2) {
              __half2 val[NB];
#pragma unroll
              for (int b = 0; b < NB; ++b) {
                const int at = (b * 4 + ks) * 2 + e;
                uint32_t code2;  // the codes of channels (c, c + 8) as half2
                if (KBITS == 2) {
                  code2 = codes_at(p < 4 ? wv[b][r2] : wv[b][r2] >> 8, p & 3);
                } else if (KBITS == 4) {
                  code2 = codes4_at(wv[b][r2], wh[b][r2], jl);
                } else {
                  code2 = codes3_at(jl < 4 ? wv[b][r2] : wh[b][r2], jl & 3);
                }
                val[b] = __hfma2(as_half2(code2), as_half2(szr[0][at]), as_half2(szr[1][at]));
                if (K_CENT) val[b] = __hadd2(val[b], as_half2(e ? cen[r2][b].x : cen[r2][b].y));
                if (PSAC_R && !PSAC_FOLD && prow[r2] >= 0)
                  val[b] = __hadd2(val[b], as_half2(pv[prow[r2] * (D / 2) + 8 * (4 * b + tig) + jl]));
              }
              const __half2 cs = as_half2(e ? rcos[r2].x : rcos[r2].y), sn = as_half2(e ? rsin[r2].x : rsin[r2].y);
              ar[0][e][r2] = as_u32(__hsub2(__hmul2(val[0], cs), __hmul2(val[NB - 1], sn)));
              ar[NB - 1][e][r2] = as_u32(__hfma2(val[NB - 1], cs, __hmul2(val[0], sn)));
            }
          }
#pragma unroll
          for (int b = 0; b < NB; ++b)
            mma16816(acc[0], ar[b][0][0], ar[b][0][1], ar[b][1][0], ar[b][1][1], qk[b][ks][0], qk[b][ks][1]);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) S[mt][x] = acc[0][x];
        continue;
      }
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        uint32_t w0 = *reinterpret_cast<const uint32_t*>(kc + chunk_offset(t0, b) + 4 * tig);
        uint32_t w1 = *reinterpret_cast<const uint32_t*>(kc + chunk_offset(t1, b) + 4 * tig);
        uint32_t h0 = w0 >> 8, h1 = w1 >> 8;
        float* c = acc[KG == 1 ? 0 : b];
        const uint32_t (&qb)[4][2] = K_CHAN ? qk[b] : qf[b];
        mma16816(c, codes_x4p<0>(w0), codes_x4p<0>(w1), codes_x4p<1>(w0), codes_x4p<1>(w1), qb[0][0], qb[0][1]);
        mma16816(c, codes_x4p<2>(w0), codes_x4p<2>(w1), codes_x4p<3>(w0), codes_x4p<3>(w1), qb[1][0], qb[1][1]);
        mma16816(c, codes_x4p<0>(h0), codes_x4p<0>(h1), codes_x4p<1>(h0), codes_x4p<1>(h1), qb[2][0], qb[2][1]);
        mma16816(c, codes_x4p<2>(h0), codes_x4p<2>(h1), codes_x4p<3>(h0), codes_x4p<3>(h1), qb[3][0], qb[3][1]);
      }
      if (K_CHAN) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = t0 + 8 * e;
          float2 cv = make_float2(0.f, 0.f);
          if (K_CENT) {
            const int id = (words[t] >> (8 * ((t * a.H + h) & 3))) & 0xFF;
            if (id < K_CENT) cv = *reinterpret_cast<const float2*>(ct + id * N + 2 * tig);  // else corrupted: none
          }
          S[mt][2 * e] = acc[0][2 * e] * kback + zc[0] + cv.x;
          S[mt][2 * e + 1] = acc[0][2 * e + 1] * kback + zc[1] + cv.y;
        }
        continue;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = t0 + 8 * e;
        const int ko = ((t * a.H + h) * KG * KES) & 3;
#pragma unroll
        for (int c = 0; c < 2; ++c) S[mt][2 * e + c] = 0.f;
#pragma unroll
        for (int g = 0; g < KG; ++g) {
          float scale = element<K_KIND>(words[t], ko + g * KES);
          float zero = K_SYM ? -scale : element<K_KIND>(words[P + t], ko + g * KES);
#pragma unroll
          for (int c = 0; c < 2; ++c) S[mt][2 * e + c] += scale * acc[g][2 * e + c] + zero * qsum_k[g][c];
        }
      }
    }
    if (OUT_N && !OUT_FOLD) {  // key outliers: S[t][n] += q_page[n][d] * value, as tensor-core products (swap-AB, like the keys)
      // Per 16 outliers, A[token][j] = value_j where outlier j sits at the tile's token (else 0; exact in fp16) and
      // B[j][n] = query row n at outlier j's channel, in the page's frame and log2 units, split in two fp16 parts
      // (hi + lo: about fp32's precision); the accumulator has the score tile's layout, so the terms add in place.
      // A lane holds outliers 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 of each 16 (the fragments' k slots). Like the
      // keys' fp16 query fragments, B overflows for |q . scale_log2| past 65504 (about |q| > 4e5 at head_dim 128),
      // and then gives NaN, never a finite wrong score (tests/test_kernel_known_limits.py).
      const uint32_t* out = reinterpret_cast<const uint32_t*>(extra + KCH_BYTES);
      const float* rope = reinterpret_cast<const float*>(extra + KCH_BYTES + OUT_BYTES);
      // Dead query rows read row 0's query (always in bounds) and score 0: every load below is unconditional, with
      // clamped indices, so a lane's loads for its four outliers are in flight together (branches around them made
      // each outlier's global round trip wait for the previous one's: the kernel's largest stall, ncu, session 21).
      const int64_t qrow = (static_cast<int64_t>(r) * Hq + h * a.group + (live_row ? gid : 0)) * D;
#pragma unroll
      for (int c0 = 0; c0 < OUT_N; c0 += 16) {
        int tok[4];
        float val[4], qd[4];
        int dd[4], tt[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int o = c0 + 2 * tig + (x & 1) + 8 * (x >> 1);
          const int oc = o < OUT_N ? o : 0;
          const int half = ((oc * a.H + h) & 1) * 16;
          const int pos = (out[oc] >> half) & 0xFFFF;  // t * D + d
          const uint16_t vb = static_cast<uint16_t>(out[OUT_N + oc] >> half);
          const int t = pos / D;
          const bool ok = o < OUT_N && t < P;
          tok[x] = ok ? t : -1;
          val[x] = ok ? __half2float(*reinterpret_cast<const __half*>(&vb)) : 0.f;
          dd[x] = pos % D;
          tt[x] = ok ? t : 0;
        }
        float q0[4], q1[4], cl[4], sl[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // the loads, all issued before any use
          const int d = dd[x], i0 = d % (D / 2);
          if (ROPE_TOKEN) {
            q0[x] = load_float<Q_KIND>(a.q, qrow + i0);
            q1[x] = load_float<Q_KIND>(a.q, qrow + i0 + D / 2);
            cl[x] = __ldg(a.local_cos + tt[x] * (D / 2) + i0);
            sl[x] = __ldg(a.local_sin + tt[x] * (D / 2) + i0);
          } else {
            q0[x] = load_float<Q_KIND>(a.q, qrow + d);
            q1[x] = PAGE_ROPE ? load_float<Q_KIND>(a.q, qrow + (d < D / 2 ? d + D / 2 : d - D / 2)) : 0.f;
          }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int d = dd[x], i0 = d % (D / 2);
          float q = q0[x];
          if (PAGE_ROPE) {
            const float partner = d < D / 2 ? q1[x] : -q1[x];
            q = q * rope[i0] + partner * rope[D / 2 + i0];
          }
          if (ROPE_TOKEN) {  // the outlier sits before RoPE: q . R(p0) R(t) e_d = (R(t)^T R(p0)^T q)_d
            const float qlo = q0[x], qhi = q1[x];
            const float blo = qlo * rope[i0] + qhi * rope[D / 2 + i0], bhi = qhi * rope[i0] - qlo * rope[D / 2 + i0];
            q = d < D / 2 ? blo * cl[x] + bhi * sl[x] : bhi * cl[x] - blo * sl[x];
          }
          qd[x] = live_row && tok[x] >= 0 ? q * a.scale_log2 : 0.f;
        }
        float lo[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) lo[x] = qd[x] - __half2float(__float2half_rn(qd[x]));
        const uint32_t bh0 = pack_half2(qd[0], qd[1]), bh1 = pack_half2(qd[2], qd[3]);
        const uint32_t bl0 = pack_half2(lo[0], lo[1]), bl1 = pack_half2(lo[2], lo[3]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int t0 = 16 * mt + gid, t1 = t0 + 8;
          const uint32_t a0 = pack_half2(tok[0] == t0 ? val[0] : 0.f, tok[1] == t0 ? val[1] : 0.f);
          const uint32_t a1 = pack_half2(tok[0] == t1 ? val[0] : 0.f, tok[1] == t1 ? val[1] : 0.f);
          const uint32_t a2 = pack_half2(tok[2] == t0 ? val[2] : 0.f, tok[3] == t0 ? val[3] : 0.f);
          const uint32_t a3 = pack_half2(tok[2] == t1 ? val[2] : 0.f, tok[3] == t1 ? val[3] : 0.f);
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
          mma16816(acc, a0, a1, a2, a3, bh0, bh1);
          mma16816(acc, a0, a1, a2, a3, bl0, bl1);
#pragma unroll
          for (int x = 0; x < 4; ++x) S[mt][x] += acc[x];
        }
      }
    }
    if (SINK > 0 && jpage == 0) {  // the exact sinks are attended by the merge kernel
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          if (16 * mt + gid + 8 * (x >> 1) < SINK) S[mt][x] = -INFINITY;
    }
    softmax_stage(S, [&](int t, int g, float& vs, float& vz) {
      const int vo = ((t * a.H + h) * VG * VES) & 3;
      vs = element<V_KIND>(words[2 * P + t], vo + g * VES);
      vz = V_SYM ? -vs : element<V_KIND>(words[3 * P + t], vo + g * VES);
    });

    // Values.
    const uint32_t sel = (gid & 1) ? 0x7632u : 0x5410u;
#pragma unroll
    for (int kt = 0; kt < MT; ++kt) {
      uint32_t pb[VG][2];
#pragma unroll
      for (int g = 0; g < VG; ++g) p_fragment(kt, g, pb[g][0], pb[g][1]);
      const int t = 16 * kt + 2 * tig;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int wo = 4 * (gid >> 1);
        uint32_t wa = *reinterpret_cast<const uint32_t*>(vc + chunk_offset(t, b) + wo);
        uint32_t wb = *reinterpret_cast<const uint32_t*>(vc + chunk_offset(t + 1, b) + wo);
        uint32_t wc = *reinterpret_cast<const uint32_t*>(vc + chunk_offset(t + 8, b) + wo);
        uint32_t wd = *reinterpret_cast<const uint32_t*>(vc + chunk_offset(t + 9, b) + wo);
        uint32_t x0 = __byte_perm(wa, wb, sel), x1 = __byte_perm(wc, wd, sel);
        uint32_t y0 = x0 >> 8, y1 = x1 >> 8;
        const uint32_t* bb = pb[VG == 1 ? 0 : b];
#if V_SUBN
        mma16816(acc_o[4 * b + 0], codes_x4s<0>(x0), codes_x4s<1>(x0), codes_x4s<0>(x1), codes_x4s<1>(x1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 1], codes_x4s<2>(x0), codes_x4s<3>(x0), codes_x4s<2>(x1), codes_x4s<3>(x1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 2], codes_x4s<0>(y0), codes_x4s<1>(y0), codes_x4s<0>(y1), codes_x4s<1>(y1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 3], codes_x4s<2>(y0), codes_x4s<3>(y0), codes_x4s<2>(y1), codes_x4s<3>(y1), bb[0], bb[1]);
#else
        mma16816(acc_o[4 * b + 0], codes_x4p<0>(x0), codes_x4p<1>(x0), codes_x4p<0>(x1), codes_x4p<1>(x1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 1], codes_x4p<2>(x0), codes_x4p<3>(x0), codes_x4p<2>(x1), codes_x4p<3>(x1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 2], codes_x4p<0>(y0), codes_x4p<1>(y0), codes_x4p<0>(y1), codes_x4p<1>(y1), bb[0], bb[1]);
        mma16816(acc_o[4 * b + 3], codes_x4p<2>(y0), codes_x4p<3>(y0), codes_x4p<2>(y1), codes_x4p<3>(y1), bb[0], bb[1]);
#endif
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
#if V_SUBN && !VROT
  // the packed part's codes were read as code x 2^-24 (subnormals); the dense pages add at scale
#pragma unroll
  for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[J][i] *= 16777216.f;
#endif

  // Rotated values: this warp's packed output (the rotated frame) moves to its rows of the merge area
  // and turns back there (x H / sqrt(D), H Sylvester's +-1 matrix: a fast Walsh-Hadamard transform);
  // the dense pages then start from zero, and the merge adds both (the packed part rescaled from the
  // running maximum it was taken at).
  float m_flush[2] = {-INFINITY, -INFINITY};
  if (VROT) {
    float* pk = VROT_IN_RING ? reinterpret_cast<float*>(wbuf) : reinterpret_cast<float*>(smem + MERGE_OFF) + warp * N * D;
    float zsum[VG][2];
#pragma unroll
    for (int g = 0; g < VG; ++g)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float z = z_run[g][c];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
        zsum[g][c] = z;
        z_run[g][c] = 0.f;
      }
#pragma unroll
    for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int e = x >> 1, c = x & 1;
        const int k = 2 * (J & 3) + e;
        pk[(2 * tig + c) * D + value_channel(J, gid, e)] =
            ldexpf(acc_o[J][x], -e_run - 2 * (k & 3) + 24 * V_SUBN) + zsum[VG == 1 ? 0 : (J >> 2)][c];
        acc_o[J][x] = 0.f;
      }
#pragma unroll
    for (int c = 0; c < 2; ++c) m_flush[c] = m_run[c];
    __syncwarp();
#pragma unroll
    for (int len = 1; len < D; len <<= 1) {
      for (int x = lane; x < N * D / 2; x += 32) {
        const int col = x / (D / 2), k = x % (D / 2);
        const int lo = (k / len) * 2 * len + k % len;
        float* v = pk + col * D;
        const float u = v[lo], w = v[lo + len];
        v[lo] = u + w;
        v[lo + len] = u - w;
      }
      __syncwarp();
    }
  }

  // ---------------------------------------------------------------- dense pages (bf16/fp16, the active tail)
  // Keys: thread tig's k-slots are channels CPT tig .. CPT tig + CPT - 1 (k-step ks, slots (2 tig, +1) =
  // channels CPT tig + 4 ks + {0, 1}, slots (2 tig + 8, +9) = + {2, 3}), read as 16-byte vectors, with
  // unscaled query fragments in the same order. Values: thread gid's rows are channels 64 b + 8 gid .. + 7,
  // one 16-byte vector per token and block.
  constexpr int CPT = D / 4;
  const int dense_first = max(first, packed) + warp;
  const int64_t hstride = static_cast<int64_t>(a.H) * D;  // elements between tokens of one dense page
  for (int j = dense_first; j < last; j += NWARPS) {
    const int64_t page = a.page_ids[start + j];
    const int n = a.valid[start + j];
    uint32_t qd[D / 16][2];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int ch = CPT * tig + 4 * ks + 2 * e;
        qd[ks][e] = live_row ? pack_half2(load_float<Q_KIND>(a.q, q_row * D + ch) * a.scale_log2,
                                          load_float<Q_KIND>(a.q, q_row * D + ch + 1) * a.scale_log2)
                             : 0u;
      }
    const int64_t kbase = (page * 2) * P * hstride + h * D + CPT * tig;
    float S[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      const int t0 = 16 * mt + gid, t1 = t0 + 8;
#pragma unroll
      for (int i = 0; i < CPT / 8; ++i) {
        const uint4 r0 = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.dense) + kbase + t0 * hstride + 8 * i);
        const uint4 r1 = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.dense) + kbase + t1 * hstride + 8 * i);
        mma16816(acc, dense_half2(r0.x), dense_half2(r1.x), dense_half2(r0.y), dense_half2(r1.y), qd[2 * i][0], qd[2 * i][1]);
        mma16816(acc, dense_half2(r0.z), dense_half2(r1.z), dense_half2(r0.w), dense_half2(r1.w), qd[2 * i + 1][0],
                 qd[2 * i + 1][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) S[mt][i] = (i < 2 ? t0 : t1) < n ? acc[i] : -INFINITY;
    }
    // P' = p * 64 and values scaled by 4^((p % 4) - 3): the same rows' 4^(p % 4) factor, no fp16 overflow.
    softmax_stage(S, [](int, int, float& vs, float& vz) {
      vs = 64.f;
      vz = 0.f;
    });
    const int64_t vbase = ((page * 2 + 1) * P) * hstride + h * D + 8 * gid;
#pragma unroll
    for (int kt = 0; kt < MT; ++kt) {
      uint32_t pb[VG][2];
#pragma unroll
      for (int g = 0; g < VG; ++g) p_fragment(kt, g, pb[g][0], pb[g][1]);
      const int t = 16 * kt + 2 * tig;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        uint32_t vec[4][4];  // tokens t, t + 1, t + 8, t + 9: channels 64 b + 8 gid .. + 7 (zero past n)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int tt = t + (x & 1) + 8 * (x >> 1);
          uint4 r = make_uint4(0u, 0u, 0u, 0u);  // rows past the page's n tokens may hold anything
          if (tt < n) r = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.dense) + vbase + tt * hstride + 64 * b);
          vec[x][0] = r.x;
          vec[x][1] = r.y;
          vec[x][2] = r.z;
          vec[x][3] = r.w;
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          uint32_t reg[4];
#pragma unroll
          for (int x = 0; x < 4; ++x) {  // (row gid | gid + 8) x (tokens t, t + 1 | t + 8, t + 9)
            const int e = x & 1, pair = x >> 1;
            const int k = 2 * jj + e;
            const int idx = 4 * (k >> 2) + 3 - (k & 3);  // channel 64 b + 8 gid + idx
            const float f = static_cast<float>(1 << (2 * (k & 3))) / 64.f;
            const float lo = dense_element(vec[2 * pair][idx >> 1], idx & 1) * f;
            const float hi = dense_element(vec[2 * pair + 1][idx >> 1], idx & 1) * f;
            reg[x] = pack_half2(lo, hi);
          }
          const uint32_t* bb = pb[VG == 1 ? 0 : b];
          mma16816(acc_o[4 * b + jj], reg[0], reg[1], reg[2], reg[3], bb[0], bb[1]);
        }
      }
    }
    __syncwarp();
  }

  // ---------------------------------------------------------------- merge the warps
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], o);
#pragma unroll
      for (int g = 0; g < VG; ++g) z_run[g][c] += __shfl_xor_sync(0xffffffffu, z_run[g][c], o);
    }
  }
  __syncthreads();  // every warp is done with its ring: reuse shared memory
  float* so = reinterpret_cast<float*>(smem + MERGE_OFF);  // [NWARPS][N][D]
  float* sm = so + NWARPS * N * D;                      // [NWARPS][N]
  float* sl = sm + NWARPS * N;                          // [NWARPS][N]
  float back[4 * NB][4];  // rotated values: this thread's cells of its warp's packed part, turned back above
  if (VROT) {
    const float* pk = VROT_IN_RING ? reinterpret_cast<const float*>(wbuf) : so + warp * N * D;
#pragma unroll
    for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
      for (int x = 0; x < 4; ++x) back[J][x] = pk[(2 * tig + (x & 1)) * D + value_channel(J, gid, x >> 1)];
    if (VROT_IN_RING) __syncthreads();  // the merge area overlaps the rings, and so every warp's packed part
  }
#pragma unroll
  for (int J = 0; J < 4 * NB; ++J)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int e = x >> 1, c = x & 1;
      const int k = 2 * (J & 3) + e;
      const int ch = value_channel(J, gid, e);
      const int g = VG == 1 ? 0 : (J >> 2);
      float value = ldexpf(acc_o[J][x], -e_run - 2 * (k & 3)) + z_run[g][c];
      if (VROT) {  // the packed part, turned back by this warp above
        const float f = m_flush[c] == -INFINITY ? 0.f : exp2f(m_flush[c] - m_run[c]) * rsqrtf(static_cast<float>(D));
        value += f * back[J][x];
      }
      so[(warp * N + 2 * tig + c) * D + ch] = value;
    }
  if (gid == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      sm[warp * N + 2 * tig + c] = m_run[c];
      sl[warp * N + 2 * tig + c] = l_run[c];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.group * D; i += NWARPS * 32) {
    const int col = i / D, ch = i % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) m = fmaxf(m, sm[w * N + col]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      const float mw = sm[w * N + col];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - m);
      o += f * so[(w * N + col) * D + ch];
      l += f * sl[w * N + col];
    }
    const int64_t part = (static_cast<int64_t>(r) * Hq + h * a.group + col) * a.num_splits + s;
    a.o_part[part * D + ch] = o;
    if (ch == 0) {
      a.m_part[part] = m;
      a.l_part[part] = l;
    }
  }
}
