"""The definition of the gated delta rule: the per-token recurrence and its reverse
recurrence, written for clarity rather than speed, in float64 when the inputs are. Every
backend is checked against it; nothing here is used to compute a backend's results."""

from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule_bwd

__all__ = ["naive_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule_bwd"]
