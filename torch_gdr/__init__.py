"""torch_gdr: the chunked gated delta rule (Gated DeltaNet) as a PyTorch op.

    o, final_state = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

Importing the package registers ``torch.ops.gdr.chunked_gated_delta_rule`` (and the ops of
every backend). ``torch_gdr.integrations`` is imported on first use (it needs transformers).
"""

import importlib
from typing import Any

from torch_gdr import ops as _ops  # noqa: F401  (registers the ops)
from torch_gdr.functional import chunk_gated_delta_rule, chunked_gated_delta_rule, fused_recurrent_gated_delta_rule
from torch_gdr import nn  # noqa: E402  (layers built on the op)

__version__ = "0.1.0"

__all__ = ["chunk_gated_delta_rule", "chunked_gated_delta_rule", "fused_recurrent_gated_delta_rule", "nn",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("integrations", "dispatch", "ref"):
        return importlib.import_module(f"torch_gdr.{name}")
    raise AttributeError(f"module 'torch_gdr' has no attribute {name!r}")
