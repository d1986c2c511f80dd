"""Pure-torch references of the gated delta rule: the per-token recurrence (the definition),
the chunked algorithm (the fast path on CPUs and GPUs) and its hand-written backward. The
chunked functions take a :class:`torch_gdr._layout.GdrCall` (the canonical layout)."""

from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ref.chunk_backward import chunk_gated_delta_rule_bwd
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd", "naive_recurrent_gated_delta_rule"]
