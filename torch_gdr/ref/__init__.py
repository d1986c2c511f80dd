"""torch_gdr.ref."""
