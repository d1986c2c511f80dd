// Pieces shared by the forward, the backward and the recurrent step: BLAS, dtype
// conversion, OpenMP helpers, and the chunk tile (one chunk of one value head, loaded and
// prepared in float32 in the calling thread's scratch).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gdr_cpu.h"

// The Fortran sgemm of the BLAS torch itself links (MKL in the x86 wheels), LP64.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace gdr {

// Row-major C[M, N] = alpha * op(A)[M, Kd] * op(B)[Kd, N] + beta * C.
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t kd, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Column-major view: C^T = op(B)^T op(A)^T.
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), Kd = static_cast<int>(kd);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  sgemm_(&ta, &tb, &M, &N, &Kd, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// Copy `n` elements to float32; returns a value that is NaN when any element is not finite.
template <typename T>
inline float load_row(const T* src, float* dst, int64_t n) {
  float probe = 0.0f;
#pragma omp simd reduction(+ : probe)
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(src[i]);
    dst[i] = x;
    probe += x * 0.0f;  // NaN for NaN or +-inf
  }
  return probe;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

#if defined(__AVX2__) && defined(__F16C__)
#if defined(__AVX2__) && defined(__FMA__)
// Registers of float32 lanes, for kernels written once for both widths (the micro-GEMM, the
// decode block): 8 lanes (AVX2 + FMA) and, where the build has AVX-512, 16.
struct Lanes8 {
  using R = __m256;
  static constexpr int kLanes = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }   // a b + c
  static R fnmadd(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
};
#endif
#if defined(__AVX512F__)
struct Lanes16 {
  using R = __m512;
  static constexpr int kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
};
#endif

// Half-precision rows converted 8 elements at a time (the compiler does not vectorise c10's
// scalar conversions): bfloat16 by shifts, rounded to nearest even as c10 does (NaN as
// 0x7FC0); float16 by the F16C instructions (round to nearest even).
namespace convert8 {
inline __m256 load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(c10::BFloat16* p, __m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
inline float load_row(const T* src, float* dst, int64_t n) {
  __m256 probe = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load(src + i);
    _mm256_storeu_ps(dst + i, x);
    probe = _mm256_fmadd_ps(x, zero, probe);  // NaN for NaN or +-inf
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, probe);
  float p = 0.0f;
  for (int l = 0; l < 8; ++l) p += lanes[l];
  for (; i < n; ++i) {
    const float x = static_cast<float>(src[i]);
    dst[i] = x;
    p += x * 0.0f;
  }
  return p;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
}  // namespace convert8

template <>
inline float load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  return convert8::load_row(src, dst, n);
}
template <>
inline float load_row<c10::Half>(const c10::Half* src, float* dst, int64_t n) { return convert8::load_row(src, dst, n); }
template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  convert8::store_row(src, dst, n);
}
template <>
inline void store_row<c10::Half>(const float* src, c10::Half* dst, int64_t n) { convert8::store_row(src, dst, n); }
#endif

// Output rows no one reads back soon: written past the caches where the CPU and the
// alignment allow (no read for ownership of the lines), else stored as usual. Call
// stream_fence() before the thread's writes must be visible (the end of a parallel region).
template <typename T>
inline void stream_row(const float* src, T* dst, int64_t n) { store_row(src, dst, n); }
#if defined(__AVX512F__)
template <>
inline void stream_row<float>(const float* src, float* dst, int64_t n) {
  if (reinterpret_cast<uintptr_t>(dst) % 64 != 0 || n % 16 != 0) return store_row(src, dst, n);
  for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
}
inline void stream_fence() { _mm_sfence(); }
#elif defined(__AVX2__)
template <>
inline void stream_row<float>(const float* src, float* dst, int64_t n) {
  if (reinterpret_cast<uintptr_t>(dst) % 32 != 0 || n % 8 != 0) return store_row(src, dst, n);
  for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
}
inline void stream_fence() { _mm_sfence(); }
#else
inline void stream_fence() {}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// softplus with torch's threshold: x itself above 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// The log decay a kernel uses for the g it read at value head h (p.gating, gdr_cpu.h).
inline float gate_of(const Problem& p, float g, int64_t h) {
  const Gating& a = p.gating;
  if (!a.A_log) return g;
  const float x = a.dt_bias ? g + a.dt_bias[h] : g;
  return -std::exp(a.A_log[h]) * softplus(x);
}

// The beta a kernel uses for the beta it read.
inline float beta_of(const Problem& p, float beta) {
  return p.gating.beta_sigmoid ? p.gating.beta_scale * (1.0f / (1.0f + std::exp(-beta))) : beta;
}

// Decays below this are flushed to zero: products of many factors would otherwise drift
// into denormals, which cost a microcode assist per multiply.
constexpr float kTiny = 1e-30f;
inline float flush(float x) { return x < kTiny ? 0.0f : x; }

// A float buffer of the calling thread, `slot` naming its use, kept across calls: after
// the first call no page faults and no zeroing. Contents are undefined on return.
inline float* thread_workspace(int slot, int64_t floats) {
  constexpr int kSlots = 4;
  thread_local std::unique_ptr<float[]> buffers[kSlots];
  thread_local int64_t sizes[kSlots] = {0, 0, 0, 0};
  if (sizes[slot] < floats) {
    buffers[slot].reset();
    buffers[slot].reset(new float[static_cast<size_t>(floats)]);
    sizes[slot] = floats;
  }
  return buffers[slot].get();
}

enum WorkspaceSlot { kStore = 0, kScratch = 1, kTranspose = 2 };

// While alive, the calling thread treats subnormal floats as zero, as inputs and results
// (x86 MXCSR FTZ and DAZ; restored on exit, so torch's own work on the thread is unchanged).
// Within a long chunk the decays reach subnormals (exp(-100) at chunk 128 with realistic
// gates), each of which costs a microcode assist per operation, which made chunk 128 many
// times slower than 64. Values below 1.2e-38 next to O(1) results change nothing a float32 output shows.
struct DenormalsAreZero {
#if defined(__SSE2__)
  unsigned int saved = _mm_getcsr();
  DenormalsAreZero() { _mm_setcsr(saved | 0x8040u); }
  ~DenormalsAreZero() { _mm_setcsr(saved); }
#endif
};

// Run body(scratch, i) for i in [0, n) in one parallel region of up to `threads` threads
// (no region with one), `scratch` being `scratch_floats` floats of the running thread.
// With `contiguous`, each thread takes one contiguous block of items (so that item i + 1 is
// usually its next, worth prefetching); else items are handed out one at a time.
template <typename Body>
inline void parallel_items(int threads, int64_t n, int64_t scratch_floats, Body body, bool contiguous = false) {
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (nt <= 1) {
    DenormalsAreZero ftz;
    float* scratch = thread_workspace(kScratch, scratch_floats);
    for (int64_t i = 0; i < n; ++i) body(scratch, i);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    DenormalsAreZero ftz;
    float* scratch = thread_workspace(kScratch, scratch_floats);
    if (contiguous) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) body(scratch, i);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) body(scratch, i);
    }
  }
}

// Segments: ranges of chunk indices [c0, c1) processed together by every sequence that
// still has chunks there, sized so that the stored per-chunk intermediates stay within a
// budget; `active` lists those sequences.
struct Segment {
  int64_t c0, c1;
  std::vector<int64_t> active;
  int64_t slots() const { return (c1 - c0) * static_cast<int64_t>(active.size()); }
};

inline std::vector<Segment> make_segments(const Problem& p, int64_t bytes_per_matrix_chunk, int64_t budget_bytes) {
  std::vector<Segment> segs;
  int64_t max_nc = 0;
  for (int64_t n = 0; n < p.num_seqs(); ++n) max_nc = std::max(max_nc, p.num_chunks(n));
  int64_t c0 = 0;
  while (c0 < max_nc) {
    Segment s;
    s.c0 = c0;
    for (int64_t n = 0; n < p.num_seqs(); ++n)
      if (p.num_chunks(n) > c0) s.active.push_back(n);
    const int64_t per_chunk = static_cast<int64_t>(s.active.size()) * p.HV * bytes_per_matrix_chunk;
    int64_t g = std::max<int64_t>(1, budget_bytes / std::max<int64_t>(1, per_chunk));
    // Enough work items per stage for every thread.
    while (g * static_cast<int64_t>(s.active.size()) * p.HV < 2 * p.threads && c0 + g < max_nc) ++g;
    s.c1 = std::min(max_nc, c0 + g);
    c0 = s.c1;
    segs.push_back(std::move(s));
  }
  return segs;
}

// Whether to run both stages per work unit (a sequence's value head, or its query/key head
// in the backward), chunk after chunk in one thread: with one thread always (best cache
// use), else when the units keep every thread busy (many, or as many equal ones as a
// multiple of the threads). Otherwise the stages run over segments, the first parallel
// over chunks too.
inline bool fuse_stages(const Problem& p, int64_t units) {
  if (p.stages != Stages::Auto) return p.stages == Stages::Fused;
  if (p.threads <= 1 || units >= 4 * static_cast<int64_t>(p.threads)) return true;
  if (units < p.threads || units % p.threads != 0) return false;
  for (int64_t n = 1; n < p.num_seqs(); ++n)
    if (p.len[n] != p.len[0]) return false;
  return true;
}

inline std::vector<int64_t> chunk_offsets(const Problem& p) {
  std::vector<int64_t> off(p.num_seqs() + 1, 0);
  for (int64_t n = 0; n < p.num_seqs(); ++n) off[n + 1] = off[n] + p.num_chunks(n);
  return off;
}

// One chunk of one (sequence, value head), float32, rows [rows, C) zero-padded.
struct Tile {
  int64_t C = 0, K = 0, V = 0;
  float* qk = nullptr;     // [2C, K]: rows :C the query y_q (l2-normalised if asked, unscaled), rows C: the key
  float* rnorm = nullptr;  // [2C]: 1 / |x| of the l2norm (query rows, then key rows)
  float* v = nullptr;      // [C, V]
  float* g = nullptr;      // [C]: log decay (0 on padding and after a bad token)
  float* beta = nullptr;   // [C]
  float* alpha = nullptr;  // [C]: exp(g)
  float* gexp = nullptr;   // [C]: exp(gamma_r), the decay from the chunk's start through r
  float* kdec = nullptr;   // [C]: exp(gamma_C - gamma_r), the decay after r to the chunk's end
  float* gam = nullptr;    // [C, C]: Gamma[r][s] = exp(gamma_r - gamma_s) for s <= r, 0 above
  int64_t rows = 0;        // valid tokens
  int64_t bad = 0;         // first token with a non-finite k, v, beta or g (NaN or +inf); rows when none

  float* query() const { return qk; }
  float* key() const { return qk + C * K; }
  float chunk_decay() const { return gexp[C - 1]; }

  static int64_t floats(int64_t C, int64_t K, int64_t V) { return 2 * C * K + 2 * C + C * V + 6 * C + C * C; }
  void bind(float* mem, int64_t c, int64_t k, int64_t v_dim) {
    C = c, K = k, V = v_dim;
    qk = mem, mem += 2 * C * K;
    rnorm = mem, mem += 2 * C;
    v = mem, mem += C * V;
    g = mem, mem += C;
    beta = mem, mem += C;
    alpha = mem, mem += C;
    gexp = mem, mem += C;
    kdec = mem, mem += C;
    mem += C;  // spare
    gam = mem;
  }
};

inline void l2norm_rows(float* x, float* rnorm, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * dim;
    const float inv = 1.0f / std::sqrt(dot(row, row, dim) + 1e-6f);
    rnorm[r] = inv;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) row[i] *= inv;
  }
}

// Ask for `bytes` from `p` into L1 (64-byte lines), kept by the optimiser (see prefetch_l2).
inline void prefetch_l1(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(c[i]));
#else
    __builtin_prefetch(c + i, 0, 3);
#endif
  }
}

// Load chunk `c` of sequence `n`, value head `h`, into `t`, sanitised: from the first bad
// token on, k, v, beta and g are zeroed (the caller re-poisons what follows it), so that no
// NaN of a later token reaches an earlier one through a masked product. The query is
// loaded only when `with_query`.
template <typename T>
void load_tile(const Problem& p, Tile& t, const T* q, const T* k, const T* v, const float* g, const float* beta,
               int64_t n, int64_t c, int64_t h, bool with_query) {
  const int64_t C = p.C, K = p.K, V = p.V, hk = h / p.group();
  const int64_t t0 = p.bos[n] + c * C;
  t.rows = std::min<int64_t>(C, p.len[n] - c * C);
  t.bad = t.rows;
  const InputStrides& st = p.strides;
  // Rows two tokens ahead asked for into L1 as each is copied: each row's first lines
  // otherwise wait on L2 or memory one at a time (-3% of the forward at T = 4096).
  constexpr int64_t kAhead = 2;
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t tok = t0 + r;
    if (r + kAhead < t.rows) {
      const int64_t ta = tok + kAhead;
      if (with_query) prefetch_l1(q + ta * st.q_tok + hk * st.q_head, K * static_cast<int64_t>(sizeof(T)));
      prefetch_l1(k + ta * st.k_tok + hk * st.k_head, K * static_cast<int64_t>(sizeof(T)));
      prefetch_l1(v + ta * st.v_tok + h * st.v_head, V * static_cast<int64_t>(sizeof(T)));
    }
    if (with_query) load_row(q + tok * st.q_tok + hk * st.q_head, t.query() + r * K, K);
    float probe = load_row(k + tok * st.k_tok + hk * st.k_head, t.key() + r * K, K);
    probe += load_row(v + tok * st.v_tok + h * st.v_head, t.v + r * V, V);
    const float gr = gate_of(p, g[tok * st.g_tok + h * st.g_head], h);
    const float br = beta_of(p, beta[tok * st.b_tok + h * st.b_head]);
    t.g[r] = gr;
    t.beta[r] = br;
    const bool bad = std::isnan(probe) || std::isnan(gr) || gr == std::numeric_limits<float>::infinity() ||
                     !std::isfinite(br);
    if (bad && t.bad == t.rows) t.bad = r;
  }
  const int64_t clean = t.bad;  // rows [clean, C) become padding
  if (with_query) std::memset(t.query() + t.rows * K, 0, sizeof(float) * (C - t.rows) * K);
  std::memset(t.key() + clean * K, 0, sizeof(float) * (C - clean) * K);
  std::memset(t.v + clean * V, 0, sizeof(float) * (C - clean) * V);
  for (int64_t r = clean; r < C; ++r) t.g[r] = 0.0f, t.beta[r] = 0.0f;
  if (p.l2norm) {
    if (with_query) l2norm_rows(t.query(), t.rnorm, C, K);
    l2norm_rows(t.key(), t.rnorm + C, C, K);
  }
}

// A prefetch into L2 that the optimiser keeps: GCC 12 deletes __builtin_prefetch loops it
// finds otherwise empty.
inline void prefetch_l2(const char* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*address));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// Ask for the rows of chunk `c` (value head `h`) of up to three token-major tensors of
// `width` x `bytes` per (token, head), to be brought into L2 while the current chunk computes.
inline void prefetch_rows(const void* base, int64_t token0, int64_t rows, int64_t heads, int64_t head,
                          int64_t row_bytes) {
  if (!base) return;
  const char* b = static_cast<const char*>(base);
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = b + ((token0 + r) * heads + head) * row_bytes;
    for (int64_t off = 0; off < row_bytes; off += 64) prefetch_l2(row + off);
  }
}

template <typename T>
inline void prefetch_chunk(const Problem& p, const T* q, const T* k, const T* v, int64_t n, int64_t c, int64_t h) {
  if (c >= p.num_chunks(n)) return;
  const int64_t t0 = p.bos[n] + c * p.C, rows = std::min<int64_t>(p.C, p.len[n] - c * p.C), hk = h / p.group();
  prefetch_rows(q, t0, rows, p.H, hk, p.K * sizeof(T));
  prefetch_rows(k, t0, rows, p.H, hk, p.K * sizeof(T));
  prefetch_rows(v, t0, rows, p.HV, h, p.V * sizeof(T));
}

// The decays of a loaded tile, from the per-token factors alpha = exp(g) by running
// products (prefix, suffix and, for Gamma, row r = row r-1 times alpha_r): no difference of
// two cumulative sums is ever formed, so any g <= 0, -inf included, is as exact as the
// recurrence, which multiplies the same factors.
inline void tile_decays(Tile& t) {
  const int64_t C = t.C;
  for (int64_t r = 0; r < C; ++r) t.alpha[r] = std::exp(t.g[r]);
  float run = 1.0f;
  for (int64_t r = 0; r < C; ++r) run = flush(run * t.alpha[r]), t.gexp[r] = run;
  run = 1.0f;
  t.kdec[C - 1] = 1.0f;
  for (int64_t r = C - 1; r > 0; --r) run = flush(run * t.alpha[r]), t.kdec[r - 1] = run;
  float* gam = t.gam;
  std::memset(gam, 0, sizeof(float) * C);
  gam[0] = 1.0f;
  for (int64_t r = 1; r < C; ++r) {
    const float a = t.alpha[r];
    const float* prev = gam + (r - 1) * C;
    float* row = gam + r * C;
#pragma omp simd
    for (int64_t s = 0; s < r; ++s) {
      const float x = prev[s] * a;
      row[s] = x < kTiny ? 0.0f : x;
    }
    row[r] = 1.0f;
    std::memset(row + r + 1, 0, sizeof(float) * (C - r - 1));
  }
}

// The parallel part of a tile (one chunk, one value head):
//   sim  [2C, C] scratch: [Q; K] K^T (query rows only when `with_query`)
//   gram [C, C]: G = strictly_lower(K K^T * Gamma)
//   attn [C, C]: P = scale (y_q K^T) * Gamma on and below the diagonal (when `with_query`)
//   inv  [C, C]: T = (I + diag(beta) G)^-1 (unit lower triangular)
//   tb   [C, C] scratch
//   u [C, V] = T diag(beta) V,  w [C, K] = w_alpha T diag(beta exp(gamma)) K
// `sim_ready`: sim already holds [Q; K] K^T of this tile's q and k (a value head sharing
// them with the tile before, GQA), not computed again.
void tile_intra(const Tile& t, float scale, bool with_query, float* sim, float* gram, float* attn, float* inv,
                float* tb, float* u, float* w, float w_alpha, bool sim_ready = false);

// C[M, N] = alpha op(A) B + beta C for the chunk products (forward.cpp): op(A) = A^T with
// trans_a (A [kd, M] then, row stride lda); `a_lower`: op(A) is lower triangular (its zeros
// are skipped). The AVX2 micro-kernels of microgemm.h where the CPU has them, else the BLAS.
void gemm_small(bool trans_a, int64_t m, int64_t n, int64_t kd, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc, bool a_lower = false);

// Bytes of per-chunk intermediates a segment may hold between its stages: small enough to
// stay in the last-level cache of a small machine, large enough to give every thread work.
constexpr int64_t kForwardBudget = int64_t(4) << 20;
constexpr int64_t kBackwardBudget = int64_t(6) << 20;

}  // namespace gdr
