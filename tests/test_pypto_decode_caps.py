"""The bench's yardsticks of the PyPTO decode kernel (``bench/pypto_decode_caps.py``), run by
PyPTO's interpreter on CPU tensors against independent float64 references:

- the decode kernel built with ``_state_on_chip_for_bench=True`` steps a state made on
  chip (every row of the start state is ``beta v`` of the sequence's first token and value
  head) and writes only o: its o must be the float64 recurrence's from that start state
  (``torch_gdr.ref``), within the decode tests' fp32 tolerance ``1e-3 |ref| + 1e-4``;
- the cube-read kernel's products must be ``[q; k] S`` of each (sequence, value head)'s
  pool row.

Tiny shapes (H2/HV4, K = V = 64): a few seconds each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_gdr.ops.pypto import is_pypto_available

if not is_pypto_available():
    pytest.skip("pypto==0.2.0 is not importable (pip install 'torch_gdr[npu]')", allow_module_level=True)

from torch_gdr.ops.pypto import interpreter  # noqa: E402
from torch_gdr.ops.pypto.kernel_decode import build_decode_kernel  # noqa: E402
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule  # noqa: E402

H, HV, DIM = 2, 4, 64


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    bad = int((err > 1e-3 * want.abs() + 1e-4).sum())
    assert bad == 0, f"{name}: {bad}/{want.numel()} elements out of tolerance, max abs err {err.max():.3g}"


@pytest.mark.parametrize("batch, tokens, heads_per_body, pool_dtype", [
    (1, 1, 2, torch.float32), (2, 2, 2, torch.float32), (1, 1, 2, torch.bfloat16)])
def test_state_on_chip_yardstick_steps_beta_v_rows(batch: int, tokens: int, heads_per_body: int,
                                                    pool_dtype: torch.dtype) -> None:
    """o of the compute-only yardstick equals the recurrence from ``S0[n, h] = 1 (beta v)^T``
    (token 0's beta and v of sequence n, head h; rounded to a bf16 pool's dtype, as a row
    read from it is), one token (one body of two heads) and two tokens a sequence."""
    gen = torch.Generator().manual_seed(5)
    n, s = batch, tokens
    q = torch.randn(n, s, H, DIM, generator=gen)
    k = torch.randn(n, s, H, DIM, generator=gen)
    v = torch.randn(n, s, HV, DIM, generator=gen)
    g = F.logsigmoid(torch.randn(n, s, HV, generator=gen))
    beta = torch.sigmoid(torch.randn(n, s, HV, generator=gen))
    scale = DIM ** -0.5
    kernel = build_decode_kernel(heads_per_body=heads_per_body, num_qk_heads=H, num_v_heads=HV, head_k_dim=DIM,
                                 head_v_dim=DIM, tokens_per_seq=s, use_qk_l2norm=True, scale=scale,
                                 pool_dtype=str(pool_dtype).removeprefix("torch."), _state_on_chip_for_bench=True)
    if s == 1:  # one-token kernels: q, k [T * H, K], v [T * HV, V]
        q_arg, k_arg, v_arg = q.reshape(n * H, DIM), k.reshape(n * H, DIM), v.reshape(n * HV, DIM)
    else:
        q_arg, k_arg, v_arg = q.reshape(n * s, H * DIM), k.reshape(n * s, H * DIM), v.reshape(n * s, HV * DIM)
    pool = torch.zeros(2 * HV * DIM, DIM, dtype=pool_dtype)
    o = torch.zeros(n * s, HV * DIM)
    args = [q_arg.contiguous(), k_arg.contiguous(), v_arg.contiguous(), g.reshape(n * s, HV).contiguous(),
            beta.reshape(n * s, HV).contiguous(), torch.zeros(n, 1, dtype=torch.int32),
            torch.zeros(n * s, dtype=torch.int32), torch.full((1,), n * HV // heads_per_body, dtype=torch.int32),
            pool, o, pool.clone()]
    interpreter.run_kernel(kernel, args, [9])

    start = (beta[:, 0, :, None] * v[:, 0]).to(pool_dtype).double()  # [N, HV, V]
    s0 = start[:, :, None, :].expand(n, HV, DIM, DIM).contiguous()
    want, _ = naive_recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                               scale=scale, initial_state=s0, use_qk_l2norm_in_kernel=True)
    _assert_close("o", o.view(n, s, HV, DIM), want)


def test_cube_read_yardstick_multiplies_q_and_k_by_each_pool_row() -> None:
    """The cube-read kernel (q and k stacked, one body a (sequence, value head)) writes
    ``q S`` and ``k S`` of the row each sequence reads, for every value head."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from pypto_decode_caps import build_cube_read_kernel

    gen = torch.Generator().manual_seed(6)
    n, slots = 2, 3
    q, k = torch.randn(n * H, DIM, generator=gen), torch.randn(n * H, DIM, generator=gen)
    pool = torch.randn(slots * HV * DIM, DIM, generator=gen)
    read_rows = torch.tensor([[2], [0]], dtype=torch.int32)
    out = torch.zeros(n * HV * 2, DIM)
    kernel = build_cube_read_kernel(num_qk_heads=H, num_v_heads=HV, head_k_dim=DIM, head_v_dim=DIM, shape="stacked")
    qk = torch.stack([q, k], 1).reshape(n * H * 2, DIM)
    interpreter.run_kernel(kernel, [qk, read_rows, torch.full((1,), n * HV, dtype=torch.int32), pool, out], [4])

    states = pool.double().view(slots, HV, DIM, DIM)[read_rows[:, 0].long()]  # [N, HV, K, V]
    lhs = torch.stack([q, k], 1).double().view(n, H, 2, DIM).repeat_interleave(HV // H, dim=1)  # [N, HV, 2, K]
    _assert_close("[q; k] S", out.view(n, HV, 2, DIM), lhs @ states)
