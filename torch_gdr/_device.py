"""NPU detection that never breaks the caller.

``torch_npu`` is never imported when this package is imported, only when a caller asks.
A broken install (no CANN toolkit, a mismatched torch) raises all kinds of exceptions,
among them the RuntimeError torch raises when a backend fails to autoload; every one of
them means "no NPU here".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util


@functools.lru_cache(maxsize=None)
def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU. Never raises."""
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        torch_npu = importlib.import_module("torch_npu")
        return bool(torch_npu.npu.is_available())
    except BaseException:  # noqa: BLE001 - any failure of a broken install means no NPU
        return False


def is_npu_device(device_type: str) -> bool:
    """True for the device types an Ascend NPU shows up as in torch."""
    return device_type in ("npu", "privateuseone")
