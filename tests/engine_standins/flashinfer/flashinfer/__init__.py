"""Stand-in for the ``flashinfer`` package's GDN entry points (tests only), served by
torch_gdr on the CPU: ``gdn_prefill.chunk_gated_delta_rule``,
``gdn_decode.gated_delta_rule_decode_pretranspose`` (and its key-first and MTP siblings),
the bf16-state pool decode kernels of ``gdn_kernels`` (``gdn_decode_bf16_state``,
``gdn_decode_bf16_wy_output_only``) and the architecture probes the tests ask (answered as an
SM90 device). FlashInfer's other CuTe-DSL kernel modules are absent: the tests of their
internals skip themselves."""
