"""The gated delta rule decode step over a state pool as one PyPTO kernel (pypto 0.2.0).

One launch runs the whole batch: every (sequence, value head) pair is an independent
iteration of one flat loop (parallel work on a 910B: each pair owns its state row), and
within a pair the S tokens of the sequence (S = 1 for plain decode, up to 8 for
speculative verification) run one after another on the state row held as a ``[K, V]``
fp32 tile. Per token, on the vector unit::

    S    <- exp(g) S                        decay
    kv    = S^T k                           matvec: (S * k[:, None]).sum(0)   [1, V]
    u     = beta (v - kv)
    S    <- S + k u^T                       rank-1 update                     [K, V]
    o     = S^T (scale q)                   matvec                            [1, V]

and the state after the token is stored to the pool row its sequence names for that
token. Rows are read and written in place through the row tables; a row of -1 reads as
a zero state and is never written (a symbolic ``if`` on the table entry).

Kernel arguments, in order (every tensor two-dimensional or one-dimensional, contiguous):

==============  ============================  ============================================
name            shape                         meaning
==============  ============================  ============================================
q, k            ``[B * S, H * K]`` in_dtype   queries, keys; token j of sequence n in row
                                              ``n * S + j``
v               ``[B * S, HV * V]`` in_dtype  values (value head h reads q/k head
                                              ``h // (HV // H)``)
g, beta         ``[B * S, HV]`` fp32          log decay, write strength
read_rows       ``[B]`` int32                 pool row each sequence starts from (-1: zeros)
write_rows      ``[B * S]`` int32             pool row the state after token j of sequence
                                              n goes to (-1: not written)
pool            ``[slots * HV * K, V]``       the pool ``[slots, HV, K, V]`` key-first,
                pool_dtype                    flattened; the rows are read from it
o               ``[B * S, HV * V]`` fp32      outputs
pool_out        as pool                       the same storage as ``pool``: the rows are
                                              written to it, in place
==============  ============================  ============================================

B is the batch bucket (the host pads with sequences whose rows are all -1), so the kernel
is specialised on it and not on the batch size; the pool's row count stays dynamic.
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

from typing import Any

from torch_gdr._layout import L2NORM_EPS  # the in-kernel l2 norm's epsilon

from ._env import import_pypto
from .spec import HEAD_DIMS as SUPPORTED_HEAD_DIMS

#: Input dtypes of q, k and v the kernel reads itself.
SUPPORTED_INPUT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: Pool dtypes the kernel reads and writes (states are computed in fp32, rounded on store).
SUPPORTED_POOL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: Most tokens per sequence in one step (speculative verification width).
MAX_TOKENS_PER_SEQ = 8


def _pypto_dtype(name: str) -> Any:
    pypto = import_pypto()
    return {"float32": pypto.DT_FP32, "float16": pypto.DT_FP16, "bfloat16": pypto.DT_BF16}[name]


def validate_decode_config(*, batch_bucket: int, num_qk_heads: int, num_v_heads: int, head_k_dim: int,
                           head_v_dim: int, tokens_per_seq: int, input_dtype: str, pool_dtype: str) -> None:
    """Raise ValueError for a configuration the decode kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim}: expected values in {SUPPORTED_HEAD_DIMS}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_qk_heads={num_qk_heads}")
    if batch_bucket <= 0:
        raise ValueError(f"batch_bucket: expected a positive int, got {batch_bucket}")
    if not 1 <= tokens_per_seq <= MAX_TOKENS_PER_SEQ:
        raise ValueError(f"tokens_per_seq: expected 1..{MAX_TOKENS_PER_SEQ}, got {tokens_per_seq}")
    if input_dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"input_dtype {input_dtype!r} not in {SUPPORTED_INPUT_DTYPES}")
    if pool_dtype not in SUPPORTED_POOL_DTYPES:
        raise ValueError(f"pool_dtype {pool_dtype!r} not in {SUPPORTED_POOL_DTYPES}")


def build_decode_kernel(
    *,
    batch_bucket: int,
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
) -> Any:
    """Build (trace lazily, on first call) the decode-step kernel for one configuration.

    Args:
        batch_bucket: B, the sequences of a launch (the host pads a smaller batch).
        num_qk_heads: H. num_v_heads: HV, a multiple of H.
        head_k_dim, head_v_dim: K and V, each 64 or 128.
        tokens_per_seq: S, tokens of every sequence (1..8; shorter sequences are padded by
            the host with tokens whose write rows are -1).
        use_qk_l2norm: l2-normalise q and k per token before use.
        scale: factor applied to q (after the norm).
        input_dtype: dtype of q, k, v. pool_dtype: dtype of the pool.
        on_device: run mode NPU rather than SIM (CPU; see :mod:`.interpreter`).

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring.
    """
    validate_decode_config(batch_bucket=batch_bucket, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads,
                           head_k_dim=head_k_dim, head_v_dim=head_v_dim, tokens_per_seq=tokens_per_seq,
                           input_dtype=input_dtype, pool_dtype=pool_dtype)
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    in_dt, pool_dt = _pypto_dtype(input_dtype), _pypto_dtype(pool_dtype)
    group = num_v_heads // num_qk_heads
    num_pairs = batch_bucket * num_v_heads
    num_tokens = batch_bucket * tokens_per_seq
    dk, dv = head_k_dim, head_v_dim
    pool_rows = pypto.DYNAMIC
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM
    state_rows = min(dk, 64)  # vector tile rows of the [K, V] state (64 x 128 fp32: 32 KiB)

    def token_row(src: Any, width: int, head: Any, token: Any) -> Any:
        """Row ``token`` of head ``head`` of ``src [tokens, heads * width]``, fp32 ``[1, width]``."""
        x = pypto.view(src, [1, width], [token, head * width])
        return x if input_dtype == "float32" else pypto.cast(x, fp32)

    def normalised(x: Any) -> Any:
        return x / pypto.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) if use_qk_l2norm else x

    def start_state(pool: Any, read_rows: Any, seq: Any, head: Any) -> Any:
        """The state sequence ``seq`` starts from on head ``head``, fp32 ``[K, V]``: its pool
        row, or zeros for row -1 (row 0 is read in its place and masked out, so a row
        holding NaN or inf never leaks)."""
        row_in = read_rows[seq]
        pypto.set_vec_tile_shapes(1, 128)
        row_value = pypto.cast(pypto.view(read_rows, [1], [seq]), fp32).reshape([1, 1])
        keep = pypto.expand_clone(row_value, [1, dv]) >= 0.0  # [1, V]
        pypto.set_vec_tile_shapes(state_rows, 128)
        stored = pypto.view(pool, [dk, dv], [(pypto.max(row_in, 0) * num_v_heads + head) * dk, 0])
        stored = pypto.cast(stored, fp32) if pool_dtype != "float32" else stored
        return pypto.where(keep, stored, 0.0)

    def token_step(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, token: Any, head: Any) -> tuple[Any, Any]:
        """One token on one value head: the state after it ``[K, V]`` and the output ``[1, V]``."""
        qk_head = head // group
        pypto.set_vec_tile_shapes(1, 128)
        q_t = normalised(token_row(q, dk, qk_head, token)) * scale
        k_t = normalised(token_row(k, dk, qk_head, token))
        v_t = token_row(v, dv, head, token)
        # [1, V] rows broadcast down the state's K rows (an expansion of one axis)
        decay = pypto.expand_clone(pypto.exp(pypto.view(g, [1, 1], [token, head])), [1, dv])
        beta_t = pypto.view(beta, [1, 1], [token, head])
        pypto.set_vec_tile_shapes(state_rows, 128)
        k_col = pypto.expand_clone(pypto.transpose(k_t, 0, 1), [dk, dv])
        q_col = pypto.expand_clone(pypto.transpose(q_t, 0, 1), [dk, dv])
        state = state * decay
        kv = (state * k_col).sum(0, keepdim=True)  # S^T k, [1, V]
        pypto.set_vec_tile_shapes(1, 128)
        u = (v_t - kv) * beta_t
        pypto.set_vec_tile_shapes(state_rows, 128)
        state = state + k_col * u  # + k u^T
        o_t = (state * q_col).sum(0, keepdim=True)  # S^T q, [1, V]
        return state, o_t

    def stored_state(state: Any) -> Any:
        pypto.set_vec_tile_shapes(state_rows, 128)
        return state if pool_dtype == "float32" else pypto.cast(state, pool_dt)

    token_offsets = tuple(range(tokens_per_seq))

    # The pool is passed twice, as the input the rows are read from and the output they are
    # written to (one tensor read and assembled into in one kernel fails to compile in
    # pypto 0.2.0: F21007); the host passes the same storage for both.
    @pypto.frontend.jit(runtime_options={"run_mode": run_mode})
    def gdr_decode_kernel(
        q: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        k: pypto.Tensor([num_tokens, num_qk_heads * dk], in_dt),
        v: pypto.Tensor([num_tokens, num_v_heads * dv], in_dt),
        g: pypto.Tensor([num_tokens, num_v_heads], fp32),
        beta: pypto.Tensor([num_tokens, num_v_heads], fp32),
        read_rows: pypto.Tensor([batch_bucket], pypto.DT_INT32),
        write_rows: pypto.Tensor([num_tokens], pypto.DT_INT32),
        pool: pypto.Tensor([pool_rows, dv], pool_dt),
        o: pypto.Tensor([num_tokens, num_v_heads * dv], fp32),
        pool_out: pypto.Tensor([pool_rows, dv], pool_dt),
    ):
        for pair in pypto.loop(num_pairs, name="LOOP_SEQ_HEAD", idx_name="pair", parallel=True):
            seq = pair // num_v_heads
            head = pair % num_v_heads
            state = start_state(pool, read_rows, seq, head)
            for j in token_offsets:  # unrolled: the state stays on chip from token to token
                token = seq * tokens_per_seq + j
                state, o_t = token_step(q, k, v, g, beta, state, token, head)
                pypto.set_vec_tile_shapes(1, 128)
                pypto.assemble(o_t, [token, head * dv], o)
                row_out = write_rows[token]
                # (a branch on a symbolic value must stand in the kernel's own body)
                if row_out >= 0:
                    pypto.assemble(stored_state(state), [(row_out * num_v_heads + head) * dk, 0], pool_out)

    return gdr_decode_kernel


def build_pool_copy_kernel(*, batch: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, tokens_per_seq: int,
                           pool_dtype: str = "float32") -> Any:
    """A kernel that moves the pool-row bytes of a decode step and does nothing else, in
    SIM run mode: the memory bound of :func:`build_decode_kernel` as pypto's cost model
    sees it (``bench/pypto_cost_model.py --decode``).

    Same loop and tiles as the decode kernel: each (sequence, value head) reads its
    ``[K, V]`` row once and writes it to each of its S rows. Arguments: ``read_rows [B]``
    int32, ``write_rows [B * S]`` int32 (valid rows only), ``pool`` and ``pool_out``
    ``[slots * HV * K, V]`` (one storage, as for the decode kernel).
    """
    pypto = import_pypto()
    pool_dt = _pypto_dtype(pool_dtype)
    hv, dk, dv, s = num_v_heads, head_k_dim, head_v_dim, tokens_per_seq
    state_rows = min(dk, 64)
    token_offsets = tuple(range(s))

    @pypto.frontend.jit(runtime_options={"run_mode": pypto.RunMode.SIM})
    def pool_row_copy(
        read_rows: pypto.Tensor([batch], pypto.DT_INT32),
        write_rows: pypto.Tensor([batch * s], pypto.DT_INT32),
        pool: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
        pool_out: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
    ):
        for pair in pypto.loop(batch * hv, name="LOOP_SEQ_HEAD", idx_name="pair", parallel=True):
            seq = pair // hv
            head = pair % hv
            pypto.set_vec_tile_shapes(state_rows, 128)
            row = pypto.view(pool, [dk, dv], [(read_rows[seq] * hv + head) * dk, 0]) + 0.0
            for j in token_offsets:
                pypto.assemble(row, [(write_rows[seq * s + j] * hv + head) * dk, 0], pool_out)

    return pool_row_copy
