"""Copy kernels that move exactly the pool bytes of a decode step: the yardstick of
:mod:`.kernel_decode` in pypto 0.2.0's cost model (``bench/pypto_cost_model.py --decode``).

A decode step over a pool reads, per (sequence, value head), one ``[K, V]`` state row and
writes S rows (one per token). Each kernel here does that and nothing else, in the pool's
dtype and layout (key-first rows of ``pool [slots * HV * K, V]``), so the fastest of them
is the floor a decode kernel is measured against. The variants differ only in how pypto
cuts the work into tasks and tiles, which is what the cost model charges for
(``bench/RESULTS.md`` has the figures):

=================  ===========================================================================
variant            task shape
=================  ===========================================================================
``partitioned``    one loop body per (sequence, value head), 64-row fp32 tiles (a 2-byte row
                   whole), pypto's default partition (a task per tile chain)
``task_64``        the same body compiled into one task (``pg_skip_partition``)
``task_row``       one task per (sequence, value head), the whole ``[K, V]`` row as one tile
``task_2heads``    one task per (sequence, pair of value heads), 64-row tiles (HV even)
``task_2heads_row``  one task per (sequence, pair of value heads), whole-row tiles (HV even)
``task_4heads_row``  one task per (sequence, four value heads), whole-row tiles (HV % 4 == 0)
``task_8heads_row``  one task per (sequence, eight value heads), whole-row tiles (HV % 8 == 0)
=================  ===========================================================================

Arguments of every variant: ``read_rows [B]`` int32 (the row each sequence reads),
``write_rows [B * S]`` int32 (the rows token j of sequence n writes, valid rows only),
``pool`` and ``pool_out`` ``[slots * HV * K, V]`` (one storage, passed twice as the decode
kernel's is). Built in SIM run mode: these kernels exist to be timed, not run.
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

from typing import Any

from ._env import import_pypto

#: The copy variants, in the order the benchmark runs them (module docstring).
COPY_VARIANTS: tuple[str, ...] = ("partitioned", "task_64", "task_row", "task_2heads", "task_2heads_row",
                                   "task_4heads_row", "task_8heads_row")
#: pypto's stitch_function_max_num for the copies (as the decode kernel's).
_STITCH_BODIES = 128


def _pypto_dtype(name: str) -> Any:
    pypto = import_pypto()
    return {"float32": pypto.DT_FP32, "float16": pypto.DT_FP16, "bfloat16": pypto.DT_BF16}[name]


def copy_variant_applies(variant: str, num_v_heads: int) -> bool:
    """Whether ``variant`` can move the bytes of a pool with ``num_v_heads`` value heads
    (the variants of n heads per task need a multiple of n)."""
    if variant not in COPY_VARIANTS:
        raise ValueError(f"variant: expected one of {COPY_VARIANTS}, got {variant!r}")
    return num_v_heads % _heads_per_task(variant) == 0


def _heads_per_task(variant: str) -> int:
    for heads in (8, 4, 2):
        if variant.startswith(f"task_{heads}heads"):
            return heads
    return 1


def build_pool_copy_kernel(*, batch: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, tokens_per_seq: int,
                           pool_dtype: str = "float32", variant: str = "partitioned") -> Any:
    """A SIM-mode kernel moving one decode step's pool bytes (module docstring).

    Args:
        batch: B, sequences. num_v_heads: HV. head_k_dim, head_v_dim: K, V.
        tokens_per_seq: S, rows written per (sequence, value head).
        pool_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        variant: one of :data:`COPY_VARIANTS`.
    """
    if not copy_variant_applies(variant, num_v_heads):
        raise ValueError(f"variant {variant!r}: needs num_v_heads a multiple of {_heads_per_task(variant)}, "
                         f"got {num_v_heads}")
    if batch <= 0 or tokens_per_seq <= 0:
        raise ValueError(f"batch, tokens_per_seq: expected positive ints, got {batch}, {tokens_per_seq}")
    pypto = import_pypto()
    pool_dt = _pypto_dtype(pool_dtype)
    hv, dk, dv, s = num_v_heads, head_k_dim, head_v_dim, tokens_per_seq
    whole_row = variant.endswith("_row") or pool_dtype != "float32"
    tile_rows = dk if whole_row else min(dk, 64)
    heads_per_body = _heads_per_task(variant)
    bodies_per_seq = hv // heads_per_body
    token_offsets = tuple(range(s))
    options: dict[str, Any] = {}
    if variant != "partitioned":
        options["pass_options"] = {"pg_skip_partition": True}

    @pypto.frontend.jit(runtime_options={"run_mode": pypto.RunMode.SIM, "stitch_function_max_num": _STITCH_BODIES},
                        **options)
    def pool_row_copy(
        read_rows: pypto.Tensor([batch], pypto.DT_INT32),
        write_rows: pypto.Tensor([batch * s], pypto.DT_INT32),
        pool: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
        pool_out: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
    ):
        for body in pypto.loop(batch * bodies_per_seq, name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            seq = body // bodies_per_seq
            first_head = (body % bodies_per_seq) * heads_per_body
            pypto.set_vec_tile_shapes(tile_rows, 128)
            rows = []
            for h in range(heads_per_body):
                rows.append(pypto.view(pool, [dk, dv], [(read_rows[seq] * hv + first_head + h) * dk, 0]) + 0.0)
            for j in token_offsets:
                for h, row in enumerate(rows):
                    pypto.assemble(row, [(write_rows[seq * s + j] * hv + first_head + h) * dk, 0], pool_out)

    return pool_row_copy
