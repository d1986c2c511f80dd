"""torch_gdr: the chunked gated delta rule as a PyTorch op."""
