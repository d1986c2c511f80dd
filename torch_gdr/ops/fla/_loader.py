"""Finding fla-core's internal functions once per process, and why they may be missing."""

from __future__ import annotations

import importlib
import importlib.util
import re
import threading
from types import SimpleNamespace
from typing import Optional, Union

TESTED_RANGE = ">=0.6.0,<0.7"
MIN_VERSION, END_VERSION = (0, 6, 0), (0, 7, 0)  # end is exclusive
INSTALL_HINT = f"pip install 'torch_gdr[gpu]', which pins fla-core{TESTED_RANGE}"

# module -> names the adapter calls (fla-core 0.6.0's layout)
REQUIRED = {
    "fla.ops.gated_delta_rule.chunk": ("chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"),
    "fla.ops.gated_delta_rule.fused_recurrent": ("fused_recurrent_gated_delta_rule_fwd",),
    "fla.modules.norm.l2norm": ("l2norm_fwd", "l2norm_bwd"),
    "fla.ops.utils.index": ("prepare_chunk_indices",),
    "fla.ops.common.gate": ("fused_beta_sigmoid_fwd", "fused_beta_sigmoid_bwd"),
}

_lock = threading.Lock()
_loaded: Optional[Union[SimpleNamespace, str]] = None


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.6.0"``, ``"0.6.1.dev3+g..."`` -> ``(0, 6, 1)``; unparsable parts count as 0."""
    numbers = [int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))  # type: ignore[return-value]


def _load() -> Union[SimpleNamespace, str]:
    try:
        fla = importlib.import_module("fla")
    except ImportError as exc:
        if getattr(exc, "name", None) == "fla":
            return f"fla-core is not installed ({INSTALL_HINT})"
        return f"fla-core could not be imported ({type(exc).__name__}: {exc})"
    except Exception as exc:  # noqa: BLE001 - a broken install (e.g. no triton, no CUDA) is a reason too
        return f"fla-core could not be imported ({type(exc).__name__}: {exc})"
    version = str(getattr(fla, "__version__", "unknown"))
    if not MIN_VERSION <= parse_version(version) < END_VERSION:
        return f"fla-core {version} is outside the tested range {TESTED_RANGE} ({INSTALL_HINT})"
    found = {"version": version}
    for module_name, names in REQUIRED.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001
            return f"fla-core {version} has no {module_name} ({type(exc).__name__}: {exc})"
        for name in names:
            fn = getattr(module, name, None)
            if fn is None:
                return f"fla-core {version} has no {module_name}.{name}"
            found[name] = fn
    try:
        found["utils"] = importlib.import_module("fla.utils")
    except Exception:  # noqa: BLE001 - only used to predict refusals
        found["utils"] = None
    return SimpleNamespace(**found)


def load() -> Union[SimpleNamespace, str]:
    """fla's functions (a namespace: ``version`` and every name of :data:`REQUIRED`) or the
    reason they cannot be used. Imported once per process (thread-safe); :func:`reset`
    forgets the result."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def reset() -> None:
    """Forget what :func:`load` found (tests that put a stand-in fla into ``sys.modules``)."""
    global _loaded
    with _lock:
        _loaded = None


def tilelang_installed() -> bool:
    return importlib.util.find_spec("tilelang") is not None
