// Fused CPU kernels of the chunked gated delta rule: shared declarations.
//
// Every tensor reaches the kernels as a raw pointer to contiguous memory, token-major:
//   q, k      [Ttot, H, K]      (scalar_t: float, c10::Half or c10::BFloat16)
//   v, o, do  [Ttot, HV, V]     (scalar_t)
//   g, beta   [Ttot, HV]        (float32)
//   states    [N, HV, K, V]     (float32, key-first)
// where Ttot = B * T and sequence n covers tokens [bos[n], bos[n] + len[n]).
// The chunk states (state entering every chunk) are [total_chunks, HV, K, V] float32, the
// chunks of sequence n at rows [chunk_off[n], chunk_off[n] + ceil(len[n] / C)).
#pragma once

#include <cstdint>
#include <vector>

namespace gdr {

enum class DType { Float, Half, BFloat16 };

// How the stages of the chunked kernels run (see fuse_stages in common.h); tests force each.
enum class Stages { Auto = 0, Fused = 1, Segmented = 2 };

// fla's activations of the gate and of beta, applied where the kernels read g and beta
// (torch_gdr/_gating.py has the definition): with `A_log` set, g holds the raw gate a and the
// log decay is -exp(A_log[h]) * softplus(a + dt_bias[h]) (softplus(x) = x above 20, as
// torch's); with `beta_sigmoid`, beta holds logits and the kernels use
// beta_scale * sigmoid(beta) (beta_scale 2 with allow_neg_eigval, else 1).
struct Gating {
  const float* A_log = nullptr;    // [HV] float32, or null: g is the log decay itself
  const float* dt_bias = nullptr;  // [HV] float32, or null (no bias)
  bool beta_sigmoid = false;
  float beta_scale = 1.0f;
};

// Element strides of the token and head dims of q, k ([Ttot, H, K]), v ([Ttot, HV, V]), g and
// beta ([Ttot, HV]); the last dim of q, k and v is contiguous. The forward kernels (chunked,
// step, pool step) read views (q, k, v carved out of one packed projection); the backward,
// contiguous tensors.
struct InputStrides {
  int64_t q_tok = 0, q_head = 0, k_tok = 0, k_head = 0, v_tok = 0, v_head = 0;
  int64_t g_tok = 0, g_head = 1, b_tok = 0, b_head = 1;
};

// How the chunked forward multiplies bfloat16 operands (pairdot.h): Auto uses the machine's
// pair-dot unit where this variant has one (avx512bf16), else converts the tiles to float32;
// Float32 always converts; Emulated runs the unit's arithmetic on AVX2 (tests only).
enum class HalfProducts { Auto = 0, Float32 = 1, Emulated = 2 };

// The shape of one call and its sequences.
struct Problem {
  DType dtype = DType::Float;
  int64_t H = 0, HV = 0, K = 0, V = 0, C = 64;
  float scale = 1.0f;
  bool l2norm = false;
  int threads = 1;
  Stages stages = Stages::Auto;
  HalfProducts half_products = HalfProducts::Auto;
  std::vector<int64_t> bos, len;  // per sequence
  Gating gating;
  InputStrides strides;  // contiguous unless the caller sets them
  int64_t num_seqs() const { return static_cast<int64_t>(len.size()); }
  int64_t group() const { return HV / H; }
  int64_t num_chunks(int64_t n) const { return (len[n] + C - 1) / C; }
};

// Forward. `o` may be null (states only). `initial` may be null (zeros). `final_state` is
// written (float32 [N, HV, K, V]). `chunk_states` may be null; else [total_chunks, HV, K, V].
// Returns whether any token had a non-finite k, v or beta (the value head's, activated) or a
// g that is NaN or +inf (activated): where none had, the outputs are the recurrence's
// wherever it is finite, with nothing for the caller's containment to do.
bool chunk_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g, const float* beta,
               const float* initial, void* o, float* final_state, float* chunk_states);

// The pair-dot unit the bfloat16 chunked forward uses with HalfProducts::Auto where the
// shapes allow it ("avx512bf16"), or "" where this build has none.
const char* half_unit();

// One pair-dot step per lane, for the tests: out[i] = acc[i] + (a_i.hi * b_i.hi + a_i.lo *
// b_i.lo) as the unit computes it (pairdot.h), a_i and b_i 32-bit words of two bfloat16
// values, n a multiple of 16. `hardware`: the machine's unit, else its AVX2 emulation.
// False (out untouched) where this build has not the one asked for.
bool pair_dot_lanes(const float* acc, const uint32_t* a, const uint32_t* b, float* out, int64_t n, bool hardware);

// Backward from the chunk states the forward saved (required: the caller recomputes them
// with chunk_fwd when it has none). `grad_final` / `d_initial` may be null.
// dq, dk, dv in scalar_t; dg, dbeta float32. With p.gating, dg and dbeta are the gradients
// of the raw gate and of the beta logits, and d_A_log / d_dt_bias ([HV] float32, each
// non-null where its parameter is given) receive the parameters' gradients, summed over
// every token.
void chunk_bwd(const Problem& p, const void* grad_o, const float* grad_final, const void* q, const void* k,
               const void* v, const float* g, const float* beta, const float* chunk_states, void* dq, void* dk,
               void* dv, float* dg, float* dbeta, float* d_initial, float* d_A_log = nullptr,
               float* d_dt_bias = nullptr);

// The per-token recurrence (decode, short T): reads `initial` (null: zeros) and writes
// `final_state`; the two may alias (in place).
void recurrent_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g,
                   const float* beta, const float* initial, void* o, float* final_state);

// The element type of a state pool or of an intermediate-states buffer.
enum class StateType { Float, Half, BFloat16, Fp8E4M3, Fp8E5M2 };

// A state tensor of any strides, seen key-first: state (row, slot, head) element (i, j)
// ([K, V] per head) at data + row * s_row + slot * s_slot + head * s_head + i * s_k + j * s_v.
// A value-first pool passes its last two strides swapped; a pool has one slot.
struct StateView {
  void* data = nullptr;
  StateType type = StateType::Float;
  int64_t s_row = 0, s_slot = 0, s_head = 0, s_k = 0, s_v = 1;
};

// The pool step's rows (see torch_gdr/_pool.py for the rules, checked by the caller: rows in
// [-1, slots), no row written twice, none written by one sequence and read by another).
// Sequence n starts from pool row start_rows[n] (-1: zeros). Token j of it starts from the
// state after its token parents[n * width + j] (-1: the start state), or after token j - 1
// without parents; its state goes to pool row indices[n * width + j] (-1: none; nowhere
// without write_pool) and, with a buffer, to buffer (row buffer_rows[n], slot j).
struct PoolArgs {
  StateView pool;
  const int64_t* indices = nullptr;      // [N, width]
  int64_t width = 1;
  const int64_t* start_rows = nullptr;   // [N]
  const int64_t* parents = nullptr;      // [N, width] or null
  bool write_pool = true;
  StateView buffer;                      // data null: no buffer
  const int64_t* buffer_rows = nullptr;  // [N]
};

// The per-token recurrence over a pool, in place (float32 compute, rounded on store).
void pool_recurrent_fwd(const Problem& p, const void* q, const void* k, const void* v, const float* g,
                        const float* beta, const PoolArgs& pool, void* o);

}  // namespace gdr
