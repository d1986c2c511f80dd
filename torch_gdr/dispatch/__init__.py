"""torch_gdr.dispatch."""
