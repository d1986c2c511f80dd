"""Inputs and error measures of the tests: :mod:`torch_gdr.testing` on the test device, and
the canonical call the raw functions of ``torch_gdr.ref`` take."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from torch_gdr.testing import make_inputs as _make_inputs
from torch_gdr.testing import rmse_ratio  # noqa: F401  (re-exported for the tests)


#: Device the inputs are made on: ``TORCH_GDR_TEST_DEVICE=cuda`` runs the suite on a GPU.
TEST_DEVICE = torch.device(os.environ.get("TORCH_GDR_TEST_DEVICE", "cpu"))


def make_inputs(**spec) -> dict:
    """:func:`torch_gdr.testing.make_inputs` on ``TEST_DEVICE``."""
    return _make_inputs(**spec, device=TEST_DEVICE)


def canonical(inputs: dict, *, scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
              chunk_size: int = 64, state_v_first: bool = False):
    """The :class:`torch_gdr._layout.GdrCall` of ``inputs`` (as :func:`make_inputs` gives them),
    what the raw functions of ``torch_gdr.ref`` take."""
    from torch_gdr._layout import canonical_call

    return canonical_call(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale,
                          inputs.get("initial_state"), use_qk_l2norm_in_kernel, inputs.get("cu_seqlens"), chunk_size,
                          state_v_first)


def chunked_reference(inputs: dict, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of the pure-torch chunked forward, called directly (no op)."""
    from torch_gdr.ops.torch.chunk import chunk_gated_delta_rule_fwd

    call = canonical(inputs, **options)
    o, final_state, _ = chunk_gated_delta_rule_fwd(call)
    return call.public_outputs(o, final_state)


def assert_compiled_matches_eager(loss, inputs: dict, names: Sequence[str]) -> None:
    """``loss(*inputs[names])`` under ``torch.compile(fullgraph=True)`` (aot_eager) against
    eager: the value and the gradient of every named input (fresh leaves for each run)."""

    def value_and_grads(fn):
        leaves = [inputs[n].detach().clone().requires_grad_() for n in names]
        value = fn(*leaves)
        return value, torch.autograd.grad(value, leaves)

    torch._dynamo.reset()
    got, got_grads = value_and_grads(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    want, want_grads = value_and_grads(loss)
    torch.testing.assert_close(got, want)
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=name)
