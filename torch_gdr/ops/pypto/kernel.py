"""The chunked gated delta rule as a PyPTO kernel (pypto 0.2.0, fp32, token-major TND).

:func:`build_gdr_kernel` returns a ``pypto.frontend.jit`` kernel specialised on every size
the compiler needs concrete; the token count T stays dynamic. Kernel arguments, in order:

==============  =====================  ====================================================
name            shape                  meaning
==============  =====================  ====================================================
q, k            ``[T, H, K]`` fp32     queries, keys (H query/key heads)
v               ``[T, HV, V]`` fp32    values (HV value heads, ``HV % H == 0``)
g               ``[T, HV]`` fp32       raw per-token log decay (cumsum done in the kernel)
beta            ``[T, HV]`` fp32       delta-rule write strength
act_seq_len     ``[N + 1]`` int32      cumulative sequence offsets, last one == T
chunk_masks     ``[M, l, l]`` fp32     constant masks, see :func:`chunk_masks`
state_in        ``[N, HV, K, V]`` fp32 initial state, key-first (``[1, 1, 1, 1]`` and
                                       never read when ``has_initial_state`` is False)
o               ``[T, HV, V]`` fp32    output
state_out       ``[N, HV, K, V]`` fp32 final state, key-first
==============  =====================  ====================================================

State orientation: key-first ``S [K, V]`` throughout, the layout of the public op, so no
transposes are needed at either end. Value head ``h`` reads q/k head ``h // (HV // H)``.

Per chunk of l tokens (rows r, s of the chunk; ``gamma`` the within-chunk cumsum of g)::

    gamma = tril @ g                           Gamma_rs = exp(gamma_r - gamma_s), r >= s
    A     = strict_lower(diag(beta) K K^T * Gamma)
    Tinv  = (I + A)^-1                         diagonal 16x16 blocks by a Neumann product,
                                               then merged pairwise: T21 = -T22 A21 T11
    U     = Tinv (beta * V);   W = Tinv (beta * exp(gamma) * K)
    V'    = U - W S
    O     = (exp(gamma) * Q) S + ((Q K^T) * Gamma) V'
    S     = exp(gamma_last) S + (exp(gamma_last - gamma) * K)^T V'

The decay exponent is masked to the lower triangle *before* the exp (the upper triangle
would overflow). A tail chunk shorter than l is read with ``valid_shape``, zero-filled with
``fillpad`` (zero k, v, beta and g leave the result exact) and only its valid rows are
written back with ``assemble``. The sequence x value-head loop is one flat ``parallel``
loop (independent work; ``parallel=True`` documents intent, pypto 0.2.0 ignores it and
overlaps iterations by their data dependencies); the chunk loop carries the state and is
sequential. Keeping to two nested loops avoids a 0.2.0 defect where three nested
sequential loops with a heavy body recycle workspace too early.

Tile shapes are those of an Ascend 910B core: vector tiles of at most 64 x 128 fp32
(32 KiB, several live in the 192 KiB unified buffer) and cube tiles of 64 x 64 fp32
(16 KiB per operand in L0A/L0B, 64 KiB L0C budget).
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

from typing import Any

import torch

from torch_gdr.ref.utils import L2NORM_EPS  # the in-kernel l2 norm's epsilon, as in the reference

from ._env import import_pypto
from .spec import CHUNK_SIZES as SUPPORTED_CHUNK_SIZES
from .spec import HEAD_DIMS as SUPPORTED_HEAD_DIMS
#: Size of the diagonal blocks inverted directly before the pairwise merges.
BASE_BLOCK = 16
#: pypto's stitch limit: a wider stitch lets the independent (sequence, head) chains overlap
#: (cost-model figures in bench/RESULTS.md). Larger stitches need more device workspace;
#: this setting has not run on hardware.
DEFAULT_STITCH_FUNCTION_MAX_NUM = 128

# Indices into the chunk_masks tensor.
MASK_LOWER = 0  # r >= s
MASK_STRICT_LOWER = 1  # r > s
MASK_IDENTITY = 2
MASK_BASE_BLOCKS = 3  # strictly lower part of the 16 x 16 diagonal blocks
# 4.. : for each merge level (block 16 -> 32 -> ... -> l), the lower-left quadrant of
#       every diagonal block of the merged size.


def num_merge_levels(chunk_size: int) -> int:
    """Pairwise merges from 16-blocks up to the chunk: 1 for l=32, 2 for 64, 3 for 128."""
    return (chunk_size // BASE_BLOCK).bit_length() - 1


def chunk_masks(chunk_size: int) -> torch.Tensor:
    """The constant masks the kernel reads, ``[4 + merge levels, l, l]`` fp32 of 0/1."""
    idx = torch.arange(chunk_size)
    row, col = idx[:, None], idx[None, :]
    masks = [row >= col, row > col, row == col, (row > col) & (row // BASE_BLOCK == col // BASE_BLOCK)]
    size = BASE_BLOCK
    for _ in range(num_merge_levels(chunk_size)):
        merged = 2 * size
        same_block = row // merged == col // merged
        masks.append(same_block & (row // size == col // size + 1) & ((row // size) % 2 == 1))
        size = merged
    return torch.stack(masks).to(torch.float32)


def validate_kernel_config(
    *, num_qk_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int
) -> None:
    """Raise ValueError for a configuration the kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim} not in {SUPPORTED_HEAD_DIMS}")
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk size {chunk_size} not in {SUPPORTED_CHUNK_SIZES}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_qk_heads={num_qk_heads}")


def _invert_unit_lower(a: Any, masks: Any, chunk_size: int) -> Any:
    """``(I + a)^-1`` for strictly lower ``a [l, l]``, by matmuls only.

    Diagonal 16x16 blocks: ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8)`` for a
    nilpotent N (N^16 = 0), done for all blocks at once on the block-diagonal part of a.
    Then each merge doubles the block size: with ``T`` block-diagonal of blocks m and
    ``A_off`` the lower-left m x m quadrants of the 2m blocks, ``T <- T - T A_off T``,
    which is ``inv21 = -inv22 A21 inv11`` for every pair at once.
    """
    pypto = import_pypto()
    eye = masks[MASK_IDENTITY]
    power = a * masks[MASK_BASE_BLOCKS] * -1.0  # -N
    inverse = eye + power
    for _ in range(3):  # multiply by (I + (-N)^(2^j)), j = 1, 2, 3
        power = pypto.matmul(power, power, pypto.DT_FP32)
        inverse = inverse + pypto.matmul(inverse, power, pypto.DT_FP32)
    for level in range(num_merge_levels(chunk_size)):
        off_diag = a * masks[MASK_BASE_BLOCKS + 1 + level]
        coupling = pypto.matmul(pypto.matmul(inverse, off_diag, pypto.DT_FP32), inverse, pypto.DT_FP32)
        inverse = inverse - coupling
    return inverse


def _chunk_step(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, masks: Any, *, scale: float, use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[Any, Any]:
    """One chunk: full-size tiles q, k ``[l, K]``, v ``[l, V]``, g, beta ``[l, 1]``, state ``[K, V]``.

    Returns the chunk output ``[l, V]`` and the state after the chunk ``[K, V]``.
    """
    pypto = import_pypto()
    if use_qk_l2norm:
        q = q / pypto.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / pypto.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * scale

    lower = masks[MASK_LOWER]
    gamma = pypto.matmul(lower, g, pypto.DT_FP32)  # [l, 1] within-chunk cumsum
    gamma_row = pypto.transpose(gamma, 0, 1)  # [1, l]
    decay = pypto.exp((gamma - gamma_row) * lower) * lower  # Gamma incl. diagonal, [l, l]
    gamma_last = pypto.view(gamma, [1, 1], [chunk_size - 1, 0])
    decay_in = pypto.exp(gamma)  # [l, 1]
    decay_out = pypto.exp(gamma_last - gamma)  # [l, 1]

    k_beta = k * beta
    a = pypto.matmul(k_beta, k, pypto.DT_FP32, b_trans=True) * decay * masks[MASK_STRICT_LOWER]
    t_inv = _invert_unit_lower(a, masks, chunk_size)
    u = pypto.matmul(t_inv, v * beta, pypto.DT_FP32)  # [l, V]
    w = pypto.matmul(t_inv, k_beta * decay_in, pypto.DT_FP32)  # [l, K]

    v_new = u - pypto.matmul(w, state, pypto.DT_FP32)  # [l, V]
    qk = pypto.matmul(q, k, pypto.DT_FP32, b_trans=True) * decay  # [l, l]
    o = pypto.matmul(q * decay_in, state, pypto.DT_FP32) + pypto.matmul(qk, v_new, pypto.DT_FP32)
    k_out = k * decay_out  # [l, K]
    chunk_decay = pypto.expand_clone(pypto.exp(gamma_last), [state.shape[0], 1])  # [K, 1]
    new_state = state * chunk_decay + pypto.matmul(k_out, v_new, pypto.DT_FP32, a_trans=True)
    return o, new_state


def build_gdr_kernel(
    *,
    num_seqs: int,
    num_qk_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    chunk_size: int,
    use_qk_l2norm: bool,
    scale: float,
    has_initial_state: bool,
    on_device: bool = False,
    stitch_function_max_num: int = DEFAULT_STITCH_FUNCTION_MAX_NUM,
) -> Any:
    """Build (trace lazily, on first call) the GDR forward kernel for one configuration.

    Args:
        num_seqs: N, the number of sequences packed along T.
        num_qk_heads: H. num_v_heads: HV, a multiple of H.
        head_k_dim, head_v_dim: K and V, each 64 or 128.
        chunk_size: l, 32, 64 or 128.
        use_qk_l2norm: l2-normalise q and k per token before use.
        scale: factor applied to q (after the norm).
        has_initial_state: read ``state_in``; otherwise every sequence starts from zeros.
        on_device: run mode NPU (launch on the Ascend device) rather than SIM (CPU; see
            :mod:`.interpreter` for how it yields numbers).
        stitch_function_max_num: pypto runtime option, how many loop-body functions the
            scheduler stitches into one submission; see ``DEFAULT_STITCH_FUNCTION_MAX_NUM``.

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring.
    """
    validate_kernel_config(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, chunk_size=chunk_size,
    )
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    tokens = pypto.DYNAMIC
    group = num_v_heads // num_qk_heads
    num_pairs = num_seqs * num_v_heads
    n_masks = 4 + num_merge_levels(chunk_size)
    state_in_shape = [num_seqs, num_v_heads, head_k_dim, head_v_dim] if has_initial_state else [1, 1, 1, 1]
    l = chunk_size  # noqa: E741  (the spec's name for the chunk length)
    dk, dv = head_k_dim, head_v_dim
    vec_rows = min(l, 64)
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM

    @pypto.frontend.jit(runtime_options={"run_mode": run_mode, "stitch_function_max_num": stitch_function_max_num})
    def gdr_fwd_kernel(
        q: pypto.Tensor([tokens, num_qk_heads, dk], fp32),
        k: pypto.Tensor([tokens, num_qk_heads, dk], fp32),
        v: pypto.Tensor([tokens, num_v_heads, dv], fp32),
        g: pypto.Tensor([tokens, num_v_heads], fp32),
        beta: pypto.Tensor([tokens, num_v_heads], fp32),
        act_seq_len: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        masks: pypto.Tensor([n_masks, l, l], fp32),
        state_in: pypto.Tensor(state_in_shape, fp32),
        o: pypto.Tensor([tokens, num_v_heads, dv], fp32),
        state_out: pypto.Tensor([num_seqs, num_v_heads, dk, dv], fp32),
    ):
        pypto.set_cube_tile_shapes([64, 64], [64, 64], [64, 64])
        mask_tiles = []
        for i in range(n_masks):  # unrolled at trace time
            pypto.set_vec_tile_shapes(1, vec_rows, 128)
            mask_tiles.append(pypto.reshape(pypto.view(masks, [1, l, l], [i, 0, 0]), [l, l]))

        for pair in pypto.loop(num_pairs, name="LOOP_SEQ_HEAD", idx_name="pair", parallel=True):
            seq = pair // num_v_heads
            head = pair % num_v_heads
            qk_head = head // group
            seq_start = act_seq_len[seq]
            seq_len = act_seq_len[seq + 1] - seq_start
            pypto.set_vec_tile_shapes(vec_rows, 128)
            if has_initial_state:
                # "+ 0.0" makes a copy: the state is updated in place below and must not
                # alias (and overwrite) the caller's initial state.
                state = pypto.reshape(
                    pypto.view(state_in, [1, 1, dk, dv], [seq, head, 0, 0]), [dk, dv]
                ) + 0.0
            else:
                state = pypto.full([dk, dv], 0.0, fp32)
            pypto.assemble(pypto.reshape(state, [1, 1, dk, dv]), [seq, head, 0, 0], state_out)

            for chunk in pypto.loop((seq_len + l - 1) // l, name="LOOP_CHUNK", idx_name="chunk"):
                start = seq_start + chunk * l
                rows = pypto.min(l, seq_len - chunk * l)
                pypto.set_vec_tile_shapes(vec_rows, 1, 128)
                q_c = pypto.reshape(
                    pypto.view(q, [l, 1, dk], [start, qk_head, 0], valid_shape=[rows, 1, dk]), [l, dk],
                    valid_shape=[rows, dk],
                )
                k_c = pypto.reshape(
                    pypto.view(k, [l, 1, dk], [start, qk_head, 0], valid_shape=[rows, 1, dk]), [l, dk],
                    valid_shape=[rows, dk],
                )
                v_c = pypto.reshape(
                    pypto.view(v, [l, 1, dv], [start, head, 0], valid_shape=[rows, 1, dv]), [l, dv],
                    valid_shape=[rows, dv],
                )
                pypto.set_vec_tile_shapes(vec_rows, 128)
                g_c = pypto.view(g, [l, 1], [start, head], valid_shape=[rows, 1])
                beta_c = pypto.view(beta, [l, 1], [start, head], valid_shape=[rows, 1])
                if pypto.is_loop_end(chunk):
                    q_c = pypto.fillpad(q_c, "constant", 0.0)
                    k_c = pypto.fillpad(k_c, "constant", 0.0)
                    v_c = pypto.fillpad(v_c, "constant", 0.0)
                    g_c = pypto.fillpad(g_c, "constant", 0.0)
                    beta_c = pypto.fillpad(beta_c, "constant", 0.0)
                    o_c, new_state = _chunk_step(
                        q_c, k_c, v_c, g_c, beta_c, state, mask_tiles,
                        scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=l,
                    )
                    state[:] = new_state
                    pypto.set_vec_tile_shapes(vec_rows, 1, 128)
                    o_rows = pypto.reshape(o_c, [l, 1, dv], valid_shape=[rows, 1, dv])
                    pypto.assemble(o_rows, [start, head, 0], o)
                    pypto.assemble(pypto.reshape(state, [1, 1, dk, dv]), [seq, head, 0, 0], state_out)
                else:
                    o_c, new_state = _chunk_step(
                        q_c, k_c, v_c, g_c, beta_c, state, mask_tiles,
                        scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=l,
                    )
                    state[:] = new_state
                    pypto.set_vec_tile_shapes(vec_rows, 1, 128)
                    pypto.assemble(pypto.reshape(o_c, [l, 1, dv]), [start, head, 0], o)

    return gdr_fwd_kernel
