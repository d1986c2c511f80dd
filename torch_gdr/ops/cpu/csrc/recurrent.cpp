// The per-token recurrence, fused, for decode and short T: one parallel region over
// (sequence, value head), each head's state in column blocks (token_block.h). The step over
// a state pool is pool.cpp.
#include "token_block.h"

namespace gdr {

namespace {

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
