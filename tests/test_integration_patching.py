"""How use_torch_gdr patches layers, on stand-ins of both layouts of transformers (no
transformers needed): kernels as instance attributes, and a decorated forward that calls
module-level kernels."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import torch_gdr.functional
from torch_gdr import testing
from torch_gdr.integrations.transformers import is_patched, remove_torch_gdr, use_torch_gdr


def reference_chunk(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """The stand-in of transformers' own kernel: tags its output so the test sees who ran."""
    return torch.full_like(value, -1.0), None


def reference_recurrent(*args: Any, **kwargs: Any):
    return reference_chunk(*args, **kwargs)


torch_chunk_gated_delta_rule = reference_chunk
torch_recurrent_gated_delta_rule = reference_recurrent


def decorator(fn):
    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        self.decorated_calls += 1
        return fn(self, *args, **kwargs)

    return wrapped


def make_inputs(seq_len: int) -> dict[str, torch.Tensor]:
    """transformers' kernel arguments (query, key, value, g, beta) from the shared factory."""
    x = testing.make_inputs(seq_len=seq_len, num_qk_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                            dtype=torch.float32, seed=seq_len)
    return dict(query=x["q"], key=x["k"], value=x["v"], g=x["g"], beta=x["beta"])


class AttributeGatedDeltaNet(torch.nn.Module):
    """Layout of transformers 4.57: kernels stored on the instance in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_gated_delta_rule = reference_chunk
        self.recurrent_gated_delta_rule = reference_recurrent

    def forward(self, seq_len: int) -> torch.Tensor:
        kernel = self.recurrent_gated_delta_rule if seq_len == 1 else self.chunk_gated_delta_rule
        return kernel(**make_inputs(seq_len), use_qk_l2norm_in_kernel=True)[0]


class GlobalGatedDeltaNet(torch.nn.Module):
    """Layout of later transformers 5.x: a decorated forward calling module-level kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.decorated_calls = 0

    @decorator
    def forward(self, seq_len: int) -> torch.Tensor:
        kernel = torch_recurrent_gated_delta_rule if seq_len == 1 else torch_chunk_gated_delta_rule
        return kernel(**make_inputs(seq_len), use_qk_l2norm_in_kernel=True)[0]


for _cls in (AttributeGatedDeltaNet, GlobalGatedDeltaNet):
    _cls.__module__ = "transformers.models.stand_in"


@pytest.mark.parametrize("layer_cls", [AttributeGatedDeltaNet, GlobalGatedDeltaNet])
def test_patch_routes_both_kernels_to_torch_gdr_and_is_removable(layer_cls: type, monkeypatch) -> None:
    calls: list[int] = []
    original = torch_gdr.functional.chunk_gated_delta_rule

    def counted(q, *args, **kwargs):
        calls.append(q.shape[1])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(torch_gdr.functional, "chunk_gated_delta_rule", counted)
    model = torch.nn.Sequential(layer_cls())
    untouched = layer_cls()
    assert use_torch_gdr(model) is model and is_patched(model[0]) and not is_patched(untouched)
    for seq_len in (5, 1):
        expected, _ = original(*make_inputs(seq_len).values(), use_qk_l2norm_in_kernel=True)
        assert torch.allclose(model[0](seq_len), expected)
        assert torch.equal(untouched(seq_len), torch.full_like(expected, -1.0))
    assert calls == [5, 1]  # prefill through the chunked kernel, a step through the recurrent one
    if layer_cls is GlobalGatedDeltaNet:
        assert model[0].decorated_calls == 2  # the decorator still runs around the rebuilt forward
        assert globals()["torch_chunk_gated_delta_rule"] is reference_chunk  # module globals untouched
    remove_torch_gdr(model)
    assert not is_patched(model[0]) and torch.equal(model[0](3), torch.full_like(model[0](3), -1.0))
