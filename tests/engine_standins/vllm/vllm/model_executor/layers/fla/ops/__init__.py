"""Stand-in for vLLM's fla ops (tests only), served by torch_gdr."""

from vllm.model_executor.layers.fla.ops.fused_recurrent import fused_recurrent_gated_delta_rule  # noqa: F401
