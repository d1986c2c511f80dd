"""The chunked gated delta rule forward as a PyPTO kernel (pypto 0.2.0, token-major TND).

:func:`build_gdr_kernel` returns a ``pypto.frontend.jit`` kernel specialised on every size
the compiler needs concrete; the token count T (and the chunk-state row count) stay
dynamic. Kernel arguments, in order:

===============  =========================  =================================================
name             shape                      meaning
===============  =========================  =================================================
q, k             ``[T, H * K]`` in_dtype    queries, keys (H query/key heads; the
                                            token-major ``[T, H, K]`` with the heads
                                            flattened); fp32, fp16 or bf16, converted to
                                            fp32 in the kernel
v                ``[T, HV * V]`` in_dtype   values (HV value heads, ``HV % H == 0``)
g                ``[T, HV]`` fp32           raw per-token log decay (cumsum in the kernel)
beta             ``[T, HV]`` fp32           delta-rule write strength (logits with
                                            ``beta_sigmoid_in_kernel``)
gate_params      ``[2, HV]`` fp32           only with ``gate_in_kernel`` (g then holds
                                            fla's raw gate): A_log in row 0, dt_bias in
                                            row 1; see :mod:`.kernel_gating`
act_seq_len      ``[N + 1]`` int32          cumulative sequence offsets, last one == T
chunk_offsets    ``[N + 1]`` int32          exclusive cumsum of ``ceil(len_n / l)``: row of
                                            sequence n's first chunk in ``chunk_states``
window           ``[N + 1]`` int32          the launch's chunks: ``window[0]`` is the
                                            first chunk c0, ``window[1 + n]`` how many of
                                            sequence n's chunks from c0 on it runs; see
                                            :func:`time_windows`
masks            ``[M * l, l]`` fp32        constant masks, see :func:`chunk_masks`
eye_pad          ``[K, K + V]`` fp32        constant ``[I_K | 0]``, see :func:`eye_pad`
state_in         ``[N*HV*(K+V), V]`` fp32   ``[S; I_V]`` per sequence and head, key-first
                                            S the state entering the window (the initial
                                            state for the first); see
                                            :func:`augmented_state`. Scratch: its
                                            contents after a launch are unspecified
o                ``[T, HV * V]`` fp32       output (the window's rows)
state_out        ``[N*HV*K, V]`` fp32       the state leaving the window ``[N, HV, K, V]``,
                                            key-first (rows of sequences with no chunk in
                                            the window are not written)
chunk_states     ``[C*HV*K, V]`` fp32       the state entering each chunk ``[C, HV, K, V]``,
                                            key-first, row ``chunk_offsets[n] + c`` for
                                            chunk c of sequence n (``[1, 1]`` and never
                                            written when ``output_chunk_states`` is False)
ticket           ``[N*HV*l, W]`` fp32       zeros, ``W`` from :func:`ticket_width`, see
                                            :func:`ticket_scratch`: every chunk
                                            but the window's first adds it to its q, k, v
                                            and g, and its key read writes zeros back, so
                                            chunk c's reads wait for chunk c - 1's
===============  =========================  =================================================

Every tensor is passed two-dimensional (the host's contiguous tensors, viewed flat), so
every read and write is a strided two-dimensional view with no reshape: a reshape of a
view is a copy task of its own. Value head ``h`` reads q/k head ``h // (HV // H)``.

The form (per chunk of l tokens, rows r, s; ``gamma`` the within-chunk cumsum of g) keeps
one matmul on the serial chain from chunk to chunk. Everything else depends on the chunk's
own inputs only, so the cost model overlaps it across chunks::

    Gamma_rs = exp(gamma_r - gamma_s), r >= s           (masked to r >= s before the exp)
    A     = strict_lower(diag(beta) K K^T * Gamma);     Tinv = (I + A)^-1
    Y     = Tinv [-(beta exp(gamma)) * K | beta * V]    = [-W | U]          [l, K + V]
    P     = (Q K^T) * Gamma                                                  [l, l]
    KO    = exp(gamma_last - gamma) * K                                      [l, K]
    MB    = [KO; exp(gamma_last) I]^T [Y; [I | 0]]      = [M | B]            [K, K + V]
    QO    = [P | exp(gamma) * Q] [Y; [I | 0]]           = [QE | OI]          [l, K + V]
    S_aug = [S; I_V]                                                         [K + V, V]
    O     = QO S_aug;   S <- MB S_aug

which is the WY form ``V' = U - W S``, ``O = (exp(gamma) Q) S + P V'``,
``S <- exp(gamma_last) S + KO^T V'`` with the state terms gathered into M and B. The
constant terms ride in the contraction (``[Y; [I | 0]]``, l + K deep) rather than in vector
adds after the products: four vector tasks a chunk fewer for one copy.

``Tinv`` is formed by matmuls and a few vector adds (:func:`_solve_unit_lower`): two short
products of power factors (16 x 16 diagonal blocks, then the block level), which then
meets the right-hand side once.

A tail chunk shorter than l is read with ``valid_shape``, zero-filled with ``fillpad``
(zero k, v, beta and g leave the result exact) and only its valid rows are written back
with ``assemble`` (its output product runs on the valid rows only, so the cube writes
them directly). The last chunk of a window takes the same path (a no-op for a full
chunk) and writes the state leaving the window. The window's first chunk is a path of its
own too (it waits for no ticket): four paths in all.

Long sequences run as several launches over consecutive windows of at most
:data:`WINDOW_CHUNKS` chunks, the host carrying the state from one to the next
(:func:`time_windows`): pypto submits loop bodies a stitch window
(``stitch_function_max_num``) at a time, so within one launch the chunks of a long
sequence's first head would fill a submission on their own and the heads' serial chains
would run one after another; a window keeps every head's chain in flight together.

Scheduling, as pypto 0.2.0's cost model charges it: an AICPU resolving a finished task
spends time per successor while its cores go unpolled, and it polls its cores in turn,
handing a core its next task only when a poll finds it done: every task costs a core
idle cycles. So nothing is shared across
loop bodies (the constant masks are viewed in each chunk: a shared copy with a successor
in every body stalled its AICPU), and the ``ticket`` chain
releases a sequence's chunks in order, so the first chunk's dependent tasks are not
queued behind every later chunk's independent ones.

The sequence x value-head loop is one flat loop (independent work, overlapped by the cost
model through data dependencies; ``parallel=True`` documents intent, pypto 0.2.0 ignores
it); the chunk loop carries the state and is sequential. A body runs several value heads
of one sequence side by side where the launch has enough of them
(:func:`heads_per_body`): pypto merges their identical cube work into one task
(``cube_nbuffer_setting``), and the vector work of each head's chunk before its first
product is one task (a merge scope, :func:`one_vector_task`).
Two nested loops only: three nested sequential loops with a heavy body recycle
workspace too early in 0.2.0.

pypto merges vector operations into one task only along a dependency chain; independent
ones (say ``I + N^2`` and ``I + N^4``) become tasks of their own, each paying the
scheduler's cost. Where several such terms are needed at once, the kernel computes them
as one chain (see :func:`_unit_plus`).

Tile shapes fit an Ascend 910B core: cube L0 tiles of 128 x 128 (fp32: 64 KiB per operand
in L0A/L0B, L0C 128 KiB), L1 tiles up to 256 along K; vector tiles of 128 x 128 fp32
(64 KiB) for the chunk's work, 64 rows for the strided reads and writes (the unified
buffer holds 192 KiB). At K or V = 256 the products stage 128-deep L1 tiles (256-deep
ones of several 256-wide operands overflow L1's 512 KiB), the ``[I | 0]`` block is written
in row slices, and a body of several value heads runs its vector work in 64-row tiles.

What bounds it in pypto 0.2.0's cost model (bench/RESULTS.md has the figures): with many
chunks in flight, the scheduler's cost per task (its CPUs poll the cores nearly all the
time; with several heads a body the vector tasks wait in its ready queue), hence fewer,
larger tasks; and a cube task is mostly data movement (each matmul's operands and result
pass through DDR; the cube pipes are busy about a quarter of the time). With few chunks,
the first chunk's chain of about a dozen dependent tasks before the serial state products
start.
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from torch_gdr._layout import L2NORM_EPS  # the in-kernel l2 norm's epsilon

from . import kernel_gating
from ._env import import_pypto

from .spec import CHUNK_SIZES as SUPPORTED_CHUNK_SIZES  # the device path picks one with kernel_chunk_size
from .spec import HEAD_DIMS as SUPPORTED_HEAD_DIMS

#: Input dtypes of q, k and v the kernel reads itself.
SUPPORTED_INPUT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: Size of the diagonal blocks of the two-level inverse.
BASE_BLOCK = 16
#: pypto's stitch limit: how many loop-body functions one submission holds. A wider
#: stitch lets the independent (sequence, head) chains and the chunk-parallel work of
#: later chunks overlap; a launch whose bodies overflow it runs its submissions one after
#: another. pypto 0.2.0's cost model crashes (segfault) above 128 for many sequences.
DEFAULT_STITCH_FUNCTION_MAX_NUM = 128

# Indices into the chunk_masks tensor.
MASK_LOWER = 0  # r >= s
MASK_STRICT_LOWER = 1  # r > s
MASK_IDENTITY = 2
MASK_BASE_BLOCKS = 3  # strictly lower part of the 16 x 16 diagonal blocks
MASK_OFF_BLOCKS = 4  # strictly lower, outside the 16 x 16 diagonal blocks
NUM_MASKS = 5

#: Merge scope ids of a body's value head j: ``SCOPE_STRIDE * (j + 1)`` and up (see
#: :func:`one_vector_task`).
SCOPE_STRIDE = 10


#: A launch with at most this many (sequence, value head, chunk of 64) bodies runs faster at
#: chunk 64 than at 128 (the first chunk's latency bounds it; measured: one sequence of 256
#: tokens, 4 value heads). Above it, the scheduler's cost per task favours 128.
SMALL_LAUNCH_BODIES = 16

#: Value heads of one sequence that one loop body runs side by side, largest first: pypto
#: merges their identical cube work into one task (``cube_nbuffer_setting``), a quarter of
#: the cube tasks at 4, each four times longer. Worth it when the launch still has at least
#: :data:`MIN_MERGED_BODIES` bodies; below, the longer tasks lengthen the chain that bounds
#: a small launch (measured: one sequence of 256 tokens at HV=4 costs 1.8x with 4).
HEADS_PER_BODY_CHOICES = (4, 2)
MIN_MERGED_BODIES = 16


def heads_per_body(num_seqs: int, num_v_heads: int) -> int:
    """How many value heads one loop body of the forward kernel runs (see
    :data:`HEADS_PER_BODY_CHOICES`): the largest choice dividing ``num_v_heads`` that leaves
    at least :data:`MIN_MERGED_BODIES` bodies, else 1."""
    for count in HEADS_PER_BODY_CHOICES:
        if num_v_heads % count == 0 and num_seqs * num_v_heads // count >= MIN_MERGED_BODIES:
            return count
    return 1


def kernel_chunk_size(head_k_dim: int, head_v_dim: int, max_seqlen: int, *, num_seqs: int,
                      num_v_heads: int) -> int:
    """The chunk length the kernel runs with, chosen for speed on the device.

    128 (full 128 x 128 cube tiles, half the serial chunk steps of 64), except: every
    sequence fits a shorter chunk (32 or 64), or the launch is small enough that the
    first chunk's latency bounds it (see ``SMALL_LAUNCH_BODIES``), then 64. The result
    does not depend on the chunk length up to rounding; ``chunk_states`` rows do (see
    :func:`chunk_offsets`), so a consumer of them must ask with the same
    arguments as the forward call: its K, V, longest sequence, sequence count and HV.
    """
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim}: expected values in {SUPPORTED_HEAD_DIMS}")
    if max_seqlen < 0 or num_seqs < 0 or num_v_heads <= 0:
        raise ValueError(f"max_seqlen={max_seqlen}, num_seqs={num_seqs}, num_v_heads={num_v_heads}: expected "
                         f"max_seqlen >= 0, num_seqs >= 0, num_v_heads > 0")
    covering = next((size for size in SUPPORTED_CHUNK_SIZES if size >= max_seqlen), SUPPORTED_CHUNK_SIZES[-1])
    if covering < 128:
        return covering
    bodies_at_64 = num_seqs * num_v_heads * -(-max_seqlen // 64)
    return 64 if bodies_at_64 <= SMALL_LAUNCH_BODIES else 128


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Row of each sequence's first chunk in ``chunk_states``.

    Args:
        cu_seqlens: ``[N + 1]`` integer cumulative sequence offsets.
        chunk_size: l, the chunk length the states were computed with.

    Returns:
        ``[N + 1]`` int64 on the device of ``cu_seqlens``: the exclusive cumsum of
        ``ceil(len_n / l)``; the last entry is the total chunk count. An empty sequence
        has no rows.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = torch.div(lengths + chunk_size - 1, chunk_size, rounding_mode="floor")
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


#: Most chunks of one sequence per launch (see :func:`time_windows`): shorter windows pay
#: more launches, longer ones serialise more heads' chains in one launch; 16 was the best
#: of the window sizes compared in the cost model (bench/RESULTS.md).
WINDOW_CHUNKS = 16


def time_windows(cu_seqlens: torch.Tensor, chunk_size: int,
                 window_chunks: int = WINDOW_CHUNKS) -> list[torch.Tensor]:
    """The kernel's ``window`` input for each launch of a call, in launch order.

    Launch j runs chunks ``[j W, (j + 1) W)`` of every sequence that has them
    (``W = window_chunks``); a call whose sequences all fit one window is one launch.

    Args:
        cu_seqlens: ``[N + 1]`` integer cumulative sequence offsets (any device).
        chunk_size: l, the kernel's chunk length.
        window_chunks: W, chunks of one sequence per launch.

    Returns:
        A list of ``[N + 1]`` int32 CPU tensors: ``[c0, count_0, ..., count_{N-1}]``, where
        ``count_n = clamp(ceil(len_n / l) - c0, 0, W)``.
    """
    if chunk_size <= 0 or window_chunks <= 0:
        raise ValueError(f"chunk_size={chunk_size}, window_chunks={window_chunks}: expected positive values")
    counts = chunk_offsets(cu_seqlens.cpu(), chunk_size).diff()
    most = int(counts.max()) if counts.numel() else 0
    return [torch.cat([torch.tensor([first]), (counts - first).clamp(0, window_chunks)]).to(torch.int32)
            for first in range(0, max(most, 1), window_chunks)]


def num_block_levels(chunk_size: int) -> int:
    """Factors ``I + G^(2^j)`` of the block-level inverse: 1 for l=32, 2 for 64, 3 for 128."""
    return (chunk_size // BASE_BLOCK).bit_length() - 1


def chunk_masks(chunk_size: int) -> torch.Tensor:
    """The constant masks the kernel reads, ``[5 * l, l]`` fp32 of 0/1: mask ``MASK_*`` in rows
    ``[MASK_* * l, (MASK_* + 1) * l)``."""
    idx = torch.arange(chunk_size)
    row, col = idx[:, None], idx[None, :]
    same_block = row // BASE_BLOCK == col // BASE_BLOCK
    masks = [row >= col, row > col, row == col, (row > col) & same_block, (row > col) & ~same_block]
    return torch.cat(masks).to(torch.float32)


def eye_pad(head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """``[I_K | 0]``, ``[K, K + V]`` fp32: the decay part of ``[M | B]``."""
    out = torch.zeros(head_k_dim, head_k_dim + head_v_dim)
    out[:, :head_k_dim] = torch.eye(head_k_dim)
    return out


def augmented_state(initial_state: torch.Tensor | None, num_seqs: int, num_v_heads: int, head_k_dim: int,
                    head_v_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernel's ``state_in``, a fresh tensor: ``[S0; I_V]`` per sequence and head, fp32.

    Args:
        initial_state: ``[N, HV, K, V]`` key-first, any float dtype, or None for zeros.

    Returns:
        ``[N * HV * (K + V), V]`` (``[N, HV, K + V, V]`` flattened), scratch to the kernel.
    """
    out = torch.zeros(num_seqs, num_v_heads, head_k_dim + head_v_dim, head_v_dim, device=device)
    if initial_state is not None:
        out[:, :, :head_k_dim] = initial_state
    out[:, :, head_k_dim:] += torch.eye(head_v_dim, device=device)
    return out.view(-1, head_v_dim)


def ticket_width(head_k_dim: int, head_v_dim: int) -> int:
    """Columns of the ``ticket`` scratch: the widest read it orders (at least 128)."""
    return max(128, head_k_dim, head_v_dim)


def ticket_scratch(num_pairs: int, chunk_size: int, device: torch.device | str = "cpu", *,
                   width: int = 128) -> torch.Tensor:
    """The kernel's ``ticket`` scratch, zeros ``[N * HV * l, width]`` fp32 (it stays zero),
    ``width`` from :func:`ticket_width`.

    Every chunk but a window's first adds the pair's block to its reads and its key read
    writes zeros back to it, so the reads of chunk c depend on those of chunk c - 1: a
    sequence's chunks enter the scheduler's queue in order instead of all at once. (The
    chunk's g is ordered after its own key read, which is as early.) A non-finite key makes
    the rest of the pair's tile non-finite, as it does the state."""
    return torch.zeros(num_pairs * chunk_size, width, device=device)


def validate_kernel_config(
    *, num_qk_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int,
    input_dtype: str = "float32",
) -> None:
    """Raise ValueError for a configuration the kernel does not cover."""
    if head_k_dim not in SUPPORTED_HEAD_DIMS or head_v_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={head_k_dim}, V={head_v_dim} not in {SUPPORTED_HEAD_DIMS}")
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk size {chunk_size} not in {SUPPORTED_CHUNK_SIZES}")
    if num_qk_heads <= 0 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_qk_heads={num_qk_heads}")
    if input_dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"input_dtype {input_dtype!r} not in {SUPPORTED_INPUT_DTYPES}")


def _pypto_dtype(name: str) -> Any:
    pypto = import_pypto()
    return {"float32": pypto.DT_FP32, "float16": pypto.DT_FP16, "bfloat16": pypto.DT_BF16}[name]


def _solve_unit_lower(n1: Any, off: Any, first_factor: Any, rhs: Any, masks: Any, chunk_size: int) -> Any:
    """``(I + a)^-1 rhs`` for strictly lower ``a [l, l]`` and ``rhs [l, n]``, by matmuls only,
    from ``n1`` and ``off``, the parts of a inside and outside the 16 x 16 diagonal blocks,
    and ``first_factor = I - n1`` (the caller's vector task computes them).

    With ``N`` the strictly lower part of the 16 x 16 diagonal blocks of a and ``L`` the
    rest (strictly block-lower), ``I + a = D (I + G)`` with ``D = I + N``,
    ``G = D^-1 L``. Both are nilpotent (N^16 = 0; G^(l/16) = 0), so each inverse is a
    short product of power factors::

        D^-1       = (I - N)(I + N^2)(I + N^4)(I + N^8)
        (I + G)^-1 = (I - G)(I + G^2)(I + G^4)       (l = 128; fewer factors below)

    The matmuls of each product run back to back with no vector work between them: a
    dependency depth of about six tasks, against three per pairwise merge level. The
    factors multiply ``D^-1`` (``[l, l]``, one column tile) and the inverse meets rhs once
    at the end, rather than each factor multiplying the wider rhs.
    """
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    eye = masks[MASK_IDENTITY]
    n2 = pypto.matmul(n1, n1, fp32)
    n4 = pypto.matmul(n2, n2, fp32)
    n8 = pypto.matmul(n4, n4, fp32)
    f2, f4, f8 = _unit_plus([n2, n4, n8], eye)
    d_inv = pypto.matmul(pypto.matmul(first_factor, f2, fp32), pypto.matmul(f4, f8, fp32), fp32)
    return _solve_block_level(d_inv, off, rhs, eye, chunk_size)


def _solve_block_level(d_inv: Any, off: Any, rhs: Any, eye: Any, chunk_size: int) -> Any:
    """``(I + G)^-1 D^-1 rhs`` with ``G = D^-1 off``, from ``D^-1`` ``[l, l]`` (block diagonal,
    16 x 16 blocks) and ``off`` ``[l, l]`` (strictly block-lower): the block level of
    :func:`_solve_unit_lower`, its factors multiplying ``D^-1`` before the one product with
    ``rhs [l, n]``."""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    levels = num_block_levels(chunk_size)
    if levels == 0:
        return pypto.matmul(d_inv, rhs, fp32)
    g1 = pypto.matmul(d_inv, off, fp32)
    powers = [g1]
    for _ in range(levels - 1):
        powers.append(pypto.matmul(powers[-1], powers[-1], fp32))
    # The last power first: every add then waits for it, and pypto makes them one vector task.
    # (The factors commute; their order does not change the product.)
    factors = _unit_plus(powers[:0:-1] + [g1 * -1.0], eye)
    inverse = d_inv
    for factor in factors:
        inverse = pypto.matmul(factor, inverse, fp32)
    return pypto.matmul(inverse, rhs, fp32)


def _unit_plus(terms: list, eye: Any) -> list:
    """``[I + t for t in terms]`` for strictly lower ``[l, l]`` terms, as one dependency chain.

    Each identity after the first is recovered from the previous result,
    ``(I + t) - t = I``, exact in floating point because t is zero on the diagonal (and
    ``x + 0 - x = 0`` off it). The chain makes pypto put every add in one vector task;
    written independently, each add is a task of its own."""
    out = [terms[0] + eye]
    for prev, term in zip(terms, terms[1:]):
        out.append((out[-1] - prev) + term)
    return out


#: Log decays below this are raised to it inside a chunk: every partial sum holding one is
#: then below -1e4 + (the rest), whose exp is 0 in float32 exactly as the true value's
#: (exp underflows below about -104), and a g of -inf (a reset) gives no inf - inf.
DECAY_FLOOR = -1.0e4


def chunk_exponents(g: Any, masks: Any, chunk_size: int, *, by_matmul: bool = False) -> tuple[Any, Any, Any]:
    """``gamma [l, 1]`` (the within-chunk cumsum of g), the exponents of Gamma ``[l, l]``
    (zero on and above the diagonal) and the decay to the chunk's end
    ``exp(gamma_last - gamma) [l, 1]`` from g ``[l, 1]``.

    The exponents are partial sums of g over ``(s, r]`` taken directly, as the cumulative
    sum down the rows of ``g_t [t > s]``, never the difference of two cumulative sums: next
    to a token of g = -1e6 those cancel in float32. The sum is a vector cumsum (the chunk's
    decay work stays one vector task), or with ``by_matmul`` a matmul of the inclusive lower
    triangle with those terms (the backward kernel's form: its tiling of the cumsum fails
    in pypto 0.2.0's cost model, FFFFFF). The decay to the end is the exponents' last row
    (transposed).

    Each consumer takes ``exp`` of the exponents itself (see :func:`_chunk_terms`): a
    Gamma tensor shared by several consumers would be a vector task of its own."""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    lower, strict = masks[MASK_LOWER], masks[MASK_STRICT_LOWER]
    g = pypto.maximum(g, DECAY_FLOOR)
    gamma = pypto.cumsum(g, 0)  # [l, 1]
    terms = pypto.expand_clone(g, [chunk_size, chunk_size]) * strict  # [t, s]: g_t where t > s
    if by_matmul:
        exponent = pypto.matmul(lower, terms, fp32)  # [r, s]: the sum of g over (s, r]
    else:
        exponent = pypto.cumsum(terms, 0)
    to_end = pypto.transpose(pypto.view(exponent, [1, chunk_size], [chunk_size - 1, 0]), 0, 1)  # [l, 1]
    return gamma, exponent, pypto.exp(to_end)


def chunk_decays(g: Any, masks: Any, chunk_size: int) -> tuple[Any, Any, Any]:
    """``gamma [l, 1]``, ``Gamma [l, l]`` (``exp`` of the partial sums of g, masked to
    ``r >= s``) and the decay to the chunk's end ``[l, 1]``, as the backward kernel takes
    them; see :func:`chunk_exponents`."""
    pypto = import_pypto()
    gamma, exponent, decay_out = chunk_exponents(g, masks, chunk_size, by_matmul=True)
    return gamma, pypto.exp(exponent) * masks[MASK_LOWER], decay_out


@contextlib.contextmanager
def one_vector_task(scope: int) -> Iterator[None]:
    """Trace the vector operations inside as one task: pypto's manual merge scope
    (``sg_set_scope``: connected operations of one non-negative scope id become one
    subgraph; a matmul never joins one). The scheduler's cost is per task whatever the
    task's work, so each stage of a chunk's vector work is one task rather than one per
    short chain of operations."""
    pypto = import_pypto()
    pypto.set_pass_options(sg_set_scope=scope)
    try:
        yield
    finally:
        pypto.set_pass_options(sg_set_scope=-1)


#: Most bytes one copy of the constant ``[I | 0]`` block moves through the unified buffer
#: (192 KiB on the 910B, shared with the task's other tiles): above it the block goes in
#: row slices (K = 256: ``[256, K + V]`` fp32 is 384-512 KiB).
_EYE_PAD_COPY_BYTES = 128 * 1024


def _write_eye_pad(y_stacked: Any, eye_pad_t: Any, row0: int) -> None:
    """Write ``eye_pad_t`` ``[K, K + V]`` into rows ``row0 .. row0 + K`` of ``y_stacked``: one
    copy where it fits :data:`_EYE_PAD_COPY_BYTES`, otherwise slices of rows."""
    pypto = import_pypto()
    rows, cols = eye_pad_t.shape
    if rows * cols * 4 <= _EYE_PAD_COPY_BYTES:
        y_stacked[row0:row0 + rows, 0:cols] = eye_pad_t
        return
    slice_rows = rows
    while slice_rows * cols * 4 > _EYE_PAD_COPY_BYTES and slice_rows % 2 == 0:
        slice_rows //= 2
    for r in range(0, rows, slice_rows):
        y_stacked[row0 + r:row0 + r + slice_rows, 0:cols] = pypto.view(eye_pad_t, [slice_rows, cols], [r, 0])


def _chunk_terms(
    q: Any, k: Any, v_beta: Any, g: Any, beta: Any, masks: Any, eye_pad_t: Any, *, scale: float,
    use_qk_l2norm: bool, chunk_size: int, vec_rows: int, scope: int, gram_masks: Any, merged: bool,
    gram_dtype: Any = None,
) -> tuple[Any, Any]:
    """The chunk's state-free terms from full-size fp32 tiles q, k ``[l, K]``, ``beta * v``
    ``[l, V]``, g, beta ``[l, 1]``: ``MB = [M | B]`` ``[K, K + V]`` and ``QO = [QE | OI]`` ``[l, K + V]``.
    ``masks``: the ``MASK_*`` tiles; ``gram_masks``: ``[lower; strict lower]`` ``[2l, l]``.

    With ``merged`` (a body of several value heads), the vector work before the first
    product is one task (merge scope ``scope``), ``Q K^T`` and ``diag(beta) K K^T`` are one
    stacked product and their masking one task (``scope + 1``). Without (one value head a
    body), the form of before (:func:`_chunk_terms_separate`): the merge scopes there make
    pypto 0.2.0's cost model fail (ParseInput BuildFunction, at T = 1024, HV = 4).

    ``gram_dtype`` (the kernel's half input dtype, or None), with ``merged``: the stacked
    Gram product's operands, the normalised and scaled q, k and ``beta * k``, are rounded to
    it in the first vector task and multiplied at the cube's half rate with fp32
    accumulation, as fla's kernels do; every other product and the state stay fp32. (Not
    in a body of one value head: there the casts are vector tasks of their own, slower than
    the fp32 products; bench/RESULTS.md has the figures.)"""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    head_k_dim, head_v_dim = k.shape[1], v_beta.shape[1]
    l = chunk_size  # noqa: E741
    pypto.set_vec_tile_shapes(vec_rows, 128)
    if not merged:
        return _chunk_terms_separate(q, k, v_beta, g, beta, masks, eye_pad_t, scale=scale,
                                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    with one_vector_task(scope):
        if use_qk_l2norm:
            q = q / pypto.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
            k = k / pypto.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
        q = q * scale
        gamma, exponent, decay_out = chunk_exponents(g, masks, chunk_size)
        gamma_last = pypto.view(gamma, [1, 1], [chunk_size - 1, 0])
        decay_in = pypto.exp(gamma)  # [l, 1]
        decay_pairs = pypto.exp(exponent)
        decay_stacked = pypto.concat([decay_pairs, decay_pairs], dim=0)  # [2l, l]
        k_beta = k * beta
        q_kbeta = pypto.concat([q, k_beta], dim=0)  # [2l, K]: one product gives Q K^T and diag(beta) K K^T
        rhs = pypto.concat([k_beta * decay_in * -1.0, v_beta], dim=1)  # [l, K + V]
        k_out = k * decay_out  # [l, K]
        chunk_decay = pypto.expand_clone(pypto.exp(gamma_last), [head_k_dim, 1])  # [K, 1]
        eye_k = pypto.view(eye_pad_t, [head_k_dim, head_k_dim], [0, 0])
        lhs_mb = pypto.concat([k_out, eye_k * chunk_decay], dim=0)  # [l + K, K]
        q_in = q * decay_in
        k_gram = k
        if gram_dtype is not None:
            q_kbeta = pypto.cast(q_kbeta, gram_dtype)
            k_gram = pypto.cast(k, gram_dtype)
    gram = pypto.matmul(q_kbeta, k_gram, fp32, b_trans=True)  # [Q K^T; diag(beta) K K^T], [2l, l]
    with one_vector_task(scope + 1):
        gram = gram * decay_stacked * gram_masks  # [P; A] in one pass
        qk = pypto.view(gram, [l, l], [0, 0])  # P
        a = pypto.view(gram, [l, l], [l, 0])
        lhs_qo = pypto.concat([qk, q_in], dim=1)  # [l, l + K]
        n1 = a * masks[MASK_BASE_BLOCKS]
        off = a * masks[MASK_OFF_BLOCKS]
        first_factor = masks[MASK_IDENTITY] - n1
    wu = _solve_unit_lower(n1, off, first_factor, rhs, masks, chunk_size)  # [-W | U]
    # [Y; [I | 0]], [l + K, K + V]: the solve's last product writes Y in place. (A scratch
    # kernel input in its place is faster, but pypto's interpreter then reads it before the
    # write.)
    y_stacked = pypto.tensor([chunk_size + head_k_dim, head_k_dim + head_v_dim], fp32)
    y_stacked[0:chunk_size, 0:head_k_dim + head_v_dim] = wu
    _write_eye_pad(y_stacked, eye_pad_t, chunk_size)
    mb = pypto.matmul(lhs_mb, y_stacked, fp32, a_trans=True)  # [K, K + V]
    qo = pypto.matmul(lhs_qo, y_stacked, fp32)  # [l, K + V]
    return mb, qo


def _chunk_terms_separate(
    q: Any, k: Any, v_beta: Any, g: Any, beta: Any, masks: Any, eye_pad_t: Any, *, scale: float,
    use_qk_l2norm: bool, chunk_size: int,
) -> tuple[Any, Any]:
    """:func:`_chunk_terms` for a body of one value head: two Gram products, no merge scopes."""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    head_k_dim, head_v_dim = k.shape[1], v_beta.shape[1]
    if use_qk_l2norm:
        q = q / pypto.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / pypto.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * scale
    gamma, exponent, decay_out = chunk_exponents(g, masks, chunk_size)
    gamma_last = pypto.view(gamma, [1, 1], [chunk_size - 1, 0])
    decay_in = pypto.exp(gamma)  # [l, 1]
    k_beta = k * beta
    a = pypto.matmul(k_beta, k, fp32, b_trans=True) * pypto.exp(exponent) * masks[MASK_STRICT_LOWER]
    rhs = pypto.concat([k_beta * decay_in * -1.0, v_beta], dim=1)  # [l, K + V]
    n1 = a * masks[MASK_BASE_BLOCKS]
    off = a * masks[MASK_OFF_BLOCKS]
    wu = _solve_unit_lower(n1, off, masks[MASK_IDENTITY] - n1, rhs, masks, chunk_size)  # [-W | U]
    qk = pypto.matmul(q, k, fp32, b_trans=True) * pypto.exp(exponent) * masks[MASK_LOWER]  # P, [l, l]
    k_out = k * decay_out  # [l, K]
    chunk_decay = pypto.expand_clone(pypto.exp(gamma_last), [head_k_dim, 1])  # [K, 1]
    eye_k = pypto.view(eye_pad_t, [head_k_dim, head_k_dim], [0, 0])
    y_stacked = pypto.tensor([chunk_size + head_k_dim, head_k_dim + head_v_dim], fp32)
    y_stacked[0:chunk_size, 0:head_k_dim + head_v_dim] = wu
    _write_eye_pad(y_stacked, eye_pad_t, chunk_size)
    lhs_mb = pypto.concat([k_out, eye_k * chunk_decay], dim=0)  # [l + K, K]
    mb = pypto.matmul(lhs_mb, y_stacked, fp32, a_trans=True)  # [K, K + V]
    lhs_qo = pypto.concat([qk, q * decay_in], dim=1)  # [l, l + K]
    qo = pypto.matmul(lhs_qo, y_stacked, fp32)  # [l, K + V]
    return mb, qo


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
    input_dtype: str = "float32",
    output_chunk_states: bool = False,
    stitch_function_max_num: int = DEFAULT_STITCH_FUNCTION_MAX_NUM,
    gate_in_kernel: bool = False,
    beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> Any:
    """Build (trace lazily, on first call) the GDR forward kernel for one configuration.

    Args:
        num_seqs: N, the number of sequences packed along T.
        num_qk_heads: H. num_v_heads: HV, a multiple of H.
        head_k_dim, head_v_dim: K and V, each 64, 128 or 256.
        chunk_size: l, 32, 64 or 128 (see :func:`kernel_chunk_size`).
        use_qk_l2norm: l2-normalise q and k per token before use.
        scale: factor applied to q (after the norm).
        has_initial_state: whether the caller passed an initial state (part of the cache
            key; the kernel code is the same, ``state_in`` holds ``[0; I]`` without one).
        on_device: run mode NPU (launch on the Ascend device) rather than SIM (CPU; see
            :mod:`.interpreter` for how it yields numbers).
        input_dtype: dtype of q, k, v: "float32", "float16" or "bfloat16".
        output_chunk_states: write the state entering every chunk to ``chunk_states``.
        stitch_function_max_num: pypto runtime option, see ``DEFAULT_STITCH_FUNCTION_MAX_NUM``.
        gate_in_kernel: g is fla's raw gate; the kernel takes ``gate_params [2, HV]`` fp32
            (A_log in row 0, dt_bias in row 1: :func:`.kernel_gating.gate_params`) after
            beta and computes the log decay ``-exp(A_log) * softplus(g + dt_bias)``.
        beta_sigmoid_in_kernel: beta holds logits; the kernel takes ``s * sigmoid(beta)``.
        allow_neg_eigval: ``s = 2``; only with ``beta_sigmoid_in_kernel``.

    Returns:
        A ``pypto.frontend.jit`` kernel taking the arguments in this module's docstring
        (with ``gate_in_kernel``, ``gate_params`` after beta).
    """
    validate_kernel_config(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, chunk_size=chunk_size, input_dtype=input_dtype,
    )
    if allow_neg_eigval and not beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires beta_sigmoid_in_kernel=True, got beta_sigmoid_in_kernel=False")
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    in_dt = _pypto_dtype(input_dtype)
    tokens = pypto.DYNAMIC
    chunk_rows = pypto.DYNAMIC
    group = num_v_heads // num_qk_heads
    num_pairs = num_seqs * num_v_heads
    body_heads = heads_per_body(num_seqs, num_v_heads)
    n_masks = NUM_MASKS
    l = chunk_size  # noqa: E741  (the spec's name for the chunk length)
    dk, dv = head_k_dim, head_v_dim
    state_in_shape = [num_pairs * (dk + dv), dv]
    chunk_states_shape = [chunk_rows, dv] if output_chunk_states else [1, 1]
    # the chunk's two-dimensional work; K or V = 256 in a body of several heads: the merged
    # vector tasks' 128-row tiles exceed the unified buffer
    vec_rows = min(l, 64 if max(dk, dv) > 128 and body_heads > 1 else 128)
    io_rows = min(l, 64)  # reads of the inputs
    ticket_cols = ticket_width(dk, dv)
    cube_l1_k = 256 if max(dk, dv) <= 128 else 128  # L1 holds 512 KiB: K = 256 products stage 128-deep tiles
    run_mode = pypto.RunMode.NPU if on_device else pypto.RunMode.SIM
    # Half inputs in a body of several heads: the chunk's k, q (and v where V == K) reads
    # and the ticket's zeros are one task (but a tail's), where each cast was one
    # (bench/RESULTS.md). Not with fla's activations in the kernel (either): joined reads
    # there fail in pypto 0.2.0's cost model (FFFFFF, ParseInput BuildFunction) in every
    # form tried (bench/RESULTS.md, both activations on).
    join_half_reads = (input_dtype != "float32" and body_heads > 1
                       and not (gate_in_kernel or beta_sigmoid_in_kernel))
    gram_dtype = None if input_dtype == "float32" else in_dt  # see _chunk_terms

    def read_rows(src: Any, width: int, head: Any, start: Any, rows: Any, order: Any, tail: bool,
                  weight: Any = None, joined: list | None = None) -> Any:
        """Rows ``[start, start + l)`` of head ``head`` of ``src [T, heads * width]`` as fp32
        ``[l, width]``, times ``weight [l, 1]`` if given.

        A strided two-dimensional view (no reshape), brought on chip by one vector task in
        64-row tiles (128 with ``joined``): the cast for half inputs, zero-filled past
        ``rows`` for a tail, plus ``order`` unless None (zeros written by the previous
        chunk's read, see the ``ticket`` input). (Consumed directly by the chunk's 128-row
        work, the view fails in pypto 0.2.0's runtime model.)

        ``joined`` (half inputs): the reads given the same list are one task, in the chunk's
        row tiles: the first read's cast goes into the list and each later read adds it
        times zero (an exact zero where it is finite; pypto merges a dependency chain into
        one task, independent casts each into a task of their own). Row-local: a non-finite
        entry of the first read's row t (the keys') makes row t of the others non-finite,
        as it does the state and o_t in the recurrence."""
        pypto.set_vec_tile_shapes(io_rows if joined is None else vec_rows, 128)
        tile = pypto.view(src, [l, width], [start, head * width], valid_shape=[rows, width])
        x = tile if input_dtype == "float32" else pypto.cast(tile, fp32)
        if joined is not None:
            if joined:
                x = x + joined[0] * 0.0
            else:
                joined.append(x)
        if tail:
            x = pypto.fillpad(x if input_dtype != "float32" else x + 0.0, "constant", 0.0)
        if order is not None:
            x = x + pypto.view(order, [l, width], [0, 0])
        elif not tail and input_dtype == "float32":
            x = x + 0.0
        return x if weight is None else x * weight

    def load_gates(g_in: Any, beta_in: Any, head: Any, start: Any, rows: Any, tail: bool,
                   g_tile_rows: int, gate_params_in: Any = None) -> tuple[Any, Any]:
        """The chunk's log decays g and write strengths beta of value head ``head``, each fp32
        ``[l, 1]``, zero past ``rows`` for a tail. beta's work runs in the reads' tiles (it
        weights v), g's in ``g_tile_rows`` rows: the chunk's (one head a body: a task fewer)
        or the reads' (several: the other makes pypto 0.2.0's cost model fail at 16 x 256,
        HV = 4).

        With ``gate_in_kernel`` g_in holds the raw gate and ``gate_params_in`` ``[2, HV]``
        A_log and dt_bias; with ``beta_sigmoid_in_kernel`` beta_in holds logits: the
        activations are computed here (:mod:`.kernel_gating`), a tail's raw rows filled with
        -inf first, whose activations are 0."""
        beta_c = pypto.view(beta_in, [l, 1], [start, head], valid_shape=[rows, 1])
        g_c = pypto.view(g_in, [l, 1], [start, head], valid_shape=[rows, 1])
        if tail or beta_sigmoid_in_kernel:
            pypto.set_vec_tile_shapes(io_rows, 128)
        if tail:
            beta_c = pypto.fillpad(beta_c, "constant", kernel_gating.RAW_FILL if beta_sigmoid_in_kernel else 0.0)
        if beta_sigmoid_in_kernel:
            beta_c = kernel_gating.activated_beta(beta_c, allow_neg_eigval)
        if tail or gate_in_kernel:
            pypto.set_vec_tile_shapes(g_tile_rows, 128)
        if tail:
            g_c = pypto.fillpad(g_c, "constant", kernel_gating.RAW_FILL if gate_in_kernel else 0.0)
        if gate_in_kernel:
            rate = kernel_gating.gate_rate(pypto.view(gate_params_in, [1, 1], [0, head]))
            bias = pypto.view(gate_params_in, [1, 1], [1, head])
            g_c = kernel_gating.log_decay(g_c, pypto.expand_clone(rate, [l, 1]), pypto.expand_clone(bias, [l, 1]))
        return g_c, beta_c

    def chunk_step(inputs: list, outputs: list, state: Any, seq: Any, head: Any, chunk: Any, start: Any,
                   rows: Any, tail: bool, first: bool, scope: int) -> None:
        """One chunk of one value head: output rows, the carried state, the chunk-state row.

        Full chunks read all l rows; the tail chunk (the window's last) zero-fills past
        ``rows``, writes only its valid output rows and writes its state to ``state_out``
        rather than back to ``state``. The values are read already weighted by beta. Every chunk but the window's first (``first``) reads after the previous
        chunk's key read (the ticket); the first starts at once. The vector work before the
        first product is one task (merge scope ``scope``; ``scope + 1``... for the later
        stages: distinct per value head of a body). ``inputs``: q, k, v, g,
        beta, chunk_offsets, masks, ``[I | 0]``, the pair's ticket tile, then ``gate_params``
        with ``gate_in_kernel``; ``outputs``: o, state_out, chunk_states."""
        q_in, k_in, v_in, g_in, beta_in, chunk_offsets_in, masks_in, eye_pad_in, ticket_in, *gate_params_in = inputs
        o_out, state_out_out, chunk_states_out = outputs
        pair = seq * num_v_heads + head
        qk_head = head // group
        order = None if first else ticket_in
        if output_chunk_states:
            entering = pypto.view(state, [dk, dv], [0, 0])
            pypto.assemble(entering, [((chunk_offsets_in[seq] + chunk) * num_v_heads + head) * dk, 0],
                           chunk_states_out)
        # (The reads in the chunk's first merge scope fail to compile in pypto 0.2.0: FFFFFF.)
        # Joined reads (join_half_reads): the keys first, as a non-finite key row may reach
        # the others' row, never the reverse.
        joined = [] if join_half_reads and not tail else None
        if joined is None:
            q_c = read_rows(q_in, dk, qk_head, start, rows, order, tail)
            k_c = read_rows(k_in, dk, qk_head, start, rows, order, tail)
        else:
            k_c = read_rows(k_in, dk, qk_head, start, rows, order, tail, joined=joined)
            q_c = read_rows(q_in, dk, qk_head, start, rows, order, tail, joined=joined)
        g_c, beta_c = load_gates(g_in, beta_in, head, start, rows, tail, io_rows if body_heads > 1 else vec_rows,
                                 *gate_params_in)
        v_beta = read_rows(v_in, dv, head, start, rows, order, tail, beta_c, joined=joined if dv == dk else None)
        pypto.set_vec_tile_shapes(io_rows, 128)
        zeros = k_c * 0.0  # written back; the next chunk's reads wait for this
        if dv > dk:  # every column a later read adds
            zeros = pypto.concat([zeros] * (dv // dk), dim=1)
        ticket_in[0:l, 0:max(dk, dv)] = zeros
        pypto.set_vec_tile_shapes(vec_rows, 128)
        if not first:
            g_c = g_c + pypto.view(ticket_in, [l, 1], [0, 0])  # the decay work waits its turn too
        mask_tiles = [pypto.view(masks_in, [l, l], [i * l, 0]) for i in range(n_masks)]
        gram_masks = pypto.view(masks_in, [2 * l, l], [MASK_LOWER * l, 0])
        eye_pad_t = pypto.view(eye_pad_in, [dk, dk + dv], [0, 0])
        mb, qo = _chunk_terms(
            q_c, k_c, v_beta, g_c, beta_c, mask_tiles, eye_pad_t,
            scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=l, vec_rows=vec_rows, scope=scope,
            gram_masks=gram_masks, merged=body_heads > 1, gram_dtype=gram_dtype,
        )
        if tail:  # the product then has the valid rows only, and the cube writes just those
            # (test_chunk_states_match_..._a_launch_per_chunk fails if padding rows are written)
            qo = pypto.view(qo, [l, dk + dv], [0, 0], valid_shape=[rows, dk + dv])
        o_c = pypto.matmul(qo, state, fp32)  # [l, V]
        new_state = pypto.matmul(mb, state, fp32)  # [K, V]
        pypto.set_vec_tile_shapes(vec_rows, 128)
        if not tail:  # the window's last chunk hands its state to state_out instead
            state[0:dk, 0:dv] = new_state
        pypto.set_vec_tile_shapes(io_rows, 128)
        pypto.assemble(o_c, [start, head * dv], o_out)
        if tail:
            pypto.set_vec_tile_shapes(vec_rows, 128)
            pypto.assemble(new_state, [pair * dk, 0], state_out_out)

    jit = pypto.frontend.jit(
        runtime_options={"run_mode": run_mode, "stitch_function_max_num": stitch_function_max_num},
        # Two vector subgraphs of the same structure per task: half the small vector tasks
        # (the scheduler's cost per task, not their work, bounds long sequences).
        # Cube subgraphs that load the same operand share a task (the two [S; I] products),
        # and the identical cube subgraphs of a body's value heads one task (cube_nbuffer).
        # pg_upper_bound (marked deprecated, still read by 0.2.0's partitioner) lifts the cap
        # on a merged subgraph's size: the solve's chain of matmuls becomes two cube tasks
        # rather than four (bench/RESULTS.md has the cost model's figures).
        pass_options={"vec_nbuffer_setting": {-1: 2}, "cube_nbuffer_setting": {-1: max(HEADS_PER_BODY_CHOICES)},
                      "cube_l1_reuse_setting": {-1: 4}, "pg_upper_bound": 100000},
    )

    @jit
    def gdr_fwd_kernel(
        q: pypto.Tensor([tokens, num_qk_heads * dk], in_dt),
        k: pypto.Tensor([tokens, num_qk_heads * dk], in_dt),
        v: pypto.Tensor([tokens, num_v_heads * dv], in_dt),
        g: pypto.Tensor([tokens, num_v_heads], fp32),
        beta: pypto.Tensor([tokens, num_v_heads], fp32),
        act_seq_len: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        chunk_offsets: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        window: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        masks: pypto.Tensor([n_masks * l, l], fp32),
        eye_pad_in: pypto.Tensor([dk, dk + dv], fp32),
        state_in: pypto.Tensor(state_in_shape, fp32),
        o: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        state_out: pypto.Tensor([num_pairs * dk, dv], fp32),
        chunk_states: pypto.Tensor(chunk_states_shape, fp32),
        ticket: pypto.Tensor([num_pairs * l, ticket_cols], fp32),
    ):
        # L0 tiles 128 x 128 (64 KiB fp32 per operand); L1 holds 256 along K, so the
        # [S; I] products (K + V = 256) load their operands once (128 where K or V is 256).
        pypto.set_cube_tile_shapes([128, 128], [128, cube_l1_k], [128, 128])

        for body in pypto.loop(num_pairs // body_heads, name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            seq = (body * body_heads) // num_v_heads
            seq_start = act_seq_len[seq]
            seq_len = act_seq_len[seq + 1] - seq_start
            pypto.set_vec_tile_shapes(vec_rows, 128)
            # Both views are written in the chunk loop, so pypto copies them into buffers of
            # the pair's own (the pair body's three copy tasks) and the chunks update those.
            # (Reading the inputs without a vector op of their own (the ticket add, a cast or
            # "+ 0.0") fails in pypto 0.2.0's runtime model: F74007.)
            heads, states, tickets = [], [], []
            for j in range(body_heads):
                pair = body * body_heads + j
                heads.append(pair % num_v_heads)
                states.append(pypto.view(state_in, [dk + dv, dv], [pair * (dk + dv), 0]))
                tickets.append(pypto.view(ticket, [l, ticket_cols], [pair * l, 0]))
            outputs = [o, state_out, chunk_states]
            for step in pypto.loop(window[seq + 1], name="LOOP_CHUNK", idx_name="step"):
                chunk = window[0] + step
                start = seq_start + chunk * l
                rows = pypto.min(l, seq_len - chunk * l)
                for j, head, state, ticket_row in zip(range(body_heads), heads, states, tickets):
                    scope = SCOPE_STRIDE * (j + 1)
                    inputs = [q, k, v, g, beta, chunk_offsets, masks, eye_pad_in, ticket_row]
                    if pypto.is_loop_begin(step):
                        if pypto.is_loop_end(step):  # the window's last chunk: maybe short; it writes the state
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, True, True, scope)
                        else:
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, False, True, scope)
                    else:
                        if pypto.is_loop_end(step):
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, True, False, scope)
                        else:
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, False, False, scope)

    # The gated variant: the same loops with the raw gate's parameters (a second jit
    # function: pypto parses the signature and the loops from the function's own source,
    # and the plain kernel keeps its arguments). Only the gate reads differ (load_gates).
    @jit
    def gdr_fwd_gated_kernel(
        q: pypto.Tensor([tokens, num_qk_heads * dk], in_dt),
        k: pypto.Tensor([tokens, num_qk_heads * dk], in_dt),
        v: pypto.Tensor([tokens, num_v_heads * dv], in_dt),
        g: pypto.Tensor([tokens, num_v_heads], fp32),
        beta: pypto.Tensor([tokens, num_v_heads], fp32),
        gate_params: pypto.Tensor([2, num_v_heads], fp32),
        act_seq_len: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        chunk_offsets: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        window: pypto.Tensor([num_seqs + 1], pypto.DT_INT32),
        masks: pypto.Tensor([n_masks * l, l], fp32),
        eye_pad_in: pypto.Tensor([dk, dk + dv], fp32),
        state_in: pypto.Tensor(state_in_shape, fp32),
        o: pypto.Tensor([tokens, num_v_heads * dv], fp32),
        state_out: pypto.Tensor([num_pairs * dk, dv], fp32),
        chunk_states: pypto.Tensor(chunk_states_shape, fp32),
        ticket: pypto.Tensor([num_pairs * l, ticket_cols], fp32),
    ):
        pypto.set_cube_tile_shapes([128, 128], [128, cube_l1_k], [128, 128])

        for body in pypto.loop(num_pairs // body_heads, name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            seq = (body * body_heads) // num_v_heads
            seq_start = act_seq_len[seq]
            seq_len = act_seq_len[seq + 1] - seq_start
            pypto.set_vec_tile_shapes(vec_rows, 128)
            heads, states, tickets = [], [], []
            for j in range(body_heads):
                pair = body * body_heads + j
                heads.append(pair % num_v_heads)
                states.append(pypto.view(state_in, [dk + dv, dv], [pair * (dk + dv), 0]))
                tickets.append(pypto.view(ticket, [l, ticket_cols], [pair * l, 0]))
            outputs = [o, state_out, chunk_states]
            for step in pypto.loop(window[seq + 1], name="LOOP_CHUNK", idx_name="step"):
                chunk = window[0] + step
                start = seq_start + chunk * l
                rows = pypto.min(l, seq_len - chunk * l)
                for j, head, state, ticket_row in zip(range(body_heads), heads, states, tickets):
                    scope = SCOPE_STRIDE * (j + 1)
                    inputs = [q, k, v, g, beta, chunk_offsets, masks, eye_pad_in, ticket_row, gate_params]
                    if pypto.is_loop_begin(step):
                        if pypto.is_loop_end(step):
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, True, True, scope)
                        else:
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, False, True, scope)
                    else:
                        if pypto.is_loop_end(step):
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, True, False, scope)
                        else:
                            chunk_step(inputs, outputs, state, seq, head, chunk, start, rows, False, False, scope)

    return gdr_fwd_gated_kernel if gate_in_kernel else gdr_fwd_kernel
