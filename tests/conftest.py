"""Test-wide settings: no files left in the working directory, reproducible CI runs."""

import os

from hypothesis import settings

# No example database (it would live in ./.hypothesis). Local runs draw new examples each
# time, to keep finding cases; CI (CI=true) draws the same ones every run, so a red CI
# always reproduces.
settings.register_profile("torch_gdr", database=None)
settings.register_profile("torch_gdr_ci", database=None, derandomize=True)
settings.load_profile("torch_gdr_ci" if os.environ.get("CI") else "torch_gdr")
