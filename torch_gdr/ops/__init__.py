"""The op ``torch.ops.gdr.chunked_gated_delta_rule`` and its device kernels.

Importing this package registers the op with ``torch.library``.
"""

from torch_gdr.ops.registration import chunked_gated_delta_rule, chunked_gated_delta_rule_backward

__all__ = ["chunked_gated_delta_rule", "chunked_gated_delta_rule_backward"]
