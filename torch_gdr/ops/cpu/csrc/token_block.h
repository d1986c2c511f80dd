// The per-token step of one value head over a block of state columns, shared by the
// per-sequence recurrence (recurrent.cpp) and the pool step (pool.cpp).
//
//   u = beta (v - exp(g) S^T k),  S' = exp(g) S + k u^T,  o = S'^T q = exp(g) S^T q + (k . q) u
//
// Every column of the state evolves on its own (column j of S' needs column j of S and the
// token's k, q, beta, v[j]), so a head's state is processed in column blocks small enough to
// stay in L1: for each block, every token of a group reads the block (S^T k, S^T q) and
// rewrites it (S'), the block read from memory once and written once per group of tokens.
// A whole head (K x V floats, 64 KiB at 128 x 128) would not fit in L1, and two passes over
// it per token would read it twice from L2.
#pragma once

#include "common.h"
#include "fp8.h"

namespace gdr {
// Columns per block (the vector path takes blocks of 1 to 4 registers' width, the rest the
// generic one): 32 columns of 128 rows are 16 KiB, which stay in L1 while the block is
// rewritten; 32 beat 64 and 16 in the decode bench (bench/RESULTS.md).
constexpr int64_t kBlock = 32;
// Columns per block of a pool of P in the pool step: on AVX-512 a pool narrower than float32
// takes 64 columns (four registers' width, so that its row piece is as many bytes as a
// float32 one of kBlock columns and the block's sums run in eight independent chains),
// elsewhere kBlock (bench/RESULTS.md).
template <typename P>
constexpr int64_t pool_block_cols() {
#if defined(__AVX512F__)
  return sizeof(P) < sizeof(float) ? 2 * kBlock : kBlock;
#else
  return kBlock;
#endif
}
// Tokens whose inputs are prepared together (their q, k, v in float32 in scratch).
constexpr int64_t kGroup = 8;

// One token's inputs, prepared once for every column block.
struct TokenIn {
  const float* q;  // [K] (l2-normalised if asked)
  const float* k;  // [K]
  const float* v;  // [V]
  float alpha;     // exp(g)
  float beta;
  float oscale;    // alpha * scale: the factor of S^T q in o
  float kq;        // (k . q) * scale: the factor of u in o
};

// Generic block of `w` columns: S^T k and S^T q into scratch, then u and o, then the write.
// `src` and `dst` point at the block's first column (rows `ss` and `ds` elements apart);
// src may be dst, or null (zeros).
template <typename T>
inline void block_generic(const TokenIn& t, const float* src, int64_t ss, float* dst, int64_t ds, int64_t K,
                          int64_t w, float* sk, float* sq, float* u, T* out) {
  std::fill(sk, sk + w, 0.0f);
  std::fill(sq, sq + w, 0.0f);
  if (src) {
    for (int64_t r = 0; r < K; ++r) {
      const float* row = src + r * ss;
      const float kr = t.k[r], qr = t.q[r];
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) sk[j] += row[j] * kr, sq[j] += row[j] * qr;
    }
  }
  const float alpha = t.alpha, b = t.beta;
#pragma omp simd
  for (int64_t j = 0; j < w; ++j) u[j] = b * (t.v[j] - alpha * sk[j]);
  for (int64_t j = 0; j < w; ++j) out[j] = from_float<T>(t.oscale * sq[j] + t.kq * u[j]);
  for (int64_t r = 0; r < K; ++r) {
    float* row = dst + r * ds;
    const float kr = t.k[r];
    if (src) {
      const float* srow = src + r * ss;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) row[j] = alpha * srow[j] + kr * u[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) row[j] = kr * u[j];
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define GDR_SIMD_BLOCK 1
// The vector registers of the block kernel below: 16 floats (AVX-512) or 8 (AVX2 + FMA).
#if defined(__AVX512F__)
using Vec = Lanes16;
#else
using Vec = Lanes8;
#endif

// Prefetch the cache lines of `n` floats from `p` (64-byte lines): for writing (`write`) or
// into L2 for reading soon.
inline void prefetch_floats(const float* p, int64_t n, bool write) {
  for (int64_t i = 0; i < n; i += 16) {
    if (write) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_ET0);
    else _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
  }
}

// A token's outputs over a block of Vec::kLanes * NV columns from its S^T k (`sk`) and S^T q
// (`sq`) of the decayed state: the delta u = beta (v - alpha S^T k) into `u`, and
// o = oscale S^T q + (k.q) u into `out` (through `obuf` for a half-precision output).
template <int NV, typename T>
inline void token_outputs(const TokenIn& t, const Vec::R* sk, const Vec::R* sq, Vec::R* u, float* obuf, T* out) {
  constexpr int L = Vec::kLanes;
  const Vec::R alpha = Vec::set1(t.alpha), b = Vec::set1(t.beta);
  const Vec::R oscale = Vec::set1(t.oscale), kq = Vec::set1(t.kq);
#pragma GCC unroll 4
  for (int i = 0; i < NV; ++i) {
    u[i] = Vec::mul(b, Vec::fnmadd(alpha, sk[i], Vec::load(t.v + L * i)));
    const Vec::R o = Vec::fmadd(oscale, sq[i], Vec::mul(kq, u[i]));
    if constexpr (std::is_same_v<T, float>) {
      Vec::store(out + L * i, o);
    } else {
      Vec::store(obuf + L * i, o);
    }
  }
  if constexpr (!std::is_same_v<T, float>) store_row(obuf, out, L * NV);
}

// The same for a block of Vec::kLanes * NV columns, its S^T k and S^T q held in registers.
// `next` (or null): the block to run after this one (row stride V), prefetched into L2 row
// by row during the write; out of place, pass 1 prefetches the destination rows for writing
// (no read-for-ownership stall in pass 2).
template <int NV, typename T>
inline void block_simd(const TokenIn& t, const float* src, float* dst, int64_t K, int64_t V, float* obuf,
                       T* out, const float* next) {
  constexpr int L = Vec::kLanes, W = L * NV;
  Vec::R sk[NV], sq[NV], u[NV];
#pragma GCC unroll 4
  for (int i = 0; i < NV; ++i) sk[i] = Vec::zero(), sq[i] = Vec::zero();
  if (src) {
    for (int64_t r = 0; r < K; ++r) {
      const float* row = src + r * V;
      const Vec::R kr = Vec::set1(t.k[r]), qr = Vec::set1(t.q[r]);
      if (src != dst) prefetch_floats(dst + r * V, W, true);  // own the destination row before pass 2
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) {
        const Vec::R x = Vec::load(row + L * i);
        sk[i] = Vec::fmadd(x, kr, sk[i]);
        sq[i] = Vec::fmadd(x, qr, sq[i]);
      }
    }
  }
  token_outputs<NV>(t, sk, sq, u, obuf, out);
  const Vec::R alpha = Vec::set1(t.alpha);
  for (int64_t r = 0; r < K; ++r) {
    float* row = dst + r * V;
    const Vec::R kr = Vec::set1(t.k[r]);
    if (next) prefetch_floats(next + r * V, W, false);  // the next block streams into L2 meanwhile
    if (src) {
      const float* srow = src + r * V;
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) Vec::store(row + L * i, Vec::fmadd(alpha, Vec::load(srow + L * i), Vec::mul(kr, u[i])));
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) Vec::store(row + L * i, Vec::mul(kr, u[i]));
    }
  }
}

// Half-precision pool rows in registers: Vec::kLanes elements of P converted to float32 on
// load and rounded to nearest even on store (c10's rounding: bfloat16 NaN as 0x7FC0).
template <typename P>
inline Vec::R load_lanes(const P* p);
template <typename P>
inline void store_lanes(P* p, Vec::R x);

template <>
inline Vec::R load_lanes<float>(const float* p) { return Vec::load(p); }
template <>
inline void store_lanes<float>(float* p, Vec::R x) { Vec::store(p, x); }

#if defined(__AVX512F__)
template <>
inline Vec::R load_lanes<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// float32 lanes rounded to nearest even, the bfloat16 in each lane's low half (NaN: 0x7FC0).
inline __m512i round_bf16_low(Vec::R x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
}
template <>
inline void store_lanes<c10::BFloat16>(c10::BFloat16* p, Vec::R x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_low(x)));
}
// Two registers into 32 bfloat16: one pack and one lane permute (two shuffles) where two
// narrowing moves take four.
inline void store_lanes2_bf16(c10::BFloat16* p, Vec::R a, Vec::R b) {
  const __m512i packed = _mm512_packus_epi32(round_bf16_low(a), round_bf16_low(b));  // per 128-bit lane: a, b
  const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi64(order, packed));
}
template <>
inline Vec::R load_lanes<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline void store_lanes<c10::Half>(c10::Half* p, Vec::R x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__F16C__)
// 8 lanes: common.h's AVX2/F16C row conversions.
template <>
inline Vec::R load_lanes<c10::BFloat16>(const c10::BFloat16* p) { return convert8::load(p); }
template <>
inline void store_lanes<c10::BFloat16>(c10::BFloat16* p, Vec::R x) { convert8::store(p, x); }
template <>
inline Vec::R load_lanes<c10::Half>(const c10::Half* p) { return convert8::load(p); }
template <>
inline void store_lanes<c10::Half>(c10::Half* p, Vec::R x) { convert8::store(p, x); }
#else
// AVX2 without F16C: c10's scalar conversions, lane by lane.
template <typename P>
inline Vec::R load_lanes_scalar(const P* p) {
  alignas(32) float f[Vec::kLanes];
  for (int i = 0; i < Vec::kLanes; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::load(f);
}
template <typename P>
inline void store_lanes_scalar(P* p, Vec::R x) {
  alignas(32) float f[Vec::kLanes];
  Vec::store(f, x);
  for (int i = 0; i < Vec::kLanes; ++i) p[i] = static_cast<P>(f[i]);
}
template <>
inline Vec::R load_lanes<c10::BFloat16>(const c10::BFloat16* p) { return load_lanes_scalar(p); }
template <>
inline void store_lanes<c10::BFloat16>(c10::BFloat16* p, Vec::R x) { store_lanes_scalar(p, x); }
template <>
inline Vec::R load_lanes<c10::Half>(const c10::Half* p) { return load_lanes_scalar(p); }
template <>
inline void store_lanes<c10::Half>(c10::Half* p, Vec::R x) { store_lanes_scalar(p, x); }
#endif

// fp8 pools: a register's lanes at a time (fp8.h).
template <typename P>
inline Vec::R fp8_load_lanes(const P* p) {
#if defined(__AVX512F__)
  return fp8_load16(p);
#else
  return fp8_load8(p);
#endif
}
template <typename P>
inline void fp8_store_lanes(P* p, Vec::R x) {
#if defined(__AVX512F__)
  fp8_store16(p, x);
#else
  fp8_store8(p, x);
#endif
}
template <>
inline Vec::R load_lanes<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) { return fp8_load_lanes(p); }
template <>
inline void store_lanes<c10::Float8_e4m3fn>(c10::Float8_e4m3fn* p, Vec::R x) { fp8_store_lanes(p, x); }
template <>
inline Vec::R load_lanes<c10::Float8_e5m2>(const c10::Float8_e5m2* p) { return fp8_load_lanes(p); }
template <>
inline void store_lanes<c10::Float8_e5m2>(c10::Float8_e5m2* p, Vec::R x) { fp8_store_lanes(p, x); }

// Prefetch `bytes` from `p` into L2 (64-byte lines).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// Prefetch `bytes` from `p` for writing (no read-for-ownership stall at the store).
inline void prefetch_write_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_ET0);
}

// NV registers into NV * Vec::kLanes elements of P (bfloat16 on AVX-512 two at a time).
template <int NV, typename P>
inline void store_lanes_n(P* p, const Vec::R* x) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<P, c10::BFloat16> && NV % 2 == 0) {
#pragma GCC unroll 2
    for (int i = 0; i < NV; i += 2) store_lanes2_bf16(p + Vec::kLanes * i, x[i], x[i + 1]);
    return;
  }
#endif
#pragma GCC unroll 4
  for (int i = 0; i < NV; ++i) store_lanes(p + Vec::kLanes * i, x[i]);
}

// One token over a block of Vec::kLanes * NV columns of a key-first state, without a
// float32 copy of a pool row: the state is read from `hsrc` (a row of P, rows `hss` elements
// apart) or `fsrc` (float32, rows `fss` apart) or is zero (both null), and the new state
// written to `fdst` (float32, for a token that follows) and/or `hdst` (a row of P, rounded);
// any of them may be the same memory as the source of its type (in place). P is float32,
// a half type or fp8. `next` (or null): the block to run after this one (P, rows `nss`
// apart), prefetched into L2 during the write.
template <int NV, typename P, typename T>
inline void block_half(const TokenIn& t, const P* hsrc, int64_t hss, const float* fsrc, int64_t fss, float* fdst,
                       int64_t fds, P* hdst, int64_t hds, int64_t K, float* obuf, T* out, const P* next,
                       int64_t nss) {
  constexpr int L = Vec::kLanes, W = L * NV;
  Vec::R sk[NV], sq[NV], u[NV];
#pragma GCC unroll 4
  for (int i = 0; i < NV; ++i) sk[i] = Vec::zero(), sq[i] = Vec::zero();
  const bool own_h = hdst && static_cast<const void*>(hdst) != static_cast<const void*>(hsrc);
  auto accumulate = [&](auto* src, int64_t ss) {
    for (int64_t r = 0; r < K; ++r) {
      const auto* row = src + r * ss;
      const Vec::R kr = Vec::set1(t.k[r]), qr = Vec::set1(t.q[r]);
      if (own_h) prefetch_write_bytes(hdst + r * hds, W * static_cast<int64_t>(sizeof(P)));
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) {
        const Vec::R x = load_lanes(row + L * i);
        sk[i] = Vec::fmadd(x, kr, sk[i]);
        sq[i] = Vec::fmadd(x, qr, sq[i]);
      }
    }
  };
  if (hsrc) accumulate(hsrc, hss);
  else if (fsrc) accumulate(fsrc, fss);
  token_outputs<NV>(t, sk, sq, u, obuf, out);
  const Vec::R alpha = Vec::set1(t.alpha);
  if (!fdst && !hdst) return;  // a last token written nowhere (row -1)
  for (int64_t r = 0; r < K; ++r) {
    const Vec::R kr = Vec::set1(t.k[r]);
    if (next) prefetch_bytes(next + r * nss, W * static_cast<int64_t>(sizeof(P)));
    Vec::R x[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      const Vec::R ku = Vec::mul(kr, u[i]);
      if (hsrc) x[i] = Vec::fmadd(alpha, load_lanes(hsrc + r * hss + L * i), ku);
      else if (fsrc) x[i] = Vec::fmadd(alpha, Vec::load(fsrc + r * fss + L * i), ku);
      else x[i] = ku;
    }
    if (fdst) {
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) Vec::store(fdst + r * fds + L * i, x[i]);
    }
    if (hdst) store_lanes_n<NV>(hdst + r * hds, x);
  }
}

#if !defined(__AVX512F__)
// bfloat16 pool blocks on AVX2, which has no bfloat16 conversion: 16 columns per pair of
// registers, the even columns in one and the odd in the other, so that a 32-byte row piece
// converts with one shift (even) and one mask (odd), and the rounded halves merge back with
// a shift, a mask and an or (no pack, no lane permute). The float32 state between tokens
// (`fsrc`, `fdst`) keeps that order within each 16 columns: only scratch the caller owns.
struct Bf16x16 {
  __m256 even, odd;
};

inline Bf16x16 load_bf16x16(const c10::BFloat16* p) {
  const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(m, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// float32 lanes rounded to nearest even, the bfloat16 in each lane's high half (NaN: 0x7FC0).
inline __m256i round_bf16_high(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

inline void store_bf16x16(c10::BFloat16* p, __m256 even, __m256 odd) {
  const __m256i e = _mm256_srli_epi32(round_bf16_high(even), 16);
  const __m256i o = _mm256_and_si256(round_bf16_high(odd), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(e, o));
}

// block_half for a bfloat16 pool on AVX2, 16 * NP columns (see Bf16x16).
template <int NP, typename T>
inline void block_bf16_pairs(const TokenIn& t, const c10::BFloat16* hsrc, int64_t hss, const float* fsrc, int64_t fss,
                             float* fdst, int64_t fds, c10::BFloat16* hdst, int64_t hds, int64_t K, float* obuf,
                             T* out, const c10::BFloat16* next, int64_t nss) {
  constexpr int W = 16 * NP;
  __m256 sk[2 * NP], sq[2 * NP], u[2 * NP];
#pragma GCC unroll 8
  for (int i = 0; i < 2 * NP; ++i) sk[i] = _mm256_setzero_ps(), sq[i] = _mm256_setzero_ps();
  auto load_pair = [&](int64_t r, int i, __m256& e, __m256& o) {
    if (hsrc) {
      const Bf16x16 x = load_bf16x16(hsrc + r * hss + 16 * i);
      e = x.even, o = x.odd;
    } else {
      e = _mm256_loadu_ps(fsrc + r * fss + 16 * i), o = _mm256_loadu_ps(fsrc + r * fss + 16 * i + 8);
    }
  };
  const bool own_h = hdst && hdst != hsrc;
  if (hsrc || fsrc) {
    for (int64_t r = 0; r < K; ++r) {
      const __m256 kr = _mm256_set1_ps(t.k[r]), qr = _mm256_set1_ps(t.q[r]);
      if (own_h) prefetch_write_bytes(hdst + r * hds, W * 2);
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) {
        __m256 e, o;
        load_pair(r, i, e, o);
        sk[2 * i] = _mm256_fmadd_ps(e, kr, sk[2 * i]), sq[2 * i] = _mm256_fmadd_ps(e, qr, sq[2 * i]);
        sk[2 * i + 1] = _mm256_fmadd_ps(o, kr, sk[2 * i + 1]), sq[2 * i + 1] = _mm256_fmadd_ps(o, qr, sq[2 * i + 1]);
      }
    }
  }
  // v in the same order (even columns, then odd, per 16), o back in column order.
  alignas(32) float vp[W], op[W];
  for (int i = 0; i < NP; ++i)
    for (int l = 0; l < 8; ++l) vp[16 * i + l] = t.v[16 * i + 2 * l], vp[16 * i + 8 + l] = t.v[16 * i + 2 * l + 1];
  const __m256 alpha = _mm256_set1_ps(t.alpha), b = _mm256_set1_ps(t.beta);
  const __m256 oscale = _mm256_set1_ps(t.oscale), kq = _mm256_set1_ps(t.kq);
#pragma GCC unroll 8
  for (int i = 0; i < 2 * NP; ++i) {
    u[i] = _mm256_mul_ps(b, _mm256_fnmadd_ps(alpha, sk[i], _mm256_load_ps(vp + 8 * i)));
    _mm256_store_ps(op + 8 * i, _mm256_fmadd_ps(oscale, sq[i], _mm256_mul_ps(kq, u[i])));
  }
  for (int i = 0; i < NP; ++i)
    for (int l = 0; l < 8; ++l) obuf[16 * i + 2 * l] = op[16 * i + l], obuf[16 * i + 2 * l + 1] = op[16 * i + 8 + l];
  store_row(obuf, out, W);
  if (!fdst && !hdst) return;
  for (int64_t r = 0; r < K; ++r) {
    const __m256 kr = _mm256_set1_ps(t.k[r]);
    if (next) prefetch_bytes(next + r * nss, W * 2);
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      __m256 e = _mm256_mul_ps(kr, u[2 * i]), o = _mm256_mul_ps(kr, u[2 * i + 1]);
      if (hsrc || fsrc) {
        __m256 se, so;
        load_pair(r, i, se, so);
        e = _mm256_fmadd_ps(alpha, se, e), o = _mm256_fmadd_ps(alpha, so, o);
      }
      if (fdst) _mm256_storeu_ps(fdst + r * fds + 16 * i, e), _mm256_storeu_ps(fdst + r * fds + 16 * i + 8, o);
      if (hdst) store_bf16x16(hdst + r * hds + 16 * i, e, o);
    }
  }
}
#endif

// One token over columns [0, w) of a block whose pointers already point at the block's first
// column (w a multiple of Vec::kLanes, at most kBlock): block_half, or on AVX2 for a
// bfloat16 pool with `bf16_pairs` (float32 scratch rows in the pairs' order) its pairs.
template <typename P, typename T>
inline void step_block_half(const TokenIn& tb, const P* hs, int64_t hss, const float* fs, int64_t fss, float* fd,
                            int64_t fds, P* hd, int64_t hds, int64_t K, int64_t w, float* scratch, T* out,
                            const P* next, int64_t nss, bool bf16_pairs) {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (bf16_pairs && w % 16 == 0) {
      if (w == 32) return block_bf16_pairs<2>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
      if (w == 16) return block_bf16_pairs<1>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
    }
  }
#endif
  switch (w / Vec::kLanes) {
    case 1: return block_half<1>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
    case 2: return block_half<2>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
    case 3: return block_half<3>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
    default: return block_half<4>(tb, hs, hss, fs, fss, fd, fds, hd, hds, K, scratch, out, next, nss);
  }
}
#endif

// Columns [j0, j0 + w) of one head for one token.
template <typename T>
inline void step_block(const TokenIn& t, const float* src, float* dst, int64_t K, int64_t V, int64_t j0, int64_t w,
                       float* scratch, T* out, const float* next) {
  const float* s = src ? src + j0 : nullptr;
  float* d = dst + j0;
  TokenIn tb = t;
  tb.v = t.v + j0;
#if defined(GDR_SIMD_BLOCK)
  if (w % Vec::kLanes == 0) {
    switch (w / Vec::kLanes) {  // kBlock / Vec::kLanes registers at most
      case 1: return block_simd<1>(tb, s, d, K, V, scratch, out + j0, next);
      case 2: return block_simd<2>(tb, s, d, K, V, scratch, out + j0, next);
      case 3: return block_simd<3>(tb, s, d, K, V, scratch, out + j0, next);
      case 4: return block_simd<4>(tb, s, d, K, V, scratch, out + j0, next);
      default: break;
    }
  }
#endif
  block_generic(tb, s, V, d, V, K, w, scratch, scratch + kBlock, scratch + 2 * kBlock, out + j0);
}

// Token `tok` of value head `h` (q/k head `hk`) in float32 at `buf` ([q | k | v], l2-normalised
// q and k if asked), with the factors every block of the step uses.
template <typename T>
inline TokenIn prepare_token(const Problem& p, const T* q, const T* k, const T* v, const float* g,
                             const float* beta, int64_t tok, int64_t hk, int64_t h, float* buf) {
  const int64_t K = p.K, V = p.V;
  float *qv = buf, *kv = qv + K, *vv = kv + K;
  const InputStrides& st = p.strides;
  load_row(q + tok * st.q_tok + hk * st.q_head, qv, K);
  load_row(k + tok * st.k_tok + hk * st.k_head, kv, K);
  load_row(v + tok * st.v_tok + h * st.v_head, vv, V);
  if (p.l2norm) {
    float rn;
    l2norm_rows(qv, &rn, 1, K);
    l2norm_rows(kv, &rn, 1, K);
  }
  // g = +inf: the recurrence's exp(g) S holds +-inf (NaN where S is 0), and every sum over
  // it, so the head's state and outputs are NaN from this token on; the fused form's
  // alpha * (S^T k) would give +-inf instead. A NaN factor gives the recurrence's NaN.
  const float gate = gate_of(p, g[tok * st.g_tok + h * st.g_head], h);
  const float alpha = gate == std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::quiet_NaN()
                                                                     : std::exp(gate);
  return TokenIn{qv, kv, vv, alpha, beta_of(p, beta[tok * st.b_tok + h * st.b_head]), alpha * p.scale, dot(kv, qv, K) * p.scale};
}

}  // namespace gdr
