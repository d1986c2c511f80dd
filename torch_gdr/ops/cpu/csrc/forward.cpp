// The chunked forward: per segment of chunks, one parallel region over (sequence, chunk,
// value head) for the whole intra-chunk part, then one over (sequence, value head) for the
// state scan, which also writes the outputs (each state stays in the thread's cache).
#include "common.h"
#include "microgemm.h"
#include "pairdot.h"

#include <atomic>

namespace gdr {

const char* half_unit() { return pairs::kHardware ? "avx512bf16" : ""; }

namespace {
template <class U>
void pair_dot_run(const float* acc, const uint32_t* a, const uint32_t* b, float* out, int64_t n) {
  DenormalsAreZero ftz;  // as the kernels run (parallel_items)
  for (int64_t i = 0; i < n; i += U::kLanes) U::storef(out + i, U::dot(U::loadf(acc + i), U::load(a + i), U::load(b + i)));
}
}  // namespace

bool pair_dot_lanes(const float* acc, const uint32_t* a, const uint32_t* b, float* out, int64_t n, bool hardware) {
  if (n % 16 != 0) return false;
  if (hardware) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    pair_dot_run<pairs::Avx512Bf16>(acc, a, b, out, n);
    return true;
#else
    return false;
#endif
  }
#if defined(__AVX2__) && defined(__FMA__)
  pair_dot_run<pairs::EmulatedBf16>(acc, a, b, out, n);
  return true;
#else
  return false;
#endif
}

void gemm_small(bool trans_a, int64_t m, int64_t n, int64_t kd, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc, bool a_lower) {
  if (micro::kEnabled)
    micro::gemm_nn(m, n, kd, alpha, a, trans_a ? 1 : lda, trans_a ? lda : 1, b, ldb, beta, c, ldc, nullptr,
                   a_lower ? micro::Tri::ALower : micro::Tri::None);
  else
    gemm(trans_a, false, m, n, kd, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace {

// T = (I + diag(beta) G)^-1 for strictly lower G [C, C], any C.
void unit_lower_inverse_any(const float* gram, const float* beta, float* inv, int64_t C) {
  std::memset(inv, 0, sizeof(float) * C * C);
  for (int64_t r = 0; r < C; ++r) {
    float* row = inv + r * C;
    row[r] = 1.0f;
    const float br = beta[r];
    if (br == 0.0f) continue;
    const float* gr = gram + r * C;
    for (int64_t s = 0; s < r; ++s) {
      const float a = br * gr[s];
      if (a == 0.0f) continue;
      const float* ts = inv + s * C;
#pragma omp simd
      for (int64_t j = 0; j <= s; ++j) row[j] -= a * ts[j];
    }
  }
}

#if defined(__AVX2__)
// The same for C = 8 * NV, each row accumulated in NV AVX registers: T_s is zero after
// column s, so only its first s / 8 + 1 vectors are read. (GCC's generic 64-byte vectors
// spilled through memory on AVX2 here: a fifth of the forward.)
template <int NV>
void unit_lower_inverse(const float* gram, const float* beta, float* inv) {
  constexpr int64_t C = 8 * NV;
  for (int64_t r = 0; r < C; ++r) {
    __m256 acc[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    const float br = beta[r];
    if (br != 0.0f) {
      const float* gr = gram + r * C;
      for (int64_t s = 0; s < r; ++s) {
        const float a = br * gr[s];
        if (a == 0.0f) continue;
        const __m256 av = _mm256_set1_ps(a);
        const float* ts = inv + s * C;
        const int used = static_cast<int>(s >> 3);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v)
          if (v <= used) acc[v] = _mm256_fnmadd_ps(av, _mm256_loadu_ps(ts + 8 * v), acc[v]);
      }
    }
    float* row = inv + r * C;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(row + 8 * v, acc[v]);
    row[r] = 1.0f;
  }
}

// T for any C: the vector kernel where C is a multiple of 8 up to 128.
void unit_lower_inverse_dispatch(const float* gram, const float* beta, float* inv, int64_t C) {
  switch (C) {
    case 8: return unit_lower_inverse<1>(gram, beta, inv);
    case 16: return unit_lower_inverse<2>(gram, beta, inv);
    case 32: return unit_lower_inverse<4>(gram, beta, inv);
    case 64: return unit_lower_inverse<8>(gram, beta, inv);
    case 128: return unit_lower_inverse<16>(gram, beta, inv);
    default: return unit_lower_inverse_any(gram, beta, inv, C);
  }
}
#else
void unit_lower_inverse_dispatch(const float* gram, const float* beta, float* inv, int64_t C) {
  unit_lower_inverse_any(gram, beta, inv, C);
}
#endif

// G = strictly_lower(K K^T * Gamma) and P = scale (y_q K^T) * Gamma on and below the
// diagonal (with_query), from sim = [y_q K^T; K K^T]: masks by selection, never by
// multiplying with 0 (0 * inf is NaN).
void tile_masks(const Tile& t, float scale, bool with_query, const float* sim, float* gram, float* attn) {
  const int64_t C = t.C;
  for (int64_t r = 0; r < C; ++r) {
    const float* kk = sim + (C + r) * C;
    const float* gr = t.gam + r * C;
    float* out = gram + r * C;
#pragma omp simd
    for (int64_t s = 0; s < C; ++s) out[s] = s < r ? kk[s] * gr[s] : 0.0f;
    if (with_query) {
      const float* qk = sim + r * C;
      float* a = attn + r * C;
#pragma omp simd
      for (int64_t s = 0; s < C; ++s) a[s] = s <= r ? scale * qk[s] * gr[s] : 0.0f;
    }
  }
}

#if defined(__AVX2__)
// The 8 x 8 floats in x transposed in place.
inline void transpose8(__m256* x) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// dst [cols, rows] = src [rows, cols]^T, both row-major and dense: 8 x 8 blocks in AVX
// registers where both sizes are multiples of 8 (a scalar transpose was 3-4% of the forward).
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
#if defined(__AVX2__)
  if (rows % 8 == 0 && cols % 8 == 0) {
    for (int64_t r = 0; r < rows; r += 8)
      for (int64_t j = 0; j < cols; j += 8) {
        __m256 x[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_ps(src + (r + i) * cols + j);
        transpose8(x);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (j + i) * rows + r, x[i]);
      }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + r] = src[r * cols + j];
}

// sim = [Q; K] K^T (only the key rows without the query), on and below the diagonal: the
// micro-kernels read K^T, transposed once into the thread's buffer.
void key_products(const Tile& t, bool with_query, float* sim) {
  const int64_t C = t.C, K = t.K;
  if (micro::kEnabled) {
    float* kt = thread_workspace(kTranspose, K * C);
    const float* key = t.key();
    transpose(key, C, K, kt);
    if (with_query) micro::gemm_nn(C, C, K, 1.0f, t.qk, K, 1, kt, C, 0.0f, sim, C, nullptr, micro::Tri::CLower);
    micro::gemm_nn(C, C, K, 1.0f, key, K, 1, kt, C, 0.0f, sim + C * C, C, nullptr, micro::Tri::CLower);
  } else if (with_query) {
    gemm(false, true, 2 * C, C, K, 1.0f, t.qk, K, t.key(), K, 0.0f, sim, C);
  } else {
    gemm(false, true, C, C, K, 1.0f, t.key(), K, t.key(), K, 0.0f, sim + C * C, C);
  }
}

}  // namespace

void tile_intra(const Tile& t, float scale, bool with_query, float* sim, float* gram, float* attn, float* inv,
                float* tb, float* u, float* w, float w_alpha, bool sim_ready) {
  const int64_t C = t.C, K = t.K, V = t.V;
  if (!sim_ready) key_products(t, with_query, sim);
  tile_masks(t, scale, with_query, sim, gram, attn);
  // T = (I + A)^-1, A = diag(beta) G, by forward substitution: T_r = e_r - sum_{s<r} A_rs T_s.
  unit_lower_inverse_dispatch(gram, t.beta, inv, C);
  // U = (T diag(beta)) V, W = (T diag(beta exp(gamma))) K: the factors scale T's columns.
  for (int64_t r = 0; r < C; ++r) {
    const float* ti = inv + r * C;
    float* o = tb + r * C;
#pragma omp simd
    for (int64_t s = 0; s < C; ++s) o[s] = ti[s] * t.beta[s];
  }
  gemm_small(false, C, V, C, 1.0f, tb, C, t.v, V, 0.0f, u, V, true);
  for (int64_t r = 0; r < C; ++r) {
    float* o = tb + r * C;
#pragma omp simd
    for (int64_t s = 0; s < C; ++s) o[s] *= t.gexp[s];
  }
  gemm_small(false, C, K, C, w_alpha, tb, C, t.key(), K, 0.0f, w, K, true);
}

namespace {

// Per (chunk, value head) intermediates handed from the parallel part to the scan, stacked
// so that the scan's products sharing an operand are single GEMMs.
struct ForwardItem {
  int64_t C, K, V;
  static int64_t floats(int64_t C, int64_t K, int64_t V) { return 2 * C * V + 3 * C * K + C * C + 16; }
  float* base;
  float* ou() const { return base; }                      // [2C, V]: rows :C O, rows C: U, then V'
  float* u() const { return ou() + C * V; }
  float* qw() const { return ou() + 2 * C * V; }          // [2C, K]: rows :C Qg = scale exp(gamma) y_q, rows C: -W
  float* neg_w() const { return qw() + C * K; }
  float* kd() const { return qw() + 2 * C * K; }          // [C, K]: exp(gamma_C - gamma) K
  float* attn() const { return kd() + C * K; }            // [C, C]: P
  float* meta() const { return attn() + C * C; }          // [0] chunk decay, [1] rows, [2] bad
};

// final_state [N, HV, K, V] float32 as the scan starts: a copy of `initial`, or zeros.
inline void start_states(const Problem& p, const float* initial, float* final_state) {
  const size_t bytes = sizeof(float) * p.num_seqs() * p.HV * p.K * p.V;
  if (initial)
    std::memcpy(final_state, initial, bytes);
  else
    std::memset(final_state, 0, bytes);
}

// Value heads a fused work unit runs together, chunk by chunk (a divisor of HV, at most 4,
// leaving enough balanced units for every thread): for each chunk the unit's heads run one
// after the other, so that the chunk's token rows (one stretch of memory per tensor, shared
// q/k heads read once) are read together, instead of each head sweeping the whole sequence
// on its own (at T = 4096 a page walk and a DRAM miss for every 512-byte row). Their states
// (64 KiB each at K = V = 128) stay in L2.
inline int64_t fused_head_group(const Problem& p) {
  int64_t group = 4;
  while (group > 1 && (p.HV % group != 0 || !fuse_stages(p, p.num_seqs() * (p.HV / group)))) group /= 2;
  return group;
}

// The two stages of a chunked forward over every (sequence, value head) item. Fused where
// there are enough balanced items for every thread: each unit (a sequence's group of
// fused_head_group value heads) runs both stages chunk after chunk, its items and states
// staying in its cache, with no barrier at all. Otherwise over segments
// of chunks (make_segments): stage 1 (`intra`, the chunk-local products) parallel over every
// (chunk, sequence, value head) of the segment, then stage 2 (`scan`, the outputs and the
// state leaving each chunk) per (sequence, value head). `view(base)` is the item stored at
// `base` (`item_floats` floats); `intra(item, scratch, n, c, h)` gets `scratch_floats` of
// scratch, `scan(item, scratch, n, c, h)` `scan_floats` (in the fused form, intra's
// scratch, free by then); `prefetch(n, c, h)` hints chunk c's inputs.
template <typename View, typename Intra, typename Scan, typename Prefetch>
void run_forward_stages(const Problem& p, int64_t scratch_floats, int64_t item_floats, int64_t scan_floats,
                        View view, Intra intra, Scan scan, Prefetch prefetch) {
  const int64_t HV = p.HV, N = p.num_seqs();
  const int64_t group = fused_head_group(p);
  if (fuse_stages(p, N * (HV / group))) {
    const int64_t units = HV / group;
    parallel_items(p.threads, N * units, scratch_floats + item_floats, [&](float* scratch, int64_t i) {
      const int64_t n = i / units, h0 = (i % units) * group, h_end = h0 + group;
      const auto it = view(scratch + scratch_floats);
      for (int64_t c = 0; c < p.num_chunks(n); ++c) {
        for (int64_t h = h0; h < h_end; ++h) {
          intra(it, scratch, n, c, h);
          if (h + 1 < h_end) prefetch(n, c, h + 1);
          else prefetch(n, c + 1, h0);
          scan(it, scratch, n, c, h);
        }
      }
      stream_fence();
    });
    return;
  }
  const auto segments = make_segments(p, item_floats * sizeof(float), kForwardBudget);
  int64_t max_slots = 0;
  for (const auto& s : segments) max_slots = std::max(max_slots, s.slots());
  float* store = thread_workspace(kStore, max_slots * HV * item_floats);
  auto item_at = [&](int64_t slot, int64_t h) { return view(store + (slot * HV + h) * item_floats); };
  for (const Segment& seg : segments) {
    const int64_t nact = static_cast<int64_t>(seg.active.size());
    // Stage 1: every (chunk, sequence, value head) of the segment.
    parallel_items(p.threads, seg.slots() * HV, scratch_floats, [&](float* scratch, int64_t i) {
      const int64_t h = i % HV, slot = i / HV, a = slot % nact, c = seg.c0 + slot / nact;
      const int64_t n = seg.active[a];
      if (c < p.num_chunks(n)) intra(item_at(slot, h), scratch, n, c, h);
    });
    // Stage 2: the scan over the segment's chunks, per (sequence, value head).
    parallel_items(p.threads, nact * HV, scan_floats, [&](float* scratch, int64_t i) {
      const int64_t h = i % HV, a = i / HV, n = seg.active[a];
      const int64_t c_end = std::min(seg.c1, p.num_chunks(n));
      for (int64_t c = seg.c0; c < c_end; ++c) scan(item_at((c - seg.c0) * nact + a, h), scratch, n, c, h);
      stream_fence();
    });
  }
}

template <typename T>
bool forward_typed(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                   const float* initial, T* o, float* final_state, float* chunk_states) {
  const int64_t C = p.C, K = p.K, V = p.V, HV = p.HV;
  const bool with_query = o != nullptr;
  const int64_t state_size = K * V;
  start_states(p, initial, final_state);
  const std::vector<int64_t> chunk_off = chunk_offsets(p);
  const int64_t item_floats = ForwardItem::floats(C, K, V);
  // tile, sim [2C, C], gram, inv, tb [C, C], then the record of what sim holds (KeyProducts)
  const int64_t record_at = Tile::floats(C, K, V) + 5 * C * C;
  const int64_t scratch_floats = record_at + 16;

  // What a thread's sim holds, recorded in the thread's scratch beside it: Q K^T and K K^T
  // of chunk c of sequence n, q/k head hk, key rows from `clean` on zeroed (load_tile), made
  // by this call (`call`: scratch outlives calls, and other kernels write it). The value
  // heads of a q/k head (GQA) share them; run one after the other (fused_head_group), all
  // but the first reuse them.
  struct KeyProducts {
    uint64_t call;
    int64_t n, c, hk, clean;
  };
  static_assert(sizeof(KeyProducts) <= 16 * sizeof(float));
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = calls.fetch_add(1, std::memory_order_relaxed) + 1;
  std::atomic<bool> any_bad{false};  // a bad token seen (chunk_fwd's answer)

  // Stage 1 of one (sequence n, chunk c, value head h): everything but the state.
  auto intra = [&](const ForwardItem& it, float* scratch, int64_t n, int64_t c, int64_t h) {
    Tile t;
    t.bind(scratch, C, K, V);
    float* sim = scratch + Tile::floats(C, K, V);
    float *gram = sim + 2 * C * C, *inv = gram + C * C, *tb = inv + C * C;
    load_tile(p, t, q, k, v, g, beta, n, c, h, with_query);
    if (t.bad < t.rows) any_bad.store(true, std::memory_order_relaxed);
    tile_decays(t);
    KeyProducts held;
    std::memcpy(&held, scratch + record_at, sizeof held);
    const KeyProducts now{call, n, c, h / p.group(), t.bad};
    const bool ready = held.call == now.call && held.n == now.n && held.c == now.c && held.hk == now.hk &&
                       held.clean == now.clean;
    std::memcpy(scratch + record_at, &now, sizeof now);
    tile_intra(t, p.scale, with_query, sim, gram, it.attn(), inv, tb, it.u(), it.neg_w(), -1.0f, ready);
    for (int64_t r = 0; r < C; ++r) {
      const float fq = p.scale * t.gexp[r], fk = t.kdec[r];
      const float *yq = t.query() + r * K, *kr = t.key() + r * K;
      float *oq = it.qw() + r * K, *ok = it.kd() + r * K;
      if (with_query) {
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) oq[j] = fq * yq[j];
      }
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) ok[j] = fk * kr[j];
    }
    it.meta()[0] = t.chunk_decay();
    it.meta()[1] = static_cast<float>(t.rows);
    it.meta()[2] = static_cast<float>(t.bad);
  };
  // Stage 2 of one chunk: the outputs and the state leaving it, from the state entering it.
  auto scan_step = [&](const ForwardItem& it, int64_t n, int64_t c, int64_t h) {
    float* state = final_state + (n * HV + h) * state_size;
    if (chunk_states)
      std::memcpy(chunk_states + ((chunk_off[n] + c) * HV + h) * state_size, state, sizeof(float) * state_size);
    const float decay = it.meta()[0];
    const int64_t rows = static_cast<int64_t>(it.meta()[1]), bad = static_cast<int64_t>(it.meta()[2]);
    if (with_query) {
      // [O; V'] = [Qg; -W] S + [0; U], then O += P V'
      gemm_small(false, C, V, K, 1.0f, it.qw(), K, state, V, 0.0f, it.ou(), V);
      gemm_small(false, C, V, K, 1.0f, it.neg_w(), K, state, V, 1.0f, it.u(), V);
      gemm_small(false, C, V, C, 1.0f, it.attn(), C, it.u(), V, 1.0f, it.ou(), V, true);
      float* out = it.ou();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t r = bad; r < rows; ++r) std::fill(out + r * V, out + (r + 1) * V, nan);
      const int64_t t0 = p.bos[n] + c * C;
      for (int64_t r = 0; r < rows; ++r) stream_row(out + r * V, o + ((t0 + r) * HV + h) * V, V);
    } else {
      gemm_small(false, C, V, K, 1.0f, it.neg_w(), K, state, V, 1.0f, it.u(), V);
    }
    // S <- exp(gamma_C) S + Kd^T V'  (the decay as the GEMM's beta)
    gemm_small(true, K, V, C, 1.0f, it.kd(), K, it.u(), V, decay, state, V);
    if (bad < rows) std::fill(state, state + state_size, std::numeric_limits<float>::quiet_NaN());
  };

  run_forward_stages(
      p, scratch_floats, item_floats, 0, [&](float* base) { return ForwardItem{C, K, V, base}; }, intra,
      [&](const ForwardItem& it, float*, int64_t n, int64_t c, int64_t h) { scan_step(it, n, c, h); },
      [&](int64_t n, int64_t c, int64_t h) { prefetch_chunk(p, with_query ? q : nullptr, k, v, n, c, h); });
  return any_bad.load();
}

// --- the bfloat16 forward on a pair-dot unit (pairdot.h) ---------------------------------
//
// Every chunk product takes bfloat16 operands and accumulates in float32, as fla's kernels
// do: q, k, v as given (q and k l2-normalised first where asked, then rounded, as fla's
// l2norm kernel returns them), and the float32 intermediates rounded to bfloat16 only as a
// product's operand: T diag(beta) (and its exp(gamma) columns), W, P, V' and the state S,
// which is carried in float32 between chunks (fla's chunk_delta_h: dot(w, h.to(w.dtype))).
// The masks, the decays and the triangular inverse stay in float32.

using pairs::u16;
using pairs::u32;

// Chunk sizes and head dims the pair path takes: whole vectors of the unit's lanes.
bool pairs_fit(const Problem& p) {
  constexpr int64_t L = 16;
  return p.C >= L && p.C % L == 0 && p.K % L == 0 && p.V % L == 0;
}

// Per (chunk, value head) intermediates of the pair path, from stage 1 to the scan.
struct PairItem {
  int64_t C, K, V;
  static int64_t floats(int64_t C, int64_t K, int64_t V) { return 2 * C * V + 2 * C + 16 + (3 * C * K + C * C) / 2; }
  float* base;
  float* ou() const { return base; }                   // [2C, V] float32: rows :C O, rows C: U, then V'
  float* u() const { return base + C * V; }
  float* qscale() const { return base + 2 * C * V; }   // [C]: scale exp(gamma_r), O's row scale
  float* kdec() const { return qscale() + C; }         // [C]: exp(gamma_C - gamma_r), V''s rows into the state
  float* meta() const { return kdec() + C; }           // [0] chunk decay, [1] rows, [2] bad
  u16* qh() const { return reinterpret_cast<u16*>(meta() + 16); }  // [C, K] bfloat16: the query
  u16* neg_w() const { return qh() + C * K; }          // [C, K]: -W
  u16* kt() const { return neg_w() + C * K; }          // [K, C]: K^T
  u16* attn() const { return kt() + K * C; }           // [C, C]: P
};

// Words of the scan's packed operands (S, V', exp(gamma_C - gamma) V').
int64_t pair_scan_words(int64_t C, int64_t K, int64_t V) { return K / 2 * V + C * V; }

// Copy n bfloat16 values; returns a value that is NaN when any is not finite.
inline float copy_probe(const u16* src, u16* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(u16) * n);
  float probe = 0.0f;
#pragma omp simd reduction(+ : probe)
  for (int64_t i = 0; i < n; ++i) probe += pairs::bf16_to_float(src[i]) * 0.0f;
  return probe;
}

inline void l2norm_bf16(u16* x, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    u16* row = x + r * dim;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += pairs::bf16_to_float(row[i]) * pairs::bf16_to_float(row[i]);
    const float inv = 1.0f / std::sqrt(ss + 1e-6f);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) row[i] = pairs::float_to_bf16(pairs::bf16_to_float(row[i]) * inv);
  }
}

// load_tile for the pair path: chunk c's rows (read through p.strides) copied as bfloat16 into
// qh, kh [C, K] and vh [C, V] (l2-normalised and rounded where asked); t gets g, beta, rows and bad, its float32
// q, k, v are left unused. Rows from the first bad token on (k, v) and padding are zero.
void load_pairs(const Problem& p, Tile& t, const u16* q, const u16* k, const u16* v, const float* g,
                const float* beta, int64_t n, int64_t c, int64_t h, bool with_query, u16* qh, u16* kh, u16* vh) {
  const int64_t C = p.C, K = p.K, V = p.V, hk = h / p.group();
  const int64_t t0 = p.bos[n] + c * C;
  t.rows = std::min<int64_t>(C, p.len[n] - c * C);
  t.bad = t.rows;
  const InputStrides& st = p.strides;
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t tok = t0 + r;
    if (with_query) std::memcpy(qh + r * K, q + tok * st.q_tok + hk * st.q_head, sizeof(u16) * K);
    float probe = copy_probe(k + tok * st.k_tok + hk * st.k_head, kh + r * K, K);
    probe += copy_probe(v + tok * st.v_tok + h * st.v_head, vh + r * V, V);
    const float gr = gate_of(p, g[tok * st.g_tok + h * st.g_head], h);
    const float br = beta_of(p, beta[tok * st.b_tok + h * st.b_head]);
    t.g[r] = gr;
    t.beta[r] = br;
    const bool bad = std::isnan(probe) || std::isnan(gr) || gr == std::numeric_limits<float>::infinity() ||
                     !std::isfinite(br);
    if (bad && t.bad == t.rows) t.bad = r;
  }
  const int64_t clean = t.bad;
  if (with_query) std::memset(qh + t.rows * K, 0, sizeof(u16) * (C - t.rows) * K);
  std::memset(kh + clean * K, 0, sizeof(u16) * (C - clean) * K);
  std::memset(vh + clean * V, 0, sizeof(u16) * (C - clean) * V);
  for (int64_t r = clean; r < C; ++r) t.g[r] = 0.0f, t.beta[r] = 0.0f;
  if (p.l2norm) {
    if (with_query) l2norm_bf16(qh, C, K);
    l2norm_bf16(kh, C, K);
  }
}

// Floats of a thread's stage-1 scratch (enough for the scan's words too).
int64_t pair_scratch_floats(int64_t C, int64_t K, int64_t V) {
  return Tile::floats(C, K, V) + 6 * C * C + C * K + (C * K + C * V + C * C) / 2 + (K * C + C * V + C * K) / 2 + 16;
}

template <class U>
bool forward_pairs(const Problem& p, const u16* q, const u16* k, const u16* v, const float* g, const float* beta,
                   const float* initial, c10::BFloat16* o, float* final_state, float* chunk_states) {
  const int64_t C = p.C, K = p.K, V = p.V, HV = p.HV;
  const bool with_query = o != nullptr;
  const int64_t state_size = K * V;
  start_states(p, initial, final_state);
  const std::vector<int64_t> chunk_off = chunk_offsets(p);
  const int64_t item_floats = PairItem::floats(C, K, V);
  // the fused stages run the scan on the same scratch
  const int64_t scratch_floats = std::max(pair_scratch_floats(C, K, V), pair_scan_words(C, K, V));
  using micro::Tri;
  std::atomic<bool> any_bad{false};

  auto intra = [&](const PairItem& it, float* scratch, int64_t n, int64_t c, int64_t h) {
    Tile t;
    t.bind(scratch, C, K, V);
    float* m = scratch + Tile::floats(C, K, V);
    float* sim = m;  // [2C, C]
    float* gram = sim + 2 * C * C;
    float* inv = gram + C * C;
    float* attn = inv + C * C;
    float* w = attn + C * C;  // [C, K]
    u16* kh = reinterpret_cast<u16*>(w + C * K);
    u16* vh = kh + C * K;
    u16* tbh = vh + C * V;
    u32* kt_words = reinterpret_cast<u32*>(tbh + C * C);  // [K / 2, C]
    u32* v_words = kt_words + K / 2 * C;                  // [C / 2, V]
    u32* k_words = v_words + C / 2 * V;                   // [C / 2, K]
    load_pairs(p, t, q, k, v, g, beta, n, c, h, with_query, it.qh(), kh, vh);
    if (t.bad < t.rows) any_bad.store(true, std::memory_order_relaxed);
    tile_decays(t);
    pairs::pack_transposed(kh, C, K, kt_words);
    if (with_query) pairs::gemm<U>(C, C, K, 1.0f, it.qh(), K, kt_words, C, 0.0f, sim, C, nullptr, Tri::CLower);
    pairs::gemm<U>(C, C, K, 1.0f, kh, K, kt_words, C, 0.0f, sim + C * C, C, nullptr, Tri::CLower);
    tile_masks(t, p.scale, with_query, sim, gram, attn);
    if (with_query) pairs::round_rows(attn, C, C, C, it.attn(), C);
    unit_lower_inverse_dispatch(gram, t.beta, inv, C);
    // U = (T diag(beta)) V, W = (T diag(beta exp(gamma))) K
    for (int64_t r = 0; r < C; ++r) {
      const float* ti = inv + r * C;
      u16* o_row = tbh + r * C;
#pragma omp simd
      for (int64_t s = 0; s < C; ++s) o_row[s] = pairs::float_to_bf16(ti[s] * t.beta[s]);
    }
    pairs::pack_bf16(vh, V, C, V, v_words);
    pairs::gemm<U>(C, V, C, 1.0f, tbh, C, v_words, V, 0.0f, it.u(), V, nullptr, Tri::ALower);
    for (int64_t r = 0; r < C; ++r) {
      const float* ti = inv + r * C;
      u16* o_row = tbh + r * C;
#pragma omp simd
      for (int64_t s = 0; s < C; ++s) o_row[s] = pairs::float_to_bf16(ti[s] * (t.beta[s] * t.gexp[s]));
    }
    pairs::pack_bf16(kh, K, C, K, k_words);
    pairs::gemm<U>(C, K, C, -1.0f, tbh, C, k_words, K, 0.0f, w, K, nullptr, Tri::ALower);
    pairs::round_rows(w, K, C, K, it.neg_w(), K);
    pairs::transpose(kh, C, K, it.kt());
    for (int64_t r = 0; r < C; ++r) it.qscale()[r] = p.scale * t.gexp[r], it.kdec()[r] = t.kdec[r];
    it.meta()[0] = t.chunk_decay();
    it.meta()[1] = static_cast<float>(t.rows);
    it.meta()[2] = static_cast<float>(t.bad);
  };
  auto scan_step = [&](const PairItem& it, u32* words, int64_t n, int64_t c, int64_t h) {
    float* state = final_state + (n * HV + h) * state_size;
    if (chunk_states)
      std::memcpy(chunk_states + ((chunk_off[n] + c) * HV + h) * state_size, state, sizeof(float) * state_size);
    const float decay = it.meta()[0];
    const int64_t rows = static_cast<int64_t>(it.meta()[1]), bad = static_cast<int64_t>(it.meta()[2]);
    u32* s_words = words;                  // [K / 2, V]: S
    u32* v_words = s_words + K / 2 * V;    // [C / 2, V]: V', then exp(gamma_C - gamma) V'
    pairs::pack_f32(state, V, nullptr, K, V, s_words);
    // [O; V'] = [diag(scale exp(gamma)) Q; -W] S + [0; U], then O += P V'
    if (with_query) pairs::gemm<U>(C, V, K, 1.0f, it.qh(), K, s_words, V, 0.0f, it.ou(), V, it.qscale());
    pairs::gemm<U>(C, V, K, 1.0f, it.neg_w(), K, s_words, V, 1.0f, it.u(), V);
    if (with_query) {
      pairs::pack_f32(it.u(), V, nullptr, C, V, v_words);
      pairs::gemm<U>(C, V, C, 1.0f, it.attn(), C, v_words, V, 1.0f, it.ou(), V, nullptr, Tri::ALower);
      float* out = it.ou();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t r = bad; r < rows; ++r) std::fill(out + r * V, out + (r + 1) * V, nan);
      const int64_t t0 = p.bos[n] + c * C;
      for (int64_t r = 0; r < rows; ++r) stream_row(out + r * V, o + ((t0 + r) * HV + h) * V, V);
    }
    // S <- exp(gamma_C) S + K^T (exp(gamma_C - gamma) V')  (fla puts the decay on V')
    pairs::pack_f32(it.u(), V, it.kdec(), C, V, v_words);
    pairs::gemm<U>(K, V, C, 1.0f, it.kt(), C, v_words, V, decay, state, V);
    if (bad < rows) std::fill(state, state + state_size, std::numeric_limits<float>::quiet_NaN());
  };

  run_forward_stages(
      p, scratch_floats, item_floats, pair_scan_words(C, K, V), [&](float* base) { return PairItem{C, K, V, base}; },
      intra,
      [&](const PairItem& it, float* scratch, int64_t n, int64_t c, int64_t h) {
        scan_step(it, reinterpret_cast<u32*>(scratch), n, c, h);
      },
      [&](int64_t n, int64_t c, int64_t h) { prefetch_chunk(p, with_query ? q : nullptr, k, v, n, c, h); });
  return any_bad.load();
}

// The bfloat16 forward on the pair-dot unit p.half_products asks for, where this build has
// it and the shapes fit; false where the float32 path is to run.
bool forward_bf16_pairs(const Problem& p, const void* q, const void* k, const void* v, const float* g,
                        const float* beta, const float* initial, void* o, float* final_state, float* chunk_states,
                        bool& nonfinite) {
  if (!pairs_fit(p)) return false;
  const auto* q16 = static_cast<const u16*>(q);
  const auto* k16 = static_cast<const u16*>(k);
  const auto* v16 = static_cast<const u16*>(v);
  auto* out = static_cast<c10::BFloat16*>(o);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (p.half_products == HalfProducts::Auto) {
    nonfinite = forward_pairs<pairs::Avx512Bf16>(p, q16, k16, v16, g, beta, initial, out, final_state, chunk_states);
    return true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (p.half_products == HalfProducts::Emulated) {
    nonfinite = forward_pairs<pairs::EmulatedBf16>(p, q16, k16, v16, g, beta, initial, out, final_state, chunk_states);
    return true;
  }
#endif
  (void)q16, (void)k16, (void)v16, (void)out;
  return false;
}

}  // namespace

bool chunk_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g, const float* beta,
               const float* initial, void* o, float* final_state, float* chunk_states) {
  switch (p.dtype) {
    case DType::Float:
      return forward_typed(p, static_cast<const float*>(q), static_cast<const float*>(k),
                           static_cast<const float*>(v), g, beta, initial, static_cast<float*>(o), final_state,
                           chunk_states);
    case DType::Half:
      return forward_typed(p, static_cast<const c10::Half*>(q), static_cast<const c10::Half*>(k),
                           static_cast<const c10::Half*>(v), g, beta, initial, static_cast<c10::Half*>(o),
                           final_state, chunk_states);
    case DType::BFloat16:
      if (bool nonfinite = false; forward_bf16_pairs(p, q, k, v, g, beta, initial, o, final_state, chunk_states, nonfinite))
        return nonfinite;
      return forward_typed(p, static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
                           static_cast<const c10::BFloat16*>(v), g, beta, initial, static_cast<c10::BFloat16*>(o),
                           final_state, chunk_states);
  }
  return true;  // (no other dtype reaches here)
}

}  // namespace gdr
