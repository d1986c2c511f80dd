"""``use_torch_gdr(..., inplace_decode=True)`` (issue 39): transformers' decode steps write the
new state into the state tensor its cache passes, with the same tokens and logits as
transformers' own kernels and as the copying path."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                    reason="this transformers has no Qwen3-Next (needs >= 4.57)")

import torch_gdr.functional  # noqa: E402
from torch_gdr.integrations.transformers import use_torch_gdr  # noqa: E402
# the module-scoped fixture of the integration tests: the same tiny model
from tests.test_transformers_integration import ATOL, reference_model, tiny_config  # noqa: E402,F401


class StepSpy:
    """Records, per call of the public step, whether it wrote in place and into which tensor."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[bool, int, bool]] = []
        original = torch_gdr.functional.fused_recurrent_gated_delta_rule

        def spied(*args, **kwargs):
            o, state = original(*args, **kwargs)
            initial = kwargs.get("initial_state")
            self.steps.append((kwargs.get("inplace_final_state") is True, initial.data_ptr(), state is initial))
            return o, state

        monkeypatch.setattr(torch_gdr.functional, "fused_recurrent_gated_delta_rule", spied)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_inplace_decode_writes_the_cache_state_with_the_same_tokens(reference_model: Any, backend: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(3, 128, (3, 13), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    copying = use_torch_gdr(copy.deepcopy(reference_model), backend=backend, inplace_decode=False)
    inplace = use_torch_gdr(copy.deepcopy(reference_model), backend=backend)
    with torch.no_grad():
        want = reference_model.generate(ids, **kwargs)
        spy = StepSpy(monkeypatch)
        without = copying.generate(ids, **kwargs)
        assert spy.steps == []  # the copying path decodes through the chunked op
        got = inplace.generate(ids, **kwargs)
    # one linear-attention layer, 4 decode steps, each into the one state tensor of the cache
    assert len(spy.steps) == 4 and all(wrote and same for wrote, _, same in spy.steps)
    assert len({pointer for _, pointer, _ in spy.steps}) == 1
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.sequences, without.sequences)
    for step_got, step_without, step_want in zip(got.logits, without.logits, want.logits, strict=True):
        assert (step_got - step_want).abs().max().item() < ATOL
        assert (step_got - step_without).abs().max().item() < ATOL


def test_recorded_decode_steps_copy(reference_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached decode step that autograd records (grad mode on, weights requiring grad)
    never writes in place: it goes through the chunked op, recorded. (Its backward fails in
    transformers' own cache, which copies the new state into the tensor the step saved, with
    or without torch_gdr.)"""
    model = use_torch_gdr(copy.deepcopy(reference_model))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    spy = StepSpy(monkeypatch)
    with torch.no_grad():  # a cached state that does not require grad
        out = model(ids[:, :6], use_cache=True)
    step = model(ids[:, 6:], cache=out.past_key_values, use_cache=True)
    assert spy.steps == [] and step.logits.requires_grad


def test_inplace_decode_flag_must_be_a_bool(reference_model: Any) -> None:
    with pytest.raises(TypeError, match="inplace_decode: expected a bool, got str"):
        use_torch_gdr(copy.deepcopy(reference_model), inplace_decode="yes")
