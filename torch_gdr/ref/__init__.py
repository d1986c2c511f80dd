"""Pure-torch references of the gated delta rule: the per-token recurrence (the
definition) and the chunked algorithm (the fast path on CPUs and GPUs)."""

from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule_fwd", "naive_recurrent_gated_delta_rule"]
