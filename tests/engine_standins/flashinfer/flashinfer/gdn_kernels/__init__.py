"""Stand-in for ``flashinfer.gdn_kernels`` (tests only): of FlashInfer's CuTe-DSL decode
kernel modules, the bf16-state pool decode (``gdn_decode_bf16_state``: T = 1, MTP, the
wide-vector MTP variant) and its output-only MTP variant (``gdn_decode_bf16_wy_output_only``),
served by torch_gdr's pool decode. The other kernel modules (the fp32 pretranspose, MTP and
nontranspose kernels, the WY ring caches, the SM120 fused decode) are absent: the tests of
their internals skip themselves or are left out by ``bench/run_engine_tests.py``."""

from .gdn_decode_bf16_state import gated_delta_rule, gated_delta_rule_mtp
from .gdn_decode_bf16_wy_output_only import gated_delta_rule_mtp as gated_delta_rule_mtp_wy_output_only

__all__ = ["gated_delta_rule", "gated_delta_rule_mtp", "gated_delta_rule_mtp_wy_output_only"]
