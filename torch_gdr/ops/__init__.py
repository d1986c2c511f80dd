"""torch_gdr.ops."""
