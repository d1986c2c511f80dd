"""Adapters that make other libraries' models run their gated delta rule on torch_gdr.

Each submodule imports its library lazily; importing :mod:`torch_gdr` imports none of them.
"""
