"""Adapters that make other libraries' models run their gated delta rule on torch_gdr.

Each submodule imports its library lazily; importing :mod:`torch_gdr` imports none of them.
"""

import importlib as _importlib
from typing import Any as _Any

#: The adapters, each a submodule imported on first access.
ADAPTERS = ("transformers",)


def __getattr__(name: str) -> _Any:
    """``torch_gdr.integrations.transformers`` on first access (it does not import transformers)."""
    if name in ADAPTERS:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
