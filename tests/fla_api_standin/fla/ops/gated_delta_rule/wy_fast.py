"""fla.ops.gated_delta_rule.wy_fast of the stand-in: fla's internal WY-representation kernels
have no counterpart in torch_gdr's API; a test that calls them is skipped."""

from __future__ import annotations

import pytest


def _internal(name: str):
    def call(*args, **kwargs):
        pytest.skip(f"{name}: an fla internal (WY representation), not part of the API torch_gdr stands in for")
    call.__name__ = name
    return call


prepare_wy_repr_bwd = _internal("prepare_wy_repr_bwd")
recompute_w_u_fwd = _internal("recompute_w_u_fwd")
