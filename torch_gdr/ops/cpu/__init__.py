"""The ``"cpu"`` backend: fused C++/OpenMP kernels of the chunked gated delta rule.

:mod:`.kernels` puts tensors in the kernels' form and calls the extension, which
:mod:`._build` loads: a module built at install time, one per instruction-set variant
(:mod:`._variants`), where it fits the running torch and sources, or else one built at first
use into the cache directory. :mod:`.op` defines the backend's ``torch.library`` ops on them
and :mod:`.backend` declares what it serves (with the reason where no module can be had);
:mod:`.pool` runs the decode step over a state pool in place (serving; the semantics are
:mod:`torch_gdr._pool`'s).
"""
