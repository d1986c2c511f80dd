"""Environment variables: torch_gdr reads them as a user would write them, and never
overwrites what the user set."""

from __future__ import annotations

import pytest
import torch

from torch_gdr.dispatch import resolve_backend


@pytest.mark.parametrize("value, backend", [(" Recurrent ", "recurrent"), ("TORCH\n", "torch"), ("  ", "torch")])
def test_backend_variable_is_stripped_and_lower_cased(monkeypatch, value: str, backend: str) -> None:
    """Like TORCH_GDR_STRICT; blank means unset (the device's default, "torch" on the CPU)."""
    monkeypatch.setenv("TORCH_GDR_BACKEND", value)
    assert resolve_backend(None, torch.device("cpu")) == backend


def test_unknown_backend_variable_still_raises(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_GDR_BACKEND", " nope ")
    with pytest.raises(ValueError, match="TORCH_GDR_BACKEND"):
        resolve_backend(None, torch.device("cpu"))
