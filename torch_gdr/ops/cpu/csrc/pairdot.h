// Chunk products on bfloat16 operands with float32 accumulation, over a "pair-dot" unit:
// one instruction multiplies the bfloat16 pairs (a[2i], a[2i+1]) and (b[2i], b[2i+1]) of
// every 32-bit lane i and adds both products to the lane's float32 accumulator.
//
// Units:
// - Avx512Bf16: VDPBF16PS (_mm512_dpbf16_ps), 16 lanes; the avx512bf16 variant only.
// - EmulatedBf16: the same instruction on AVX2, for the tests of the machines without it
//   (torch_gdr.ops.cpu.kernels.HALF_PRODUCTS): Intel's SDM defines, per lane,
//     acc += fp32(a.hi) * fp32(b.hi);  acc += fp32(a.lo) * fp32(b.lo)
//   each step a float32 FMA rounded to nearest even, input denormals read as zero, output
//   denormals flushed to zero, MXCSR not consulted. A product of two bfloat16 values is exact
//   in float32 (8 x 8 significand bits), so each step is one FMA here, in the same order; the
//   kernels run under DenormalsAreZero (common.h), whose MXCSR DAZ and FTZ give the same
//   denormal behaviour. 16 lanes as two AVX2 registers, so that the blocking (and every
//   index) is the one the real unit runs.
//
// Operand layouts of gemm() (C[M, N] = alpha * diag(row_scale) * A B + beta * C):
//   A bfloat16 row-major [M, kd] (row stride lda, even), kd even: pair r of row i is the
//     32-bit word at a + i * lda + 2r;
//   B "pair-packed" [kd / 2, N] 32-bit words: word (r, j) holds B[2r][j] in its low half and
//     B[2r + 1][j] in its high half (pack_* below), row stride ldb words;
//   N a multiple of the unit's 16 lanes.
#pragma once

#include "common.h"
#include "microgemm.h"

namespace gdr {
namespace pairs {

using u16 = uint16_t;
using u32 = uint32_t;

inline float bf16_to_float(u16 x) {
  const u32 b = static_cast<u32>(x) << 16;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// Rounded to nearest even, as c10::BFloat16 does (NaN as 0x7FC0).
inline u16 float_to_bf16(float f) {
  u32 b;
  std::memcpy(&b, &f, sizeof(b));
  const u32 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? u16(0x7FC0) : static_cast<u16>(rounded);
}

inline u32 word(u16 lo, u16 hi) { return static_cast<u32>(lo) | (static_cast<u32>(hi) << 16); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
struct Avx512Bf16 {
  static constexpr int kLanes = 16;
  using Acc = __m512;
  using Words = __m512i;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Words load(const u32* p) { return _mm512_loadu_si512(p); }
  static Words broadcast(u32 w) { return _mm512_set1_epi32(static_cast<int>(w)); }
  static Acc dot(Acc acc, Words a, Words b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static Acc loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, Acc x) { _mm512_storeu_ps(p, x); }
  // s * x (+ beta * y)
  static Acc scale(Acc x, float s) { return _mm512_mul_ps(x, _mm512_set1_ps(s)); }
  static Acc scale_add(Acc x, float s, float beta, Acc y) {
    return _mm512_fmadd_ps(_mm512_set1_ps(beta), y, _mm512_mul_ps(x, _mm512_set1_ps(s)));
  }
};
constexpr bool kHardware = true;
#else
constexpr bool kHardware = false;
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct EmulatedBf16 {
  static constexpr int kLanes = 16;
  struct Acc {
    __m256 lo, hi;
  };
  struct Words {
    __m256i lo, hi;
  };
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Words load(const u32* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
  }
  static Words broadcast(u32 w) {
    const __m256i x = _mm256_set1_epi32(static_cast<int>(w));
    return {x, x};
  }
  static __m256 dot8(__m256 acc, __m256i a, __m256i b) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256 a_hi = _mm256_castsi256_ps(_mm256_and_si256(a, high));
    const __m256 b_hi = _mm256_castsi256_ps(_mm256_and_si256(b, high));
    const __m256 a_lo = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    const __m256 b_lo = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    acc = _mm256_fmadd_ps(a_hi, b_hi, acc);  // element 2i + 1 first, as the SDM's pseudo-code
    return _mm256_fmadd_ps(a_lo, b_lo, acc);
  }
  static Acc dot(Acc acc, Words a, Words b) { return {dot8(acc.lo, a.lo, b.lo), dot8(acc.hi, a.hi, b.hi)}; }
  static Acc loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void storef(float* p, Acc x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
  static Acc scale(Acc x, float s) {
    const __m256 v = _mm256_set1_ps(s);
    return {_mm256_mul_ps(x.lo, v), _mm256_mul_ps(x.hi, v)};
  }
  static Acc scale_add(Acc x, float s, float beta, Acc y) {
    const __m256 v = _mm256_set1_ps(s), b = _mm256_set1_ps(beta);
    return {_mm256_fmadd_ps(b, y.lo, _mm256_mul_ps(x.lo, v)), _mm256_fmadd_ps(b, y.hi, _mm256_mul_ps(x.hi, v))};
  }
};
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

// MR rows x NV vectors of columns of C, reducing over kp pairs.
template <class U, int MR, int NV>
inline void kernel(int64_t kp, const u16* a, int64_t lda, const u32* b, int64_t ldb, float* c, int64_t ldc,
                   float alpha, const float* row_scale, float beta) {
  typename U::Acc acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = U::zero();
#pragma GCC unroll 2
  for (int64_t r = 0; r < kp; ++r) {
    typename U::Words bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = U::load(b + r * ldb + U::kLanes * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      u32 w;
      std::memcpy(&w, a + i * lda + 2 * r, sizeof(w));
      const typename U::Words ai = U::broadcast(w);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = U::dot(acc[i][v], ai, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const float s = row_scale ? alpha * row_scale[i] : alpha;
    float* ci = c + i * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cv = ci + U::kLanes * v;
      U::storef(cv, beta != 0.0f ? U::scale_add(acc[i][v], s, beta, U::loadf(cv)) : U::scale(acc[i][v], s));
    }
  }
}

template <class U, int NV>
inline void rows_block(int mr, int64_t i, int64_t kp, const u16* a, int64_t lda, const u32* b, int64_t ldb,
                       float* c, int64_t ldc, float alpha, const float* rs, float beta) {
  const u16* ai = a + i * lda;
  float* ci = c + i * ldc;
  const float* ri = rs ? rs + i : nullptr;
  switch (mr) {
    case 6: return kernel<U, 6, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    case 5: return kernel<U, 5, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    case 4: return kernel<U, 4, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    case 3: return kernel<U, 3, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    case 2: return kernel<U, 2, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    case 1: return kernel<U, 1, NV>(kp, ai, lda, b, ldb, ci, ldc, alpha, ri, beta);
    default: return;
  }
}

// Rows of one column block starting at column j0, as micro::column_block: 6 at a time, a
// tail of 7 or 8 as 4 + 3 or 4 + 4; with ALower a row block reduces over the pairs that
// reach its last row's diagonal, with CLower the blocks wholly above the diagonal are skipped.
template <class U, int NV>
inline void column_block(int64_t M, int64_t kd, const u16* a, int64_t lda, const u32* b, int64_t ldb, float* c,
                         int64_t ldc, float alpha, const float* rs, float beta, micro::Tri tri, int64_t j0) {
  int64_t i = tri == micro::Tri::CLower ? std::min(M, j0) : 0;
  auto run = [&](int mr, int64_t row) {
    const int64_t k_rows = tri == micro::Tri::ALower ? std::min(kd, row + mr) : kd;
    rows_block<U, NV>(mr, row, (k_rows + 1) / 2, a, lda, b, ldb, c, ldc, alpha, rs, beta);
  };
  for (; M - i > 8; i += 6) run(6, i);
  const int64_t rest = M - i;
  if (rest >= 7) {
    run(4, i);
    run(static_cast<int>(rest - 4), i + 4);
  } else if (rest > 0) {
    run(static_cast<int>(rest), i);
  }
}

// C[M, N] = alpha * diag(row_scale) * A B + beta * C (layouts: the top of this file; with
// beta 0 C is only written). With ALower, A(i, r) = 0 for r > i, and kd even: an odd row's
// last pair reads one entry above the diagonal, which must hold 0.
template <class U>
inline void gemm(int64_t M, int64_t N, int64_t kd, float alpha, const u16* a, int64_t lda, const u32* b, int64_t ldb,
                 float beta, float* c, int64_t ldc, const float* row_scale = nullptr,
                 micro::Tri tri = micro::Tri::None) {
  if (M <= 0 || N <= 0) return;
  constexpr int64_t L = U::kLanes;
  int64_t j = 0;
  for (; j + 2 * L <= N; j += 2 * L)
    column_block<U, 2>(M, kd, a, lda, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
  if (j + L <= N) column_block<U, 1>(M, kd, a, lda, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
}

// --- operands in the units' layouts -----------------------------------------------------

// dst [R, N] bfloat16 (row stride ldd) = src [R, N] float32 (row stride lds), rounded.
inline void round_rows(const float* src, int64_t lds, int64_t R, int64_t N, u16* dst, int64_t ldd) {
  for (int64_t r = 0; r < R; ++r) {
    const float* s = src + r * lds;
    u16* d = dst + r * ldd;
#pragma omp simd
    for (int64_t j = 0; j < N; ++j) d[j] = float_to_bf16(s[j]);
  }
}

// Pair-packed [R / 2, N] words from bfloat16 rows [R, N] (row stride lds), R even.
inline void pack_bf16(const u16* src, int64_t lds, int64_t R, int64_t N, u32* dst) {
  for (int64_t r = 0; r < R / 2; ++r) {
    const u16 *even = src + 2 * r * lds, *odd = even + lds;
    u32* d = dst + r * N;
#pragma omp simd
    for (int64_t j = 0; j < N; ++j) d[j] = word(even[j], odd[j]);
  }
}

// Pair-packed [R / 2, N] words from float32 rows [R, N] (row stride lds), each row times
// row_scale[r] (null: ones), rounded; R even.
inline void pack_f32(const float* src, int64_t lds, const float* row_scale, int64_t R, int64_t N, u32* dst) {
  for (int64_t r = 0; r < R / 2; ++r) {
    const float *even = src + 2 * r * lds, *odd = even + lds;
    const float se = row_scale ? row_scale[2 * r] : 1.0f, so = row_scale ? row_scale[2 * r + 1] : 1.0f;
    u32* d = dst + r * N;
#pragma omp simd
    for (int64_t j = 0; j < N; ++j) d[j] = word(float_to_bf16(se * even[j]), float_to_bf16(so * odd[j]));
  }
}

// B = X^T pair-packed, from X [R, K] bfloat16 row-major (K even): word (r, j) = (X[j][2r],
// X[j][2r + 1]), a transpose of X's 32-bit words. dst [K / 2, R].
inline void pack_transposed(const u16* x, int64_t R, int64_t K, u32* dst) {
  for (int64_t j = 0; j < R; ++j) {
    const u16* row = x + j * K;
    for (int64_t r = 0; r < K / 2; ++r) dst[r * R + j] = word(row[2 * r], row[2 * r + 1]);
  }
}

// dst [K, R] = X^T for X [R, K] bfloat16.
inline void transpose(const u16* x, int64_t R, int64_t K, u16* dst) {
  for (int64_t j = 0; j < R; ++j)
    for (int64_t i = 0; i < K; ++i) dst[i * R + j] = x[j * K + i];
}

}  // namespace pairs
}  // namespace gdr
