// Python bindings: tensors in, raw pointers to the kernels. The Python wrapper
// (torch_gdr/ops/cpu/kernels.py) validates arguments and passes contiguous tensors in the
// dtypes stated below; these functions only check what would make a kernel read out of
// bounds.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

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
  p.strides = {p.H * p.K, p.K, p.H * p.K, p.K, p.HV * p.V, p.V, p.HV, 1, p.HV, 1};  // contiguous
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

// The token and head strides of q/k/v [B, T, heads, dim] (dim contiguous) or g/beta
// [B, T, heads], where the B * T tokens are one strided dim.
void token_strides(const Tensor& t, const char* name, int64_t& tok, int64_t& head) {
  const int64_t B = t.size(0), T = t.size(1);
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  if (t.dim() == 4) TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, name, ": expected a contiguous last dim");
  TORCH_CHECK(B == 1 || T == 1 || t.stride(0) == T * t.stride(1), name,
              ": expected the batch and time dims to flatten into one token dim, got strides ", t.strides());
  tok = T == 1 ? t.stride(0) : t.stride(1);
  head = t.stride(2);
}

// q, k, v of q's dtype and g, beta float32 in the problem's shapes, read through their strides
// (views of a packed projection; token_strides' rules), which go to p.strides.
void check_token_inputs(gdr::Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                        const Tensor& beta) {
  TORCH_CHECK(k.sizes() == q.sizes() && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "k, v: expected k in q's shape and q, k, v of one dtype");
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), "v: expected q's batch and time dims");
  TORCH_CHECK(g.dim() == 3 && beta.dim() == 3 && g.sizes() == beta.sizes() && g.size(0) == q.size(0) &&
                  g.size(1) == q.size(1) && g.size(2) == p.HV && g.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat,
              "g, beta: expected float32 [B, T, HV]");
  gdr::InputStrides& st = p.strides;
  token_strides(q, "q", st.q_tok, st.q_head);
  token_strides(k, "k", st.k_tok, st.k_head);
  token_strides(v, "v", st.v_tok, st.v_head);
  token_strides(g, "g", st.g_tok, st.g_head);
  token_strides(beta, "beta", st.b_tok, st.b_head);
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

// -> (o (or an empty tensor without `with_output`), final_state, chunk_states (or empty),
// whether some input was not finite (gdr::chunk_fwd))
std::tuple<Tensor, Tensor, Tensor, bool> chunk_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                                   const Tensor& beta, double scale,
                                                   const optional<Tensor>& initial_state, bool l2norm,
                                                   const optional<Tensor>& cu_seqlens, int64_t chunk, bool save_states,
                                                   bool with_output, int64_t stages, const optional<Tensor>& A_log,
                                                   const optional<Tensor>& dt_bias, bool beta_sigmoid,
                                                   double beta_scale) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, chunk, scale, l2norm, stages);
  check_token_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  const float* initial = optional_state(initial_state, p, "initial_state");
  const auto f32 = q.options().dtype(at::kFloat);
  const auto out = v.options().memory_format(at::MemoryFormat::Contiguous);
  Tensor o = with_output ? advise_huge(at::empty(v.sizes(), out)) : at::empty({0}, out);
  Tensor final_state = at::empty({p.num_seqs(), p.HV, p.K, p.V}, f32);
  Tensor states = save_states ? advise_huge(at::empty({total_chunks(p), p.HV, p.K, p.V}, f32)) : at::empty({0}, f32);
  bool nonfinite = false;
  {
    pybind11::gil_scoped_release no_gil;
    nonfinite = gdr::chunk_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(),
                               beta.data_ptr<float>(), initial, with_output ? o.data_ptr() : nullptr,
                               final_state.data_ptr<float>(), save_states ? states.data_ptr<float>() : nullptr);
  }
  return {o, final_state, states, nonfinite};
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
  check_token_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  const float* initial = optional_state(initial_state, p, "initial_state");
  Tensor final_state;
  if (out_state.has_value() && out_state->defined()) {
    optional_state(out_state, p, "out_state");
    final_state = *out_state;
  } else {
    final_state = at::empty({p.num_seqs(), p.HV, p.K, p.V}, q.options().dtype(at::kFloat));
  }
  Tensor o = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  {
    pybind11::gil_scoped_release no_gil;
    gdr::recurrent_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(), beta.data_ptr<float>(),
                       initial, o.data_ptr(), final_state.data_ptr<float>());
  }
  return {o, final_state};
}

// A state pool's or buffer's element type.
gdr::StateType state_type_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return gdr::StateType::Float;
    case at::kHalf: return gdr::StateType::Half;
    case at::kBFloat16: return gdr::StateType::BFloat16;
    case at::kFloat8_e4m3fn: return gdr::StateType::Fp8E4M3;
    case at::kFloat8_e5m2: return gdr::StateType::Fp8E5M2;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t.scalar_type());
  }
}

// A [rows, (slots,) HV, K, V] state tensor ([.., V, K] with v_first) as a key-first view.
gdr::StateView state_view(const Tensor& t, const char* name, const gdr::Problem& p, bool v_first, bool slotted) {
  const int64_t lead = slotted ? 2 : 1;
  TORCH_CHECK(t.device().is_cpu() && t.dim() == lead + 3, name, ": expected a ", lead + 3, "-D CPU tensor");
  const int64_t inner1 = v_first ? p.V : p.K, inner2 = v_first ? p.K : p.V;
  TORCH_CHECK(t.size(lead) == p.HV && t.size(lead + 1) == inner1 && t.size(lead + 2) == inner2, name,
              ": expected inner dims [HV, ", v_first ? "V, K" : "K, V", "] = [", p.HV, ", ", inner1, ", ", inner2,
              "], got ", t.sizes());
  gdr::StateView s;
  s.data = t.data_ptr();
  s.type = state_type_of(t, name);
  s.s_row = t.stride(0);
  s.s_slot = slotted ? t.stride(1) : 0;
  s.s_head = t.stride(lead);
  s.s_k = t.stride(v_first ? lead + 2 : lead + 1);
  s.s_v = t.stride(v_first ? lead + 1 : lead + 2);
  return s;
}

// Row indices as the kernels read them: an int32 tensor (as serving engines pass them)
// widened to int64 here, in C++, where it costs less than a Python call; int64 as it is.
Tensor as_rows(const Tensor& t) { return t.scalar_type() == at::kInt ? t.to(at::kLong).contiguous() : t; }

// An int64 CPU tensor of `numel` elements with every value in [lo, hi).
const int64_t* checked_rows(const Tensor& t, const char* name, int64_t numel, int64_t lo, int64_t hi) {
  check(t, name, at::kLong, numel);
  const int64_t* x = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < numel; ++i)
    TORCH_CHECK(x[i] >= lo && x[i] < hi, name, ": ", x[i], " outside [", lo, ", ", hi, ")");
  return x;
}

// Runs gdr::pool_recurrent_fwd without the GIL -> o [B, T, HV, V] in v's dtype.
Tensor run_pool_step(const gdr::Problem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const gdr::PoolArgs& args) {
  Tensor o = at::empty({q.size(0), q.size(1), p.HV, p.V}, v.options().memory_format(at::MemoryFormat::Contiguous));
  {
    pybind11::gil_scoped_release no_gil;
    gdr::pool_recurrent_fwd(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr<float>(),
                            beta.data_ptr<float>(), args, o.data_ptr());
  }
  return o;
}

// The recurrence over a state pool, in place -> o (gdr_cpu.h: PoolArgs). q, k, v [B, T, *, *]
// of one dtype and g, beta float32 [B, T, HV], any strides where B * T flatten into one dim
// and the last dim of q, k, v is contiguous. pool [slots, HV, K, V] ([slots, HV, V, K] with
// v_first) float32/bfloat16/float16/fp8, any strides; indices int64 or int32 [N, width] ([N]:
// width 1); start_rows int64 or int32 [N]; parents int64 [N, width] or None; buffer [R, S, HV, K, V] (pool layout)
// float32/bfloat16/float16 with buffer_rows int64 [N], or None. The Python wrapper
// (torch_gdr/ops/cpu/pool.py) checks the rules of a pool call (no row written twice, parents
// before children, ...); this checks what would make the kernel read or write out of bounds.
Tensor pool_recurrent_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          double scale, const Tensor& pool, const Tensor& index_table, const Tensor& start_table,
                          bool l2norm, const optional<Tensor>& cu_seqlens, bool v_first,
                          const optional<Tensor>& A_log, const optional<Tensor>& dt_bias, bool beta_sigmoid,
                          double beta_scale, const optional<Tensor>& parents, bool write_pool,
                          const optional<Tensor>& buffer, const optional<Tensor>& buffer_rows) {
  gdr::Problem p = make_problem(q, v, cu_seqlens, 64, scale, l2norm);
  check_token_inputs(p, q, k, v, g, beta);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  const int64_t num = p.num_seqs();
  const Tensor indices = as_rows(index_table), start_rows = as_rows(start_table);
  TORCH_CHECK((indices.dim() == 2 || indices.dim() == 1) && indices.size(0) == num &&
                  (indices.dim() == 1 || indices.size(1) >= 1),
              "indices: expected [N, width] or [N] with N = ", num);
  const int64_t width = indices.dim() == 2 ? indices.size(1) : 1;
  for (int64_t n = 0; n < num; ++n)
    TORCH_CHECK(p.len[n] <= width, "indices: sequence ", n, " has ", p.len[n], " tokens, more than width ", width);
  gdr::PoolArgs args;
  args.pool = state_view(pool, "pool", p, v_first, false);
  const int64_t slots = pool.size(0);
  args.indices = checked_rows(indices, "indices", num * width, -1, slots);
  args.width = width;
  args.start_rows = checked_rows(start_rows, "start_rows", num, -1, slots);
  if (parents.has_value() && parents->defined()) {
    TORCH_CHECK(parents->dim() == 2 && parents->size(1) == width, "parents: expected [N, width]");
    const int64_t* par = checked_rows(*parents, "parents", num * width, -1, width);
    for (int64_t n = 0; n < num; ++n)
      for (int64_t j = 0; j < p.len[n]; ++j)
        TORCH_CHECK(par[n * width + j] < j, "parents: token ", j, " of sequence ", n, " has parent ",
                    par[n * width + j], ", not before it");
    args.parents = par;
  }
  args.write_pool = write_pool;
  if (buffer.has_value() && buffer->defined()) {
    args.buffer = state_view(*buffer, "buffer", p, v_first, true);
    TORCH_CHECK(args.buffer.type == gdr::StateType::Float || args.buffer.type == gdr::StateType::Half ||
                    args.buffer.type == gdr::StateType::BFloat16,
                "buffer: expected float32, float16 or bfloat16");
    TORCH_CHECK(buffer->size(1) >= width, "buffer: expected at least ", width, " slots a row, got ", buffer->size(1));
    TORCH_CHECK(buffer_rows.has_value() && buffer_rows->defined(), "buffer_rows: required with a buffer");
    args.buffer_rows = checked_rows(*buffer_rows, "buffer_rows", num, 0, buffer->size(0));
  }
  return run_pool_step(p, q, k, v, g, beta, args);
}

// A plain decode step over [N] rows (one token a sequence, written to its row, read from it)
// whose call's metadata passed the pool rules before (torch_gdr/ops/cpu/pool.py's memo): the
// value rules checked here, then the kernel -> o, or None where a value might break a rule (a
// row outside [-1, slots), a row written twice, offsets other than one token a sequence), and
// nothing is run (the caller then runs every check, for the error). rows: int32 or int64 [N],
// any stride; q, k, v [N, 1, *, *], or [1, N, *, *] with cu_seqlens int32 or int64 [N + 1]
// (vLLM's decode call: then 0, 1, ..., N), q and k cast to v's dtype and g, beta to float32
// where they differ (a bfloat16 beta, as vLLM's gating gives it); the rest as
// pool_recurrent_fwd. One call from Python: no int64 copy of the rows, no list of them.
template <typename I>
void read_index(const Tensor& t, std::vector<int64_t>& out) {
  const I* x = t.data_ptr<I>();
  const int64_t step = t.stride(0);
  for (size_t n = 0; n < out.size(); ++n) out[n] = x[static_cast<int64_t>(n) * step];
}

bool read_index_values(const Tensor& t, std::vector<int64_t>& out) {
  if (!t.device().is_cpu() || t.dim() != 1 || t.size(0) != static_cast<int64_t>(out.size())) return false;
  if (t.scalar_type() == at::kInt) {
    read_index<int32_t>(t, out);
  } else if (t.scalar_type() == at::kLong) {
    read_index<int64_t>(t, out);
  } else {
    return false;
  }
  return true;
}

// t as a one-token-a-sequence step reads it (kernels.py's _token_view): itself where it has
// `dtype` and a contiguous last dim, else a contiguous copy in `dtype`.
Tensor token_input(const Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && (t.dim() == 3 || t.stride(-1) == 1 || t.size(-1) == 1)) return t;
  return t.to(dtype).contiguous();
}

py::object pool_step_rows(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          double scale, const Tensor& pool, const Tensor& rows, const optional<Tensor>& cu_seqlens,
                          bool l2norm, bool v_first, const optional<Tensor>& A_log, const optional<Tensor>& dt_bias,
                          bool beta_sigmoid, double beta_scale) {
  TORCH_CHECK(q.dim() == 4, "q: expected [B, T, H, K], got ", q.sizes());
  const bool varlen = cu_seqlens.has_value() && cu_seqlens->defined();
  TORCH_CHECK(varlen ? q.size(0) == 1 : q.size(1) == 1, "q: expected ", varlen ? "[1, N, H, K]" : "[N, 1, H, K]",
              " for one token a sequence, got ", q.sizes());
  const int64_t num = varlen ? q.size(1) : q.size(0), slots = pool.size(0);
  std::vector<int64_t> values(static_cast<size_t>(num));
  if (!read_index_values(rows, values)) return py::none();
  if (varlen) {  // one token a sequence: 0, 1, ..., N
    std::vector<int64_t> offsets(static_cast<size_t>(num + 1));
    if (!read_index_values(*cu_seqlens, offsets)) return py::none();
    for (int64_t n = 0; n <= num; ++n)
      if (offsets[n] != n) return py::none();
  }
  std::vector<int64_t> written;
  written.reserve(values.size());
  for (const int64_t row : values) {
    if (row < -1 || row >= slots) return py::none();
    if (row >= 0) written.push_back(row);
  }
  std::sort(written.begin(), written.end());
  if (std::adjacent_find(written.begin(), written.end()) != written.end()) return py::none();
  // q, k in v's dtype, g and beta float32, as the checked call's step had them
  const Tensor qd = token_input(q, v.scalar_type()), kd = token_input(k, v.scalar_type()),
               vd = token_input(v, v.scalar_type()), g32 = token_input(g, at::kFloat),
               beta32 = token_input(beta, at::kFloat);
  gdr::Problem p = make_problem(qd, vd, {}, 64, scale, l2norm);
  if (varlen) {  // the N tokens of the one batch row are N sequences
    p.bos.resize(num), p.len.assign(num, 1);
    for (int64_t n = 0; n < num; ++n) p.bos[n] = n;
  }
  check_token_inputs(p, qd, kd, vd, g32, beta32);
  set_gating(p, A_log, dt_bias, beta_sigmoid, beta_scale);
  gdr::PoolArgs args;
  args.pool = state_view(pool, "pool", p, v_first, false);
  args.indices = values.data();
  args.width = 1;
  args.start_rows = values.data();
  args.write_pool = true;
  return py::cast(run_pool_step(p, qd, kd, vd, g32, beta32, args));
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

// The key of a decode call's metadata (torch_gdr/_decode_memo.py's `signature`), as bytes:
// per argument a tag and its fields, for a plain strided torch.Tensor (type, sizes, strides,
// dtype, device, requires_grad), None, or an exact bool / int / float / str; grad mode last.
// None for any other argument (a tensor subclass, another layout, an int beyond int64): the
// caller then takes the Python key. The fields are written with their lengths, so two
// different argument lists never give one key. A few C++ reads instead of Python objects
// per tensor: after the step has swept the caches the Python key took ~15 us at B = 1.
py::object decode_signature(const py::args& args) {
  std::string key;
  key.reserve(64 * args.size());
  auto put = [&key](const void* p, size_t n) { key.append(static_cast<const char*>(p), n); };
  auto put_i64 = [&put](int64_t v) { put(&v, sizeof v); };
  for (const py::handle& arg : args) {
    PyObject* obj = arg.ptr();
    if (obj == Py_None) {
      key.push_back('N');
    } else if (PyBool_Check(obj)) {
      key.push_back(obj == Py_True ? 'B' : 'b');
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return py::none();
      }
      key.push_back('I');
      put_i64(v);
    } else if (PyFloat_CheckExact(obj)) {
      const double v = PyFloat_AS_DOUBLE(obj);
      key.push_back('F');
      put(&v, sizeof v);
    } else if (PyUnicode_CheckExact(obj)) {
      Py_ssize_t n = 0;
      const char* text = PyUnicode_AsUTF8AndSize(obj, &n);
      if (!text) {
        PyErr_Clear();
        return py::none();
      }
      key.push_back('S');
      put_i64(n);
      put(text, static_cast<size_t>(n));
    } else if (Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
      const Tensor& t = THPVariable_Unpack(obj);
      if (t.layout() != at::kStrided) return py::none();
      key.push_back('T');
      put_i64(t.dim());
      for (const int64_t size : t.sizes()) put_i64(size);
      for (const int64_t stride : t.strides()) put_i64(stride);
      key.push_back(static_cast<char>(t.scalar_type()));
      key.push_back(static_cast<char>(t.device().type()));
      put_i64(t.device().index());
      key.push_back(t.requires_grad() ? 'G' : 'g');
    } else {
      return py::none();
    }
  }
  key.push_back(at::GradMode::is_enabled() ? 'G' : 'g');
  return py::bytes(key);
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
  m.def("pool_step_rows", &pool_step_rows);
  m.def("decode_signature", &decode_signature);
}
