"""The gated delta rule decode step over a state pool as one PyPTO kernel (pypto 0.2.0).

One launch runs the whole batch. The loop bodies are independent, each one vector task
(``pg_skip_partition``). A one-token kernel's body runs one sequence on 1, 2, 4, 8 or 16
adjacent value heads (:func:`value_heads_per_body`: by the cost of the step's waves over
the vector cores), one head after another; a several-token kernel's body runs one
sequence on one or two value heads, its S tokens (up to 16, speculative verification)
one after another on the states held on chip (the heads one after another within a
token). Per token and value head, on the vector unit,
with ``d = exp(g)`` and the state S read once and multiplied by ``d`` first::

    kv = (d S)^T k,   u = beta v - beta kv,   S' = d S + k u^T,   o = S'^T q

(q scaled after its norm; the output is read from the new state, as fla's recurrent
kernel does, which saves the ``q . k`` term and leaves one matvec once q is on chip;
one-token bodies of 16 heads over a 2-byte pool or with the activations take
``o = (d S)^T q + (q . k) u``, which the cost model runs faster there), and the state after the token is stored to the pool row its
sequence names for that token. Rows are read and written in place through the row tables;
a row of -1 reads as a zero state and is never written (symbolic ``if`` s on the table
entries: four paths in a one-token kernel, 2^S in a several-token one unless it stores
every token).

What the cost model charges (bench/RESULTS.md has the figures): a copy between memory and
the unified buffer costs ~1,400 cycles whatever its size (64 KiB: 2,090), one after
another on the task's copy-in pipe; a view of a copied-in input read by several ops is
copied in once per op; the scheduler adds ~5.8k cycles between a core's tasks. Hence:
every small input is one copy for all the heads of a body (one-token: q, k ``[T * H, K]``
and v ``[T * HV, V]``, whose heads are adjacent rows; g, beta a row of the body's heads)
or for all the tokens of a sequence (several-token: ``[T, H * K]`` views), and the
per-head or per-token rows are views of computed tiles (on chip); the fp32 row of a
one-token kernel is one 64 KiB copy (K <= 128) multiplied by ``d`` once, the others read
64-row blocks (a 128-row tile fails in the cost model at S = 16 and in the cast of a
2-byte row). The state is held as 64-row blocks whose column sums are taken apart and
added (a sum over the whole ``[K, V]`` is a pairwise reduction across its tiles). What is
left: seven vector passes over the state per token and head, and, for fp32 bodies of
several heads, the rows the unified buffer spills (all of a body's rows are copied in at
its start).

Kernel arguments, in order (every tensor two-dimensional or one-dimensional, contiguous):

==============  ============================  ============================================
name            shape                         meaning
==============  ============================  ============================================
q, k            ``[B * S, H * K]`` in_dtype   queries, keys; token j of sequence n in row
                                              ``n * S + j`` (one-token kernels: ``[B * H,
                                              K]``, head h of sequence n in row n * H + h)
v               ``[B * S, HV * V]`` in_dtype  values (value head h reads q/k head
                                              ``h // (HV // H)``; one-token kernels:
                                              ``[B * HV, V]``)
g, beta         ``[B * S, HV]`` fp32          log decay, write strength (raw where the
                                              kernel applies fla's activations, below)
gate_params     ``[2, HV]`` fp32              only with ``gate_in_kernel``: ``A_log`` in row
                                              0, ``dt_bias`` in row 1 (zeros without one)
read_rows       ``[B, 1]`` int32              pool row each sequence starts from (-1: zeros;
                                              two-dimensional: its [1, 1] view needs no
                                              reshape, a round trip through memory)
write_rows      ``[B * S]`` int32             pool row the state after token j of sequence
                                              n goes to (-1: not written)
bodies          ``[1]`` int32                 loop bodies to run: ``B * HV / heads_per_body``
pool            ``[slots * HV * K, V]``       the pool ``[slots, HV, K, V]`` key-first,
                pool_dtype                    flattened; the rows are read from it
o               ``[B * S, HV * V]`` fp32      outputs
pool_out        as pool                       the same storage as ``pool``: the rows are
                                              written to it, in place
==============  ============================  ============================================

With ``gate_in_kernel`` the kernel reads g as the raw gate ``a`` and takes the log decay
as ``-exp(A_log[h]) * softplus(a + dt_bias[h])`` (softplus(x) = x above 20, the threshold
of torch and fla, else ``log1p(exp(x))``); ``-exp(A_log)`` and ``dt_bias`` are read once
per body and the raw gate with the rest of the body's small inputs (fewer copies than a
``[1, 1]`` view per head). With ``beta_sigmoid_in_kernel`` it reads beta as logits and
takes ``s * sigmoid(beta)``, ``s = 2`` with ``allow_neg_eigval``. Without either flag the kernel is the
plain one (no ``gate_params`` argument).

The batch B is not built into the kernel: every tensor's first dimension is dynamic and
the body loop runs ``bodies[0]`` times (in the cost model a loop bound read from a tensor
costs the same cycles as a constant one). The kernel is specialised on S (the host pads S
to a bucket, :func:`torch_gdr.ops.pypto.decode.token_bucket`) and on the value heads per
body (five shapes at one token; at S = 4, 8, 12 and 16 one or two heads, one head at
the other buckets), so a configuration has at most 5 + 7 + 4 = 16 decode kernels.
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

from typing import Any, Optional

from torch_gdr._layout import L2NORM_EPS  # the in-kernel l2 norm's epsilon

from . import kernel_gating
from ._env import import_pypto
from .spec import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from .spec import MAX_STEP_TOKENS as MAX_TOKENS_PER_SEQ

#: Input dtypes of q, k and v the kernel reads itself.
SUPPORTED_INPUT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: Pool dtypes the kernel reads and writes (states are computed in fp32, rounded on store).
SUPPORTED_POOL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: pypto's stitch_function_max_num: loop bodies in one submission (at pypto's default,
#: ten, the bodies of a step run in waves of ten).
STITCH_BODIES = 128


def _pypto_dtype(name: str) -> Any:
    pypto = import_pypto()
    return {"float32": pypto.DT_FP32, "float16": pypto.DT_FP16, "bfloat16": pypto.DT_BF16}[name]


#: Most tokens per sequence a kernel with a branch per token's store is built for (above:
#: ``store_every_token``; 2^S compiled paths).
MAX_BRANCHED_TOKENS = 4

#: Vector cores of the simulated device (Ascend 910B, pypto's A2A3 config).
VECTOR_CORES = 48
#: Most value heads one loop body of a one-token kernel runs (a task of 16 heads takes
#: ~100k cycles in the cost model; more would leave cores idle at every batch).
MAX_HEADS_PER_BODY = 16


#: Cycles one task of a one-token kernel over an fp32 pool costs by value heads per body
#: (pypto 0.2.0 cost model, H16/HV32, K = V = 128: the task itself plus ~6k of the
#: scheduler's between tasks; 8 heads with the decay's scheduling nudge, see
#: :func:`build_decode_kernel`, 16 heads spill rows: bench/RESULTS.md). Relative weights.
FP32_TASK_CYCLES = {1: 16_700, 2: 21_300, 4: 29_500, 8: 45_500, 16: 103_400}


#: Value heads of a several-token body once the step's pairs outnumber the vector cores
#: (cost model, fp32 pool, S = 4: B = 8 140,744 cycles against 182,996 for one head and
#: 170,838 for four; B = 64 1,122,158 against 1,452,179 and 1,020,719).
WIDE_SEQUENCE_HEADS = 2
#: Token buckets whose several-token kernel also comes with wide bodies: four buckets
#: (with the one-token kernel's five body sizes and one kernel per other bucket, 16
#: kernels a configuration at most).
WIDE_TOKEN_BUCKETS = (4, 8, 12, 16)


def value_heads_per_body(num_seqs: int, num_qk_heads: int, num_v_heads: int, tokens_per_seq: int = 1,
                         pool_dtype: str = "float32") -> int:
    """Value heads one loop body (one vector task) runs.

    One token a sequence: a power of two dividing HV, at most :data:`MAX_HEADS_PER_BODY`
    (a task's fixed costs, ~6k cycles of scheduling and a ~1,400-cycle copy per small
    input, are paid once for all its heads); 1 while every (sequence, head) pair gets a
    core (the step's latency is one pair's). Over an fp32 pool the one whose waves over
    the vector cores cost the fewest cycles by :data:`FP32_TASK_CYCLES` (H16/HV32: 4
    heads at B = 4-6 and 13-18, 8 at B = 7-12 and 19-256; 16-head fp32 bodies spill);
    over a 2-byte pool the fewest that fit one wave (its 16-head bodies do not spill). Several tokens a sequence: one head per
    body while every pair gets a core, else :data:`WIDE_SEQUENCE_HEADS` for the token
    buckets in :data:`WIDE_TOKEN_BUCKETS` (fewer tasks, each paying the scheduler once for
    the heads' S tokens), one head for the others (a configuration's kernel count)."""
    pairs = num_seqs * num_v_heads
    group = num_v_heads // max(num_qk_heads, 1)
    if tokens_per_seq > 1:
        wide = WIDE_SEQUENCE_HEADS
        fits = num_v_heads % wide == 0 and (wide % group == 0 or group % wide == 0)
        return wide if tokens_per_seq in WIDE_TOKEN_BUCKETS and pairs > VECTOR_CORES and fits else 1
    if pairs <= VECTOR_CORES:
        return 1
    candidates = [1]
    while (candidates[-1] * 2 <= min(MAX_HEADS_PER_BODY, num_v_heads) and num_v_heads % (candidates[-1] * 2) == 0):
        candidates.append(candidates[-1] * 2)
    candidates = [h for h in candidates if h % group == 0 or group % h == 0]
    if pool_dtype == "float32":
        def cost(h: int) -> int:
            return -(-pairs // (h * max(VECTOR_CORES, 1))) * FP32_TASK_CYCLES[h]
        return min(candidates, key=lambda h: (cost(h), h))
    for heads in candidates:
        if pairs <= VECTOR_CORES * heads:
            return heads
    return candidates[-1]


def validate_decode_config(*, heads_per_body: int, num_qk_heads: int, num_v_heads: int, head_k_dim: int,
                           head_v_dim: int, tokens_per_seq: int, input_dtype: str, pool_dtype: str) -> None:
    """Raise ValueError for a configuration the decode kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim}: expected values in {SUPPORTED_HEAD_DIMS}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_qk_heads={num_qk_heads}")
    group = num_v_heads // num_qk_heads
    if heads_per_body < 1 or num_v_heads % heads_per_body or (heads_per_body > group and heads_per_body % group) or (
            heads_per_body < group and group % heads_per_body) or (tokens_per_seq > 1 and heads_per_body not in (1, 2, 4)):
        raise ValueError(f"heads_per_body: expected a divisor of num_v_heads = {num_v_heads} that divides or is a "
                         f"multiple of num_v_heads // num_qk_heads = {group} (1, 2 or 4 for more than one token a sequence), "
                         f"got {heads_per_body} with tokens_per_seq = {tokens_per_seq}")
    if not 1 <= tokens_per_seq <= MAX_TOKENS_PER_SEQ:
        raise ValueError(f"tokens_per_seq: expected 1..{MAX_TOKENS_PER_SEQ}, got {tokens_per_seq}")
    if input_dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"input_dtype {input_dtype!r} not in {SUPPORTED_INPUT_DTYPES}")
    if pool_dtype not in SUPPORTED_POOL_DTYPES:
        raise ValueError(f"pool_dtype {pool_dtype!r} not in {SUPPORTED_POOL_DTYPES}")


def build_decode_kernel(
    *,
    heads_per_body: int,
    num_qk_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    tokens_per_seq: int,
    use_qk_l2norm: bool,
    scale: float,
    input_dtype: str = "float32",
    pool_dtype: str = "float32",
    on_device: bool = False,
    gate_in_kernel: bool = False,
    beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    store_every_token: bool = False,
    _state_on_chip_for_bench: bool = False,
) -> Any:
    """Build (trace lazily, on first call) the decode-step kernel for one configuration.

    Args:
        heads_per_body: value heads one loop body runs, a power of two dividing HV (at
            most 16; 1, 2 or 4 for several tokens), :func:`value_heads_per_body` of the
            launch's batch. The batch itself is not
            built in: the kernel runs ``bodies[0]`` loop bodies, the tensors' first
            dimension is dynamic.
        num_qk_heads: H. num_v_heads: HV, a multiple of H.
        head_k_dim, head_v_dim: K and V, each 64, 128 or 256.
        tokens_per_seq: S, tokens of every sequence (1..16; shorter sequences are padded by
            the host with tokens whose write rows are -1).
        use_qk_l2norm: l2-normalise q and k per token before use.
        scale: factor applied to q (after the norm).
        input_dtype: dtype of q, k, v. pool_dtype: dtype of the pool.
        on_device: run mode NPU rather than SIM (CPU; see :mod:`.interpreter`).
        gate_in_kernel: g is the raw gate; the kernel takes ``gate_params`` and computes
            the log decay (module docstring).
        beta_sigmoid_in_kernel: beta is logits; the kernel takes ``s * sigmoid(beta)``.
        allow_neg_eigval: ``s = 2`` (beta in [0, 2]); only with ``beta_sigmoid_in_kernel``.
        store_every_token: store every token's state to its write row, which the host makes
            a valid row (a staging slot); otherwise a token whose write row is -1 is not
            stored (a branch on the row). pypto 0.2.0 compiles a loop body once per
            combination of its branches (2^S paths: S = 6 takes minutes in the interpreter),
            so the host stores every token for S above :data:`MAX_BRANCHED_TOKENS`.
        _state_on_chip_for_bench: a yardstick for ``bench/pypto_decode_caps.py``, never for
            the op: the kernel's vector work with no pool traffic. Each (sequence, value head)
            starts from a state made on chip, every row ``beta v`` of its first token (the
            body's computed ``[1, V]`` row; rounded to a 2-byte pool's dtype), expanded to
            each 64-row block (cast to fp32 for a 2-byte pool) and multiplied by ``exp(g)``
            as a row read from the pool is; the state after each token is not stored (a
            2-byte pool's store cast is still taken, and one ``[1, V]`` row of each cast
            block written to ``pool_out`` at row ``(n * HV + h) * K / 64 + block``, so that
            pypto keeps the cast), only ``o`` is written. ``read_rows``, ``write_rows`` and
            ``pool`` are taken and not read. Plain kernels only (no ``gate_in_kernel`` or
            ``beta_sigmoid_in_kernel``).

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring.
    """
    validate_decode_config(heads_per_body=heads_per_body, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads,
                           head_k_dim=head_k_dim, head_v_dim=head_v_dim, tokens_per_seq=tokens_per_seq,
                           input_dtype=input_dtype, pool_dtype=pool_dtype)
    if allow_neg_eigval and not beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires beta_sigmoid_in_kernel=True, got beta_sigmoid_in_kernel=False")
    if _state_on_chip_for_bench and (gate_in_kernel or beta_sigmoid_in_kernel):
        raise ValueError("_state_on_chip_for_bench: plain kernels only (no in-kernel activations)")
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    in_dt, pool_dt = _pypto_dtype(input_dtype), _pypto_dtype(pool_dtype)
    group = num_v_heads // num_qk_heads
    heads = heads_per_body
    key_heads = max(1, heads // group)  # key heads of a body's value heads
    bodies_per_seq = num_v_heads // heads
    one_token = tokens_per_seq == 1
    num_tokens = pypto.DYNAMIC
    dk, dv = head_k_dim, head_v_dim
    pool_rows = pypto.DYNAMIC
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM
    state_rows = min(dk, 64)  # vector tile rows of the state's blocks (64 x 128 fp32: 32 KiB)
    # A one-token kernel reads an fp32 row as one tile while it fits 64 KiB (K <= 128); the
    # others read 64-row blocks: a 128-row tile makes the cost model fail (FFFFFF) in the
    # several-token kernel at S = 16 (which reads the row once for S tokens anyway) and in
    # the cast of a 2-byte row.
    read_rows_tile = dk if one_token and pool_dtype == "float32" and dk * min(dv, 128) * 4 <= 65536 else state_rows
    small_rows = 8  # tile rows of the small inputs (16-row tiles spill more in the cost model)
    # The output from the state after the update (fla's order, no q . k term) everywhere but
    # in one-token bodies of 16 heads over a 2-byte pool or with the activations, where the
    # cost model's scheduler places that order's tiles worse (bench/RESULTS.md: H16/HV32,
    # B = 64, bf16 pool 264,629 against 247,343 cycles; activations 351,056 against
    # 281,915; fp32 pool without them 299,201 against 333,773).
    output_from_new_state = not (one_token and heads >= 16 and (pool_dtype != "float32" or gate_in_kernel))
    # A scheduling nudge: one-token bodies of 8 heads over an fp32 pool take exp(g * 1.0)
    # (exact). The extra [1, heads] multiply changes where pypto 0.2.0's scheduler places
    # the body's copies: fewer rows spilled and re-read, B = 8 62,642 -> 45,356 cycles,
    # B = 64 (8 heads a task) 269,426 (bench/RESULTS.md); it slows 16-head and 2-byte bodies.
    decay_nudge = one_token and heads == 8 and pool_dtype == "float32"

    def fp32_of(x: Any, dtype: str) -> Any:
        return x if dtype == "float32" else pypto.cast(x, fp32)

    def normalised(x: Any) -> Any:
        return x / pypto.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) if use_qk_l2norm else x

    def columns(row: Any, width: int) -> Any:
        """``[1, heads]`` -> ``[heads, width]``: entry h of the row along row h."""
        pypto.set_vec_tile_shapes(8, 8)
        col = pypto.transpose(row, 0, 1)
        pypto.set_vec_tile_shapes(small_rows, 128)
        return pypto.expand_clone(col, [heads, width])

    def activations(g_raw: Any, beta_raw: Any, gates: Optional[tuple[Any, Any]]) -> tuple[Any, Any]:
        """exp(g) and beta as the kernel uses them, tiles of the raw inputs' shape."""
        if gates is not None:
            g_log = kernel_gating.log_decay(g_raw, *gates)
        else:
            g_log = g_raw * 1.0 if decay_nudge else g_raw
        beta_t = kernel_gating.activated_beta(beta_raw, allow_neg_eigval) if beta_sigmoid_in_kernel else beta_raw
        return pypto.exp(g_log), beta_t

    def gate_terms(gate_params: Any, first_head: Any) -> tuple[Any, Any]:
        """``(-exp(A_log), dt_bias)`` of the body's value heads, fp32 ``[1, heads]``."""
        pypto.set_vec_tile_shapes(8, 8)
        rate = kernel_gating.gate_rate(pypto.view(gate_params, [1, heads], [0, first_head]))
        return rate, pypto.view(gate_params, [1, heads], [1, first_head])

    def one_token_inputs(q: Any, k: Any, v: Any, g: Any, beta: Any, seq: Any, first_head: Any,
                         gates: Optional[tuple[Any, Any]], zero_state: bool = False) -> list:
        """A one-token body's inputs per value head ``h``: ``(q, k [1, K], exp(g), beta,
        beta v, q . k as [1, V] rows)`` (``q . k`` only for a ``zero_state`` or where the
        output is read from the state before the update, else None).
        One copy per input for all the body's heads (q and
        k ``[T * H, K]``, v ``[T * HV, V]``: a body's heads are adjacent rows; g and beta a
        row of ``[T, HV]``); the per-head rows are views of computed tiles (on chip)."""
        key_row = seq * num_qk_heads + first_head // group
        pypto.set_vec_tile_shapes(small_rows, 128)
        q_rows = normalised(fp32_of(pypto.view(q, [key_heads, dk], [key_row, 0]), input_dtype)) * scale
        k_rows = normalised(fp32_of(pypto.view(k, [key_heads, dk], [key_row, 0]), input_dtype))
        qk = (pypto.expand_clone((q_rows * k_rows).sum(-1, keepdim=True), [key_heads, dv])
              if zero_state or not output_from_new_state else None)
        v_rows = fp32_of(pypto.view(v, [heads, dv], [seq * num_v_heads + first_head, 0]), input_dtype)
        pypto.set_vec_tile_shapes(8, 8)
        decay_row, beta_row = activations(pypto.view(g, [1, heads], [seq, first_head]),
                                          pypto.view(beta, [1, heads], [seq, first_head]), gates)
        decay, beta_cols = columns(decay_row, dv), columns(beta_row, dv)
        beta_v = v_rows * beta_cols
        out = []
        for h in range(heads):
            kh = h // group if heads >= group else 0
            pypto.set_vec_tile_shapes(1, 128)
            out.append(tuple(None if x is None else pypto.view(x, [1, width], [row, 0]) for x, width, row in (
                (q_rows, dk, kh), (k_rows, dk, kh), (decay, dv, h), (beta_cols, dv, h), (beta_v, dv, h), (qk, dv, kh))))
        return [out]

    def sequence_inputs(q: Any, k: Any, v: Any, g: Any, beta: Any, seq: Any, head: Any,
                        gates: Optional[tuple[Any, Any]]) -> list:
        """A several-token body's inputs for one of its value heads, per token as
        :func:`one_token_inputs`: one copy per input for all S tokens (q and k ``[T, H *
        K]``, v ``[T, HV * V]``: the sequence's tokens are adjacent rows), rows of computed
        tiles per token (``q . k`` only where the output is read from the state before the
        update: the state is never zero, a -1 row reads as a masked row)."""
        first = seq * tokens_per_seq
        pypto.set_vec_tile_shapes(small_rows, 128)
        q_rows = normalised(fp32_of(pypto.view(q, [tokens_per_seq, dk], [first, (head // group) * dk]),
                                    input_dtype)) * scale
        k_rows = normalised(fp32_of(pypto.view(k, [tokens_per_seq, dk], [first, (head // group) * dk]), input_dtype))
        qk = None if output_from_new_state else pypto.expand_clone((q_rows * k_rows).sum(-1, keepdim=True),
                                                                   [tokens_per_seq, dv])
        v_rows = fp32_of(pypto.view(v, [tokens_per_seq, dv], [first, head * dv]), input_dtype)
        pypto.set_vec_tile_shapes(small_rows, 8)
        g_col = pypto.view(g, [tokens_per_seq, 1], [first, head])
        beta_col = pypto.view(beta, [tokens_per_seq, 1], [first, head])
        if gates is not None:
            gates = tuple(pypto.expand_clone(x, [tokens_per_seq, 1]) for x in gates)
        decay_col, beta_col = activations(g_col, beta_col, gates)
        pypto.set_vec_tile_shapes(small_rows, 128)
        decay = pypto.expand_clone(decay_col, [tokens_per_seq, dv])
        beta_cols = pypto.expand_clone(beta_col, [tokens_per_seq, dv])
        beta_v = v_rows * beta_cols
        out = []
        for j in range(tokens_per_seq):
            pypto.set_vec_tile_shapes(1, 128)
            out.append([tuple(None if x is None else pypto.view(x, [1, width], [j, 0]) for x, width in (
                (q_rows, dk), (k_rows, dk), (decay, dv), (beta_cols, dv), (beta_v, dv), (qk, dv)))])
        return out

    def decayed_row(pool: Any, first_row: Any, decay: Any, keep: Any = None) -> list:
        """The pool row starting at ``first_row`` times exp(g) ``[1, V]``, as fp32 blocks
        ``[state_rows, V]``: one copy of the row (K <= 128) multiplied once, so the copy
        has one consumer (a view read by several ops is copied in once per op).
        ``keep`` ``[1, V]`` bool: zeros where false (the row read in its place masked out)."""
        pypto.set_vec_tile_shapes(read_rows_tile, 128)
        row = pypto.view(pool, [dk, dv], [first_row, 0])
        if keep is not None:
            row = pypto.where(keep, row, 0.0)
        row = fp32_of(row, pool_dtype) * decay
        pypto.set_vec_tile_shapes(state_rows, 128)
        return [pypto.view(row, [state_rows, dv], [r, 0]) for r in range(0, dk, state_rows)]

    def on_chip_row(seed: Any, decay: Any) -> list:
        """The bench's stand-in for :func:`decayed_row`: ``seed`` ``[1, V]`` (a row of a
        computed tile; rounded to a 2-byte pool's dtype) expanded to each block ``[state_rows,
        V]`` (where a row would be copied in), cast to fp32 as a 2-byte row is, times exp(g)
        ``[1, V]``. Per block one expansion and one multiply (a 64-row block each: a
        ``[K, V]`` expansion spills in the cost model)."""
        if pool_dtype != "float32":  # the row in the pool's dtype, as a 2-byte row is copied in
            pypto.set_vec_tile_shapes(1, 128)
            seed = pypto.cast(seed, pool_dt)
        pypto.set_vec_tile_shapes(state_rows, 128)
        return [fp32_of(pypto.expand_clone(seed, [state_rows, dv]), pool_dtype) * decay
                for _ in range(0, dk, state_rows)]

    def head_token(state: Optional[list], inputs: tuple, o: Any, o_row: Any, o_col: Any) -> list:
        """One token on one value head: writes the output ``[1, V]`` at ``o[o_row, o_col:]``,
        returns the state after it (fp32 blocks). ``state``: the state before it already
        times exp(g) (:func:`decayed_row`, or the previous state times the decay), None
        for a zero state. With ``d = exp(g)``::

            kv = (d S)^T k,  u = beta v - beta kv,  S' = d S + k u^T,
            o = S'^T q  (fla's order)  or  o = (d S)^T q + (q . k) u

        The first (``output_from_new_state``) has no ``q . k`` term and leaves one matvec
        once q is on chip; the second reads the output from the state before the update
        (a zero state: ``o = (q . k) u``). Which one the cost model runs faster depends
        on how its scheduler places the tiles (``output_from_new_state`` above). Each
        block's column sums are taken apart and added (a sum over the whole ``[K, V]`` is
        a pairwise reduction across its tiles)."""
        q_t, k_t, _, beta_t, beta_v, qk = inputs
        pypto.set_vec_tile_shapes(state_rows, 128)
        k_col, q_col = pypto.transpose(k_t, 0, 1), pypto.transpose(q_t, 0, 1)  # [K, 1]
        k_blocks = [pypto.view(k_col, [state_rows, 1], [r, 0]) for r in range(0, dk, state_rows)]
        q_blocks = [pypto.view(q_col, [state_rows, 1], [r, 0]) for r in range(0, dk, state_rows)]
        late_output = output_from_new_state and state is not None
        kv = sq = None
        for block, k_b, q_b in zip(state or [], k_blocks, q_blocks):
            kv_b = (block * k_b).sum(0, keepdim=True)
            kv = kv_b if kv is None else kv + kv_b
            if not late_output:
                sq_b = (block * q_b).sum(0, keepdim=True)
                sq = sq_b if sq is None else sq + sq_b
        pypto.set_vec_tile_shapes(1, 128)
        u = beta_v if state is None else beta_v - kv * beta_t
        if not late_output:
            o_t = u * qk if state is None else sq + u * qk
            pypto.assemble(o_t, [o_row, o_col], o)
        pypto.set_vec_tile_shapes(state_rows, 128)
        update = [pypto.expand_clone(k_b, [state_rows, dv]) * u for k_b in k_blocks]
        new_state = update if state is None else [block + up for block, up in zip(state, update)]
        if late_output:
            o_t = None
            for block, q_b in zip(new_state, q_blocks):
                o_b = (block * q_b).sum(0, keepdim=True)
                o_t = o_b if o_t is None else o_t + o_b
            pypto.set_vec_tile_shapes(1, 128)
            pypto.assemble(o_t, [o_row, o_col], o)
        return new_state

    def store(pool_out: Any, state: list, first_row: Any) -> None:
        pypto.set_vec_tile_shapes(state_rows, 128)
        for r, block in zip(range(0, dk, state_rows), state):
            pypto.assemble(block if pool_dtype == "float32" else pypto.cast(block, pool_dt),
                           [first_row + r, 0], pool_out)

    def one_token_body(q: Any, k: Any, v: Any, g: Any, beta: Any, pool: Any, o: Any, pool_out: Any, seq: Any,
                       first_head: Any, row_in: Any, row_out: Any, gates: Optional[tuple[Any, Any]] = None) -> None:
        """One token of sequence ``seq`` on the body's value heads, one head after another
        (its row read, stepped, stored before the next: the rows do not pile up in the
        unified buffer). ``row_in``/``row_out``: the rows read and written, None for -1."""
        per_head = one_token_inputs(q, k, v, g, beta, seq, first_head, gates, zero_state=row_in is None)[0]
        for h in range(heads):
            head = first_head + h
            if _state_on_chip_for_bench:
                state = on_chip_row(per_head[h][4], per_head[h][2])
            else:
                state = None if row_in is None else decayed_row(pool, (row_in * num_v_heads + head) * dk,
                                                                per_head[h][2])
            state = head_token(state, per_head[h], o, seq, head * dv)
            if _state_on_chip_for_bench:
                bench_store_cast(pool_out, state, seq, head)
            elif row_out is not None:
                store(pool_out, state, (row_out * num_v_heads + head) * dk)

    def bench_store_cast(pool_out: Any, state: list, seq: Any, head: Any) -> None:
        """The bench's stand-in for :func:`store`: a 2-byte pool's cast of each block, one
        ``[1, V]`` row of it written to ``pool_out`` row ``(seq * HV + head) * K / state_rows
        + block`` (256 bytes a block: an unused cast is dropped by pypto, and with it the
        state's last add); nothing for fp32 (the state after the update feeds o)."""
        if pool_dtype != "float32":
            blocks = dk // state_rows
            for b, block in enumerate(state):
                pypto.set_vec_tile_shapes(state_rows, 128)
                cast = pypto.cast(block, pool_dt)
                pypto.set_vec_tile_shapes(1, 128)
                pypto.assemble(pypto.view(cast, [1, dv], [0, 0]), [(seq * num_v_heads + head) * blocks + b, 0],
                               pool_out)

    def sequence_start(read_rows: Any, pool: Any, seq: Any, head: Any, inputs: list) -> list:
        """The first token's decayed start state (-1 rows: zeros, row 0 read and masked)."""
        row_in = read_rows[seq, 0]
        pypto.set_vec_tile_shapes(1, 128)
        keep = pypto.expand_clone(pypto.cast(pypto.view(read_rows, [1, 1], [seq, 0]), fp32), [1, dv]) >= 0.0
        return decayed_row(pool, (pypto.max(row_in, 0) * num_v_heads + head) * dk, inputs[0][0][2], keep)

    def sequence_token(state: list, inputs: list, o: Any, seq: Any, head: Any, j: int) -> list:
        if j > 0:  # the state times this token's decay
            pypto.set_vec_tile_shapes(state_rows, 128)
            state = [block * inputs[j][0][2] for block in state]
        return head_token(state, inputs[j][0], o, seq * tokens_per_seq + j, head * dv)

    def sequence_store(pool_out: Any, state: list, row_out: Any, head: Any) -> None:
        store(pool_out, state, (row_out * num_v_heads + head) * dk)

    token_offsets = tuple(range(tokens_per_seq))

    def sequence_states(q: Any, k: Any, v: Any, g: Any, beta: Any, read_rows: Any, pool: Any, seq: Any,
                        first_head: Any, gates: Optional[tuple[Any, Any]]) -> tuple[list, list]:
        """A several-token body's inputs and decayed start states, per value head."""
        pypto.set_vec_tile_shapes(8, 8)
        per_head = [None if gates is None else tuple(pypto.view(x, [1, 1], [0, h]) for x in gates)
                    for h in range(heads)]  # the body's gate terms are [1, heads]
        inputs = [sequence_inputs(q, k, v, g, beta, seq, first_head + h, per_head[h]) for h in range(heads)]
        if _state_on_chip_for_bench:
            return inputs, [on_chip_row(inputs[h][0][0][4], inputs[h][0][0][2]) for h in range(heads)]
        return inputs, [sequence_start(read_rows, pool, seq, first_head + h, inputs[h]) for h in range(heads)]

    def sequence_tokens(states: list, inputs: list, o: Any, seq: Any, first_head: Any, j: int) -> list:
        """Token ``j`` on the body's value heads, one after another."""
        return [sequence_token(states[h], inputs[h], o, seq, first_head + h, j) for h in range(heads)]

    def sequence_stores(pool_out: Any, states: list, row_out: Any, first_head: Any) -> None:
        for h in range(heads):
            sequence_store(pool_out, states[h], row_out, first_head + h)

    jit = pypto.frontend.jit(runtime_options={"run_mode": run_mode, "stitch_function_max_num": STITCH_BODIES},
                             pass_options={"pg_skip_partition": True})
    q_shape = [pypto.DYNAMIC, dk] if one_token else [num_tokens, num_qk_heads * dk]  # rows: T * H or T
    v_shape = [pypto.DYNAMIC, dv] if one_token else [num_tokens, num_v_heads * dv]

    # The pool is passed twice, as the input the rows are read from and the output they are
    # written to (one tensor read and assembled into in one kernel fails to compile in
    # pypto 0.2.0: F21007); the host passes the same storage for both. A branch on a
    # symbolic value must stand in the kernel's own body: the one-token kernel branches on
    # the rows read and written (four paths), the several-token one on each token's row
    # (2^S paths; none with store_every_token).
    @jit
    def gdr_decode_kernel(
        q: pypto.Tensor(q_shape, in_dt),
        k: pypto.Tensor(q_shape, in_dt),
        v: pypto.Tensor(v_shape, in_dt),
        g: pypto.Tensor([num_tokens, num_v_heads], fp32),
        beta: pypto.Tensor([num_tokens, num_v_heads], fp32),
        read_rows: pypto.Tensor([pypto.DYNAMIC, 1], pypto.DT_INT32),
        write_rows: pypto.Tensor([num_tokens], pypto.DT_INT32),
        bodies: pypto.Tensor([1], pypto.DT_INT32),
        pool: pypto.Tensor([pool_rows, dv], pool_dt),
        o: pypto.Tensor([num_tokens, num_v_heads * dv], fp32),
        pool_out: pypto.Tensor([pool_rows, dv], pool_dt),
    ):
        for body in pypto.loop(bodies[0], name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            seq = body // bodies_per_seq
            first_head = (body % bodies_per_seq) * heads
            if one_token:
                row_in = read_rows[seq, 0]
                row_out = write_rows[seq]
                if row_in >= 0:
                    if row_out >= 0:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, row_in, row_out)
                    else:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, row_in, None)
                else:
                    if row_out >= 0:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, None, row_out)
                    else:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, None, None)
            else:
                inputs, states = sequence_states(q, k, v, g, beta, read_rows, pool, seq, first_head, None)
                for j in token_offsets:  # unrolled: the states stay on chip from token to token
                    states = sequence_tokens(states, inputs, o, seq, first_head, j)
                    row_out = write_rows[seq * tokens_per_seq + j]
                    if store_every_token:
                        sequence_stores(pool_out, states, row_out, first_head)
                    elif row_out >= 0:  # one branch a token for all the body's heads
                        sequence_stores(pool_out, states, row_out, first_head)

    # The gated variant: the same body with the raw gate's parameters (a second jit function:
    # pypto reads the signature, and the plain kernel keeps its arguments).
    @jit
    def gdr_decode_gated_kernel(
        q: pypto.Tensor(q_shape, in_dt),
        k: pypto.Tensor(q_shape, in_dt),
        v: pypto.Tensor(v_shape, in_dt),
        g: pypto.Tensor([num_tokens, num_v_heads], fp32),
        beta: pypto.Tensor([num_tokens, num_v_heads], fp32),
        gate_params: pypto.Tensor([2, num_v_heads], fp32),
        read_rows: pypto.Tensor([pypto.DYNAMIC, 1], pypto.DT_INT32),
        write_rows: pypto.Tensor([num_tokens], pypto.DT_INT32),
        bodies: pypto.Tensor([1], pypto.DT_INT32),
        pool: pypto.Tensor([pool_rows, dv], pool_dt),
        o: pypto.Tensor([num_tokens, num_v_heads * dv], fp32),
        pool_out: pypto.Tensor([pool_rows, dv], pool_dt),
    ):
        for body in pypto.loop(bodies[0], name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            seq = body // bodies_per_seq
            first_head = (body % bodies_per_seq) * heads
            gates = gate_terms(gate_params, first_head)
            if one_token:
                row_in = read_rows[seq, 0]
                row_out = write_rows[seq]
                if row_in >= 0:
                    if row_out >= 0:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, row_in, row_out, gates)
                    else:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, row_in, None, gates)
                else:
                    if row_out >= 0:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, None, row_out, gates)
                    else:
                        one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, None, None, gates)
            else:
                inputs, states = sequence_states(q, k, v, g, beta, read_rows, pool, seq, first_head, gates)
                for j in token_offsets:  # unrolled: the states stay on chip from token to token
                    states = sequence_tokens(states, inputs, o, seq, first_head, j)
                    row_out = write_rows[seq * tokens_per_seq + j]
                    if store_every_token:
                        sequence_stores(pool_out, states, row_out, first_head)
                    elif row_out >= 0:  # one branch a token for all the body's heads
                        sequence_stores(pool_out, states, row_out, first_head)

    if _state_on_chip_for_bench:
        # The bench's yardstick (no pool traffic): the plain kernel's signature, its body
        # without the branches on the rows and without the stores.
        @jit
        def gdr_decode_state_on_chip_kernel(
            q: pypto.Tensor(q_shape, in_dt),
            k: pypto.Tensor(q_shape, in_dt),
            v: pypto.Tensor(v_shape, in_dt),
            g: pypto.Tensor([num_tokens, num_v_heads], fp32),
            beta: pypto.Tensor([num_tokens, num_v_heads], fp32),
            read_rows: pypto.Tensor([pypto.DYNAMIC, 1], pypto.DT_INT32),
            write_rows: pypto.Tensor([num_tokens], pypto.DT_INT32),
            bodies: pypto.Tensor([1], pypto.DT_INT32),
            pool: pypto.Tensor([pool_rows, dv], pool_dt),
            o: pypto.Tensor([num_tokens, num_v_heads * dv], fp32),
            pool_out: pypto.Tensor([pool_rows, dv], pool_dt),
        ):
            for body in pypto.loop(bodies[0], name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
                seq = body // bodies_per_seq
                first_head = (body % bodies_per_seq) * heads
                if one_token:
                    one_token_body(q, k, v, g, beta, pool, o, pool_out, seq, first_head, 0, None)
                else:
                    inputs, states = sequence_states(q, k, v, g, beta, read_rows, pool, seq, first_head, None)
                    for j in token_offsets:
                        states = sequence_tokens(states, inputs, o, seq, first_head, j)
                        for h, state in enumerate(states):
                            bench_store_cast(pool_out, state, seq, first_head + h)

        return gdr_decode_state_on_chip_kernel
    return gdr_decode_gated_kernel if gate_in_kernel else gdr_decode_kernel
