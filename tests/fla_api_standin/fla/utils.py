"""fla.utils of the stand-in: the comparison fla's tests use, and a CPU with no GPU flags."""

from __future__ import annotations

import torch

device = "cpu"
device_platform = "cpu"
IS_INTEL_ALCHEMIST = False
IS_NPU = False
IS_NVIDIA = False
IS_NVIDIA_HOPPER = False
IS_NVIDIA_BLACKWELL = False
IS_NVIDIA_SM100 = False
IS_NVIDIA_SM120 = False


def get_abs_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest absolute difference."""
    return (x.detach().double() - y.detach().double()).abs().max().item()


def get_err_ratio(x: torch.Tensor, y: torch.Tensor) -> float:
    """rms(x - y) / rms(x), fla's error measure (its denominator offset 1e-8)."""
    x, y = x.detach().double(), y.detach().double()
    return ((x - y).square().mean().sqrt() / (x.square().mean().sqrt() + 1e-8)).item()


def assert_close(prefix: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float, warning: bool = False,
                 err_atol: float = 1e-6) -> None:
    """fla's acceptance rule: the largest absolute error at most ``err_atol``, or else no NaN
    and an error ratio below ``ratio`` (strict here: never only a warning)."""
    abs_err, err_ratio = get_abs_err(ref, tri), get_err_ratio(ref, tri)
    if abs_err <= err_atol:
        return
    assert not torch.isnan(ref).any(), f"{prefix}: NaN in the reference"
    assert not torch.isnan(tri).any(), f"{prefix}: NaN in the result"
    assert err_ratio < ratio, f"{prefix:>16} diff: {abs_err:.6f} ratio: {err_ratio:.6f} (bound {ratio})"
