"""torch_gdr inside transformers: Qwen3-Next weights in torch_gdr.nn.GatedDeltaNet, and
``use_torch_gdr`` routing a Qwen3-Next model's gated delta rule to torch_gdr."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                 reason="this transformers has no Qwen3-Next (needs >= 4.57)")

import torch_gdr.functional  # noqa: E402
from torch_gdr.integrations.transformers import is_patched, remove_torch_gdr, use_torch_gdr  # noqa: E402
from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache  # noqa: E402

ATOL = 1e-4


def tiny_config() -> Any:
    return transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0, pad_token_id=0, bos_token_id=2,
        eos_token_id=1)


def mild_decay_(layer: torch.nn.Module, seed: int = 0) -> None:
    """Realistic gates so the recurrent state carries across tokens (the default A up to 16
    forgets within a token), and a norm weight that is not all ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(-3.0, -1.0, generator=g))
        layer.dt_bias.copy_(torch.randn(layer.dt_bias.shape, generator=g) * 0.5)
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(layer.norm.weight.shape, generator=g))


@pytest.fixture(scope="module")
def reference_model() -> Any:
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            mild_decay_(layer.linear_attn)
    return model


class CountCalls:
    """Counts calls of torch_gdr's public ops (what the patched model must go through): the
    chunked one, and the step that in-place decode runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
            monkeypatch.setattr(torch_gdr.functional, name, self._counted(getattr(torch_gdr.functional, name)))

    def _counted(self, original):
        def counted(q, *args, **kwargs):
            self.calls.append(q.shape[1])
            return original(q, *args, **kwargs)

        return counted


def test_hf_layer_weights_load_by_name_and_outputs_match() -> None:
    config = tiny_config()
    torch.manual_seed(1)
    hf = qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    mild_decay_(hf)
    ours = GatedDeltaNet.from_config(config, layer_idx=0, backend="torch")
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 37, config.hidden_size)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :9] = 0  # left padding
    with torch.no_grad():
        assert (ours(x) - hf(x)).abs().max().item() < ATOL
        expected = hf(x, attention_mask=mask)
        got = ours(x, attention_mask=mask)
    assert (got[mask.bool()] - expected[mask.bool()]).abs().max().item() < ATOL


def test_logits_match_for_prompt_and_greedy_decode(reference_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(3, 128, (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want_prompt = reference_model(ids).logits
        want = reference_model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True)

    model = use_torch_gdr(copy.deepcopy(reference_model))
    counter = CountCalls(monkeypatch)
    with torch.no_grad():
        got_prompt = model(ids).logits
        got = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    # One linear-attention layer: the prompt twice (forward, generate's prefill), then 4 single-token steps.
    assert counter.calls == [29, 29, 1, 1, 1, 1]
    assert (got_prompt - want_prompt).abs().max().item() < ATOL
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.logits, want.logits, strict=True):
        assert (step_got - step_want).abs().max().item() < ATOL


def test_left_padded_batch_generation_matches(reference_model: Any) -> None:
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    model = use_torch_gdr(copy.deepcopy(reference_model), backend="recurrent")
    with torch.no_grad():
        want = reference_model.generate(ids, **kwargs)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.logits, want.logits, strict=True):
        assert (step_got - step_want).abs().max().item() < ATOL


def test_other_models_untouched_and_removable(reference_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    other = copy.deepcopy(reference_model)
    patched = use_torch_gdr(copy.deepcopy(reference_model))
    assert is_patched(patched.model.layers[0].linear_attn)
    assert not any(is_patched(m) for m in other.modules())
    counter = CountCalls(monkeypatch)
    with torch.no_grad():
        other(ids)
        assert counter.calls == []
        patched(ids)
        assert counter.calls == [9]
        remove_torch_gdr(patched)
        patched(ids)
    assert counter.calls == [9]
    assert not any(is_patched(m) for m in patched.modules())


def test_our_cache_decode_matches_transformers_decode(reference_model: Any) -> None:
    """The HF layer's weights in our layer, decoded with our cache, against the HF model's own
    layer outputs during its cached decode."""
    hf_layer = reference_model.model.layers[0].linear_attn
    ours = GatedDeltaNet.from_config(reference_model.config, layer_idx=0)
    ours.load_state_dict(hf_layer.state_dict())
    seen: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def record(module: Any, args: Any, kwargs: Any, out: torch.Tensor) -> None:
        seen.append(kwargs["hidden_states"])
        outs.append(out)

    hook = hf_layer.register_forward_hook(record, with_kwargs=True)
    try:
        ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            reference_model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        hook.remove()
    cache = GatedDeltaNetCache()
    with torch.no_grad():
        for x, want in zip(seen, outs, strict=True):
            assert (ours(x, cache=cache) - want).abs().max().item() < ATOL


def test_model_without_gated_deltanet_is_refused() -> None:
    with pytest.raises(ValueError, match="no Gated DeltaNet"):
        use_torch_gdr(torch.nn.Linear(2, 2))
