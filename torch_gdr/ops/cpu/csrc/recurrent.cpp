// The per-token recurrence, fused, for decode and short T: one parallel region over
// (sequence, value head).
//
//   u = beta (v - exp(g) S^T k),  S' = exp(g) S + k u^T,  o = S'^T q = exp(g) S^T q + (k . q) u
//
// Every column of the state evolves on its own (column j of S' needs column j of S and the
// token's k, q, beta, v[j]), so a head's state is processed in column blocks small enough to
// stay in L1: for each block, every token of a group reads the block (S^T k, S^T q) and
// rewrites it (S'), the block read from memory once and written once per group of tokens.
// A whole head (K x V floats, 64 KiB at 128 x 128) would not fit in L1, and two passes over
// it per token would read it twice from L2.
#include "common.h"

namespace gdr {

namespace {

// Columns per block (the vector path takes blocks of 1 to 4 registers' width, the rest the
// generic one): 32 columns of 128 rows are 16 KiB, which stay in L1 while the block is
// rewritten; 32 beat 64 and 16 in the decode bench (bench/RESULTS.md).
constexpr int64_t kBlock = 32;
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
// `src` and `dst` point at the block's first column (row stride V); src may be dst, or null
// (zeros).
template <typename T>
inline void block_generic(const TokenIn& t, const float* src, float* dst, int64_t K, int64_t V, int64_t w,
                          float* sk, float* sq, float* u, T* out) {
  std::fill(sk, sk + w, 0.0f);
  std::fill(sq, sq + w, 0.0f);
  if (src) {
    for (int64_t r = 0; r < K; ++r) {
      const float* row = src + r * V;
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
    float* row = dst + r * V;
    const float kr = t.k[r];
    if (src) {
      const float* srow = src + r * V;
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
struct Vec {
#if defined(__AVX512F__)
  using R = __m512;
  static constexpr int kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c
  static R fnmadd(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
#else
  using R = __m256;
  static constexpr int kLanes = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
#endif
};

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
template <>
inline void store_lanes<c10::BFloat16>(c10::BFloat16* p, Vec::R x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
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

// Prefetch `bytes` from `p` into L2 (64-byte lines).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// One token over a block of Vec::kLanes * NV columns of a key-first half-precision pool
// head, without a float32 copy of the head: the state is read from `hsrc` (pool row, P,
// row stride V) or `fsrc` (float32, row stride V) or is zero (both null), and the new state
// written to `fdst` (float32, for a token that follows) and/or `hdst` (pool row, rounded);
// any of them may be the same memory as the source of its type (in place). `next` (or
// null): the pool block to run after this one, prefetched into L2 during the write.
template <int NV, typename P, typename T>
inline void block_half(const TokenIn& t, const P* hsrc, const float* fsrc, float* fdst, P* hdst, int64_t K,
                       int64_t V, float* obuf, T* out, const P* next) {
  constexpr int L = Vec::kLanes, W = L * NV;
  Vec::R sk[NV], sq[NV], u[NV];
#pragma GCC unroll 4
  for (int i = 0; i < NV; ++i) sk[i] = Vec::zero(), sq[i] = Vec::zero();
  auto accumulate = [&](auto* src) {
    for (int64_t r = 0; r < K; ++r) {
      const auto* row = src + r * V;
      const Vec::R kr = Vec::set1(t.k[r]), qr = Vec::set1(t.q[r]);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) {
        const Vec::R x = load_lanes(row + L * i);
        sk[i] = Vec::fmadd(x, kr, sk[i]);
        sq[i] = Vec::fmadd(x, qr, sq[i]);
      }
    }
  };
  if (hsrc) accumulate(hsrc);
  else if (fsrc) accumulate(fsrc);
  token_outputs<NV>(t, sk, sq, u, obuf, out);
  const Vec::R alpha = Vec::set1(t.alpha);
  if (!fdst && !hdst) return;  // a last token written nowhere (row -1)
  for (int64_t r = 0; r < K; ++r) {
    const Vec::R kr = Vec::set1(t.k[r]);
    if (next) prefetch_bytes(next + r * V, W * static_cast<int64_t>(sizeof(P)));
    Vec::R x[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      const Vec::R ku = Vec::mul(kr, u[i]);
      if (hsrc) x[i] = Vec::fmadd(alpha, load_lanes(hsrc + r * V + L * i), ku);
      else if (fsrc) x[i] = Vec::fmadd(alpha, Vec::load(fsrc + r * V + L * i), ku);
      else x[i] = ku;
    }
    if (fdst) {
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) Vec::store(fdst + r * V + L * i, x[i]);
    }
    if (hdst) {
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) store_lanes(hdst + r * V + L * i, x[i]);
    }
  }
}

#if !defined(__AVX512F__)
// bfloat16 pool blocks on AVX2, which has no bfloat16 conversion: 16 columns per pair of
// registers, the even columns in one and the odd in the other, so that a 32-byte row piece
// converts with one shift (even) and one mask (odd), and the rounded halves merge back with
// a shift, a mask and an or (no pack, no lane permute). The float32 state between tokens
// (`fsrc`, `fdst`) keeps that order within each 16 columns: written and read only here.
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
inline void block_bf16_pairs(const TokenIn& t, const c10::BFloat16* hsrc, const float* fsrc, float* fdst,
                             c10::BFloat16* hdst, int64_t K, int64_t V, float* obuf, T* out,
                             const c10::BFloat16* next) {
  constexpr int W = 16 * NP;
  __m256 sk[2 * NP], sq[2 * NP], u[2 * NP];
#pragma GCC unroll 8
  for (int i = 0; i < 2 * NP; ++i) sk[i] = _mm256_setzero_ps(), sq[i] = _mm256_setzero_ps();
  auto load_pair = [&](int64_t r, int i, __m256& e, __m256& o) {
    if (hsrc) {
      const Bf16x16 x = load_bf16x16(hsrc + r * V + 16 * i);
      e = x.even, o = x.odd;
    } else {
      e = _mm256_loadu_ps(fsrc + r * V + 16 * i), o = _mm256_loadu_ps(fsrc + r * V + 16 * i + 8);
    }
  };
  if (hsrc || fsrc) {
    for (int64_t r = 0; r < K; ++r) {
      const __m256 kr = _mm256_set1_ps(t.k[r]), qr = _mm256_set1_ps(t.q[r]);
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
    if (next) prefetch_bytes(next + r * V, W * 2);
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      __m256 e = _mm256_mul_ps(kr, u[2 * i]), o = _mm256_mul_ps(kr, u[2 * i + 1]);
      if (hsrc || fsrc) {
        __m256 se, so;
        load_pair(r, i, se, so);
        e = _mm256_fmadd_ps(alpha, se, e), o = _mm256_fmadd_ps(alpha, so, o);
      }
      if (fdst) _mm256_storeu_ps(fdst + r * V + 16 * i, e), _mm256_storeu_ps(fdst + r * V + 16 * i + 8, o);
      if (hdst) store_bf16x16(hdst + r * V + 16 * i, e, o);
    }
  }
}
#endif

// Columns [j0, j0 + w) of one head for one token over a half pool (w a multiple of
// Vec::kLanes, at most kBlock): block_half with the pointers offset to the block.
template <typename P, typename T>
inline void step_block_half(const TokenIn& t, const P* hsrc, const float* fsrc, float* fdst, P* hdst, int64_t K,
                            int64_t V, int64_t j0, int64_t w, float* scratch, T* out, const P* next) {
  TokenIn tb = t;
  tb.v = t.v + j0;
  const P* hs = hsrc ? hsrc + j0 : nullptr;
  const float* fs = fsrc ? fsrc + j0 : nullptr;
  float* fd = fdst ? fdst + j0 : nullptr;
  P* hd = hdst ? hdst + j0 : nullptr;
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (w % 16 == 0) {
      if (w == 32) return block_bf16_pairs<2>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
      if (w == 16) return block_bf16_pairs<1>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
    }
  }
#endif
  switch (w / Vec::kLanes) {
    case 1: return block_half<1>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
    case 2: return block_half<2>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
    case 3: return block_half<3>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
    default: return block_half<4>(tb, hs, fs, fd, hd, K, V, scratch, out + j0, next);
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
  block_generic(tb, s, d, K, V, w, scratch, scratch + kBlock, scratch + 2 * kBlock, out + j0);
}

// Token `tok` of value head `h` (q/k head `hk`) in float32 at `buf` ([q | k | v], l2-normalised
// q and k if asked), with the factors every block of the step uses.
template <typename T>
inline TokenIn prepare_token(const Problem& p, const T* q, const T* k, const T* v, const float* g,
                             const float* beta, int64_t tok, int64_t hk, int64_t h, float* buf) {
  const int64_t K = p.K, V = p.V, H = p.H, HV = p.HV;
  float *qv = buf, *kv = qv + K, *vv = kv + K;
  load_row(q + (tok * H + hk) * K, qv, K);
  load_row(k + (tok * H + hk) * K, kv, K);
  load_row(v + (tok * HV + h) * V, vv, V);
  if (p.l2norm) {
    float rn;
    l2norm_rows(qv, &rn, 1, K);
    l2norm_rows(kv, &rn, 1, K);
  }
  // g = +inf: the recurrence's exp(g) S holds +-inf (NaN where S is 0), and every sum over
  // it, so the head's state and outputs are NaN from this token on; the fused form's
  // alpha * (S^T k) would give +-inf instead. A NaN factor gives the recurrence's NaN.
  const float gate = gate_of(p, g[tok * HV + h], h);
  const float alpha = gate == std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::quiet_NaN()
                                                                     : std::exp(gate);
  return TokenIn{qv, kv, vv, alpha, beta_of(p, beta[tok * HV + h]), alpha * p.scale, dot(kv, qv, K) * p.scale};
}

template <typename T>
void recurrent_typed(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                     const float* initial, T* o, float* final_state) {
  const int64_t K = p.K, V = p.V, HV = p.HV, group = p.group();
  const int64_t state_size = K * V;
  const int64_t token_floats = 2 * K + V;
  parallel_items(
      p.threads, p.num_seqs() * HV, kGroup * token_floats + 3 * kBlock,
      [&](float* scratch, int64_t i) {
        const int64_t n = i / HV, h = i % HV, hk = h / group;
        float* dst = final_state + i * state_size;
        const float* src = initial ? initial + i * state_size : nullptr;
        if (p.len[n] == 0) {
          if (src) {
            if (src != dst) std::memcpy(dst, src, sizeof(float) * state_size);
          } else {
            std::memset(dst, 0, sizeof(float) * state_size);
          }
          return;
        }
        float* block_scratch = scratch + kGroup * token_floats;
        TokenIn in[kGroup];
        for (int64_t t0 = 0; t0 < p.len[n]; t0 += kGroup) {
          const int64_t count = std::min(kGroup, p.len[n] - t0);
          for (int64_t c = 0; c < count; ++c) {
            const int64_t tok = p.bos[n] + t0 + c;
            in[c] = prepare_token(p, q, k, v, g, beta, tok, hk, h, scratch + c * token_floats);
          }
          for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
            const int64_t w = std::min(kBlock, V - j0);
            const float* s = src;
            for (int64_t c = 0; c < count; ++c) {
              const int64_t tok = p.bos[n] + t0 + c;
              const float* next = nullptr;  // after the group's last token: the next block read
              if (c == count - 1) {
                if (j0 + kBlock < V) next = src ? src + j0 + kBlock : nullptr;
                else if (initial && i + 1 < p.num_seqs() * HV && t0 + kGroup >= p.len[n])
                  next = initial + (i + 1) * state_size;
              }
              step_block(in[c], s, dst, K, V, j0, w, block_scratch, o + (tok * HV + h) * V, next);
              s = dst;
            }
          }
          src = dst;
        }
      },
      /*contiguous=*/true);
}

// ---------------------------------------------------------------------------------------
// The same recurrence over a state pool, in place (see gdr_cpu.h: PoolArgs).
//
// A float32 key-first pool is computed on directly: token c of a sequence reads the state
// the token before it left (the start row for the first) and writes its row, column block by
// column block, as above (columns evolve independently, so a block of the start row is read
// before any token overwrites it, even when a later token's row is the start row). Rows -1
// go to a thread-local buffer instead. A key-first bfloat16 / float16 pool whose V is a
// multiple of the vector width is read and written in place too, converted in registers
// (pool_half_direct, above). Other pools (value-first, or V not a multiple of the width) are
// loaded once into a float32 key-first buffer that the tokens update in place, each token's
// block rounded into its row right after it is computed.

// Copy the block of columns [j0, j0 + w) of a key-first float32 state into a pool head
// (rounded to P; value-first transposes).
template <typename P>
inline void store_state_block(const float* state, P* head, int64_t K, int64_t V, int64_t j0, int64_t w,
                              bool v_first) {
  if (v_first) {
    for (int64_t j = j0; j < j0 + w; ++j) {
      P* out = head + j * K;
      for (int64_t r = 0; r < K; ++r) out[r] = from_float<P>(state[r * V + j]);
    }
  } else {
    for (int64_t r = 0; r < K; ++r) store_row(state + r * V + j0, head + r * V + j0, w);
  }
}

// A pool head into a key-first float32 state.
template <typename P>
inline void load_state(const P* head, float* state, int64_t K, int64_t V, bool v_first) {
  if (v_first) {
    for (int64_t j = 0; j < V; ++j) {
      const P* in = head + j * K;
      for (int64_t r = 0; r < K; ++r) state[r * V + j] = to_float(in[r]);
    }
  } else {
    load_row(head, state, K * V);
  }
}

#if defined(GDR_SIMD_BLOCK)
// A key-first half-precision pool (V a multiple of Vec::kLanes), without a float32 copy of
// its rows: the first token of a sequence reads its start row's blocks straight from the
// pool (converted in registers) and every token rounds its new state into its row from
// registers, so a one-token step moves 2 bytes per state element each way. Where another
// token of the sequence follows, the float32 state is also kept in `work` ([K, V]) for it:
// the state is carried in float32 between tokens and rounded only where stored, as in the
// float32-buffer path.
template <typename T, typename P>
void pool_half_direct(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                      const PoolArgs& a, T* o) {
  const int64_t K = p.K, V = p.V, HV = p.HV, group = p.group();
  const int64_t state_size = K * V;
  const int64_t token_floats = 2 * K + V;
  P* pool = static_cast<P*>(a.pool);
  auto head_of = [&](int64_t row, int64_t h) { return pool + row * a.row_stride + h * state_size; };
  auto start_row = [&](int64_t n) { return a.indices[n * a.width + (a.read_pos ? a.read_pos[n] : 0)]; };
  const int64_t items = p.num_seqs() * HV;
  parallel_items(
      p.threads, items, kGroup * token_floats + 3 * kBlock + state_size,
      [&](float* scratch, int64_t i) {
        const int64_t n = i / HV, h = i % HV, hk = h / group;
        const int64_t len = p.len[n];
        if (len == 0) return;  // no token: nothing read, nothing written
        float* block_scratch = scratch + kGroup * token_floats;
        float* work = block_scratch + 3 * kBlock;  // [K, V]: the float32 state between tokens
        const int64_t r0 = start_row(n);
        const P* first = r0 >= 0 ? head_of(r0, h) : nullptr;  // null: the zero state
        const P* next_item = nullptr;  // the head this thread runs next (contiguous schedule)
        if (i + 1 < items && p.len[(i + 1) / HV] > 0) {
          const int64_t r1 = start_row((i + 1) / HV);
          if (r1 >= 0) next_item = head_of(r1, (i + 1) % HV);
        }
        TokenIn in[kGroup];
        P* store[kGroup];
        for (int64_t t0 = 0; t0 < len; t0 += kGroup) {
          const int64_t count = std::min(kGroup, len - t0);
          for (int64_t c = 0; c < count; ++c) {
            const int64_t tok = p.bos[n] + t0 + c;
            in[c] = prepare_token(p, q, k, v, g, beta, tok, hk, h, scratch + c * token_floats);
            const int64_t row = a.indices[n * a.width + t0 + c];
            store[c] = row >= 0 ? head_of(row, h) : nullptr;
          }
          const bool last_group = t0 + kGroup >= len;
          for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
            const int64_t w = std::min(kBlock, V - j0);
            for (int64_t c = 0; c < count; ++c) {
              const int64_t j = t0 + c;  // the token's place in its sequence
              const int64_t tok = p.bos[n] + j;
              const P* hsrc = j == 0 ? first : nullptr;
              const float* fsrc = j == 0 ? nullptr : work;
              float* fdst = j + 1 < len ? work : nullptr;
              const P* next = nullptr;
              if (c == count - 1) {
                if (j0 + kBlock < V) next = j == 0 && first ? first + j0 + kBlock : nullptr;
                else if (last_group) next = next_item;
              }
              step_block_half(in[c], hsrc, fsrc, fdst, store[c], K, V, j0, w, block_scratch,
                              o + (tok * HV + h) * V, next);
            }
          }
        }
      },
      /*contiguous=*/true);
}
#endif

template <typename T, typename P>
void pool_typed(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                const PoolArgs& a, T* o) {
  const int64_t K = p.K, V = p.V, HV = p.HV, group = p.group();
  const int64_t state_size = K * V;
  const int64_t token_floats = 2 * K + V;
#if defined(GDR_SIMD_BLOCK)
  if constexpr (!std::is_same_v<P, float>) {
    if (!a.v_first && V % Vec::kLanes == 0) return pool_half_direct<T, P>(p, q, k, v, g, beta, a, o);
  }
#endif
  P* pool = static_cast<P*>(a.pool);
  const bool direct = std::is_same_v<P, float> && !a.v_first;
  auto head_of = [&](int64_t row, int64_t h) { return pool + row * a.row_stride + h * state_size; };
  auto start_row = [&](int64_t n) { return a.indices[n * a.width + (a.read_pos ? a.read_pos[n] : 0)]; };
  const int64_t items = p.num_seqs() * HV;
  parallel_items(
      p.threads, items, kGroup * token_floats + 3 * kBlock + state_size,
      [&](float* scratch, int64_t i) {
        const int64_t n = i / HV, h = i % HV, hk = h / group;
        if (p.len[n] == 0) return;  // no token: nothing read, nothing written
        float* block_scratch = scratch + kGroup * token_floats;
        float* work = block_scratch + 3 * kBlock;  // [K, V]: the state where it has no float32 row
        const int64_t r0 = start_row(n);
        const float* src = nullptr;  // null: the zero state
        if (r0 >= 0) {
          if (direct) {
            src = reinterpret_cast<const float*>(head_of(r0, h));
          } else {
            load_state(head_of(r0, h), work, K, V, a.v_first);
            src = work;
          }
        }
        // The head computed after this one in this thread (contiguous schedule), to prefetch.
        const float* next_item = nullptr;
        if (direct && i + 1 < items && p.len[(i + 1) / HV] > 0) {
          const int64_t r1 = start_row((i + 1) / HV);
          if (r1 >= 0) next_item = reinterpret_cast<const float*>(head_of(r1, (i + 1) % HV));
        }
        TokenIn in[kGroup];
        float* dst[kGroup];
        P* store[kGroup];
        for (int64_t t0 = 0; t0 < p.len[n]; t0 += kGroup) {
          const int64_t count = std::min(kGroup, p.len[n] - t0);
          for (int64_t c = 0; c < count; ++c) {
            const int64_t tok = p.bos[n] + t0 + c;
            in[c] = prepare_token(p, q, k, v, g, beta, tok, hk, h, scratch + c * token_floats);
            const int64_t row = a.indices[n * a.width + t0 + c];
            dst[c] = (direct && row >= 0) ? reinterpret_cast<float*>(head_of(row, h)) : work;
            store[c] = (!direct && row >= 0) ? head_of(row, h) : nullptr;
          }
          const bool last_group = t0 + kGroup >= p.len[n];
          for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
            const int64_t w = std::min(kBlock, V - j0);
            const float* s = src;
            for (int64_t c = 0; c < count; ++c) {
              const int64_t tok = p.bos[n] + t0 + c;
              const float* next = nullptr;
              if (c == count - 1) {
                if (j0 + kBlock < V) next = src ? src + j0 + kBlock : nullptr;
                else if (last_group) next = next_item;
              }
              step_block(in[c], s, dst[c], K, V, j0, w, block_scratch, o + (tok * HV + h) * V, next);
              if (store[c]) store_state_block(dst[c], store[c], K, V, j0, w, a.v_first);
              s = dst[c];
            }
          }
          src = dst[count - 1];
        }
      },
      /*contiguous=*/true);
}

template <typename T>
void pool_dispatch(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                   const PoolArgs& a, T* o) {
  switch (a.dtype) {
    case DType::Float: return pool_typed<T, float>(p, q, k, v, g, beta, a, o);
    case DType::Half: return pool_typed<T, c10::Half>(p, q, k, v, g, beta, a, o);
    case DType::BFloat16: return pool_typed<T, c10::BFloat16>(p, q, k, v, g, beta, a, o);
  }
}

}  // namespace

void recurrent_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g,
                   const float* beta, const float* initial, void* o, float* final_state) {
  switch (p.dtype) {
    case DType::Float:
      return recurrent_typed(p, static_cast<const float*>(q), static_cast<const float*>(k),
                             static_cast<const float*>(v), g, beta, initial, static_cast<float*>(o), final_state);
    case DType::Half:
      return recurrent_typed(p, static_cast<const c10::Half*>(q), static_cast<const c10::Half*>(k),
                             static_cast<const c10::Half*>(v), g, beta, initial, static_cast<c10::Half*>(o),
                             final_state);
    case DType::BFloat16:
      return recurrent_typed(p, static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
                             static_cast<const c10::BFloat16*>(v), g, beta, initial,
                             static_cast<c10::BFloat16*>(o), final_state);
  }
}

void pool_recurrent_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g,
                        const float* beta, const PoolArgs& pool, void* o) {
  switch (p.dtype) {
    case DType::Float:
      return pool_dispatch(p, static_cast<const float*>(q), static_cast<const float*>(k),
                           static_cast<const float*>(v), g, beta, pool, static_cast<float*>(o));
    case DType::Half:
      return pool_dispatch(p, static_cast<const c10::Half*>(q), static_cast<const c10::Half*>(k),
                           static_cast<const c10::Half*>(v), g, beta, pool, static_cast<c10::Half*>(o));
    case DType::BFloat16:
      return pool_dispatch(p, static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
                           static_cast<const c10::BFloat16*>(v), g, beta, pool, static_cast<c10::BFloat16*>(o));
  }
}

}  // namespace gdr
