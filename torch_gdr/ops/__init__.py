"""The backends under ``torch.ops.gdr``: one folder each (``torch``, ``cpu``, ``recurrent``,
``pypto``, ``fla``) with the same shape: ``backend.py`` (its :class:`~._backend.Backend`:
capabilities and reasons), ``op.py`` (its forward and backward ops, and its step, sharing one
registered autograd through :mod:`._define`) and the kernels behind them.

Importing this package registers every backend's ops; it imports neither pypto nor fla
(their kernels import them at first use), nor builds the C++ extension.
"""

from torch_gdr.ops.cpu import backend as _cpu  # noqa: F401
from torch_gdr.ops.fla import backend as _fla  # noqa: F401
from torch_gdr.ops.pypto import backend as _pypto  # noqa: F401
from torch_gdr.ops.recurrent import backend as _recurrent  # noqa: F401
from torch_gdr.ops.torch import backend as _torch  # noqa: F401
