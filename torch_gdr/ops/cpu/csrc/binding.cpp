// Python bindings: tensors in, raw pointers to the kernels. The Python wrapper
// (torch_gdr/ops/cpu/kernels.py) validates arguments and passes contiguous tensors in the
// dtypes stated below; these functions only check what would make a kernel read out of
// bounds.
#include <torch/extension.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "gdr_cpu.h"

namespace {

using at::Tensor;
using c10::optional;

gdr::DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return gdr::DType::Float;
    case at::kHalf: return gdr::DType::Half;
    case at::kBFloat16: return gdr::DType::BFloat16;
    default: TORCH_CHECK(false, "torch_gdr cpu kernels: unsupported dtype ", t.scalar_type());
  }
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, ": expected a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.numel() == numel, name, ": expected ", numel, " elements, got ", t.numel());
}

// q [B, T, H, K], v [B, T, HV, V]; cu_seqlens int64 [N + 1] or None.
gdr::Problem make_problem(const Tensor& q, const Tensor& v, const optional<Tensor>& cu_seqlens, int64_t chunk,
                          double scale, bool l2norm, int64_t stages = 0) {
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, "q and v must be 4-D");
  gdr::Problem p;
  p.dtype = dtype_of(q);
  const int64_t B = q.size(0), T = q.size(1);
  p.H = q.size(2), p.K = q.size(3), p.HV = v.size(2), p.V = v.size(3), p.C = chunk;
  TORCH_CHECK(p.H > 0 && p.HV % p.H == 0, "HV must be a multiple of H");
  p.scale = static_cast<float>(scale);
  p.l2norm = l2norm;
  p.threads = std::max(1, at::get_num_threads());
  // stages: bits 0-1 the stages (gdr::Stages), bits 2-3 how bfloat16 products run (gdr::HalfProducts)
  TORCH_CHECK(stages >= 0 && (stages & 3) <= 2 && (stages >> 2) <= 2,
              "stages must be 0 (auto), 1 (fused) or 2 (segmented), plus 4 x (0 auto, 1 float32, 2 emulated)");
  p.stages = static_cast<gdr::Stages>(stages & 3);
  p.half_products = static_cast<gdr::HalfProducts>(stages >> 2);
  if (cu_seqlens.has_value() && cu_seqlens->defined()) {
    const Tensor cu = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* c = cu.data_ptr<int64_t>();
    const int64_t num = cu.numel() - 1;
    TORCH_CHECK(num >= 0 && c[0] == 0 && c[num] == B * T, "cu_seqlens must run from 0 to B * T");
    for (int64_t n = 0; n < num; ++n) {
      TORCH_CHECK(c[n + 1] >= c[n], "cu_seqlens must be non-decreasing");
      p.bos.push_back(c[n]);
      p.len.push_back(c[n + 1] - c[n]);
    }
  } else {
    for (int64_t n = 0; n < B; ++n) p.bos.push_back(n * T), p.len.push_back(T);
  }
  return p;
}

// Ask Linux to back a large fresh output with transparent huge pages (where the system
// allows them on request): its first touch, inside the kernels, then costs one page fault
// per 2 MiB instead of 512, a visible share of the time per token at long T on VMs.
Tensor advise_huge(Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = start + static_cast<uintptr_t>(t.nbytes());
  const uintptr_t first = (start + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return t;
}

// fla's activation arguments (gdr_cpu.h: Gating): A_log, dt_bias float32 [HV] or None
// (A_log given: g is the raw gate); beta_sigmoid with its scale (2 with allow_neg_eigval).
void set_gating(gdr::Problem& p, const optional<Tensor>& A_log, const optional<Tensor>& dt_bias, bool beta_sigmoid,
                double beta_scale) {
  const bool has_a_log = A_log.has_value() && A_log->defined();
  const bool has_bias = dt_bias.has_value() && dt_bias->defined();
  TORCH_CHECK(has_a_log || !has_bias, "dt_bias: only with A_log (use_gate_in_kernel)");
  if (has_a_log) {
    check(*A_log, "A_log", at::kFloat, p.HV);
    p.gating.A_log = A_log->data_ptr<float>();
  }
  if (has_bias) {
    check(*dt_bias, "dt_bias", at::kFloat, p.HV);
    p.gating.dt_bias = dt_bias->data_ptr<float>();
  }
  p.gating.beta_sigmoid = beta_sigmoid;
  p.gating.beta_scale = static_cast<float>(beta_scale);
}

int64_t total_chunks(const gdr::Problem& p) {
  int64_t total = 0;
  for (int64_t n = 0; n < p.num_seqs(); ++n) total += p.num_chunks(n);
  return total;
}

void check_inputs(const gdr::Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                  const Tensor& beta) {
  const int64_t tokens = q.size(0) * q.size(1);
  check(q, "q", q.scalar_type(), tokens * p.H * p.K);
  check(k, "k", q.scalar_type(), tokens * p.H * p.K);
  check(v, "v", q.scalar_type(), tokens * p.HV * p.V);
  check(g, "g", at::kFloat, tokens * p.HV);
  check(beta, "beta", at::kFloat, tokens * p.HV);
}

const float* optional_state(const optional<Tensor>& t, const gdr::Problem& p, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check(*t, name, at::kFloat, p.num_seqs() * p.HV * p.K * p.V);
  return t->data_ptr<float>();
}

// -> [o (or an empty tensor without `with_output`), final_state, chunk_states (or empty)]
std::vector<Tensor> chunk_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              double scale, const optional<Tensor>& initial_state, bool l2norm,
                              const optional<Tensor>& cu_seqlens, int64_t chunk, bool save_states, bool with_output,
                              int64_t stages, const optional<Tensor>& A_log, const optional<Tensor>& dt_bias,
                              bool beta_sigmoid, double beta_scale) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, chunk, scale, l2norm, stages);
  check_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  const float* initial = optional_state(initial_state, p, "initial_state");
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor o = with_output ? advise_huge(at::empty(v.sizes(), v.options())) : at::empty({0}, v.options());
  Tensor final_state = at::empty({p.num_seqs(), p.HV, p.K, p.V}, f32);
  Tensor states = save_states ? advise_huge(at::empty({total_chunks(p), p.HV, p.K, p.V}, f32)) : at::empty({0}, f32);
  {
    pybind11::gil_scoped_release no_gil;
    gdr::chunk_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(), beta.data_ptr<float>(), initial,
                   with_output ? o.data_ptr() : nullptr, final_state.data_ptr<float>(),
                   save_states ? states.data_ptr<float>() : nullptr);
  }
  return {o, final_state, states};
}

// -> [dq, dk, dv, dg (float32), dbeta (float32), d_initial_state (or empty), dA_log, ddt_bias
// (float32 [HV], or empty without A_log / dt_bias)]; with the gating, dg and dbeta are the
// gradients of the raw gate and of the beta logits.
std::vector<Tensor> chunk_bwd(const Tensor& grad_o, const optional<Tensor>& grad_final_state, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, double scale,
                              bool want_d_initial, bool l2norm, const optional<Tensor>& cu_seqlens, int64_t chunk,
                              const Tensor& chunk_states, int64_t stages, const optional<Tensor>& A_log,
                              const optional<Tensor>& dt_bias, bool beta_sigmoid, double beta_scale) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, chunk, scale, l2norm, stages);
  check_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  check(grad_o, "grad_o", q.scalar_type(), v.numel());
  check(chunk_states, "chunk_states", at::kFloat, total_chunks(p) * p.HV * p.K * p.V);
  const float* grad_final = optional_state(grad_final_state, p, "grad_final_state");
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = advise_huge(at::empty(q.sizes(), q.options())), dk = advise_huge(at::empty(k.sizes(), k.options()));
  Tensor dv = advise_huge(at::empty(v.sizes(), v.options()));
  Tensor dg = at::empty(g.sizes(), f32), dbeta = at::empty(beta.sizes(), f32);
  Tensor d_initial = want_d_initial ? at::empty({p.num_seqs(), p.HV, p.K, p.V}, f32) : at::empty({0}, f32);
  Tensor d_a_log = at::empty({p.gating.A_log ? p.HV : 0}, f32);
  Tensor d_dt_bias = at::empty({p.gating.dt_bias ? p.HV : 0}, f32);
  {
    pybind11::gil_scoped_release no_gil;
    gdr::chunk_bwd(p, grad_o.data_ptr(), grad_final, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(),
                   beta.data_ptr<float>(), chunk_states.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(),
                   dv.data_ptr(), dg.data_ptr<float>(), dbeta.data_ptr<float>(),
                   want_d_initial ? d_initial.data_ptr<float>() : nullptr,
                   p.gating.A_log ? d_a_log.data_ptr<float>() : nullptr,
                   p.gating.dt_bias ? d_dt_bias.data_ptr<float>() : nullptr);
  }
  return {dq, dk, dv, dg, dbeta, d_initial, d_a_log, d_dt_bias};
}

// -> [o, final_state]; with `out_state` given, the final state is written there (it may be
// the initial state itself: an in-place step).
std::vector<Tensor> recurrent_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, double scale, const optional<Tensor>& initial_state, bool l2norm,
                                  const optional<Tensor>& cu_seqlens, const optional<Tensor>& out_state,
                                  const optional<Tensor>& A_log, const optional<Tensor>& dt_bias, bool beta_sigmoid,
                                  double beta_scale) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, 64, scale, l2norm);
  check_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  const float* initial = optional_state(initial_state, p, "initial_state");
  Tensor final_state;
  if (out_state.has_value() && out_state->defined()) {
    optional_state(out_state, p, "out_state");
    final_state = *out_state;
  } else {
    final_state = at::empty({p.num_seqs(), p.HV, p.K, p.V}, q.options().dtype(at::kFloat));
  }
  Tensor o = at::empty(v.sizes(), v.options());
  {
    pybind11::gil_scoped_release no_gil;
    gdr::recurrent_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(), beta.data_ptr<float>(),
                       initial, o.data_ptr(), final_state.data_ptr<float>());
  }
  return {o, final_state};
}

// The recurrence over a state pool, in place -> o. pool [slots, HV, K, V] ([slots, HV, V, K]
// with v_first) float32/bfloat16/float16 with contiguous rows; indices int64 [N, width];
// read_pos int64 [N] (the column each sequence starts from) or None (column 0). The Python
// wrapper (torch_gdr/ops/cpu/pool.py) checks the rules of a pool call (no row written twice,
// ...); this checks what would make the kernel read or write out of bounds.
Tensor pool_recurrent_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          double scale, const Tensor& pool, const Tensor& indices, const optional<Tensor>& read_pos,
                          bool l2norm, const optional<Tensor>& cu_seqlens, bool v_first,
                          const optional<Tensor>& A_log, const optional<Tensor>& dt_bias, bool beta_sigmoid,
                          double beta_scale) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, 64, scale, l2norm);
  check_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 4, "pool: expected a 4-D CPU tensor");
  const int64_t inner1 = v_first ? p.V : p.K, inner2 = v_first ? p.K : p.V;
  TORCH_CHECK(pool.size(1) == p.HV && pool.size(2) == inner1 && pool.size(3) == inner2,
              "pool: expected [slots, HV, ", v_first ? "V, K" : "K, V", "] = [slots, ", p.HV, ", ", inner1, ", ",
              inner2, "], got ", pool.sizes());
  TORCH_CHECK(pool.stride(3) == 1 && pool.stride(2) == inner2 && pool.stride(1) == inner1 * inner2 &&
                  pool.stride(0) >= p.HV * p.K * p.V,
              "pool: expected contiguous rows, got strides ", pool.strides());
  const int64_t slots = pool.size(0), num = p.num_seqs();
  TORCH_CHECK(indices.device().is_cpu() && indices.is_contiguous() && indices.scalar_type() == at::kLong &&
                  indices.dim() == 2 && indices.size(0) == num && indices.size(1) >= 1,
              "indices: expected a contiguous int64 CPU tensor [N, width] with N = ", num);
  const int64_t width = indices.size(1);
  const int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.numel(); ++i)
    TORCH_CHECK(idx[i] >= -1 && idx[i] < slots, "indices: row ", idx[i], " outside [-1, ", slots, ")");
  for (int64_t n = 0; n < num; ++n)
    TORCH_CHECK(p.len[n] <= width, "indices: sequence ", n, " has ", p.len[n], " tokens, more than width ", width);
  const int64_t* pos = nullptr;
  if (read_pos.has_value() && read_pos->defined()) {
    check(*read_pos, "read_pos", at::kLong, num);
    pos = read_pos->data_ptr<int64_t>();
    for (int64_t n = 0; n < num; ++n)
      TORCH_CHECK(pos[n] >= 0 && pos[n] < width, "read_pos: ", pos[n], " outside [0, ", width, ")");
  }
  gdr::PoolArgs args;
  args.pool = pool.data_ptr();
  args.dtype = dtype_of(pool);
  args.row_stride = pool.stride(0);
  args.v_first = v_first;
  args.indices = idx;
  args.width = width;
  args.read_pos = pos;
  Tensor o = at::empty(v.sizes(), v.options());
  {
    pybind11::gil_scoped_release no_gil;
    gdr::pool_recurrent_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(),
                            beta.data_ptr<float>(), args, o.data_ptr());
  }
  return o;
}

// One pair-dot step per lane (tests; gdr::pair_dot_lanes): acc float32 [n], a and b int32 [n]
// (words of two bfloat16 values), n a multiple of 16 -> float32 [n], or an empty tensor where
// this build has not the unit asked for (`hardware`: the machine's, else the AVX2 emulation).
Tensor pair_dot_lanes(const Tensor& acc, const Tensor& a, const Tensor& b, bool hardware) {
  const int64_t n = acc.numel();
  check(acc, "acc", at::kFloat, n);
  check(a, "a", at::kInt, n);
  check(b, "b", at::kInt, n);
  TORCH_CHECK(n % 16 == 0, "acc: expected a multiple of 16 elements, got ", n);
  Tensor out = at::empty_like(acc);
  const bool ran = gdr::pair_dot_lanes(acc.data_ptr<float>(), reinterpret_cast<const uint32_t*>(a.data_ptr<int32_t>()),
                                       reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>()),
                                       out.data_ptr<float>(), n, hardware);
  return ran ? out : at::empty({0}, acc.options());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_gdr fused CPU kernels of the chunked gated delta rule";
  m.def("chunk_fwd", &chunk_fwd);
  m.def("half_unit", [] { return std::string(gdr::half_unit()); });
  m.def("pair_dot_lanes", &pair_dot_lanes);
  m.def("chunk_bwd", &chunk_bwd);
  m.def("recurrent_fwd", &recurrent_fwd);
  m.def("pool_recurrent_fwd", &pool_recurrent_fwd);
}
