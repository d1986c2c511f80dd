"""The ``"recurrent"`` backend: the per-token recurrence of :mod:`torch_gdr.ref` as ops.

Slow by design (a Python loop over tokens): the definition, selectable by name to check
another backend against it in a model, and a step that is differentiable on any device.
"""
