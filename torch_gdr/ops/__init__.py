"""The ops under ``torch.ops.gdr``: the public ``chunked_gated_delta_rule`` and, per backend,
a forward op and a backward op sharing one registered autograd (:mod:`._define`).

Importing this package registers them all; it does not import pypto (the PyPTO kernels
import it at their first build).
"""

from torch_gdr.ops import registration as _registration  # noqa: F401  (torch, recurrent; the public op)
from torch_gdr.ops.pypto import op as _pypto_op  # noqa: F401  (pypto; the public op's NPU kernel)
