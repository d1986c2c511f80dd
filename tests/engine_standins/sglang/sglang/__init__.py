"""Stand-in for the ``sglang`` package (tests only): importing it registers the CPU GDN ops
``torch.ops.sgl_kernel.*`` (served by torch_gdr), as SGLang's CPU build does."""

import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
