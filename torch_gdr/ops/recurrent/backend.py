"""The ``"recurrent"`` backend: the chunked call and the step, any device, dtype and size."""

from __future__ import annotations

from torch_gdr.ops._backend import Backend, Capabilities
from torch_gdr.ops.recurrent.op import recurrent_bwd, recurrent_fwd, recurrent_step

BACKEND = Backend(
    name="recurrent",
    capabilities=Capabilities(entries=frozenset({"chunk", "step"})),
    forward_op=recurrent_fwd,
    backward_op=recurrent_bwd,
    step=recurrent_step,
    description="the per-token recurrence (the definition), any device; slow",
)
