"""``torch.compile(fullgraph=True)`` through every backend: forward and backward in one
graph, the same values and gradients as eager."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import assert_compiled_matches_eager, make_inputs
from torch_gdr.ops.pypto import is_pypto_available

BACKENDS = ["torch", "recurrent",
            pytest.param("pypto", marks=[pytest.mark.skipif(not is_pypto_available(), reason="pypto not installed"),
                                         pytest.mark.slow])]  # the interpreter under autograd: seconds


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_forward_and_backward(backend: str) -> None:
    head_dim = 64 if backend == "pypto" else 16  # the kernel's head dims
    inputs = make_inputs(seqlens=[40, 0, 9], num_qk_heads=1, num_v_heads=2, head_k_dim=head_dim,
                         head_v_dim=head_dim, with_initial_state=True, dtype=torch.float32)
    inputs["initial_state"] = inputs["initial_state"].float()
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def loss(q, k, v, g, beta, initial_state):
        o, s = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                cu_seqlens=inputs["cu_seqlens"], backend=backend)
        return (o * o).sum() + s.sum()

    assert_compiled_matches_eager(loss, inputs, names)


@pytest.mark.slow
@pytest.mark.skipif(not is_pypto_available(), reason="pypto not installed")
def test_opcheck_pypto_ops() -> None:
    """The pypto backend's forward and backward ops pass torch.library's checks (each check
    runs the kernel through the interpreter several times: slow)."""
    inputs = make_inputs(seqlens=[40, 0, 9], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                         with_initial_state=True, dtype=torch.float32)
    args = tuple(inputs[n].requires_grad_() for n in ("q", "k", "v", "g", "beta"))
    h0 = inputs["initial_state"].float().requires_grad_()
    options = (True, inputs["cu_seqlens"], 64, False)
    torch.library.opcheck(torch.ops.gdr._pypto_fwd.default, args + (None, h0, True) + options + (True,))
    with torch.no_grad():
        _, _, states = torch.ops.gdr._pypto_fwd(*args, None, h0, True, *options, True)
    grad_o, dht = torch.randn_like(inputs["v"]), torch.randn_like(h0)
    torch.library.opcheck(torch.ops.gdr._pypto_bwd.default,
                          (grad_o, dht) + tuple(a.detach() for a in args) + (None, h0.detach()) + options + (states,))
