"""The gated delta rule decode step over a state pool as one PyPTO kernel (pypto 0.2.0).

One launch runs the whole batch. The loop bodies are independent: each owns the state
rows of one sequence on one value head, or on all the value heads of one key head
(:func:`value_heads_per_body`: one head per body while every pair gets a vector core of
its own, so a small batch's latency is one pair's; the group once the bodies queue, so q
and k are read and normalised once and the scheduler meets half the tasks). Within a
body the S tokens of the sequence (S = 1 for plain decode, up to 16 for speculative
verification) run one after another on the state rows held as fp32 blocks of 64 rows. Per
token and value head, on the vector unit, with ``d = exp(g)``::

    kv    = S^T k,   sq = S^T q             two matvecs of the state before the token,
                                            (S * k[:, None]).sum(0)             [1, V]
    u     = beta (v - d kv)
    o     = d sq + (q . k) u                = S'^T q
    S'    = d S + k u^T                     the decayed state plus the rank-1 update

(q scaled after its norm), and the state after the token is stored to the pool row its
sequence names for that token. Both matvecs read the state the token starts from, so they
do not wait for the update, and the update is the state's only other pass. Rows are read
and written in place through the row tables; a row of -1 reads as a zero state and is
never written (a symbolic ``if`` on the table entry).

What the cost model charges (bench/RESULTS.md has the figures): pypto splits a body into
a task per dependency chain and per state tile (about ten dependent vector tasks per
pair and token, each waiting 5-9k cycles for the scheduler), and submits ten bodies at a
time by default. So the kernel compiles each body into one vector task
(``pg_skip_partition``) and submits up to :data:`STITCH_BODIES` bodies at once. Within a
task, every copy between memory and the unified buffer costs about 1,400 cycles
whatever its size (32 KiB: 1,750), one after another on the task's copy-in pipe, which
bounds the task. Hence: each input read straight from memory where it is used (a view of
an on-chip tensor is a round trip through memory: the decays are read per head rather
than as one row of the group), the row table two-dimensional (its ``[1, 1]`` view needs
no reshape, another round trip), and the state tiles at 64 rows (32-row tiles double the
copies; 128-row fp32 tiles fail in the cost model). The state is held as separate
64-row blocks: a column sum over the whole ``[K, V]`` is a pairwise reduction across its
tiles, an order of magnitude dearer on the vector pipe than the blocks' own sums added.
A 2-byte pool row (bf16, fp16) is read whole, ``[K, V]`` in one copy (as many bytes as
one fp32 block: one copy where fp32 needs two), masked in its own dtype and cast to fp32
block by block (slices of an on-chip tile that match the blocks stay on chip). What is
left: the copies and, for fp32, a few tiles the unified buffer spills.

Kernel arguments, in order (every tensor two-dimensional or one-dimensional, contiguous):

==============  ============================  ============================================
name            shape                         meaning
==============  ============================  ============================================
q, k            ``[B * S, H * K]`` in_dtype   queries, keys; token j of sequence n in row
                                              ``n * S + j``
v               ``[B * S, HV * V]`` in_dtype  values (value head h reads q/k head
                                              ``h // (HV // H)``)
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
per body and the raw gate once per token, each as a row over the body's heads (fewer
copies than a ``[1, 1]`` view per head). With ``beta_sigmoid_in_kernel`` it reads beta as logits and takes ``s *
sigmoid(beta)``, ``s = 2`` with ``allow_neg_eigval``. Without either flag the kernel is the
plain one (no ``gate_params`` argument).

The batch B is not built into the kernel: every tensor's first dimension is dynamic and
the body loop runs ``bodies[0]`` times (in the cost model a loop bound read from a tensor
costs the same cycles as a constant one: 22,308 / 91,769 at B = 1 / 8, H16/HV32). The kernel
is specialised on S (the host pads S to a bucket, :func:`torch_gdr.ops.pypto.decode.token_bucket`)
and on the value heads per body, so a configuration has at most 16 decode kernels.
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


def value_heads_per_body(num_seqs: int, num_qk_heads: int, num_v_heads: int) -> int:
    """Value heads one loop body (one vector task) runs: 1 while every (sequence, value
    head) pair gets a vector core of its own (the step's latency is one pair's), else all
    the value heads of a key head (q and k read and normalised once; half the tasks at
    HV = 2H, which the scheduler's cost per task favours)."""
    if num_seqs * num_v_heads <= VECTOR_CORES:
        return 1
    return num_v_heads // num_qk_heads


def validate_decode_config(*, heads_per_body: int, num_qk_heads: int, num_v_heads: int, head_k_dim: int,
                           head_v_dim: int, tokens_per_seq: int, input_dtype: str, pool_dtype: str) -> None:
    """Raise ValueError for a configuration the decode kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim}: expected values in {SUPPORTED_HEAD_DIMS}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_qk_heads={num_qk_heads}")
    if heads_per_body not in (1, num_v_heads // num_qk_heads):
        raise ValueError(f"heads_per_body: expected 1 or num_v_heads // num_qk_heads = {num_v_heads // num_qk_heads}, "
                         f"got {heads_per_body}")
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
) -> Any:
    """Build (trace lazily, on first call) the decode-step kernel for one configuration.

    Args:
        heads_per_body: value heads one loop body runs, 1 or HV / H
            (:func:`value_heads_per_body` of the launch's batch). The batch itself is not
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

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring.
    """
    validate_decode_config(heads_per_body=heads_per_body, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads,
                           head_k_dim=head_k_dim, head_v_dim=head_v_dim, tokens_per_seq=tokens_per_seq,
                           input_dtype=input_dtype, pool_dtype=pool_dtype)
    if allow_neg_eigval and not beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires beta_sigmoid_in_kernel=True, got beta_sigmoid_in_kernel=False")
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    in_dt, pool_dt = _pypto_dtype(input_dtype), _pypto_dtype(pool_dtype)
    group = num_v_heads // num_qk_heads
    bodies_per_seq = num_v_heads // heads_per_body
    num_tokens = pypto.DYNAMIC
    dk, dv = head_k_dim, head_v_dim
    pool_rows = pypto.DYNAMIC
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM
    state_rows = min(dk, 64)  # vector tile rows of the [K, V] state (64 x 128 fp32: 32 KiB)

    def token_row(src: Any, width: int, col: Any, token: Any) -> Any:
        """Columns ``[col, col + width)`` of row ``token`` of ``src``, fp32 ``[1, width]``."""
        x = pypto.view(src, [1, width], [token, col])
        return x if input_dtype == "float32" else pypto.cast(x, fp32)

    def normalised(x: Any) -> Any:
        return x / pypto.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) if use_qk_l2norm else x

    def row_kept(read_rows: Any, seq: Any) -> tuple[Any, Any]:
        """The pool row sequence ``seq`` starts from (symbolic) and ``[1, V]`` bool:
        whether it reads one (its row is not -1)."""
        row_in = read_rows[seq, 0]
        pypto.set_vec_tile_shapes(1, 128)
        row_value = pypto.cast(pypto.view(read_rows, [1, 1], [seq, 0]), fp32)
        return row_in, pypto.expand_clone(row_value, [1, dv]) >= 0.0

    def start_state(pool: Any, row_in: Any, keep: Any, head: Any) -> list:
        """The state a sequence starts from on value head ``head``, as its row blocks (fp32
        ``[state_rows, V]`` each, K / state_rows of them): its pool row ``row_in``, or zeros
        where ``keep`` ``[1, V]`` is false (row -1: row 0 is read in its place and masked
        out, so a row holding NaN or inf never leaks)."""
        first_row = (pypto.max(row_in, 0) * num_v_heads + head) * dk
        if pool_dtype == "float32":
            pypto.set_vec_tile_shapes(state_rows, 128)
            return [pypto.where(keep, pypto.view(pool, [state_rows, dv], [first_row + r, 0]), 0.0)
                    for r in range(0, dk, state_rows)]
        # a 2-byte row: one copy of the whole [K, V] row (one tile), cast per block
        pypto.set_vec_tile_shapes(dk, 128)
        stored = pypto.where(keep, pypto.view(pool, [dk, dv], [first_row, 0]), 0.0)
        pypto.set_vec_tile_shapes(state_rows, 128)
        return [pypto.cast(pypto.view(stored, [state_rows, dv], [r, 0]), fp32) for r in range(0, dk, state_rows)]

    def token_step(state: list, q_t: Any, k_t: Any, v_t: Any, decay: Any, beta_t: Any, qk: Any) -> tuple[list, Any]:
        """One token on one value head: the state after it (row blocks, as
        :func:`start_state`) and the output ``[1, V]``, from the state before it, q and k
        ``[1, K]``, v ``[1, V]``, exp(g) and q . k as ``[1, V]`` rows and beta ``[1, 1]``.
        Each block's column sums are taken apart and added (a sum over the whole ``[K, V]``
        costs a pairwise reduction across the tiles)."""
        pypto.set_vec_tile_shapes(state_rows, 128)
        k_col = pypto.transpose(k_t, 0, 1)  # [K, 1]
        q_col = pypto.transpose(q_t, 0, 1)
        k_blocks = [pypto.view(k_col, [state_rows, 1], [r, 0]) for r in range(0, dk, state_rows)]
        q_blocks = [pypto.view(q_col, [state_rows, 1], [r, 0]) for r in range(0, dk, state_rows)]
        kv = sq = None
        for block, k_b, q_b in zip(state, k_blocks, q_blocks):
            kv_b = (block * k_b).sum(0, keepdim=True)  # S^T k before the decay
            sq_b = (block * q_b).sum(0, keepdim=True)  # S^T q
            kv = kv_b if kv is None else kv + kv_b
            sq = sq_b if sq is None else sq + sq_b
        pypto.set_vec_tile_shapes(1, 128)
        u = (v_t - kv * decay) * beta_t
        o_t = sq * decay + u * qk  # (decayed S + k u^T)^T q
        pypto.set_vec_tile_shapes(state_rows, 128)
        state = [block * decay + pypto.expand_clone(k_b, [state_rows, dv]) * u for block, k_b in zip(state, k_blocks)]
        return state, o_t

    def gate_terms(gate_params: Any, first_head: Any) -> tuple[Any, Any]:
        """The body's ``(-exp(A_log), dt_bias)`` over its value heads, each fp32 ``[1, heads]``."""
        pypto.set_vec_tile_shapes(1, 128)
        rate = kernel_gating.gate_rate(pypto.view(gate_params, [1, heads_per_body], [0, first_head]))
        return rate, pypto.view(gate_params, [1, heads_per_body], [1, first_head])

    def body_beta(beta_g: Any) -> Any:
        """Beta ``[1, heads]`` as the kernel uses it: as given, or ``s * sigmoid(logits)``."""
        return kernel_gating.activated_beta(beta_g, allow_neg_eigval) if beta_sigmoid_in_kernel else beta_g

    def start_states(pool: Any, read_rows: Any, seq: Any, first_head: Any) -> list:
        """The states sequence ``seq`` starts from on the body's value heads, each fp32 ``[K, V]``."""
        row_in, keep = row_kept(read_rows, seq)
        return [start_state(pool, row_in, keep, first_head + h) for h in range(heads_per_body)]

    def body_token_step(q: Any, k: Any, v: Any, g: Any, beta: Any, o: Any, states: list, token: Any,
                        first_head: Any, gates: Optional[tuple[Any, Any]] = None) -> list:
        """One token on the body's value heads ``first_head + [0, heads_per_body)`` (one key
        head's): writes their outputs, returns their states. ``gates``: :func:`gate_terms`
        of the body where g is the raw gate, else None."""
        g_g = None
        qk_head = first_head // group
        pypto.set_vec_tile_shapes(1, 128)
        q_t = normalised(token_row(q, dk, qk_head * dk, token)) * scale
        k_t = normalised(token_row(k, dk, qk_head * dk, token))
        v_g = token_row(v, heads_per_body * dv, first_head * dv, token)  # [1, heads * V]
        beta_g = body_beta(pypto.view(beta, [1, heads_per_body], [token, first_head]))
        qk = pypto.expand_clone((q_t * k_t).sum(-1, keepdim=True), [1, dv])  # q . k
        if gates is not None:  # the activation on the row of the body's heads: one copy of g
            g_g = kernel_gating.log_decay(pypto.view(g, [1, heads_per_body], [token, first_head]), *gates)
        new_states = []
        for h in range(heads_per_body):
            pypto.set_vec_tile_shapes(1, 128)
            g_t = pypto.view(g, [1, 1], [token, first_head + h]) if gates is None else pypto.view(g_g, [1, 1], [0, h])
            decay = pypto.expand_clone(pypto.exp(g_t), [1, dv])
            beta_t = pypto.view(beta_g, [1, 1], [0, h])
            v_t = pypto.view(v_g, [1, dv], [0, h * dv])
            state, o_t = token_step(states[h], q_t, k_t, v_t, decay, beta_t, qk)
            new_states.append(state)
            pypto.set_vec_tile_shapes(1, 128)
            pypto.assemble(o_t, [token, (first_head + h) * dv], o)
        return new_states

    def store_states(pool_out: Any, states: list, row_out: Any, first_head: Any) -> None:
        for h, state in enumerate(states):
            pypto.set_vec_tile_shapes(state_rows, 128)
            for r, block in zip(range(0, dk, state_rows), state):
                stored = block if pool_dtype == "float32" else pypto.cast(block, pool_dt)
                pypto.assemble(stored, [(row_out * num_v_heads + first_head + h) * dk + r, 0], pool_out)

    token_offsets = tuple(range(tokens_per_seq))
    jit = pypto.frontend.jit(runtime_options={"run_mode": run_mode, "stitch_function_max_num": STITCH_BODIES},
                             pass_options={"pg_skip_partition": True})

    # The pool is passed twice, as the input the rows are read from and the output they are
    # written to (one tensor read and assembled into in one kernel fails to compile in
    # pypto 0.2.0: F21007); the host passes the same storage for both.
    @jit
    def gdr_decode_kernel(
        q: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        k: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        v: pypto.Tensor([num_tokens, num_v_heads * dv], in_dt),
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
            first_head = (body % bodies_per_seq) * heads_per_body
            states = start_states(pool, read_rows, seq, first_head)
            for j in token_offsets:  # unrolled: the states stay on chip from token to token
                token = seq * tokens_per_seq + j
                states = body_token_step(q, k, v, g, beta, o, states, token, first_head)
                row_out = write_rows[token]
                # (a branch on a symbolic value must stand in the kernel's own body)
                if store_every_token:
                    store_states(pool_out, states, row_out, first_head)
                elif row_out >= 0:
                    store_states(pool_out, states, row_out, first_head)

    # The gated variant: the same body with the raw gate's parameters (a second jit function:
    # pypto reads the signature, and the plain kernel keeps its arguments).
    @jit
    def gdr_decode_gated_kernel(
        q: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        k: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        v: pypto.Tensor([num_tokens, num_v_heads * dv], in_dt),
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
            first_head = (body % bodies_per_seq) * heads_per_body
            gates = gate_terms(gate_params, first_head)
            states = start_states(pool, read_rows, seq, first_head)
            for j in token_offsets:
                token = seq * tokens_per_seq + j
                states = body_token_step(q, k, v, g, beta, o, states, token, first_head, gates)
                row_out = write_rows[token]
                if store_every_token:
                    store_states(pool_out, states, row_out, first_head)
                elif row_out >= 0:
                    store_states(pool_out, states, row_out, first_head)

    return gdr_decode_gated_kernel if gate_in_kernel else gdr_decode_kernel

