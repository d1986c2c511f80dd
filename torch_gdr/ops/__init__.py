"""The ops under ``torch.ops.gdr``: the public ``chunked_gated_delta_rule`` and, per backend,
a forward op and a backward op sharing one registered autograd (:mod:`._define`).

Importing this package registers them all; it imports neither pypto nor fla (their kernels import
them at first use).
"""

from torch_gdr.ops import registration as _registration  # noqa: F401  (torch, recurrent; the public op)
from torch_gdr.ops.pypto import op as _pypto_op  # noqa: F401  (pypto; the public op's NPU kernel)
from torch_gdr.ops.fla import op as _fla_op  # noqa: F401  (fla, on CUDA)
