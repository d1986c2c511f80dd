// The per-token recurrence over a state pool, in place (the rules: gdr_cpu.h's PoolArgs and
// torch_gdr/_pool.py): one parallel region over (sequence, value head), each head's state
// in column blocks (token_block.h; columns evolve independently, so a block of the start
// row is read before any token of the sequence overwrites it).
//
// For each column block, the tokens of a sequence run in order. A token reads its parent's
// block (the start row's for the first token of a chain and for a tree's roots) and writes
// its own: into its pool row (rounded to the pool's type; fp8 saturating), straight from
// vector registers, and where a later token starts from it or a buffer takes it, also as
// float32: its row itself when that row is float32, else a scratch block of the calling
// thread (one for a chain, updated in place; one per token for a tree). From that block it
// goes to its buffer slot: float32 slots by non-temporal stores (the call never reads them
// back, so their lines are neither read for ownership nor kept in cache), others converted.
// The state is carried in float32 between tokens and rounded only where stored.
//
// Pools and buffers whose value dim is not contiguous (value-first pools, other views), a V
// that is not a multiple of the vector width, and CPUs without AVX2 + FMA take the staged
// path: the start block is loaded into float32 scratch, every token computes into scratch,
// and its block is then stored, converted, wherever it goes.
#include "token_block.h"

namespace gdr {

namespace {

// The block (row, slot, head) of a state view from column j0, as E.
template <typename E>
inline E* state_at(const StateView& s, int64_t row, int64_t slot, int64_t head, int64_t j0) {
  return static_cast<E*>(s.data) + row * s.s_row + slot * s.s_slot + head * s.s_head + j0 * s.s_v;
}

// [K, w] float32 (rows `fs` apart) from a block of E (rows s_k, columns s_v apart).
template <typename E>
inline void load_block(const E* src, int64_t s_k, int64_t s_v, float* dst, int64_t fs, int64_t K, int64_t w) {
  if (s_v == 1) {
    for (int64_t r = 0; r < K; ++r) load_row(src + r * s_k, dst + r * fs, w);
    return;
  }
  for (int64_t c = 0; c < w; ++c)
    for (int64_t r = 0; r < K; ++r) dst[r * fs + c] = to_float(src[r * s_k + c * s_v]);
}

// `n` float32 values into a row of E (store_cast's rounding: fp8 saturates).
template <typename E>
inline void store_row_cast(const float* src, E* dst, int64_t n) {
  if constexpr (is_fp8_v<E>) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) fp8_store8(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = store_cast<E>(src[i]);
  } else {
    store_row(src, dst, n);
  }
}

// A [K, w] float32 block (rows `fs` apart) into a block of E (rows s_k, columns s_v apart).
template <typename E>
inline void store_block(const float* src, int64_t fs, E* dst, int64_t s_k, int64_t s_v, int64_t K, int64_t w) {
  if (s_v == 1) {
    for (int64_t r = 0; r < K; ++r) store_row_cast(src + r * fs, dst + r * s_k, w);
    return;
  }
  for (int64_t c = 0; c < w; ++c)
    for (int64_t r = 0; r < K; ++r) dst[r * s_k + c * s_v] = store_cast<E>(src[r * fs + c]);
}

// A [K, w] float32 block (rows `fs` apart) into float32 rows `s_k` apart, with non-temporal
// stores where the destination is 32-byte aligned: an intermediate state is read by the engine
// after the call, not by this call (which reads its float32 copy), so its lines need not be
// read for ownership nor displace the cache. The caller fences (_mm_sfence) before returning.
inline void stream_block(const float* src, int64_t fs, float* dst, int64_t s_k, int64_t K, int64_t w) {
  for (int64_t r = 0; r < K; ++r) {
    const float* from = src + r * fs;
    float* to = dst + r * s_k;
    int64_t i = 0;
#if defined(__AVX2__)
    if ((reinterpret_cast<uintptr_t>(to) & 31) == 0)
      for (; i + 8 <= w; i += 8) _mm256_stream_ps(to + i, _mm256_loadu_ps(from + i));
#endif
    for (; i < w; ++i) to[i] = from[i];
  }
}

// store_block into a buffer of any StateType.
inline void store_block_as(const float* src, int64_t fs, const StateView& s, int64_t row, int64_t slot,
                           int64_t head, int64_t j0, int64_t K, int64_t w) {
  switch (s.type) {
    case StateType::Float:
      return store_block(src, fs, state_at<float>(s, row, slot, head, j0), s.s_k, s.s_v, K, w);
    case StateType::Half:
      return store_block(src, fs, state_at<c10::Half>(s, row, slot, head, j0), s.s_k, s.s_v, K, w);
    case StateType::BFloat16:
      return store_block(src, fs, state_at<c10::BFloat16>(s, row, slot, head, j0), s.s_k, s.s_v, K, w);
    case StateType::Fp8E4M3:
      return store_block(src, fs, state_at<c10::Float8_e4m3fn>(s, row, slot, head, j0), s.s_k, s.s_v, K, w);
    case StateType::Fp8E5M2:
      return store_block(src, fs, state_at<c10::Float8_e5m2>(s, row, slot, head, j0), s.s_k, s.s_v, K, w);
  }
}

// Where a token's float32 state lives while later tokens of the block read it.
struct Loc {
  float* base = nullptr;  // a row's column 0, or a scratch block
  int64_t stride = 0;     // between rows
  bool scratch = false;   // a scratch block (already the block's own) or a row (offset by j0)
  float* at(int64_t j0) const { return base ? (scratch ? base : base + j0) : nullptr; }
};

// Per token of the item being computed (the calling thread's, reused).
struct TokenPlan {
  int64_t parent;      // -1: the start state
  int64_t pool_row;    // -1: not stored in the pool
  bool followed;       // a later token starts from it
  Loc loc;             // its float32 state (vector path), or none
  bool store_pool_h;   // the vector path stores its pool row from registers (hdst)
};

template <typename T, typename P>
void pool_typed(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                const PoolArgs& a, T* o) {
  constexpr int64_t kB = pool_block_cols<P>();  // columns per block
  const int64_t K = p.K, V = p.V, HV = p.HV, group = p.group(), width = a.width;
  const int64_t token_floats = 2 * K + V, block_floats = K * kB;
  const StateView& pv = a.pool;
  const StateView& bv = a.buffer;
  const bool tree = a.parents != nullptr, has_buf = bv.data != nullptr;
  constexpr bool f32_pool = std::is_same_v<P, float>;
  bool vector = false;
#if defined(GDR_SIMD_BLOCK)
  vector = pv.s_v == 1 && (!has_buf || bv.s_v == 1) && V % Vec::kLanes == 0;
#endif
  const bool buf_f32 = vector && has_buf && bv.type == StateType::Float;
  // scratch blocks: one per token of a tree (one for a chain), then the staged start block
  const int64_t slots = tree ? width : 1;
  const int64_t scratch_floats = width * token_floats + 3 * kB + (slots + 1) * block_floats;
  auto start_of = [&](int64_t n) { return a.start_rows[n]; };
  const int64_t items = p.num_seqs() * HV;
  parallel_items(
      p.threads, items, scratch_floats,
      [&](float* scratch, int64_t i) {
        const int64_t n = i / HV, h = i % HV, hk = h / group, len = p.len[n];
        if (len == 0) return;  // no token: nothing read, nothing written
        thread_local std::vector<TokenIn> ins;
        thread_local std::vector<TokenPlan> plan;
        if (static_cast<int64_t>(ins.size()) < width) ins.resize(width), plan.resize(width);
        float* block_scratch = scratch + width * token_floats;
        float* slot_base = block_scratch + 3 * kB;
        float* stage = slot_base + slots * block_floats;  // the start row's block, float32
        const int64_t r0 = start_of(n);
        // the tokens, and where each one's state goes
        for (int64_t j = 0; j < len; ++j) {
          const int64_t tok = p.bos[n] + j;
          ins[j] = prepare_token(p, q, k, v, g, beta, tok, hk, h, scratch + j * token_floats);
          TokenPlan& t = plan[j];
          t.parent = tree ? a.parents[n * width + j] : j - 1;
          const int64_t row = a.indices[n * width + j];
          t.pool_row = a.write_pool ? row : -1;
          t.followed = false;
          if (t.parent >= 0) plan[t.parent].followed = true;
        }
        bool stage_start = !vector && r0 >= 0;
        if (vector && tree && r0 >= 0) {  // a root after a token that overwrote the start row
          bool overwritten = false;  // by an earlier token (a root reads its block before writing it)
          for (int64_t j = 0; j < len; ++j) {
            stage_start = stage_start || (overwritten && plan[j].parent < 0);
            overwritten = overwritten || plan[j].pool_row == r0;
          }
        }
        for (int64_t j = 0; j < len; ++j) {
          TokenPlan& t = plan[j];
          t.loc = Loc{};
          t.store_pool_h = vector && t.pool_row >= 0;
          float* slot = slot_base + (tree ? j : 0) * block_floats;
          if (!vector) {
            t.loc = Loc{slot, kB, true};
          } else if (f32_pool && t.pool_row >= 0) {
            t.loc = Loc{reinterpret_cast<float*>(state_at<P>(pv, t.pool_row, 0, h, 0)), pv.s_k, false};
          } else if (t.followed || has_buf) {
            t.loc = Loc{slot, kB, true};
          }
        }
        // bfloat16 pairs keep scratch in their own column order: only where nothing else reads it
        const bool pairs = !has_buf && !stage_start;
        const P* start = r0 >= 0 ? state_at<P>(pv, r0, 0, h, 0) : nullptr;
        const P* next_item = nullptr;  // the head this thread runs next (contiguous schedule)
        if (vector && i + 1 < items && p.len[(i + 1) / HV] > 0 && start_of((i + 1) / HV) >= 0)
          next_item = state_at<P>(pv, start_of((i + 1) / HV), 0, (i + 1) % HV, 0);
        // a key-first row in one piece whose block rows are under two cache lines (2-byte and
        // fp8 pools on AVX2, fp8 on AVX-512), or of bfloat16: each block's pass 2 asks for its
        // share of the next item's row, in address order, a whole item ahead (the thread's
        // first item asks for its own row at once). float32 and, on AVX-512, float16 rows keep
        // the next block's prefetch, which measured faster for them (bench/RESULTS.md)
        constexpr bool narrow_rows =
            kB * static_cast<int64_t>(sizeof(P)) < 128 || std::is_same_v<P, c10::BFloat16>;
        const bool rows_contiguous = vector && narrow_rows && pv.s_v == 1 && pv.s_k == V;
#if defined(GDR_SIMD_BLOCK)
        thread_local int64_t last_item = -2;
        if (rows_contiguous && start && !stage_start && last_item != i - 1)
          prefetch_bytes(start, K * V * static_cast<int64_t>(sizeof(P)));
        last_item = i;
#endif
        (void)next_item;
        (void)pairs;
        (void)rows_contiguous;
        for (int64_t j0 = 0; j0 < V; j0 += kB) {
          const int64_t w = std::min(kB, V - j0);
          if (stage_start) load_block(start + j0 * pv.s_v, pv.s_k, pv.s_v, stage, kB, K, w);
          for (int64_t j = 0; j < len; ++j) {
            const TokenPlan& t = plan[j];
            const int64_t tok = p.bos[n] + j;
            T* out = o + (tok * HV + h) * V + j0;
            TokenIn tb = ins[j];
            tb.v = ins[j].v + j0;
            // the state it starts from: its parent's float32 block, the start row, or zeros
            const float* fsrc = nullptr;
            int64_t fss = 0;
            const P* hsrc = nullptr;
            if (t.parent >= 0) {
              fsrc = plan[t.parent].loc.at(j0), fss = plan[t.parent].loc.stride;
            } else if (stage_start) {
              fsrc = stage, fss = kB;
            } else if (start) {
              hsrc = start + j0;
            }
            float* fdst = t.loc.at(j0);
            if (!vector) {
              block_generic(tb, fsrc, fss, fdst, kB, K, w, block_scratch, block_scratch + kB,
                            block_scratch + 2 * kB, out);
              if (t.pool_row >= 0)
                store_block(fdst, kB, state_at<P>(pv, t.pool_row, 0, h, j0), pv.s_k, pv.s_v, K, w);
              if (has_buf) store_block_as(fdst, kB, bv, a.buffer_rows[n], j, h, j0, K, w);
              continue;
            }
#if defined(GDR_SIMD_BLOCK)
            P* hdst = t.store_pool_h ? state_at<P>(pv, t.pool_row, 0, h, j0) : nullptr;
            if (f32_pool && fdst && static_cast<void*>(fdst) == static_cast<void*>(hdst)) hdst = nullptr;
            const P* next = nullptr;
            int64_t nss = pv.s_k;
            if (j == len - 1) {
              if (rows_contiguous && next_item) {
                next = next_item + j0 * K, nss = w;  // this block's share of the next row, in address order
              } else if (j0 + kB < V) {
                next = start && !stage_start ? start + j0 + kB : nullptr;
              } else {
                next = next_item;
              }
            }
            step_block_half(tb, hsrc, pv.s_k, fsrc, fss, fdst, t.loc.stride, hdst, pv.s_k, K, w, block_scratch, out,
                            next, nss, pairs);
            if (buf_f32) {
              stream_block(fdst, t.loc.stride, state_at<float>(bv, a.buffer_rows[n], j, h, j0), bv.s_k, K, w);
            } else if (has_buf) {
              store_block_as(fdst, t.loc.stride, bv, a.buffer_rows[n], j, h, j0, K, w);
            }
#endif
          }
        }
#if defined(__AVX2__)
        if (buf_f32) _mm_sfence();  // the streamed buffer blocks, before another thread or the caller reads them
#endif
      },
      /*contiguous=*/true);
}

template <typename T>
void pool_dispatch(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                   const PoolArgs& a, T* o) {
  switch (a.pool.type) {
    case StateType::Float: return pool_typed<T, float>(p, q, k, v, g, beta, a, o);
    case StateType::Half: return pool_typed<T, c10::Half>(p, q, k, v, g, beta, a, o);
    case StateType::BFloat16: return pool_typed<T, c10::BFloat16>(p, q, k, v, g, beta, a, o);
    case StateType::Fp8E4M3: return pool_typed<T, c10::Float8_e4m3fn>(p, q, k, v, g, beta, a, o);
    case StateType::Fp8E5M2: return pool_typed<T, c10::Float8_e5m2>(p, q, k, v, g, beta, a, o);
  }
}

}  // namespace

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
