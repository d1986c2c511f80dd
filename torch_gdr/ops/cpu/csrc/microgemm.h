// Small GEMMs of the chunked kernels without a BLAS call: register-blocked AVX2 (FMA)
// micro-kernels of 6 rows x 16 columns (6 x 32 in AVX-512 registers where the variant has
// them), no packing, operands read where they lie.
//
// The chunk products are small (tens to a hundred rows, 128 columns) and repeated thousands
// of times a call; the BLAS's fixed cost per call (argument checks, packing both operands,
// scaling C by beta) was a quarter of the forward's time on a Zen 3 EPYC. Here:
//   C[M, N] = alpha * diag(row_scale) * A B + beta * C    (beta 0: C is not read)
// where A is float32 read through element strides (so op(A) = A^T costs nothing: swap the
// strides) and B is row-major float32 (half operands are converted as their tiles load).
#pragma once

#include "common.h"

namespace gdr {
namespace micro {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kEnabled = true;

// The micro-kernels take their registers as L: Lanes8 or Lanes16 (common.h). With AVX-512
// the column blocks of 16 and 32 columns run in Lanes16, the 8-column tail in Lanes8.

// acc[i][v] = sum_r A(i, r) * B[r][w v : w v + w] (w = L::kLanes) for MR rows and NV vectors
// of columns, then stored as described above.
template <int MR, int NV, typename L, typename TB>
inline void kernel(int64_t kd, const float* a, int64_t ars, int64_t acs, const TB* b, int64_t ldb, float* c,
                   int64_t ldc, float alpha, const float* row_scale, float beta) {
  constexpr int W = L::kLanes;
  typename L::R acc[MR][NV];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = L::zero();
#pragma GCC unroll 4
  for (int64_t r = 0; r < kd; ++r) {
    typename L::R bv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) bv[v] = L::load(b + r * ldb + W * v);
    const float* ar = a + r * acs;
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const typename L::R ai = L::broadcast(ar + i * ars);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = L::fmadd(ai, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    const typename L::R s = L::set1(row_scale ? alpha * row_scale[i] : alpha);
    float* ci = c + i * ldc;
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      typename L::R x = L::mul(acc[i][v], s);
      if (beta != 0.0f) x = L::fmadd(L::set1(beta), L::load(ci + W * v), x);
      L::store(ci + W * v, x);
    }
  }
}

// MR rows (1 to 6) starting at row i of one column block of NV vectors; `kd` the reduction
// length of these rows.
template <int NV, typename L, typename TB>
inline void rows_block(int mr, int64_t i, int64_t kd, const float* a, int64_t ars, int64_t acs, const TB* b,
                       int64_t ldb, float* c, int64_t ldc, float alpha, const float* rs, float beta) {
  const float* ai = a + i * ars;
  float* ci = c + i * ldc;
  const float* ri = rs ? rs + i : nullptr;
  switch (mr) {
    case 6: return kernel<6, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    case 5: return kernel<5, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    case 4: return kernel<4, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    case 3: return kernel<3, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    case 2: return kernel<2, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    case 1: return kernel<1, NV, L>(kd, ai, ars, acs, b, ldb, ci, ldc, alpha, ri, beta);
    default: return;
  }
}
#endif

// Which part of a product is needed (the rest of A is zero, or the rest of C unused).
enum class Tri {
  None,
  ALower,  // A lower triangular (A(i, r) = 0 for r > i): row i reduces over r <= i only
  CLower,  // only C(i, j) for j <= i is wanted; the rest of C is left as it was
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Rows [i0, M) of the column block starting at column j0, 6 rows at a time; a tail of 7 or 8
// rows as 4 + 3 or 4 + 4 (fewer than 8 accumulators leave the FMA units idle).
template <int NV, typename L, typename TB>
inline void column_block(int64_t M, int64_t kd, const float* a, int64_t ars, int64_t acs, const TB* b, int64_t ldb,
                         float* c, int64_t ldc, float alpha, const float* rs, float beta, Tri tri, int64_t j0) {
  int64_t i = tri == Tri::CLower ? std::min(M, j0) : 0;
  auto run = [&](int mr, int64_t row) {
    const int64_t k_rows = tri == Tri::ALower ? std::min(kd, row + mr) : kd;
    rows_block<NV, L>(mr, row, k_rows, a, ars, acs, b, ldb, c, ldc, alpha, rs, beta);
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
#else
constexpr bool kEnabled = false;
#endif

// The columns past the last multiple of 8, one element at a time.
template <typename TB>
inline void scalar_columns(int64_t M, int64_t j0, int64_t N, int64_t kd, const float* a, int64_t ars, int64_t acs,
                           const TB* b, int64_t ldb, float* c, int64_t ldc, float alpha, const float* rs,
                           float beta, Tri tri) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = j0; j < N; ++j) {
      if (tri == Tri::CLower && j > i) continue;
      const int64_t k_rows = tri == Tri::ALower ? std::min(kd, i + 1) : kd;
      float s = 0.0f;
      for (int64_t r = 0; r < k_rows; ++r) s += a[i * ars + r * acs] * to_float(b[r * ldb + j]);
      const float x = (rs ? alpha * rs[i] : alpha) * s;
      c[i * ldc + j] = beta != 0.0f ? x + beta * c[i * ldc + j] : x;
    }
}

// C[M, N] = alpha * diag(row_scale) * A B + beta * C, A(i, r) = a[i * ars + r * acs] (float32),
// B row-major [kd, N] with row stride ldb, C row-major with row stride ldc. `row_scale`
// [M] may be null (ones); with beta 0 C is only written. `tri`: see Tri (with CLower, the
// entries above the diagonal may be written too, in whole blocks).
template <typename TB>
inline void gemm_nn(int64_t M, int64_t N, int64_t kd, float alpha, const float* a, int64_t ars, int64_t acs,
                    const TB* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* row_scale = nullptr,
                    Tri tri = Tri::None) {
  if (M <= 0 || N <= 0) return;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if defined(__AVX512F__)
  for (; j + 32 <= N; j += 32)
    column_block<2, Lanes16>(M, kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
  if (j + 16 <= N) {
    column_block<1, Lanes16>(M, kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
    j += 16;
  }
#else
  for (; j + 16 <= N; j += 16)
    column_block<2, Lanes8>(M, kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
#endif
  if (j + 8 <= N) {
    column_block<1, Lanes8>(M, kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, row_scale, beta, tri, j);
    j += 8;
  }
#endif
  if (j < N) scalar_columns(M, j, N, kd, a, ars, acs, b, ldb, c, ldc, alpha, row_scale, beta, tri);
}

}  // namespace micro
}  // namespace gdr
