"""The backward of the chunked gated delta rule as a PyPTO kernel (pypto 0.2.0, fp32, TND).

:func:`build_gdr_bwd_kernel` returns a ``pypto.frontend.jit`` kernel specialised on every
size the compiler needs concrete; the token count T and the number of chunks stay dynamic.
Kernel arguments, in order:

================  =======================  ================================================
name              shape                    meaning
================  =======================  ================================================
q, k              ``[T, H * K]`` fp32      queries, keys as the recurrence reads them
                                           (already l2-normalised when the call asks for it;
                                           the host applies the l2norm backward)
v                 ``[T, HV * V]`` fp32     values
g                 ``[T, HV]`` fp32         raw per-token log decay (fla's raw gate with
                                           ``gate_in_kernel``)
beta              ``[T, HV]`` fp32         delta-rule write strength (logits with
                                           ``beta_sigmoid_in_kernel``)
gate_params       ``[2, HV]`` fp32         only with ``gate_in_kernel``: A_log in row 0,
                                           dt_bias in row 1 (:mod:`.kernel_gating`)
grad_o            ``[T, HV * V]`` fp32     gradient on the output
act_seq_len       ``[N + 1]`` int32        cumulative sequence offsets, last one == T
chunk_offsets     ``[N + 1]`` int32        exclusive cumsum of ``ceil(len_n / l)``
chunk_masks       ``[M * l, l]`` fp32      constant masks, see :func:`bwd_chunk_masks`;
                                           each chunk views them itself (a copy shared by
                                           every chunk stalls the scheduler resolving it)
eye               ``[K, K]`` fp32          the identity
chunk_states      ``[C, HV, K, V]`` fp32   the state ENTERING every chunk, key-first;
                                           sequence n's chunk c at row chunk_offsets[n] + c
grad_state_in     ``[N, HV, K + V, V]``    ``[dS_final; I]``: the gradient on the final
                  fp32                     state (zeros when there is none) over the
                                           V x V identity
dq, dk            ``[T, HV * K]`` fp32     gradients w.r.t. q, k per VALUE head (the host
                                           sums each group of HV / H value heads)
dv                ``[T, HV * V]`` fp32
dg, dbeta         ``[T, HV]`` fp32         of g and beta as the kernel reads them (the
                                           raw gate's and the logits' where activated)
d_a_log           ``[T, HV]`` fp32         only with ``gate_in_kernel``: ``dL/dg * g``
                                           per token (g the log decay); the host sums
                                           it over tokens into dA_log, and dL/da into
                                           ddt_bias
grad_state_out    ``[N, HV, K, V]`` fp32   gradient w.r.t. the initial state
================  =======================  ================================================

The head-major tensors are passed flattened to 2-D (``[T, H, K]`` viewed as ``[T, H * K]``),
so a chunk's tile is a plain 2-D view: a 3-D view would need a reshape, a pure-copy task
per tensor and chunk.

The sequences are the outer loop; inside, the chunks are walked in reverse (loop index i,
chunk ``c = n_chunks - 1 - i``), and every loop body handles all value heads of its chunk
(unrolled at trace time; their tasks are independent and overlap), each carrying its
``dS``, the gradient w.r.t. the state leaving the chunk, from the final-state gradient
down to the initial state's. One body per chunk rather than per (chunk, head) keeps a
long call within one stitch (``DEFAULT_STITCH_FUNCTION_MAX_NUM`` bodies): bodies beyond
it go into a later submission, whose parallel work only starts when the first drains.

The value heads of a body have identical cube subgraphs; in a launch of enough (sequence,
value head) pairs they are merged into shared tasks (:func:`default_pass_options`), fewer
and larger tasks where the scheduler's cost per task bounds the launch.

Per chunk, with ``S`` the state entering it (read from ``chunk_states``) and the
forward's quantities recomputed (the notation of :mod:`torch_gdr.ops.torch.chunk_backward`,
where the whole derivation is)::

    gamma = tril @ g   Gamma = exp(gamma_r - gamma_s) (r >= s)   G = strict(K K^T * Gamma)
    T = (I + diag(beta) G)^-1   U = T (beta V)   W = T (beta exp(gamma) K)   V' = U - W S
    P = (Q K^T) * Gamma   Qg = exp(gamma) Q   Kd = exp(gamma_C - gamma) K

    dV' = P^T dO + Kd dS'                       dS = exp(gamma_C) dS' + Qg^T dO - W^T dV'
                                                   = (exp(gamma_C) I - W^T Kd) dS' + (Qg - P W)^T dO
    dVb = T^T dV'   -dKb = dVb S^T   dP = dO V'^T   -dA = strict(dVb V'^T)
    dQ = (dP * Gamma) K + exp(gamma) (dO S^T)
    dK = (dP * Gamma)^T Q + (dB + dB^T) K + beta exp(gamma) dKb + Kd-term   dB = beta dA * Gamma
    dV = beta dVb     dbeta = rowsum(dVb V) + rowsum(dA G) + exp(gamma) rowsum(dKb K)
    dg = reverse cumsum of dgamma (+ the chunk-last terms, which reach every row)

The carried chain is one matmul per chunk: with ``R = (Qg - P W)^T dO`` and the chain
matrix ``M = exp(gamma_C) I - W^T Kd`` (both off the chain), the kernel carries
``[dS; I]`` (``[K + V, V]``) and computes ``dS = [M | R] @ [dS'; I]``. Every other task of
a chunk depends on the chain only through ``dS'`` and overlaps with the neighbouring
chunks' work; the vector ops that read ``dS'`` share no producer with the chunk's
parallel part (pypto fuses a producer into its consumer's task, which would put the
parallel part behind the chain).

fla's activations (``gate_in_kernel``, ``beta_sigmoid_in_kernel``, ``allow_neg_eigval``)
are applied to each chunk's raw tiles before the above, and their derivatives multiply dg
and dbeta after it (elementwise, :mod:`.kernel_gating`): ``da = dg * (-exp(A_log)) *
sigmoid(a + dt_bias)``, ``db = dbeta * s * sigmoid(b) (1 - sigmoid(b))``. The per-head sums
over tokens (dA_log, ddt_bias) cross chunks and sequences, which the kernel's loops carry
nothing across, so the host reduces the kernel's per-token terms.

The tail chunk of a sequence (its first iteration here) is read with ``valid_shape`` and
zero-filled with ``fillpad``: zero q, k, v, beta, g and dO rows contribute nothing, and
only the valid rows are written back. Two nested loops only (three nested sequential
loops with a heavy body corrupt data in pypto 0.2.0). The gradient w.r.t. the initial
state is written after the chunk loop; for an empty sequence it is the final-state
gradient itself.
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

from typing import Any, NamedTuple

import torch

from . import kernel_gating
from ._env import import_pypto
from .kernel import (BASE_BLOCK, DEFAULT_STITCH_FUNCTION_MAX_NUM, MASK_BASE_BLOCKS, MASK_IDENTITY, MASK_LOWER,
                     MASK_STRICT_LOWER, chunk_decays)
from .spec import CHUNK_SIZES as SUPPORTED_CHUNK_SIZES
from .spec import HEAD_DIMS as SUPPORTED_HEAD_DIMS

#: Cube tile edge: 128 x 128 tiles (the largest an Ascend 910B cube takes in fp32 with
#: double buffering), so a chunk's l x l matmul is one task.
CUBE_TILE = 128

# Indices into the mask tensor: the forward's first four (BASE_BLOCK, the stitch limit and
# the masks are shared with it), then
# 4.. : for each merge level (block 16 -> 32 -> ... -> l), the lower-left quadrant of
#       every diagonal block of the merged size.


def num_merge_levels(chunk_size: int) -> int:
    """Pairwise merges from 16-blocks up to the chunk: 1 for l=32, 2 for 64, 3 for 128."""
    return (chunk_size // BASE_BLOCK).bit_length() - 1


def bwd_chunk_masks(chunk_size: int) -> torch.Tensor:
    """The constant masks the kernel reads, ``[(4 + merge levels) * l, l]`` fp32 of 0/1: mask i
    in rows ``[i * l, (i + 1) * l)``."""
    idx = torch.arange(chunk_size)
    row, col = idx[:, None], idx[None, :]
    masks = [row >= col, row > col, row == col, (row > col) & (row // BASE_BLOCK == col // BASE_BLOCK)]
    size = BASE_BLOCK
    for _ in range(num_merge_levels(chunk_size)):
        merged = 2 * size
        same_block = row // merged == col // merged
        masks.append(same_block & (row // size == col // size + 1) & ((row // size) % 2 == 1))
        size = merged
    return torch.cat(masks).to(torch.float32)


def validate_bwd_kernel_config(
    *, num_qk_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int
) -> None:
    """Raise ValueError for a configuration the kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims: expected K and V in {list(SUPPORTED_HEAD_DIMS)}, got K={head_k_dim}, "
                         f"V={head_v_dim}")
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {list(SUPPORTED_CHUNK_SIZES)}, got {chunk_size}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads: expected a positive multiple of num_qk_heads={num_qk_heads}, "
                         f"got {num_v_heads}")


def _invert_unit_lower(a: Any, masks: Any, chunk_size: int) -> Any:
    """``(I + a)^-1`` for strictly lower ``a [l, l]``, by matmuls only.

    Diagonal 16x16 blocks: ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8)`` (N^16 = 0),
    for all blocks at once; then each merge doubles the block size with
    ``T <- T - T A_off T`` (``inv21 = -inv22 A21 inv11`` for every pair at once).
    """
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    power = a * masks[MASK_BASE_BLOCKS] * -1.0  # -N
    inverse = masks[MASK_IDENTITY] + power
    for _ in range(3):
        power = pypto.matmul(power, power, fp32)
        inverse = inverse + pypto.matmul(inverse, power, fp32)
    for level in range(num_merge_levels(chunk_size)):
        off_diag = a * masks[MASK_BASE_BLOCKS + 1 + level]
        inverse = inverse - pypto.matmul(pypto.matmul(inverse, off_diag, fp32), inverse, fp32)
    return inverse


def _chunk_backward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, do: Any, state: Any, d_state_aug: Any, masks: Any, eye: Any, *,
    scale: float,
    chunk_size: int, head_k_dim: int,
) -> tuple[Any, ...]:
    """One chunk: full-size tiles q, k ``[l, K]``, v, do ``[l, V]``, g, beta ``[l, 1]``,
    ``state [K, V]`` entering the chunk, ``d_state_aug [K + V, V]`` the gradient w.r.t.
    the state leaving it over the V x V identity, ``eye [K, K]`` the identity.

    Returns ``(dq, dk, dv, dg, dbeta, d_state_in)``: dq, dk ``[l, K]`` (dq w.r.t. the
    unscaled q), dv ``[l, V]``, dg, dbeta ``[l, 1]``, and the gradient w.r.t. the state
    entering the chunk ``[K, V]``.
    """
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    lower, strict = masks[MASK_LOWER], masks[MASK_STRICT_LOWER]
    d_state = pypto.view(d_state_aug, [head_k_dim, d_state_aug.shape[1]], [0, 0])
    q = q * scale

    # The forward's chunk quantities.
    gamma, decay, decay_out = chunk_decays(g, masks, chunk_size)  # partial sums of g, no cancellation
    gamma_last = pypto.view(gamma, [1, 1], [chunk_size - 1, 0])
    decay_in = pypto.exp(gamma)  # [l, 1]
    chunk_decay = pypto.exp(gamma_last)  # [1, 1]
    gram = pypto.matmul(k, k, fp32, b_trans=True) * decay * strict  # G
    t_inv = _invert_unit_lower(gram * beta, masks, chunk_size)
    k_in = k * (beta * decay_in)  # Kb
    u = pypto.matmul(t_inv, v * beta, fp32)
    w = pypto.matmul(t_inv, k_in, fp32)
    v_new = u - pypto.matmul(w, state, fp32)  # V'
    attn = pypto.matmul(q, k, fp32, b_trans=True) * decay  # P
    k_out = k * decay_out  # Kd
    q_in = q * decay_in  # Qg

    # The carried chain: dS = (exp(gamma_C) I - W^T Kd) dS' + (Qg^T dO - W^T P^T dO). (The
    # chain matrix gets its own exp: a value shared with a vector op that reads dS' may be
    # fused into that op's task, which would hold the chain matrix back behind the chain.)
    dv_out = pypto.matmul(attn, do, fp32, a_trans=True)  # P^T dO
    chain = eye * pypto.expand_clone(pypto.exp(gamma_last), [head_k_dim, 1]) - pypto.matmul(
        w, k_out, fp32, a_trans=True)
    d_state_rest = pypto.matmul(q_in, do, fp32, a_trans=True) - pypto.matmul(w, dv_out, fp32, a_trans=True)
    # One matmul on the chain: [dS; I] carried, dS <- [chain | rest] @ [dS'; I].
    d_state_in = pypto.matmul(pypto.concat([chain, d_state_rest], dim=1), d_state_aug, fp32)
    dv_new = dv_out + pypto.matmul(k_out, d_state, fp32)

    # Everything else.
    dvb = pypto.matmul(t_inv, dv_new, fp32, a_trans=True)  # d(beta V)
    dq_in = pypto.matmul(do, state, fp32, b_trans=True) * decay_in  # exp(gamma) dO S^T
    neg_dkb = pypto.matmul(dvb, state, fp32, b_trans=True)  # -d(Kb)
    dp = pypto.matmul(do, v_new, fp32, b_trans=True)
    neg_da = pypto.matmul(dvb, v_new, fp32, b_trans=True) * strict  # -dA
    dg_gram = neg_da * beta * -1.0  # dG = beta dA
    m = dp * attn + dg_gram * gram
    dgamma = (dq_in * q).sum(-1, keepdim=True) + m.sum(-1, keepdim=True) - pypto.transpose(
        m.sum(0, keepdim=True), 0, 1)
    dp_decay = dp * decay
    d_gram = dg_gram * decay  # dB, the gradient of K K^T
    dq = (pypto.matmul(dp_decay, k, fp32) + dq_in) * scale
    s_kb = (neg_dkb * k).sum(-1, keepdim=True) * -1.0  # rowsum(dKb * K)
    dbeta = (dvb * v).sum(-1, keepdim=True) - (neg_da * gram).sum(-1, keepdim=True) + decay_in * s_kb
    beta_in = beta * decay_in
    dgamma = dgamma + beta_in * s_kb
    dk_out = pypto.matmul(v_new, d_state, fp32, b_trans=True)  # d(Kd)
    t_out = (dk_out * k_out).sum(-1, keepdim=True)
    dgamma = dgamma - t_out
    # sum(dS' * S) as the trace of dS' S^T: a vector op reading the state tile itself would
    # have the state's load fused into it and hold every reader of the state behind dS'.
    state_dot = (pypto.matmul(d_state, state, fp32, b_trans=True) * eye).sum(-1, keepdim=True).sum(0, keepdim=True)
    last = t_out.sum(0, keepdim=True) + chunk_decay * state_dot
    dk = (
        pypto.matmul(dp_decay, q, fp32, a_trans=True)
        + pypto.matmul(d_gram + pypto.transpose(d_gram, 0, 1), k, fp32)
        - neg_dkb * beta_in
        + dk_out * decay_out
    )
    dv = dvb * beta
    # reverse cumsum within the chunk: total - cumsum + self
    dg = dgamma - pypto.cumsum(dgamma, 0) + (dgamma.sum(0, keepdim=True) + last)
    return dq, dk, dv, dg, dbeta, d_state_in


class Activations(NamedTuple):
    """fla's activations a backward kernel applies (:mod:`.kernel_gating`): with
    ``gate_params`` (the kernel's ``[2, HV]`` input) g is the raw gate, and ``d_a_log_out``
    (``[T, HV]``) receives ``dL/dg * g`` per token, whose sum over tokens is dA_log; with
    ``beta_sigmoid`` beta holds logits (times 2 with ``allow_neg_eigval``)."""

    gate_params: Any = None
    d_a_log_out: Any = None
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False


def _activated_gates(g_raw: Any, beta_raw: Any, head: Any, act: Activations, l: int) -> tuple:  # noqa: E741
    """``(g, beta, g_slope, beta_slope)``: the activated g and beta ``[l, 1]`` from the raw
    tiles, and the derivatives ``dg/da`` and ``dbeta/db`` (None where not activated)."""
    pypto = import_pypto()
    g, beta, g_slope, b_slope = g_raw, beta_raw, None, None
    if act.gate_params is not None:
        rate = pypto.expand_clone(kernel_gating.gate_rate(pypto.view(act.gate_params, [1, 1], [0, head])), [l, 1])
        x = g_raw + pypto.expand_clone(pypto.view(act.gate_params, [1, 1], [1, head]), [l, 1])
        g = rate * kernel_gating.softplus(x)
        g_slope = rate * kernel_gating.softplus_slope(x)
    if act.beta_sigmoid:
        # one sigmoid for both (kernel_gating.beta_and_slope)
        beta, b_slope = kernel_gating.beta_and_slope(beta_raw, act.allow_neg_eigval)
    return g, beta, g_slope, b_slope


def _head_chunk(
    q: Any, k: Any, v: Any, g: Any, beta: Any, grad_o: Any, chunk_states: Any, d_state: Any, masks: Any, eye: Any,
    dq_out: Any, dk_out: Any, dv_out: Any, dg_out: Any, dbeta_out: Any, head: int, qk_head: int, start: Any,
    rows: Any, state_row: Any, tail: bool, scale: float, l: int, dk: int, dv: int, num_v_heads: int,  # noqa: E741
    rows_v: int, act: Activations = Activations(),
) -> None:
    """One chunk of one value head: read its tiles (zero-filled past ``rows`` when ``tail``;
    raw gate and beta logits filled with -inf, whose activations are 0), apply ``act``'s
    activations, run :func:`_chunk_backward`, update the carried ``d_state [K + V, V]`` and
    write the chunk's gradients (only the valid rows when ``tail``): those of the raw gate
    and logits by the chain rule, and ``dL/dg * g`` to ``act.d_a_log_out``."""
    pypto = import_pypto()
    pypto.set_vec_tile_shapes(1, 1, rows_v, 128)
    state = pypto.reshape(pypto.view(chunk_states, [1, 1, dk, dv], [state_row, head, 0, 0]), [dk, dv])
    pypto.set_vec_tile_shapes(rows_v, 128)
    # 2-D views of the token-major inputs: no reshape, so no pure-copy task.
    q_c = pypto.view(q, [l, dk], [start, qk_head * dk], valid_shape=[rows, dk])
    k_c = pypto.view(k, [l, dk], [start, qk_head * dk], valid_shape=[rows, dk])
    v_c = pypto.view(v, [l, dv], [start, head * dv], valid_shape=[rows, dv])
    do_c = pypto.view(grad_o, [l, dv], [start, head * dv], valid_shape=[rows, dv])
    g_c = pypto.view(g, [l, 1], [start, head], valid_shape=[rows, 1])
    beta_c = pypto.view(beta, [l, 1], [start, head], valid_shape=[rows, 1])
    if tail:
        q_c, k_c, v_c, do_c = (pypto.fillpad(t, "constant", 0.0) for t in (q_c, k_c, v_c, do_c))
        g_c = pypto.fillpad(g_c, "constant", kernel_gating.RAW_FILL if act.gate_params is not None else 0.0)
        beta_c = pypto.fillpad(beta_c, "constant", kernel_gating.RAW_FILL if act.beta_sigmoid else 0.0)
    g_c, beta_c, g_slope, b_slope = _activated_gates(g_c, beta_c, head, act, l)
    dq_c, dk_c, dv_c, dg_c, dbeta_c, d_state_in = _chunk_backward(
        q_c, k_c, v_c, g_c, beta_c, do_c, state, d_state, masks, eye, scale=scale, chunk_size=l, head_k_dim=dk)
    d_state[0:dk, 0:dv] = d_state_in
    d_a_log_c = None
    if g_slope is not None:  # the chain rule to the raw gate; dA_log's per-token terms
        d_a_log_c = dg_c * g_c
        dg_c = dg_c * g_slope
    if b_slope is not None:
        dbeta_c = dbeta_c * b_slope
    if tail:
        dq_c = pypto.view(dq_c, [l, dk], [0, 0], valid_shape=[rows, dk])
        dk_c = pypto.view(dk_c, [l, dk], [0, 0], valid_shape=[rows, dk])
        dv_c = pypto.view(dv_c, [l, dv], [0, 0], valid_shape=[rows, dv])
        dg_c = pypto.view(dg_c, [l, 1], [0, 0], valid_shape=[rows, 1])
        dbeta_c = pypto.view(dbeta_c, [l, 1], [0, 0], valid_shape=[rows, 1])
        if d_a_log_c is not None:
            d_a_log_c = pypto.view(d_a_log_c, [l, 1], [0, 0], valid_shape=[rows, 1])
    pypto.assemble(dq_c, [start, head * dk], dq_out)
    pypto.assemble(dk_c, [start, head * dk], dk_out)
    pypto.assemble(dv_c, [start, head * dv], dv_out)
    pypto.assemble(dg_c, [start, head], dg_out)
    pypto.assemble(dbeta_c, [start, head], dbeta_out)
    if d_a_log_c is not None:
        pypto.assemble(d_a_log_c, [start, head], act.d_a_log_out)


def _set_pass_options(options: dict | None) -> None:
    """``pypto.set_pass_options(**options)`` inside a jit body (which cannot branch on a dict)."""
    if options:
        import_pypto().set_pass_options(**options)


#: A launch of at least this many (sequence, value head) pairs merges its heads' identical
#: cube work (``cube_nbuffer_setting``, :func:`default_pass_options`). Cost model, H2/HV4
#: K = V = 128, cycles without / with: 4 pairs (1 x 1024) 642,595 / 964,769, 8 pairs (2 x
#: 1024) 1,103,499 / 1,085,417, 16 pairs (4 x 1024) 2,099,563 / 1,456,790.
MIN_MERGED_PAIRS = 8
#: How many identical cube subgraphs (a chunk's products of that many value heads) one task
#: runs, in a merged launch: 8 against 4 / 6 / 16 on H16/HV32 2 x 512 (81.85 cycles per
#: value-head x token against 83.49 / 82.17 / 90.62; 128.24 unmerged).
MERGED_CUBE_SUBGRAPHS = 8


def default_pass_options(num_seqs: int, num_v_heads: int) -> dict:
    """The backward's pypto pass options for a launch of ``num_seqs`` sequences: a body runs
    every value head of a chunk, and with enough pairs in flight (``MIN_MERGED_PAIRS``) the
    heads' identical cube subgraphs are merged into fewer, larger tasks (the scheduler's cost
    per task bounds saturating launches); with few, merging only lengthens each sequence's
    serial chain."""
    if num_seqs * num_v_heads < MIN_MERGED_PAIRS:
        return {}
    return {"cube_nbuffer_setting": {-1: MERGED_CUBE_SUBGRAPHS}}


def build_gdr_bwd_kernel(
    *,
    num_seqs: int,
    num_qk_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    chunk_size: int,
    scale: float,
    on_device: bool = False,
    vec_rows: int = 128,
    stitch_function_max_num: int = DEFAULT_STITCH_FUNCTION_MAX_NUM,
    pass_options: dict | None = None,
    runtime_options: dict | None = None,
    gate_in_kernel: bool = False,
    beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> Any:
    """Build (trace lazily, on first call) the GDR backward kernel for one configuration.

    Args:
        num_seqs: N. num_qk_heads: H. num_v_heads: HV, a multiple of H.
        head_k_dim, head_v_dim: K and V, each 64, 128 or 256.
        chunk_size: l, 32, 64 or 128; must be the chunk length of the ``chunk_states``.
        scale: the factor the forward applied to q.
        on_device: run mode NPU rather than SIM (CPU interpreter or cost model).
        vec_rows: rows of the vector tiles (at most l; 64 at most where K or V is 256).
        stitch_function_max_num: pypto runtime option (see the forward kernel).
        pass_options, runtime_options: further pypto options of the jit (tuning);
            ``pass_options`` update :func:`default_pass_options`.
        gate_in_kernel: g is fla's raw gate; the kernel takes ``gate_params [2, HV]`` after
            beta and writes ``d_a_log [T, HV]`` after dbeta (module docstring).
        beta_sigmoid_in_kernel: beta holds logits. allow_neg_eigval: beta = 2 sigmoid(logits).

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring.
    """
    if allow_neg_eigval and not beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires beta_sigmoid_in_kernel=True, got beta_sigmoid_in_kernel=False")
    validate_bwd_kernel_config(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, chunk_size=chunk_size,
    )
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    tokens = pypto.DYNAMIC
    chunks_total = pypto.DYNAMIC
    group = num_v_heads // num_qk_heads
    n_masks = 4 + num_merge_levels(chunk_size)
    d_state_shape = [num_seqs, num_v_heads, head_k_dim + head_v_dim, head_v_dim]
    l = chunk_size  # noqa: E741  (the spec's name for the chunk length)
    dk, dv = head_k_dim, head_v_dim
    # K or V = 256: 64-row vector tiles (with 128 rows pypto 0.2.0's cost model fails to simulate the kernel)
    rows_v = min(l, vec_rows if max(head_k_dim, head_v_dim) <= 128 else 64)
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM

    pass_options = {**default_pass_options(num_seqs, num_v_heads), **(pass_options or {})}
    runtime = {"run_mode": run_mode, "stitch_function_max_num": stitch_function_max_num, **(runtime_options or {})}
    jit_options: dict = {"runtime_options": runtime}

    jit = pypto.frontend.jit(**jit_options)

    def head_chunk(*args: Any, gate_params: Any = None, d_a_log_out: Any = None) -> None:
        """:func:`_head_chunk` with this kernel's activations (the raw gate's tensors in the
        gated variant). (A NamedTuple in the jit body becomes a plain tuple: built here.)"""
        _head_chunk(*args, Activations(gate_params, d_a_log_out, beta_sigmoid_in_kernel, allow_neg_eigval))

    @jit
    def gdr_bwd_kernel(
        q: pypto.Tensor([tokens, num_qk_heads * dk], fp32),
        k: pypto.Tensor([tokens, num_qk_heads * dk], fp32),
        v: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        g: pypto.Tensor([tokens, num_v_heads], fp32),
        beta: pypto.Tensor([tokens, num_v_heads], fp32),
        grad_o: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        act_seq_len: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        chunk_offsets: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        masks: pypto.Tensor([n_masks * l, l], fp32),
        eye: pypto.Tensor([dk, dk], fp32),
        chunk_states: pypto.Tensor([chunks_total, num_v_heads, dk, dv], fp32),
        grad_state_in: pypto.Tensor(d_state_shape, fp32),
        dq_out: pypto.Tensor([tokens, num_v_heads * dk], fp32),
        dk_out: pypto.Tensor([tokens, num_v_heads * dk], fp32),
        dv_out: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        dg_out: pypto.Tensor([tokens, num_v_heads], fp32),
        dbeta_out: pypto.Tensor([tokens, num_v_heads], fp32),
        grad_state_out: pypto.Tensor([num_seqs, num_v_heads, dk, dv], fp32),
    ):
        pypto.set_cube_tile_shapes([CUBE_TILE, CUBE_TILE], [CUBE_TILE, CUBE_TILE], [CUBE_TILE, CUBE_TILE])
        _set_pass_options(pass_options)

        for seq in pypto.loop(num_seqs, name="LOOP_SEQ", idx_name="seq", parallel=True):
            seq_start = act_seq_len[seq]
            seq_len = act_seq_len[seq + 1] - seq_start
            first_chunk_row = chunk_offsets[seq]
            n_chunks = (seq_len + l - 1) // l
            pypto.set_vec_tile_shapes(rows_v, 128)
            # One carried [dS; I] per value head; "+ 0.0" makes a copy, updated in place below.
            d_states = []
            for head in range(num_v_heads):  # unrolled at trace time
                d_states.append(pypto.reshape(
                    pypto.view(grad_state_in, [1, 1, dk + dv, dv], [seq, head, 0, 0]), [dk + dv, dv]) + 0.0)

            for step in pypto.loop(n_chunks, name="LOOP_CHUNK_REVERSED", idx_name="step"):
                chunk = n_chunks - 1 - step
                start = seq_start + chunk * l
                rows = pypto.min(l, seq_len - chunk * l)
                pypto.set_vec_tile_shapes(rows_v, 128)
                mask_tiles = []
                for i in range(n_masks):  # unrolled at trace time
                    mask_tiles.append(pypto.view(masks, [l, l], [i * l, 0]))
                eye_k = pypto.view(eye, [dk, dk], [0, 0])
                if pypto.is_loop_begin(step):  # the sequence's last chunk: possibly a partial tail
                    for head in range(num_v_heads):  # unrolled at trace time
                        head_chunk(
                            q, k, v, g, beta, grad_o, chunk_states, d_states[head], mask_tiles, eye_k,
                            dq_out, dk_out, dv_out, dg_out, dbeta_out, head, head // group, start, rows,
                            first_chunk_row + chunk, True, scale, l, dk, dv, num_v_heads, rows_v)
                else:
                    for head in range(num_v_heads):
                        head_chunk(
                            q, k, v, g, beta, grad_o, chunk_states, d_states[head], mask_tiles, eye_k,
                            dq_out, dk_out, dv_out, dg_out, dbeta_out, head, head // group, start, rows,
                            first_chunk_row + chunk, False, scale, l, dk, dv, num_v_heads, rows_v)
            pypto.set_vec_tile_shapes(rows_v, 128)
            for head in range(num_v_heads):
                d_state_final = pypto.view(d_states[head], [dk, dv], [0, 0])
                pypto.assemble(pypto.reshape(d_state_final, [1, 1, dk, dv]), [seq, head, 0, 0], grad_state_out)

    # The gated variant (fla's raw gate): the plain loops with the gate's parameters in and
    # dA_log's per-token terms out (pypto parses a jit function's signature and loops from
    # its own source, so a second function; the plain kernel keeps its arguments).
    @jit
    def gdr_bwd_gated_kernel(
        q: pypto.Tensor([tokens, num_qk_heads * dk], fp32),
        k: pypto.Tensor([tokens, num_qk_heads * dk], fp32),
        v: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        g: pypto.Tensor([tokens, num_v_heads], fp32),
        beta: pypto.Tensor([tokens, num_v_heads], fp32),
        gate_params: pypto.Tensor([2, num_v_heads], fp32),
        grad_o: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        act_seq_len: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        chunk_offsets: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        masks: pypto.Tensor([n_masks * l, l], fp32),
        eye: pypto.Tensor([dk, dk], fp32),
        chunk_states: pypto.Tensor([chunks_total, num_v_heads, dk, dv], fp32),
        grad_state_in: pypto.Tensor(d_state_shape, fp32),
        dq_out: pypto.Tensor([tokens, num_v_heads * dk], fp32),
        dk_out: pypto.Tensor([tokens, num_v_heads * dk], fp32),
        dv_out: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        dg_out: pypto.Tensor([tokens, num_v_heads], fp32),
        dbeta_out: pypto.Tensor([tokens, num_v_heads], fp32),
        d_a_log_out: pypto.Tensor([tokens, num_v_heads], fp32),
        grad_state_out: pypto.Tensor([num_seqs, num_v_heads, dk, dv], fp32),
    ):
        pypto.set_cube_tile_shapes([CUBE_TILE, CUBE_TILE], [CUBE_TILE, CUBE_TILE], [CUBE_TILE, CUBE_TILE])
        _set_pass_options(pass_options)

        for seq in pypto.loop(num_seqs, name="LOOP_SEQ", idx_name="seq", parallel=True):
            seq_start = act_seq_len[seq]
            seq_len = act_seq_len[seq + 1] - seq_start
            first_chunk_row = chunk_offsets[seq]
            n_chunks = (seq_len + l - 1) // l
            pypto.set_vec_tile_shapes(rows_v, 128)
            d_states = []
            for head in range(num_v_heads):
                d_states.append(pypto.reshape(
                    pypto.view(grad_state_in, [1, 1, dk + dv, dv], [seq, head, 0, 0]), [dk + dv, dv]) + 0.0)

            for step in pypto.loop(n_chunks, name="LOOP_CHUNK_REVERSED", idx_name="step"):
                chunk = n_chunks - 1 - step
                start = seq_start + chunk * l
                rows = pypto.min(l, seq_len - chunk * l)
                pypto.set_vec_tile_shapes(rows_v, 128)
                mask_tiles = []
                for i in range(n_masks):
                    mask_tiles.append(pypto.view(masks, [l, l], [i * l, 0]))
                eye_k = pypto.view(eye, [dk, dk], [0, 0])
                if pypto.is_loop_begin(step):
                    for head in range(num_v_heads):
                        head_chunk(
                            q, k, v, g, beta, grad_o, chunk_states, d_states[head], mask_tiles, eye_k,
                            dq_out, dk_out, dv_out, dg_out, dbeta_out, head, head // group, start, rows,
                            first_chunk_row + chunk, True, scale, l, dk, dv, num_v_heads, rows_v,
                            gate_params=gate_params, d_a_log_out=d_a_log_out)
                else:
                    for head in range(num_v_heads):
                        head_chunk(
                            q, k, v, g, beta, grad_o, chunk_states, d_states[head], mask_tiles, eye_k,
                            dq_out, dk_out, dv_out, dg_out, dbeta_out, head, head // group, start, rows,
                            first_chunk_row + chunk, False, scale, l, dk, dv, num_v_heads, rows_v,
                            gate_params=gate_params, d_a_log_out=d_a_log_out)
            pypto.set_vec_tile_shapes(rows_v, 128)
            for head in range(num_v_heads):
                d_state_final = pypto.view(d_states[head], [dk, dv], [0, 0])
                pypto.assemble(pypto.reshape(d_state_final, [1, 1, dk, dv]), [seq, head, 0, 0], grad_state_out)

    return gdr_bwd_gated_kernel if gate_in_kernel else gdr_bwd_kernel
