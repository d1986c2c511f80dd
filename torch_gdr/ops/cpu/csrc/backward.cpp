// The hand-written chunked backward (derivation: torch_gdr/ops/torch/chunk_backward.py), per
// segment of chunks, last segment first, in three parallel regions:
//   1. over (sequence, chunk, value head): the intra-chunk part again, and V' = U - W S
//      from the saved chunk states;
//   2. over (sequence, value head), chunks in reverse: dV' = P^T dO + Kd dS' and
//      dS = exp(gamma_C) dS' + Qg^T dO - W^T dV', carried across chunks and segments;
//   3. over (sequence, chunk, query/key head), looping over the value heads that share it
//      (so that their dq, dk are summed without races): every gradient.
#include "common.h"

namespace gdr {

namespace {

struct BackwardItem {
  int64_t C, K, V;
  static int64_t floats(int64_t C, int64_t K, int64_t V) { return 3 * C * C + 3 * C * K + 3 * C * V + K * V + 16; }
  float* base;
  float* inv() const { return base; }              // [C, C]: T
  float* gram() const { return inv() + C * C; }    // [C, C]: G
  float* attn() const { return gram() + C * C; }   // [C, C]: P (scaled)
  float* qg() const { return attn() + C * C; }     // [2C, K]: rows :C Qg, rows C: -W
  float* neg_w() const { return qg() + C * K; }
  float* kd() const { return qg() + 2 * C * K; }   // [C, K]
  float* vnew() const { return kd() + C * K; }     // [C, V]: V'
  float* dov() const { return vnew() + C * V; }    // [2C, V]: rows :C dO, rows C: dV'
  float* dvnew() const { return dov() + C * V; }
  float* ds() const { return dov() + 2 * C * V; }  // [K, V]: dS', the gradient on the state leaving the chunk
  float* meta() const { return ds() + K * V; }     // [0] chunk decay
};

template <typename T>
void load_grad_rows(const Problem& p, const T* grad_o, int64_t n, int64_t c, int64_t h, int64_t rows, float* out) {
  const int64_t V = p.V, t0 = p.bos[n] + c * p.C;
  for (int64_t r = 0; r < rows; ++r) load_row(grad_o + ((t0 + r) * p.HV + h) * V, out + r * V, V);
  std::memset(out + rows * V, 0, sizeof(float) * (p.C - rows) * V);
}

// dx = r (dy - y (y . dy)) for y = x r, in place on dy rows.
void l2norm_backward(float* dy, const float* y, const float* rnorm, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dy + r * dim;
    const float* yr = y + r * dim;
    const float proj = dot(yr, d, dim), rn = rnorm[r];
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) d[i] = rn * (d[i] - yr[i] * proj);
  }
}

// The gradients of one token's raw gate and beta logits (p.gating, gdr_cpu.h) from those of
// the g and beta the kernels used (dg, dbeta), at value head h; adds the token's terms of
// dA_log and ddt_bias to `sums` ([2] double: sum dg * g, sum da).
inline void gating_chain(const Problem& p, float raw_g, float raw_beta, int64_t h, float& dg, float& dbeta,
                         double* sums) {
  const Gating& a = p.gating;
  if (a.A_log) {
    const float x = a.dt_bias ? raw_g + a.dt_bias[h] : raw_g;
    const float rate = std::exp(a.A_log[h]);
    const float slope = x > 20.0f ? 1.0f : 1.0f / (1.0f + std::exp(-x));  // softplus'(x)
    const float gate = -rate * softplus(x);
    const float da = -dg * rate * slope;
    sums[0] += static_cast<double>(dg) * gate;
    sums[1] += da;
    dg = da;
  }
  if (a.beta_sigmoid) {
    const float sig = 1.0f / (1.0f + std::exp(-raw_beta));
    dbeta = dbeta * a.beta_scale * sig * (1.0f - sig);
  }
}

template <typename T>
void backward_typed(const Problem& p, const T* grad_o, const float* grad_final, const T* q, const T* k, const T* v,
                    const float* g, const float* beta, const float* chunk_states, T* dq, T* dk, T* dv, float* dg,
                    float* dbeta, float* d_initial, float* d_A_log, float* d_dt_bias) {
  const int64_t C = p.C, K = p.K, V = p.V, H = p.H, HV = p.HV, N = p.num_seqs(), group = p.group();
  const int64_t state_size = K * V;
  const std::vector<int64_t> chunk_off = chunk_offsets(p);
  std::vector<float> own_carry;
  float* carry = d_initial;
  if (!carry) {
    own_carry.resize(static_cast<size_t>(N * HV * state_size));
    carry = own_carry.data();
  }
  if (grad_final)
    std::memcpy(carry, grad_final, sizeof(float) * N * HV * state_size);
  else
    std::memset(carry, 0, sizeof(float) * N * HV * state_size);

  // dA_log and ddt_bias: per (chunk, value head) sums, each written by the one thread that
  // computes that chunk's gradients, added up in a fixed order at the end (deterministic).
  const bool gated = p.gating.A_log || p.gating.beta_sigmoid;
  std::vector<double> head_sums(p.gating.A_log ? static_cast<size_t>(chunk_off[N] * HV * 2) : 0, 0.0);
  auto reduce_head_sums = [&]() {
    if (!p.gating.A_log) return;
    for (int64_t h = 0; h < HV; ++h) {
      double a_log = 0.0, bias = 0.0;
      for (int64_t c = 0; c < chunk_off[N]; ++c) {
        a_log += head_sums[(c * HV + h) * 2];
        bias += head_sums[(c * HV + h) * 2 + 1];
      }
      if (d_A_log) d_A_log[h] = static_cast<float>(a_log);
      if (d_dt_bias) d_dt_bias[h] = static_cast<float>(bias);
    }
  };

  const int64_t item_floats = BackwardItem::floats(C, K, V);
  auto state_at = [&](int64_t n, int64_t c, int64_t h) {
    return chunk_states + ((chunk_off[n] + c) * HV + h) * state_size;
  };

  // 1. One chunk's intra-chunk part again, and V' = U - W S.
  auto intra = [&](const BackwardItem& it, float* scratch, int64_t n, int64_t c, int64_t h) {
    Tile t;
    t.bind(scratch, C, K, V);
    float* sim = scratch + Tile::floats(C, K, V);
    float* tb = sim + 2 * C * C;
    load_tile(p, t, q, k, v, g, beta, n, c, h, true);
    tile_decays(t);
    tile_intra(t, p.scale, true, sim, it.gram(), it.attn(), it.inv(), tb, it.vnew(), it.neg_w(), -1.0f);
    gemm(false, false, C, V, K, 1.0f, it.neg_w(), K, state_at(n, c, h), V, 1.0f, it.vnew(), V);
    for (int64_t r = 0; r < C; ++r) {
      const float fq = p.scale * t.gexp[r], fk = t.kdec[r];
      const float *yq = t.query() + r * K, *kr = t.key() + r * K;
      float *oq = it.qg() + r * K, *ok = it.kd() + r * K;
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) oq[j] = fq * yq[j], ok[j] = fk * kr[j];
    }
    it.meta()[0] = t.chunk_decay();
  };
  // 2. One step of the reverse scan: dS' of the chunk kept, dV', and dS entering it.
  auto scan_step = [&](const BackwardItem& it, int64_t n, int64_t c, int64_t h) {
    float* ds = carry + (n * HV + h) * state_size;
    std::memcpy(it.ds(), ds, sizeof(float) * state_size);
    load_grad_rows(p, grad_o, n, c, h, std::min<int64_t>(C, p.len[n] - c * C), it.dov());
    // dV' = P^T dO + Kd dS';  dS = exp(gamma_C) dS' + [Qg; -W]^T [dO; dV']
    gemm(true, false, C, V, C, 1.0f, it.attn(), C, it.dov(), V, 0.0f, it.dvnew(), V);
    gemm(false, false, C, V, K, 1.0f, it.kd(), K, it.ds(), V, 1.0f, it.dvnew(), V);
    gemm(true, false, K, V, 2 * C, 1.0f, it.qg(), K, it.dov(), V, it.meta()[0], ds, V);
  };
  // 3. Every gradient of one chunk and query/key head, over the value heads sharing it.
  const int64_t tile_f = Tile::floats(C, K, V);
  const int64_t scratch_f = tile_f + 2 * C * V + 2 * C * K + 2 * C * C + 3 * C * C + 2 * C * C + 4 * C * K + 3 * C;
  auto gradients = [&](float* scratch, int64_t n, int64_t c, int64_t hk, auto item_for) {
      float* m = scratch;
      Tile t;
      t.bind(m, C, K, V);
      m += tile_f;
      float* x = m;  // [2C, V]: [dO; dVb]
      m += 2 * C * V;
      float* xs = m;  // [2C, K]: [dO S^T; -dKb]
      m += 2 * C * K;
      float* xv = m;  // [2C, C]: [dP; -dA]
      m += 2 * C * C;
      float* dpg = m;  // [C, C]: dP * Gamma
      m += C * C;
      float* db = m;  // [C, C]: dB
      m += C * C;
      float* spare = m;
      m += C * C;
      float* lhs = m;  // [C, 2C]
      m += 2 * C * C;
      float* dq_acc = m;  // [C, K]
      m += C * K;
      float* dk_acc = m;  // [C, K]
      m += C * K;
      float* dkd = m;  // [C, K]
      m += 2 * C * K;
      float* dgamma = m;
      float* colsum = m + C;
      float* dbeta_r = m + 2 * C;
      (void)spare;
      std::memset(dq_acc, 0, sizeof(float) * 2 * C * K);
      const int64_t t0 = p.bos[n] + c * C;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        load_tile(p, t, q, k, v, g, beta, n, c, h, true);
        tile_decays(t);
        const BackwardItem it = item_for(h);
        const float* s_in = state_at(n, c, h);
        const float* gam = t.gam;
        const float *pm = it.attn(), *gm = it.gram();
        const int64_t rows = t.rows;
        std::memcpy(x, it.dov(), sizeof(float) * C * V);
        float* dvb = x + C * V;
        gemm(true, false, C, V, C, 1.0f, it.inv(), C, it.dvnew(), V, 0.0f, dvb, V);
        gemm(false, true, 2 * C, K, V, 1.0f, x, V, s_in, V, 0.0f, xs, K);
        gemm(false, true, 2 * C, C, V, 1.0f, x, V, it.vnew(), V, 0.0f, xv, C);
        std::memset(colsum, 0, sizeof(float) * C);
        // From O = Qg S + P V'.
        for (int64_t r = 0; r < C; ++r) {
          const float* xr = xs + r * K;
          const float* yq = t.query() + r * K;
          float* dqr = dq_acc + r * K;
          const float ge = t.gexp[r];
          float dqy = 0.0f;
#pragma omp simd reduction(+ : dqy)
          for (int64_t j = 0; j < K; ++j) {
            const float d = ge * xr[j];
            dqy += d * yq[j];
            dqr[j] += d;
          }
          float row_sum = 0.0f;
          const float *dp = xv + r * C, *pr = pm + r * C, *gr = gam + r * C;
          float* dpgr = dpg + r * C;
#pragma omp simd reduction(+ : row_sum)
          for (int64_t s = 0; s < C; ++s) {
            // The diagonal (Gamma_rr = 1) does not depend on g: leaving it out of the
            // row and column sums, which would cancel it, keeps tiny decays exact.
            const float mm = s < r ? dp[s] * pr[s] : 0.0f;
            row_sum += mm;
            colsum[s] += mm;
            dpgr[s] = s <= r ? dp[s] * gr[s] : 0.0f;
          }
          dgamma[r] = p.scale * dqy + row_sum;
        }
        for (int64_t s = 0; s < C; ++s) dgamma[s] -= colsum[s];
        gemm(false, false, C, K, C, 1.0f, dpg, C, t.key(), K, 1.0f, dq_acc, K);
        // From A = diag(beta) G: dA = -strictly_lower(dVb V'^T).
        std::memset(colsum, 0, sizeof(float) * C);
        for (int64_t r = 0; r < C; ++r) {
          const float* nda = xv + (C + r) * C;
          const float *gr = gm + r * C, *gmr = gam + r * C;
          float* dbr = db + r * C;
          const float br = t.beta[r];
          float da_g = 0.0f, row_sum = 0.0f;
#pragma omp simd reduction(+ : da_g, row_sum)
          for (int64_t s = 0; s < C; ++s) {
            const bool on = s < r;
            const float da = on ? -nda[s] : 0.0f;
            const float prod = da * gr[s];
            da_g += prod;
            const float m2 = br * prod;
            row_sum += m2;
            colsum[s] += m2;
            dbr[s] = on ? br * da * gmr[s] : 0.0f;
          }
          dbeta_r[r] = dot(dvb + r * V, t.v + r * V, V) + da_g;
          dgamma[r] += row_sum;
        }
        for (int64_t s = 0; s < C; ++s) dgamma[s] -= colsum[s];
        // dK = [scale (dP Gamma)^T | dB + dB^T] [y_q; K]
        for (int64_t r = 0; r < C; ++r) {
          float* lr = lhs + r * 2 * C;
          for (int64_t s = 0; s < C; ++s) {
            lr[s] = p.scale * dpg[s * C + r];
            lr[C + s] = db[r * C + s] + db[s * C + r];
          }
        }
        gemm(false, false, C, K, 2 * C, 1.0f, lhs, 2 * C, t.qk, K, 1.0f, dk_acc, K);
        // From Kb = beta exp(gamma) K (rows C: of xs hold -dKb) and Kd = exp(gamma_C - gamma) K.
        gemm(false, true, C, K, V, 1.0f, it.vnew(), V, it.ds(), V, 0.0f, dkd, K);
        float* tr_row = colsum;  // tr[r] = sum(dKd_r * Kd_r): a gradient of g_j for every j > r
        for (int64_t r = 0; r < C; ++r) {
          const float* ndkb = xs + (C + r) * K;
          const float* kr = t.key() + r * K;
          const float* dkdr = dkd + r * K;
          float* dkr = dk_acc + r * K;
          const float ge = t.gexp[r], be = t.beta[r] * ge, kd = t.kdec[r];
          const float s_kb = -dot(ndkb, kr, K);
          tr_row[r] = kd * dot(dkdr, kr, K);
          dbeta_r[r] += ge * s_kb;
          dgamma[r] += be * s_kb;
#pragma omp simd
          for (int64_t j = 0; j < K; ++j) dkr[j] += kd * dkdr[j] - be * ndkb[j];
        }
        dgamma[C - 1] += t.chunk_decay() * dot(it.ds(), s_in, state_size);
        // dg = reverse cumsum of dgamma within the chunk, plus the decays to the chunk's
        // end, exp(sum of g over (r, C)), as an exclusive prefix sum of tr: summed as
        // -tr at r and +tr at the end, the two would cancel for j <= r, and with an
        // O(1) tr (no decay left after r, e.g. in a padded tail) drown tiny gradients.
        float run = 0.0f;
        for (int64_t r = C - 1; r >= 0; --r) {
          run += dgamma[r];
          dgamma[r] = run;
        }
        run = 0.0f;
        for (int64_t r = 0; r < C; ++r) {
          dgamma[r] += run;
          run += tr_row[r];
        }
        double* sums = p.gating.A_log ? head_sums.data() + ((chunk_off[n] + c) * HV + h) * 2 : nullptr;
        if (sums) sums[0] = sums[1] = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t idx = (t0 + r) * HV + h;
          float dgr = dgamma[r], dbr = dbeta_r[r];
          if (gated) gating_chain(p, g[idx], beta[idx], h, dgr, dbr, sums);
          dg[idx] = dgr;
          dbeta[idx] = dbr;
          float* dvr = dvb + r * V;
          const float br = t.beta[r];
#pragma omp simd
          for (int64_t j = 0; j < V; ++j) dvr[j] *= br;
          stream_row(dvr, dv + idx * V, V);
        }
      }
      // dq: the scale; then the l2norm backward for both.
#pragma omp simd
      for (int64_t j = 0; j < C * K; ++j) dq_acc[j] *= p.scale;
      if (p.l2norm) {
        l2norm_backward(dq_acc, t.query(), t.rnorm, t.rows, K);
        l2norm_backward(dk_acc, t.key(), t.rnorm + C, t.rows, K);
      }
      for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t idx = (t0 + r) * H + hk;
        stream_row(dq_acc + r * K, dq + idx * K, K);
        stream_row(dk_acc + r * K, dk + idx * K, K);
      }
  };

  if (fuse_stages(p, N * H)) {
    // Per (sequence, query/key head), chunks in reverse, all three steps per chunk in one
    // thread: no barrier, the items of its value heads staying in its cache.
    parallel_items(p.threads, N * H, scratch_f + group * item_floats, [&](float* scratch, int64_t i) {
      const int64_t n = i / H, hk = i % H;
      float* items = scratch + scratch_f;
      auto item_for = [&](int64_t h) { return BackwardItem{C, K, V, items + (h - hk * group) * item_floats}; };
      for (int64_t c = p.num_chunks(n) - 1; c >= 0; --c) {
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          intra(item_for(h), scratch, n, c, h);
          scan_step(item_for(h), n, c, h);
          prefetch_chunk(p, q, k, v, n, c - 1, h);
          prefetch_chunk<T>(p, nullptr, nullptr, grad_o, n, c - 1, h);
        }
        gradients(scratch, n, c, hk, item_for);
      }
      stream_fence();
    });
    reduce_head_sums();
    return;
  }
  const auto segments = make_segments(p, item_floats * sizeof(float), kBackwardBudget);
  int64_t max_slots = 0;
  for (const auto& s : segments) max_slots = std::max(max_slots, s.slots());
  float* store = thread_workspace(kStore, max_slots * HV * item_floats);
  auto item_at = [&](int64_t slot, int64_t h) { return BackwardItem{C, K, V, store + (slot * HV + h) * item_floats}; };
  for (auto seg_it = segments.rbegin(); seg_it != segments.rend(); ++seg_it) {
    const Segment& seg = *seg_it;
    const int64_t nact = static_cast<int64_t>(seg.active.size());
    parallel_items(p.threads, seg.slots() * HV, tile_f + 3 * C * C + C * V, [&](float* scratch, int64_t i) {
      const int64_t h = i % HV, slot = i / HV, a = slot % nact, c = seg.c0 + slot / nact;
      const int64_t n = seg.active[a];
      if (c < p.num_chunks(n)) intra(item_at(slot, h), scratch, n, c, h);
    });
    parallel_items(p.threads, nact * HV, 0, [&](float*, int64_t i) {
      const int64_t h = i % HV, a = i / HV, n = seg.active[a];
      const int64_t c_end = std::min(seg.c1, p.num_chunks(n));
      for (int64_t c = c_end - 1; c >= seg.c0; --c) scan_step(item_at((c - seg.c0) * nact + a, h), n, c, h);
    });
    parallel_items(p.threads, seg.slots() * H, scratch_f, [&](float* scratch, int64_t i) {
      const int64_t hk = i % H, slot = i / H, a = slot % nact, c = seg.c0 + slot / nact;
      const int64_t n = seg.active[a];
      if (c < p.num_chunks(n)) gradients(scratch, n, c, hk, [&](int64_t h) { return item_at(slot, h); });
      stream_fence();
    });
  }
  reduce_head_sums();
}

}  // namespace

void chunk_bwd(const Problem& p, const void* grad_o, const float* grad_final, const void* q, const void* k,
               const void* v, const float* g, const float* beta, const float* chunk_states, void* dq, void* dk,
               void* dv, float* dg, float* dbeta, float* d_initial, float* d_A_log, float* d_dt_bias) {
  switch (p.dtype) {
    case DType::Float:
      return backward_typed(p, static_cast<const float*>(grad_o), grad_final, static_cast<const float*>(q),
                            static_cast<const float*>(k), static_cast<const float*>(v), g, beta, chunk_states,
                            static_cast<float*>(dq), static_cast<float*>(dk), static_cast<float*>(dv), dg, dbeta,
                            d_initial, d_A_log, d_dt_bias);
    case DType::Half:
      return backward_typed(p, static_cast<const c10::Half*>(grad_o), grad_final, static_cast<const c10::Half*>(q),
                            static_cast<const c10::Half*>(k), static_cast<const c10::Half*>(v), g, beta,
                            chunk_states, static_cast<c10::Half*>(dq), static_cast<c10::Half*>(dk),
                            static_cast<c10::Half*>(dv), dg, dbeta, d_initial, d_A_log, d_dt_bias);
    case DType::BFloat16:
      return backward_typed(p, static_cast<const c10::BFloat16*>(grad_o), grad_final,
                            static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
                            static_cast<const c10::BFloat16*>(v), g, beta, chunk_states,
                            static_cast<c10::BFloat16*>(dq), static_cast<c10::BFloat16*>(dk),
                            static_cast<c10::BFloat16*>(dv), dg, dbeta, d_initial, d_A_log,
                            d_dt_bias);
  }
}

}  // namespace gdr
