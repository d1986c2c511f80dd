"""Stand-in for ``flashinfer.utils`` (tests only): the device answers as an SM90 GPU, so the
tests take their default (Hopper) paths; the Blackwell-only (SM100/SM12x) cases skip."""

from __future__ import annotations

import torch


def get_compute_capability(device: torch.device | None = None) -> tuple[int, int]:
    return (9, 0)


def is_sm90a_supported(device: torch.device | None = None) -> bool:
    return True


def is_sm100a_supported(device: torch.device | None = None) -> bool:
    return False


def is_sm12x_supported(device: torch.device | None = None) -> bool:
    return False


def is_sm120a_supported(device: torch.device | None = None) -> bool:
    return False
