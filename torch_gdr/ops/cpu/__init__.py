"""The ``"cpu"`` backend: fused C++/OpenMP kernels of the chunked gated delta rule.

:mod:`.kernels` puts tensors in the kernels' form and calls the extension, which
:mod:`._build` loads (prebuilt at install, or built at first use into the cache dir);
:mod:`.op` defines the backend's ``torch.library`` ops on them and :mod:`.backend` declares
what it serves; :mod:`.pool` runs the decode step over a state pool in place (serving; the
semantics are :mod:`torch_gdr._pool`'s).
"""
