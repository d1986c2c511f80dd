// fp8 state pools (float8_e4m3fn, float8_e5m2): stored by a plain cast, rounded to nearest
// even and saturated at the format's largest finite value (NaN stays NaN), read back exactly.
//
// Scalar: c10's conversions after a clamp (c10 maps an overflow to NaN for e4m3fn and to inf
// for e5m2). Vector (AVX2, 8 lanes): the same rounding on the float32 bits, as c10 does it
// lane by lane: a normal value keeps its top mantissa bits, rounded by adding half an ulp
// minus one plus the lowest kept bit; a value below the smallest normal is rounded by the
// FPU when added to a power of two whose ulp is the format's subnormal step.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

namespace gdr {

// The layout of an fp8 format: exponent bias, mantissa bits, largest finite value.
template <typename P>
struct Fp8Format;
template <>
struct Fp8Format<c10::Float8_e4m3fn> {
  static constexpr int kBias = 7, kMant = 3;
  static constexpr float kMax = 448.0f;
};
template <>
struct Fp8Format<c10::Float8_e5m2> {
  static constexpr int kBias = 15, kMant = 2;
  static constexpr float kMax = 57344.0f;
};

template <typename P>
constexpr bool is_fp8_v = std::is_same_v<P, c10::Float8_e4m3fn> || std::is_same_v<P, c10::Float8_e5m2>;

// One element stored into a pool of P: a plain cast, saturating for fp8.
template <typename P>
inline P store_cast(float x) {
  if constexpr (is_fp8_v<P>) {
    constexpr float m = Fp8Format<P>::kMax;
    if (x > m) x = m;  // NaN compares false both ways: kept
    if (x < -m) x = -m;
  }
  return static_cast<P>(x);
}

#if defined(__AVX2__)
// 8 fp8 values at `p` as float32 lanes.
template <typename P>
inline __m256 fp8_load8(const P* p) {
  constexpr int bias = Fp8Format<P>::kBias, mant = Fp8Format<P>::kMant;
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 23 - mant), _mm256_set1_epi32((127 - bias) << 23));
  // exponent 0: em = the mantissa, in steps of 2^(1 - bias - mant)
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em),
                                   _mm256_castsi256_ps(_mm256_set1_epi32((127 + 1 - bias - mant) << 23)));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << mant), em);
  __m256 x = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(is_sub));
  if constexpr (std::is_same_v<P, c10::Float8_e4m3fn>) {  // 0x7F: NaN (no infinities)
    const __m256i nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F));
    x = _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_castsi256_ps(nan));
  } else {  // exponent all ones: inf (mantissa 0) or NaN
    const __m256i special = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7B));
    const __m256i bits = _mm256_or_si256(_mm256_set1_epi32(0x7F800000),
                                         _mm256_slli_epi32(_mm256_and_si256(em, _mm256_set1_epi32(3)), 21));
    x = _mm256_blendv_ps(x, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(special));
  }
  return _mm256_or_ps(x, _mm256_castsi256_ps(sign));
}

// 8 float32 lanes stored as fp8 at `p` (store_cast's rounding and saturation).
template <typename P>
inline void fp8_store8(P* p, __m256 x) {
  constexpr int bias = Fp8Format<P>::kBias, mant = Fp8Format<P>::kMant;
  const __m256 m = _mm256_set1_ps(Fp8Format<P>::kMax);
  // min/max return their second operand when either is NaN: x, so NaN stays NaN
  x = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), m), _mm256_min_ps(m, x));
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 23 - mant), _mm256_set1_epi32(1));
  const __m256i rounding = _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(bias - 127) << 23) +
                                                              ((1u << (22 - mant)) - 1u)));
  const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, rounding), odd), 23 - mant);
  const __m256i magic = _mm256_set1_epi32((127 - bias + 23 - mant + 1) << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 - bias + 1) << 23), a);
  __m256i r = _mm256_blendv_epi8(normal, sub, is_sub);
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  // the low byte of each lane, in order, into the low 8 bytes
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(r, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

#if defined(__AVX512F__)
// fp8_load8 for 16 values, in AVX-512 registers (comparisons into mask registers).
template <typename P>
inline __m512 fp8_load16(const P* p) {
  constexpr int bias = Fp8Format<P>::kBias, mant = Fp8Format<P>::kMant;
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 23 - mant), _mm512_set1_epi32((127 - bias) << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em),
                                   _mm512_castsi512_ps(_mm512_set1_epi32((127 + 1 - bias - mant) << 23)));
  __m512 x = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(1 << mant)),
                                  _mm512_castsi512_ps(normal), sub);
  if constexpr (std::is_same_v<P, c10::Float8_e4m3fn>) {  // 0x7F: NaN (no infinities)
    x = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)), x,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  } else {  // exponent all ones: inf (mantissa 0) or NaN
    const __m512i bits = _mm512_or_si512(_mm512_set1_epi32(0x7F800000),
                                         _mm512_slli_epi32(_mm512_and_si512(em, _mm512_set1_epi32(3)), 21));
    x = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(em, _mm512_set1_epi32(0x7B)), x, _mm512_castsi512_ps(bits));
  }
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}

// fp8_store8 for 16 lanes: the same rounding and saturation, one narrowing move at the end.
template <typename P>
inline void fp8_store16(P* p, __m512 x) {
  constexpr int bias = Fp8Format<P>::kBias, mant = Fp8Format<P>::kMant;
  const __m512 m = _mm512_set1_ps(Fp8Format<P>::kMax);
  // min/max return their second operand when either is NaN: x, so NaN stays NaN
  x = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), m), _mm512_min_ps(m, x));
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 23 - mant), _mm512_set1_epi32(1));
  const __m512i rounding = _mm512_set1_epi32(static_cast<int>((static_cast<uint32_t>(bias - 127) << 23) +
                                                              ((1u << (22 - mant)) - 1u)));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, rounding), odd), 23 - mant);
  const __m512i magic = _mm512_set1_epi32((127 - bias + 23 - mant + 1) << 23);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic))), magic);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((127 - bias + 1) << 23)), normal, sub);
  r = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), r, _mm512_set1_epi32(0x7F));
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
}
#endif

}  // namespace gdr
