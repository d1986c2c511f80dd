"""Test-wide settings: no files left in the working directory."""

from hypothesis import settings

# Hypothesis would otherwise keep an example database in ./.hypothesis.
settings.register_profile("torch_gdr", database=None)
settings.load_profile("torch_gdr")
