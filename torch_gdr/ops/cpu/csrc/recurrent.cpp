// The per-token recurrence, fused, for decode and short T: one parallel region over
// (sequence, value head); per token two passes over the state (one read to form S^T k and
// S^T q, one read-modify-write), the state of one head staying in cache between tokens.
//
//   u = beta (v - exp(g) S^T k),  S' = exp(g) S + k u^T,  o = S'^T q = exp(g) S^T q + (k . q) u
#include "common.h"

namespace gdr {

namespace {

template <typename T>
void recurrent_typed(const Problem& p, const T* q, const T* k, const T* v, const float* g, const float* beta,
                     const float* initial, T* o, float* final_state) {
  const int64_t K = p.K, V = p.V, H = p.H, HV = p.HV, group = p.group();
  const int64_t state_size = K * V;
  parallel_items(
      p.threads, p.num_seqs() * HV, 2 * K + 4 * V,
      [&](float* scratch, int64_t i) {
        const int64_t n = i / HV, h = i % HV, hk = h / group;
        float *qv = scratch, *kv = qv + K, *vv = kv + K, *sk = vv + V, *sq = sk + V, *u = sq + V;
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
        for (int64_t tt = 0; tt < p.len[n]; ++tt) {
          const int64_t tok = p.bos[n] + tt;
          load_row(q + (tok * H + hk) * K, qv, K);
          load_row(k + (tok * H + hk) * K, kv, K);
          load_row(v + (tok * HV + h) * V, vv, V);
          if (p.l2norm) {
            float rn;
            l2norm_rows(qv, &rn, 1, K);
            l2norm_rows(kv, &rn, 1, K);
          }
          const float alpha = std::exp(g[tok * HV + h]), b = beta[tok * HV + h];
          std::fill(sk, sk + 2 * V, 0.0f);
          if (src) {
            for (int64_t r = 0; r < K; ++r) {
              const float* row = src + r * V;
              const float kr = kv[r], qr = qv[r];
#pragma omp simd
              for (int64_t j = 0; j < V; ++j) sk[j] += row[j] * kr, sq[j] += row[j] * qr;
            }
          }
          if (tt == p.len[n] - 1 && initial && i + 1 < p.num_seqs() * HV) {
            // The next item's state streams in while this one is written back.
            const char* next = reinterpret_cast<const char*>(initial + (i + 1) * state_size);
            for (int64_t off = 0; off < state_size * int64_t(sizeof(float)); off += 64) prefetch_l2(next + off);
          }
          const float kq = dot(kv, qv, K) * p.scale;
          T* out = o + (tok * HV + h) * V;
#pragma omp simd
          for (int64_t j = 0; j < V; ++j) u[j] = b * (vv[j] - alpha * sk[j]);
          for (int64_t j = 0; j < V; ++j) out[j] = from_float<T>(alpha * p.scale * sq[j] + kq * u[j]);
          for (int64_t r = 0; r < K; ++r) {
            float* row = dst + r * V;
            const float kr = kv[r];
            if (src) {
              const float* srow = src + r * V;
#pragma omp simd
              for (int64_t j = 0; j < V; ++j) row[j] = alpha * srow[j] + kr * u[j];
            } else {
#pragma omp simd
              for (int64_t j = 0; j < V; ++j) row[j] = kr * u[j];
            }
          }
          src = dst;
        }
      },
      /*contiguous=*/true);
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

}  // namespace gdr
