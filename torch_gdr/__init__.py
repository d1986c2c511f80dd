"""torch_gdr: the chunked gated delta rule (Gated DeltaNet) as a PyTorch op.

    o, final_state = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

Importing the package registers ``torch.ops.gdr.chunked_gated_delta_rule`` (and the ops of
every backend). ``torch_gdr.integrations`` (adapters for other libraries) is imported on
first access, and imports none of those libraries itself.
"""

import importlib as _importlib
from typing import Any as _Any

from torch_gdr import ops as _ops  # noqa: F401  (registers the ops)
from torch_gdr._gating import fused_gdn_gating
from torch_gdr.functional import chunk_gated_delta_rule, chunked_gated_delta_rule, fused_recurrent_gated_delta_rule
from torch_gdr import nn  # noqa: E402  (layers built on the op)
from torch_gdr.ops.cpu._build import CpuKernelBuildWarning

__version__ = "0.1.0"

__all__ = ["CpuKernelBuildWarning", "chunk_gated_delta_rule", "chunked_gated_delta_rule",
           "fused_gdn_gating", "fused_recurrent_gated_delta_rule", "integrations", "nn", "__version__"]

_LAZY_SUBMODULES = ("integrations", "distributed", "dispatch", "ref", "testing")


def __getattr__(name: str) -> _Any:
    """``torch_gdr.integrations`` (and the other submodules) on first access, so that
    ``torch_gdr.integrations.transformers.use_torch_gdr(model)`` works after ``import torch_gdr``."""
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
