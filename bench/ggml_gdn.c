/* A small driver of ggml's CPU GATED_DELTA_NET op for bench/ggml_compare.py (issue 38).
 *
 * Built by the bench against a ggml built from its own sources outside this repository
 * (never into the package): one graph of one ggml_gated_delta_net node over caller-owned
 * buffers, planned once, so that a timed call is ggml_graph_compute alone.
 *
 * ggml's layouts (fastest dim first; the same memory as torch's row-major tensors):
 *   q, k   [S, H, T, B]   = torch [B, T, H, S]
 *   v      [S, HV, T, B]  = torch [B, T, HV, S]
 *   g, beta[1, HV, T, B]  = torch [B, T, HV]        (g the log decay, beta as used)
 *   state  [S, S, HV, B]  = torch [B, HV, V, K]     (value-first)
 *   out    [S * HV, T * B + S * B]: o (torch [B, T, HV, V]) then the final state (value-first)
 * Value head j reads q/k head j % H (the caller permutes its heads to match).
 *
 * With write_back, the graph also copies the final state over the initial state (a
 * ggml_cpy node after the op), as llama.cpp's graph writes a layer's new state into its
 * recurrent cache after the op.
 */
#include <stdlib.h>

#include "ggml-cpu.h"
#include "ggml.h"

struct gdn_handle {
  struct ggml_context* ctx;
  struct ggml_cgraph* graph;
  struct ggml_cplan plan;
  void* work;
  struct ggml_tensor* op;        /* the GATED_DELTA_NET node */
  struct ggml_tensor* state_dst; /* the write-back's destination (NULL without write_back) */
  struct ggml_tensor* copy;      /* the write-back node (a view of state_dst) */
};

/* The output's size in floats for the given shape. */
long gdn_out_floats(int S, int HV, int T, int B) { return (long)S * HV * ((long)T * B + (long)S * B); }

struct gdn_handle* gdn_create(int S, int H, int HV, int T, int B, int threads, float* q, float* k, float* v,
                              float* g, float* beta, float* state, float* out, int write_back) {
  struct ggml_init_params params = {.mem_size = 1 << 20, .mem_buffer = NULL, .no_alloc = true};
  struct gdn_handle* h = calloc(1, sizeof(*h));
  h->ctx = ggml_init(params);
  struct ggml_tensor* tq = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, S, H, T, B);
  struct ggml_tensor* tk = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, S, H, T, B);
  struct ggml_tensor* tv = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, S, HV, T, B);
  struct ggml_tensor* tg = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, 1, HV, T, B);
  struct ggml_tensor* tb = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, 1, HV, T, B);
  struct ggml_tensor* ts = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, S, S, HV, B);
  tq->data = q, tk->data = k, tv->data = v, tg->data = g, tb->data = beta, ts->data = state;
  struct ggml_tensor* o = ggml_gated_delta_net(h->ctx, tq, tk, tv, tg, tb, ts, 1);
  o->data = out;
  h->op = o;
  h->graph = ggml_new_graph(h->ctx);
  ggml_build_forward_expand(h->graph, o);
  if (write_back) {
    /* the final state: after the T * B rows of o in the output (views take their data now) */
    struct ggml_tensor* final_state =
        ggml_view_4d(h->ctx, o, S, S, HV, B, o->nb[0] * S, o->nb[0] * S * S, o->nb[0] * S * S * HV, o->nb[1] * (size_t)T * B);
    h->state_dst = ggml_new_tensor_4d(h->ctx, GGML_TYPE_F32, S, S, HV, B);
    h->state_dst->data = state;
    h->copy = ggml_cpy(h->ctx, final_state, h->state_dst);
    ggml_build_forward_expand(h->graph, h->copy);
  }
  h->plan = ggml_graph_plan(h->graph, threads, NULL);
  h->work = h->plan.work_size ? malloc(h->plan.work_size) : NULL;
  h->plan.work_data = h->work;
  return h;
}

/* Point the op at another initial state (same shape): the graph and plan do not change. */
void gdn_set_state(struct gdn_handle* h, float* state) {
  h->op->src[5]->data = state;
  if (h->state_dst) h->state_dst->data = state, h->copy->data = state;
}

int gdn_compute(struct gdn_handle* h) { return (int)ggml_graph_compute(h->graph, &h->plan); }

void gdn_destroy(struct gdn_handle* h) {
  free(h->work);
  ggml_free(h->ctx);
  free(h);
}
