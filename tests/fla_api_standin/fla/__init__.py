"""Test-only stand-in for fla-core 0.6 (see ../README.md): fla's API served by torch_gdr."""

__version__ = "0.6.0"
