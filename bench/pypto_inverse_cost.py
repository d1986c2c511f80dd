"""What forming ``(I + A)^-1 B`` costs in pypto's cost model, by several methods, and what one
product costs: the measurements behind the forward kernel's floor (bench/RESULTS.md, "PyPTO
forward: where its floor is in the cost model").

The chunk's inverse is most of the forward's cube time. This script runs one solve in a loop
over ``--bodies`` independent (A, B) pairs (A ``[128, 128]`` strictly lower, B ``[128, 256]``),
as a body of the forward kernel would, and prints the SIM's figures and the mean time of each
task kind. ``--check`` runs the same kernel through PyPTO's interpreter against a float64
triangular solve instead. Methods:

- ``power``: the kernel's own (:func:`torch_gdr.ops.pypto.kernel._solve_unit_lower`): 16 x 16
  diagonal blocks by power factors, then the block level; 12 products of 128 x 128.
- ``split64``: the two diagonal 64 x 64 blocks by power factors (10 products of 64^3 each),
  joined by ``-T2^-1 C T1^-1``.
- ``vector16``: the 16 x 16 diagonal blocks by column elimination on the vector unit
  (``[8, 16, 16]`` tiles), then the block level on the cube (6 products).
- ``batched16``: the 16 x 16 diagonal blocks by batched ``[8, 16, 16]`` products.

``--product M,K,N`` instead times one ``[M, K] x [K, N]`` product a task (``--dtype``).

Examples::

    python bench/pypto_inverse_cost.py --method power --bodies 192
    python bench/pypto_inverse_cost.py --method vector16 --check
    python bench/pypto_inverse_cost.py --product 128,128,128 --dtype bfloat16
"""

# No `from __future__ import annotations`: pypto reads the jit signature's annotations as objects.

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script belongs to

from pypto_cost_model import output_root, simulate_launches  # noqa: E402

from torch_gdr.ops.pypto import kernel as fwd  # noqa: E402
from torch_gdr.ops.pypto._env import import_pypto  # noqa: E402
from torch_gdr.ops.pypto.interpreter import run_kernel  # noqa: E402

CHUNK = 128  # l
RHS_WIDTH = 256  # K + V at K = V = 128
BLOCK = fwd.BASE_BLOCK


def _product_tree(factors: list) -> Any:
    """The product of ``factors`` in order, as a balanced tree of matmuls (a shallow chain)."""
    pypto = import_pypto()
    while len(factors) > 1:
        paired = [pypto.matmul(factors[i], factors[i + 1], pypto.DT_FP32) for i in range(0, len(factors) - 1, 2)]
        factors = paired + factors[len(paired) * 2:]
    return factors[0]


def _diagonal_blocks(square: Any) -> Any:
    """The 16 x 16 diagonal blocks of a block-diagonal ``[l, l]`` (zero elsewhere), ``[l / 16, 16, 16]``."""
    pypto = import_pypto()
    count = CHUNK // BLOCK
    pypto.set_vec_tile_shapes(CHUNK, count, BLOCK)
    stacked = pypto.reshape(square, [CHUNK, count, BLOCK], inplace=True).sum(1)  # [l, 16]
    return pypto.reshape(stacked, [count, BLOCK, BLOCK], inplace=True)


def solve_power(a: Any, rhs: Any, masks: list) -> Any:
    """``(I + a)^-1 rhs`` as the forward kernel forms it; ``a [l, l]`` strictly lower, ``rhs [l, 256]``,
    fp32 tiles; ``masks`` the kernel's ``MASK_*`` tiles. Returns ``[l, 256]``."""
    n1 = a * masks[fwd.MASK_BASE_BLOCKS]
    off = a * masks[fwd.MASK_OFF_BLOCKS]
    return fwd._solve_unit_lower(n1, off, masks[fwd.MASK_IDENTITY] - n1, rhs, masks, CHUNK)


def solve_split64(a: Any, rhs: Any, masks: list) -> Any:
    """As :func:`solve_power`, from the inverses of the two diagonal 64 x 64 blocks."""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    h = CHUNK // 2
    eye_h = pypto.view(masks[fwd.MASK_IDENTITY], [h, h], [0, 0])
    a_lower = a * masks[fwd.MASK_STRICT_LOWER]
    blocks = [pypto.view(a_lower, [h, h], [0, 0]), pypto.view(a_lower, [h, h], [h, h])]
    neg_c = pypto.view(a_lower, [h, h], [h, 0]) * -1.0
    terms = []
    for block in blocks:  # (I + X)^-1 = (I - X)(I + X^2)...(I + X^32) for nilpotent X of index 64
        powers = [block]
        for _ in range(5):
            powers.append(pypto.matmul(powers[-1], powers[-1], fp32))
        terms += powers[:0:-1] + [block * -1.0]
    factors = fwd._unit_plus(terms, eye_h)
    inv_top, inv_bottom = _product_tree(factors[:6]), _product_tree(factors[6:])
    out = pypto.tensor([CHUNK, RHS_WIDTH], fp32)
    out[0:h, 0:RHS_WIDTH] = pypto.matmul(inv_top, pypto.view(rhs, [h, RHS_WIDTH], [0, 0]), fp32)
    bottom_rows = pypto.tensor([h, CHUNK], fp32)  # [-T2^-1 C T1^-1 | T2^-1]
    bottom_rows[0:h, 0:h] = pypto.matmul(pypto.matmul(inv_bottom, neg_c, fp32), inv_top, fp32)
    bottom_rows[0:h, h:CHUNK] = inv_bottom
    out[h:CHUNK, 0:RHS_WIDTH] = pypto.matmul(bottom_rows, rhs, fp32)
    return out


def solve_vector16(a: Any, rhs: Any, masks: list) -> Any:
    """As :func:`solve_power`, the 16 x 16 diagonal blocks inverted on the vector unit."""
    pypto = import_pypto()
    count = CHUNK // BLOCK
    eye = masks[fwd.MASK_IDENTITY]
    with fwd.one_vector_task(50):
        pypto.set_vec_tile_shapes(CHUNK, CHUNK)
        n1 = a * masks[fwd.MASK_BASE_BLOCKS]
        off = a * masks[fwd.MASK_OFF_BLOCKS]
        blocks = _diagonal_blocks(n1)
        inverse = _diagonal_blocks(eye + 0.0)
        pypto.set_vec_tile_shapes(count, BLOCK, BLOCK)
        for j in range(BLOCK - 1):  # X <- X - N[:, j] X[j, :], blockwise: X = (I + N)^-1 at the end
            column = pypto.expand_clone(pypto.view(blocks, [count, BLOCK, 1], [0, 0, j]), [count, BLOCK, BLOCK])
            row = pypto.expand_clone(pypto.view(inverse, [count, 1, BLOCK], [0, j, 0]), [count, BLOCK, BLOCK])
            inverse = inverse - column * row
        pypto.set_vec_tile_shapes(CHUNK, count, BLOCK)
        spread = pypto.expand_clone(pypto.reshape(inverse, [CHUNK, 1, BLOCK], inplace=True), [CHUNK, count, BLOCK])
        pypto.set_vec_tile_shapes(CHUNK, CHUNK)
        d_inv = pypto.reshape(spread, [CHUNK, CHUNK], inplace=True) * (masks[fwd.MASK_BASE_BLOCKS] + eye)
    return fwd._solve_block_level(d_inv, off, rhs, eye, CHUNK)


def solve_batched16(a: Any, rhs: Any, masks: list) -> Any:
    """As :func:`solve_power`, the 16 x 16 diagonal blocks by batched ``[8, 16, 16]`` products."""
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    count = CHUNK // BLOCK
    eye = masks[fwd.MASK_IDENTITY]
    with fwd.one_vector_task(50):
        n1 = a * masks[fwd.MASK_BASE_BLOCKS]
        off = a * masks[fwd.MASK_OFF_BLOCKS]
        blocks = _diagonal_blocks(n1)
        eyes = _diagonal_blocks(eye + 0.0)
        first = eyes - blocks
    n2 = pypto.matmul(blocks, blocks, fp32)
    n4 = pypto.matmul(n2, n2, fp32)
    n8 = pypto.matmul(n4, n4, fp32)
    pypto.set_vec_tile_shapes(count, BLOCK, BLOCK)
    f2, f4, f8 = fwd._unit_plus([n2, n4, n8], eyes)
    pypto.set_vec_tile_shapes(CHUNK, CHUNK)
    d_inv = pypto.matmul(pypto.matmul(first, f2, fp32), pypto.matmul(f4, f8, fp32), fp32)  # [l / 16, 16, 16]

    def blockwise(x: Any, width: int) -> Any:  # D^-1 x, ``x [l, width]``
        out = pypto.matmul(d_inv, pypto.reshape(x, [count, BLOCK, width], inplace=True), fp32)
        return pypto.reshape(out, [CHUNK, width], inplace=True)

    powers = [blockwise(off, CHUNK)]
    for _ in range(fwd.num_block_levels(CHUNK) - 1):
        powers.append(pypto.matmul(powers[-1], powers[-1], fp32))
    factors = fwd._unit_plus(powers[:0:-1] + [powers[0] * -1.0], eye)
    return pypto.matmul(_product_tree(factors), blockwise(rhs, RHS_WIDTH), fp32)


METHODS = {"power": solve_power, "split64": solve_split64, "vector16": solve_vector16, "batched16": solve_batched16}


def build_solve_kernel(method: str, bodies: int) -> Any:
    """A SIM-mode kernel: ``y[b] = (I + strict_lower(a[b]))^-1 rhs[b]`` for each of ``bodies``."""
    import_pypto()
    import pypto  # the jit parser resolves the annotations' module by name

    solve = METHODS[method]
    fp32 = pypto.DT_FP32

    def body(a: Any, rhs: Any, masks: Any, index: Any, y: Any) -> None:
        pypto.set_vec_tile_shapes(CHUNK, CHUNK)
        mask_tiles = [pypto.view(masks, [CHUNK, CHUNK], [i * CHUNK, 0]) for i in range(fwd.NUM_MASKS)]
        a_tile = pypto.view(a, [CHUNK, CHUNK], [index * CHUNK, 0]) * mask_tiles[fwd.MASK_STRICT_LOWER]
        rhs_tile = pypto.view(rhs, [CHUNK, RHS_WIDTH], [index * CHUNK, 0]) + 0.0
        pypto.assemble(solve(a_tile, rhs_tile, mask_tiles), [index * CHUNK, 0], y)

    @pypto.frontend.jit(
        runtime_options={"run_mode": pypto.RunMode.SIM, "stitch_function_max_num": fwd.DEFAULT_STITCH_FUNCTION_MAX_NUM},
        pass_options={"vec_nbuffer_setting": {-1: 2}, "cube_l1_reuse_setting": {-1: 4}, "pg_upper_bound": 100000},
    )
    def solve_kernel(
        a: pypto.Tensor([bodies * CHUNK, CHUNK], fp32),
        rhs: pypto.Tensor([bodies * CHUNK, RHS_WIDTH], fp32),
        masks: pypto.Tensor([fwd.NUM_MASKS * CHUNK, CHUNK], fp32),
        y: pypto.Tensor([bodies * CHUNK, RHS_WIDTH], fp32),
    ):
        pypto.set_cube_tile_shapes([128, 128], [128, 256], [128, 128])
        for index in pypto.loop(bodies, name="LOOP_BODY", idx_name="index", parallel=True):
            body(a, rhs, masks, index, y)

    return solve_kernel


def build_product_kernel(m: int, k: int, n: int, dtype: str, bodies: int) -> Any:
    """A SIM-mode kernel: ``c[b] = a[b] @ b[b]``, one ``[m, k] x [k, n]`` product a body, fp32 out."""
    import_pypto()
    import pypto

    in_dt = {"float32": pypto.DT_FP32, "bfloat16": pypto.DT_BF16, "float16": pypto.DT_FP16}[dtype]

    @pypto.frontend.jit(runtime_options={"run_mode": pypto.RunMode.SIM},
                        pass_options={"cube_l1_reuse_setting": {-1: 4}, "pg_upper_bound": 100000})
    def product_kernel(
        a: pypto.Tensor([bodies * m, k], in_dt),
        b: pypto.Tensor([bodies * k, n], in_dt),
        c: pypto.Tensor([bodies * m, n], pypto.DT_FP32),
    ):
        pypto.set_cube_tile_shapes([128, 128], [128, 256], [128, 128])
        for index in pypto.loop(bodies, name="LOOP_BODY", idx_name="index", parallel=True):
            product = pypto.matmul(pypto.view(a, [m, k], [index * m, 0]), pypto.view(b, [k, n], [index * k, 0]),
                                   pypto.DT_FP32)
            pypto.assemble(product, [index * m, 0], c)

    return product_kernel


def task_times(out: Path) -> dict[str, tuple[int, float]]:
    """Per core type: tasks run and their mean cycles, from the SIM's swim lanes."""
    swim = json.loads(next(out.rglob("_simulate.swim.json")).read_text())
    durations: dict[str, list[int]] = collections.defaultdict(list)
    for core in swim:
        for task in core["tasks"]:
            durations[core["coreType"]].append(task["execEnd"] - task["execStart"])
    return {kind: (len(d), sum(d) / len(d)) for kind, d in durations.items() if d}


def solve_inputs(bodies: int) -> list[torch.Tensor]:
    """The solve kernel's arguments: A (scaled so the solution reaches several units), B, the
    masks and a zero output."""
    gen = torch.Generator().manual_seed(0)
    a = 0.1 * torch.randn(bodies * CHUNK, CHUNK, generator=gen)
    rhs = torch.randn(bodies * CHUNK, RHS_WIDTH, generator=gen)
    return [a, rhs, fwd.chunk_masks(CHUNK), torch.zeros(bodies * CHUNK, RHS_WIDTH)]


def check(method: str, bodies: int) -> float:
    """Largest error of the method's result through the interpreter against a float64 solve."""
    args = solve_inputs(bodies)
    run_kernel(build_solve_kernel(method, bodies), args, [3])
    a = torch.tril(args[0].view(bodies, CHUNK, CHUNK).double(), -1) + torch.eye(CHUNK, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(a, args[1].view(bodies, CHUNK, RHS_WIDTH).double(), upper=False)
    return (args[3].view(bodies, CHUNK, RHS_WIDTH).double() - ref).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=sorted(METHODS), default="power")
    parser.add_argument("--bodies", type=int, default=192, help="independent solves (or products) in the loop")
    parser.add_argument("--check", action="store_true", help="check the method in the interpreter instead")
    parser.add_argument("--product", help="M,K,N: time one [M, K] x [K, N] product a body instead")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="with --product: the operands' dtype")
    parser.add_argument("--out", help="keep the SIM's output here")
    args = parser.parse_args(argv)
    if args.check:
        print(f"{args.method}: max |error| {check(args.method, min(args.bodies, 2)):.3g} against a float64 solve")
        return
    if args.product:
        m, k, n = (int(x) for x in args.product.split(","))
        kernel = build_product_kernel(m, k, n, args.dtype, args.bodies)
        in_dtype = getattr(torch, args.dtype)
        launch = [torch.zeros(args.bodies * m, k, dtype=in_dtype), torch.zeros(args.bodies * k, n, dtype=in_dtype),
                  torch.zeros(args.bodies * m, n)]
        label = f"product {m}x{k}x{n} {args.dtype}"
    else:
        kernel, launch, label = build_solve_kernel(args.method, args.bodies), solve_inputs(args.bodies), args.method
    with output_root(args.out) as out:
        figures = simulate_launches(kernel, [launch], out)[0]
        tasks = task_times(out)
    kinds = ", ".join(f"{kind} {count} tasks of {mean:,.0f} cycles" for kind, (count, mean) in sorted(tasks.items()))
    print(f"{label}, {args.bodies} bodies: {figures['total_cycles']:,} cycles; {kinds}; "
          f"cores busy: cube {figures['cube_busy_pct']}%, vector {figures['vector_busy_pct']}%")


if __name__ == "__main__":
    main()
